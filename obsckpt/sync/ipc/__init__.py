"""Colocated weight sync: trainer and rollout share a device and hand over buffers, not bytes.

When the rollout engine runs on the trainer's GPU (verl's hybrid engine),
sending the weights through a collective is wasted work: both processes can
map the same device memory. :class:`IpcWeightSender` hands the rollout
process a small :class:`IpcPayload` (the tensors' names, dtypes and shapes,
the step, and handles to device memory), and :class:`IpcWeightReceiver`
copies the tensors into its own weights. Two layouts:

* ``direct`` (CUDA): the handles name the trainer's own tensors' storages,
  so the weights are copied once, straight into the rollout's. It is used
  while the trainer's tensors stay in place from one sync to the next (a
  model held whole on the GPU, updated in place by its optimizer); the
  rollout keeps each storage open, so a sync opens nothing new.
* ``buckets``: the sender packs the tensors into bucket buffers of its own
  (one dtype per bucket, the plan of :func:`~obsckpt.sync.buckets.plan_buckets`)
  and hands out their handles, opened once and reused. The bytes are
  copied twice, but nothing is opened per sync. It is used when the
  tensors are new at each sync (gathered from shards, as FSDP and Megatron
  do): opening fresh handles per tensor would cost more than the copy. It
  is also the CPU fallback, where a handle is a file in shared memory
  (``/dev/shm``) that both processes map, so the same protocol runs, and is
  tested, without a GPU.

The payload travels however the caller likes (a Ray actor call in the demo);
the sender waits for the receiver's acknowledgement within ``timeout_s``,
and does not touch the tensors meanwhile. A CUDA receiver whose weights are
used on its current stream may answer as soon as its copy is queued
(``recv(wait=False)``): the answer names an interprocess CUDA event recorded
after the copy, and the sender returns once that event has completed, so the
answer's way back overlaps the copy.

A sync costs the copy plus a fixed part: the two processes' wake-ups and the
bookkeeping on both sides. The bookkeeping does not grow with the number of
tensors more than it must: each layout of the weights (names, dtypes,
shapes, and the handles and views that locate them) gets an id, its
description travels once, and later payloads name the id only, while the
receiver keeps the views and target tensors that layout gave it. The sender
sees that a layout is unchanged from a cheap fingerprint of its tensors
(address, shape, dtype, density), not by rebuilding the description.

The same checks as a broadcast: the step must be newer than the last one
sent (and received); a payload that reaches the receiver after the sender's
deadline is refused (the sender may already be changing its tensors), and
so is one whose copy finishes after it; that copy has by then written the
receiver's weights, which it marks as not a known version
(``IpcWeightReceiver.weights_valid``) until the next accepted sync. Each sync is timed into
``obsckpt_broadcast_duration_seconds{method="ipc"}`` (backend ``cuda_ipc`` or
``shm``), counted on failure, and traced as an ``obsckpt.broadcast`` span
whose ``obsckpt.ipc_layout`` attribute names the layout.

Memory: with ``buckets`` the sender keeps one device copy of the model's
bytes between syncs; with ``direct`` the rollout keeps the trainer's
storages of the last sync mapped (for tensors that stay in place that costs
nothing). :meth:`IpcWeightSender.close` and :meth:`IpcWeightReceiver.close`
release them.

Modules: :mod:`~obsckpt.sync.ipc.payload` (what travels),
:mod:`~obsckpt.sync.ipc.sender` (the trainer side's transport: payload,
acknowledgement, deadline), :mod:`~obsckpt.sync.ipc.layouts` (how the
trainer's tensors are laid out for the receiver: direct storages or buckets),
:mod:`~obsckpt.sync.ipc.shm` (the CPU fallback's shared-memory files),
:mod:`~obsckpt.sync.ipc.receiver`, and :mod:`~obsckpt.sync.ipc.streams` (the
CUDA streams and interprocess events both sides use). The version rule and
:class:`~obsckpt.sync.BroadcastResult` are :mod:`~obsckpt.sync.wire`'s, shared
with the broadcast.
"""

from obsckpt.errors import IpcLayoutUnknownError
from obsckpt.sync.ipc.payload import METHOD, IpcPayload
from obsckpt.sync.ipc.receiver import IpcWeightReceiver
from obsckpt.sync.ipc.sender import IpcWeightSender

__all__ = [
    "METHOD",
    "IpcLayoutUnknownError",
    "IpcPayload",
    "IpcWeightReceiver",
    "IpcWeightSender",
]
