"""Span attribute keys: every key obsckpt sets on a span is a constant here.

Code sets attributes through these names (``{attributes.STEP: step}``), never a
string literal, so a key cannot be misspelt in one place and a dashboard or
trace query written against :data:`SPAN_ATTRIBUTES` finds every span.
"""

from __future__ import annotations

STEP = "obsckpt.step"
SLOT = "obsckpt.slot"
KIND = "obsckpt.kind"
RANK = "obsckpt.rank"
BYTES = "obsckpt.bytes"
ERROR = "obsckpt.error"
SKIPPED = "obsckpt.skipped"
BACKEND = "obsckpt.backend"
METHOD = "obsckpt.method"
MODE = "obsckpt.mode"
IPC_LAYOUT = "obsckpt.ipc_layout"
IPC_QUEUED = "obsckpt.ipc_queued"
IPC_DESCRIBED_AGAIN = "obsckpt.ipc_described_again"

# Each key and what it holds; the first five are on every save and commit span.
SPAN_ATTRIBUTES: dict[str, str] = {
    STEP: "the training step (the weight-sync version on obsckpt.broadcast)",
    SLOT: "the save slot",
    KIND: "checkpoint or state_dict",
    RANK: "the rank that saved, sent or received",
    BYTES: "bytes written, sent or received",
    ERROR: "the exception type of a save that failed (also SaveTimeoutError)",
    SKIPPED: "true on a save not written because its step was already closed",
    BACKEND: "weight sync: nccl, gloo, cuda_ipc or shm",
    METHOD: "weight sync: broadcast or ipc",
    MODE: "broadcast: bucketed or per_tensor",
    IPC_LAYOUT: "ipc sender: direct or buckets",
    IPC_QUEUED: "ipc receiver: true when it answered once its copy was queued",
    IPC_DESCRIBED_AGAIN: "ipc sender: true when the receiver had lost the layout "
    "(a restarted rollout) and it was sent again",
}
