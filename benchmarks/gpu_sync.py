"""Colocated weight sync on one GPU: the ipc method vs a device-to-device copy of the same bytes.

The trainer side hands CUDA IPC handles to a second process on the same
GPU, which copies the tensors into its own weights and acknowledges (through
a pipe here, a Ray call in the demo). The reference is one in-process
device-to-device copy of the same tensors, one ``copy_`` per tensor. The
value is copy time / sync time (1.0: the sync costs one copy), for a state
that stays in place between syncs, as a model updated in place by its
optimizer is: the ``direct`` layout, one copy from the trainer's tensors
into the receiver's. A sync is timed until the sender returns, which is
when the receiver's copy has finished. The copy and the syncs take turns,
so each starts right after the other process's GPU work and pays once the
GPU's switch between the two processes' contexts, which an RL loop pays
anyway when it passes from training to generation; the copy right after
the trainer's own work, without that switch, is in the details
(``d2d_own_s``, and the value's sync against it, the harshest reading). The
receiver replays its copies as a CUDA graph from the second sync into the
same tensors on (the first timed sync comes later). The value's receiver
answers once its copy is queued (``recv(wait=False)``) and the sender waits for the
receiver's event; the details give the same sync with the receiver answering
after its copy (``recv``'s default) beside it, and split that one's time
into the receiver's part (its copy alone), the transport's round trip (a
ping through the same pipe) and the sender's own, and time the same bytes
copied outside the protocol, batched and per tensor: in the receiver, from
the sender's tensors and between its own; in the sender, from its tensors
into the receiver's. They also give one batched copy
(``torch._foreach_copy_``, the receiver's copy before its graph), the ratio for four
times the tensors and bytes, and the ``buckets`` layout, used when the
tensors are new at each sync (gathered from shards): packed into the
sender's buckets, then copied out, two copies.
"""

from __future__ import annotations

import time

from benchmarks.common import Result, Sizes, cuda_seconds, median, rounded, skipped

NAME = "gpu_ipc_sync_vs_d2d"
TARGET = 0.8


def _per_tensor(dsts: list, srcs: list) -> None:  # one copy_ per tensor: the reference
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=True)


def _batched(dsts: list, srcs: list) -> None:  # one batched copy, as the receiver does
    import torch

    torch._foreach_copy_(dsts, srcs)


def _bare(name: str, dsts: list, srcs: list) -> dict[str, float]:
    """``srcs`` copied into ``dsts`` outside the protocol, batched and per tensor."""
    return {
        f"{name}_batched": cuda_seconds(_batched, dsts, srcs),
        f"{name}_per_tensor": cuda_seconds(_per_tensor, dsts, srcs),
    }


def _receiver(conn, device_index: int) -> None:
    import torch

    from obsckpt.sync.ipc import IpcWeightReceiver

    torch.cuda.set_device(device_index)
    receiver = IpcWeightReceiver(device=torch.device("cuda", device_index))
    weights: dict = {}  # the receive area, as the last sync returned it
    sender_tensors: list = []  # the sender's tensors, shared through the pipe (torch's CUDA IPC)
    scratch: list = []  # this process's own tensors, for the bare copies
    while True:
        message = conn.recv()
        if message is None:
            break
        if message == "ping":  # the transport alone: two wake-ups, nothing else
            conn.send("pong")
            continue
        if isinstance(message, tuple) and message[0] == "sender_tensors":
            sender_tensors = message[1]
            conn.send(len(sender_tensors))
            continue
        if message in ("copies", "scratch"):
            area = list(weights.values())
            if [t.shape for t in scratch] != [t.shape for t in area]:
                scratch[:] = [torch.empty_like(t) for t in area]
                cuda_seconds(_batched, scratch, area)  # first touch, untimed
            if message == "scratch":  # for the sender to copy into (torch's CUDA IPC)
                conn.send(list(scratch))
            else:
                # The same bytes copied outside the protocol, into tensors of this
                # process: from its own receive area (a copy in a second process), and
                # from the sender's tensors (a copy from memory another process allocated).
                conn.send(
                    {**_bare("own", scratch, area), **_bare("sender", scratch, sender_tensors)}
                )
            continue
        payload, wait = message
        try:
            ack, weights = receiver.recv(payload, wait=wait)
            ack["receiver_s"] = receiver.last_seconds
            ack["copy_s"] = receiver.last_copy_seconds
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            ack = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send(ack)
    sender_tensors.clear()
    scratch.clear()
    receiver.close()


def _bare_copies(series: dict) -> dict[str, float]:
    """The median of each bare copy (see ``_bare``): the receiver's and the sender's."""
    copies = [{**c, **p} for c, p in zip(series["copies"], series["pushed"], strict=True)]
    return {k: round(median([c[k] for c in copies]), 6) for k in copies[0]}


def run_gpu_ipc_sync(sizes: Sizes, log) -> Result:
    import torch

    if not torch.cuda.is_available():
        return skipped(NAME, ">=", TARGET, "CUDA is not available", unit="x")
    import torch.multiprocessing as mp

    from obsckpt.sync.ipc import IpcWeightSender

    device = torch.device("cuda", torch.cuda.current_device())
    per = max(1, sizes.state_bytes // sizes.state_tensors // 2)

    def make_state(tensors: int) -> dict:
        return {
            f"layers.{i}.weight": torch.randn(per, dtype=torch.bfloat16, device=device)
            for i in range(tensors)
        }

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, device.index), daemon=True)
    proc.start()
    sender = IpcWeightSender(device=device, timeout_s=120.0)

    answers: list[dict] = []  # the receiver's acknowledgements, with its timings

    def deliver(payload, wait: bool):
        parent.send((payload, wait))
        if not parent.poll(120.0):
            raise TimeoutError("the receiver did not answer within 120 s")
        ack = parent.recv()
        if "error" in ack:
            raise RuntimeError(ack["error"])
        answers.append(ack)
        return ack

    def ping() -> float:
        t0 = time.perf_counter()
        parent.send("ping")
        parent.recv()
        return time.perf_counter() - t0

    def receiver_copies() -> dict:  # bare copies, as timed in the receiver
        parent.send("copies")
        return parent.recv()

    step = 0

    def sync(state: dict, wait: bool = False) -> float:
        """One sync, until the receiver's copy has finished (the sender waits for it)."""
        nonlocal step
        step += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sender.send(state, lambda p: deliver(p, wait), step=step)
        return time.perf_counter() - t0

    reps = max(9, sizes.save_reps)  # a sync takes milliseconds: enough for a steady median

    def in_place(state: dict) -> dict:
        """Syncs of a state kept in place, taking turns with a D2D copy of it.

        Two kinds of sync: the receiver answers once its copy is queued (the
        sender waits for the copy through the receiver's event), or after its
        copy (``recv``'s default).
        """
        srcs = list(state.values())
        dsts = [torch.empty_like(t) for t in srcs]
        parent.send(("sender_tensors", srcs))  # for the receiver's bare copies
        parent.recv()
        # After other tensors, the first sync sees them new (buckets), the second opens
        # their storages and takes the receiver's event, the third copies into the same
        # targets again, the fourth captures those copies as the receiver's CUDA graph.
        for _ in range(4):
            sync(state)
        cuda_seconds(_per_tensor, dsts, srcs)
        parent.send("scratch")  # the receiver's own tensors, for the sender to write into
        theirs = parent.recv()
        cuda_seconds(_batched, theirs, srcs)  # first touch from this process, untimed
        out = {
            k: []
            for k in "sync waits d2d d2d_own batched ping copies pushed layouts receiver "
            "queued copy waits_receiver waits_copy after_bare".split()
        }
        # The value: the reference copy and both kinds of sync, taking turns so that
        # each starts right after the other process's GPU work (the copy after the
        # rollout's, a sync after the trainer's). Two processes on one GPU run in two
        # contexts, and the GPU switches between them: each timed operation here pays
        # that switch once, as an RL loop does when it passes from training to
        # generation (d2d_own: the same copy right after the trainer's own work).
        for _ in range(reps):
            out["d2d"].append(cuda_seconds(_per_tensor, dsts, srcs))
            out["sync"].append(sync(state))
            out["layouts"].append(sender.last_layout)
            out["receiver"].append(answers[-1]["receiver_s"])
            out["copy"].append(answers[-1]["copy_s"])
            out["queued"].append(answers[-1].get("event", (None, 1))[1] is None)
            out["d2d"].append(cuda_seconds(_per_tensor, dsts, srcs))
            out["waits"].append(sync(state, wait=True))
            out["waits_receiver"].append(answers[-1]["receiver_s"])
            out["waits_copy"].append(answers[-1]["copy_s"])
        # The diagnostics in a loop of their own: the bare copies go through torch's
        # own CUDA IPC, which the protocol does not use, and a sync right after them
        # is timed apart (after_bare).
        for _ in range(reps):
            out["d2d_own"].append(cuda_seconds(_per_tensor, dsts, srcs))
            out["batched"].append(cuda_seconds(_batched, dsts, srcs))
            out["ping"].append(ping())
            out["copies"].append(receiver_copies())
            out["pushed"].append(_bare("into_receiver", theirs, srcs))  # the sender's
            out["after_bare"].append(sync(state))
        out["nbytes"] = sum(t.numel() * t.element_size() for t in srcs)
        theirs.clear()
        return out

    try:
        state = make_state(sizes.state_tensors)
        main = in_place(state)
        # Tensors new at each sync: the sender switches to its buckets.
        fresh_syncs, fresh_layouts = [], []
        for _ in range(reps + 3):  # untimed: the switch, a new layout, its graph's capture
            fresh_syncs.append(sync({k: v.clone() for k, v in state.items()}))
            fresh_layouts.append(sender.last_layout)
        fresh_syncs, fresh_layouts = fresh_syncs[3:], fresh_layouts[3:]
        # Four times the tensors and bytes (a model nearer to what RL trains): the
        # fixed part of a sync weighs less against the copy.
        del state
        larger = in_place(make_state(4 * sizes.state_tensors))
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        sender.close()
    nbytes = main["nbytes"]
    s, w, c = median(main["sync"]), median(main["waits"]), median(main["d2d"])
    own = median(main["d2d_own"])  # the copy right after the trainer's own work
    f, p = median(fresh_syncs), median(main["ping"])
    r, wr = median(main["receiver"]), median(main["waits_receiver"])
    ls, lc = median(larger["sync"]), median(larger["d2d"])
    layouts = main["layouts"]
    bare, larger_bare = _bare_copies(main), _bare_copies(larger)
    log(
        f"  ipc sync {s * 1e3:.2f} ms ({'/'.join(sorted(set(layouts)))}, the rollout answering "
        f"once its copy is queued) vs D2D copy {c * 1e3:.2f} ms ({nbytes / c / 1e9:.1f} GB/s) "
        f"for {nbytes / 1e9:.2f} GB (right after the trainer's own work "
        f"{own * 1e3:.2f} ms); answering after its copy {w * 1e3:.2f} ms ({c / w:.3f}): "
        f"in the receiver {wr * 1e3:.2f} ms (its copy {median(main['waits_copy']) * 1e3:.2f} "
        f"ms; bare, from the sender's tensors {bare['sender_batched'] * 1e3:.2f} ms, between "
        f"its own {bare['own_batched'] * 1e3:.2f} ms, the sender's into the receiver's "
        f"{bare['into_receiver_batched'] * 1e3:.2f} ms), "
        f"transport {p * 1e3:.2f} ms, the sender's own {(w - wr - p) * 1e3:.2f} ms; fresh "
        f"tensors {f * 1e3:.2f} ms ({'/'.join(sorted(set(fresh_layouts)))}); 4x the state: "
        f"{ls * 1e3:.2f} ms vs {lc * 1e3:.2f} ms ({lc / ls:.3f})"
    )
    return Result(
        NAME,
        c / s,
        ">=",
        TARGET,
        unit="x",
        limit="device memory bandwidth (one device-to-device copy of the same bytes)",
        details={
            "device": torch.cuda.get_device_name(device),
            "state_bytes": nbytes,
            "tensors": sizes.state_tensors,
            # The value's sync: the rollout answers once its copy is queued
            # (recv(wait=False)); the sender returns when the copy has finished.
            "sync_s": round(s, 6),
            # How many of the timed syncs were answered before the copy finished.
            "answered_before_copy": f"{sum(main['queued'])} of {len(main['queued'])}",
            "d2d_s": round(c, 6),
            "d2d_GBps": round(nbytes / c / 1e9, 3),
            # The copy right after the trainer's own GPU work (no context switch),
            # and the value's sync against it: the harshest reading.
            "d2d_own_s": round(own, 6),
            "d2d_own_over_sync": round(own / s, 3),
            "sync_samples_s": rounded(main["sync"]),
            "d2d_samples_s": rounded(main["d2d"]),
            "d2d_batched_s": round(median(main["batched"]), 6),
            "d2d_batched_over_sync": round(median(main["batched"]) / s, 3),
            "layouts": layouts,
            "receiver_s": round(r, 6),
            "receiver_queue_s": round(median(main["copy"]), 6),
            # The same sync, timed right after the bare copies below (not in the value).
            "sync_after_bare_copies_s": round(median(main["after_bare"]), 6),
            # The rollout answering after its copy (recv's default), and where that
            # sync's time goes: the receiver's recv (its copy and wait included; the
            # copy alone), the transport's round trip (a ping through the same pipe),
            # and the rest, the sender's own work.
            "answer_after_copy": {
                "sync_s": round(w, 6),
                "d2d_over_sync": round(c / w, 3),
                "samples_s": rounded(main["waits"]),
                "receiver_s": round(wr, 6),
                "receiver_copy_s": round(median(main["waits_copy"]), 6),
                "transport_s": round(p, 6),
                "sender_own_s": round(w - wr - p, 6),
            },
            # The same bytes copied outside the protocol, batched as recv does and
            # per tensor as the reference does. In the receiver: from the sender's
            # tensors (memory another process allocated: sender_*) and between its
            # own (own_*). In the sender: from its tensors into the receiver's
            # (into_receiver_*). If sender_* is slower than own_*, the copy from
            # shared memory is the limit, which no saving on the host closes;
            # into_receiver_* tells whether the sender writing into the rollout's
            # memory would be faster than the rollout reading the trainer's.
            "bare_copies_s": bare,
            "fresh_tensors": {
                "sync_s": round(f, 6),
                "d2d_over_sync": round(c / f, 3),
                "samples_s": rounded(fresh_syncs),
                "layouts": fresh_layouts,
                "note": "new tensors at each sync: packed into the sender's buckets, then "
                "copied out (two copies)",
            },
            "four_times_the_state": {
                "state_bytes": larger["nbytes"],
                "tensors": 4 * sizes.state_tensors,
                "sync_s": round(ls, 6),
                "d2d_s": round(lc, 6),
                "d2d_over_sync": round(lc / ls, 3),
                "answer_after_copy_s": round(median(larger["waits"]), 6),
                "receiver_s": round(median(larger["receiver"]), 6),
                "bare_copies_s": larger_bare,
                "layouts": larger["layouts"],
            },
        },
    )
