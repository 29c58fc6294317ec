"""Colocated weight sync on one GPU: the ipc method vs a device-to-device copy of the same bytes.

The trainer side hands CUDA IPC handles to a second process on the same
GPU, which copies the tensors into its own weights and acknowledges (through
a pipe here, a Ray call in the demo). The reference is one in-process
device-to-device copy of the same tensors, one ``copy_`` per tensor. The
value is copy time / sync time (1.0: the sync costs one copy); the details
also give one batched copy (``torch._foreach_copy_``, which the receiver
uses) for a state that stays in place between
syncs, as a model updated in place by its optimizer does: the ``direct``
layout, one copy from the trainer's tensors into the receiver's. They split
the sync's time into the receiver's part (copy included), the transport's
round trip (a ping through the same pipe) and the sender's own. They
also give the ``buckets`` layout, used when the tensors are new at each
sync (gathered from shards): packed into the sender's buckets, then copied
out, two copies.
"""

from __future__ import annotations

import time

from benchmarks.common import Result, Sizes, median, rounded, skipped

NAME = "gpu_ipc_sync_vs_d2d"
TARGET = 0.8


def _receiver(conn, device_index: int) -> None:
    import torch

    from obsckpt.sync.ipc import IpcWeightReceiver

    torch.cuda.set_device(device_index)
    receiver = IpcWeightReceiver(device=torch.device("cuda", device_index))
    while True:
        payload = conn.recv()
        if payload is None:
            break
        if payload == "ping":  # the transport alone: two wake-ups, nothing else
            conn.send("pong")
            continue
        try:
            ack, _ = receiver.recv(payload)
            ack["receiver_s"] = receiver.last_seconds
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            ack = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send(ack)
    receiver.close()


def run_gpu_ipc_sync(sizes: Sizes, log) -> Result:
    import torch

    if not torch.cuda.is_available():
        return skipped(NAME, ">=", TARGET, "CUDA is not available", unit="x")
    import torch.multiprocessing as mp

    from obsckpt.sync.ipc import IpcWeightSender

    device = torch.device("cuda", torch.cuda.current_device())
    per = max(1, sizes.state_bytes // sizes.state_tensors // 2)
    state = {
        f"layers.{i}.weight": torch.randn(per, dtype=torch.bfloat16, device=device)
        for i in range(sizes.state_tensors)
    }
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    copies = {k: torch.empty_like(t) for k, t in state.items()}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, device.index), daemon=True)
    proc.start()
    sender = IpcWeightSender(device=device, timeout_s=120.0)

    receiver_s: list[float] = []

    def deliver(payload):
        parent.send(payload)
        if not parent.poll(120.0):
            raise TimeoutError("the receiver did not answer within 120 s")
        ack = parent.recv()
        if "error" in ack:
            raise RuntimeError(ack["error"])
        receiver_s.append(ack["receiver_s"])
        return ack

    def ping() -> float:
        t0 = time.perf_counter()
        parent.send("ping")
        parent.recv()
        return time.perf_counter() - t0

    step = 0

    def sync() -> float:
        nonlocal step
        step += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sender.send(state, deliver, step=step)
        return time.perf_counter() - t0

    def d2d() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, t in state.items():
            copies[k].copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def d2d_batched() -> float:  # one batched copy (what the receiver uses), for the details
        dsts, srcs = list(copies.values()), list(state.values())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch._foreach_copy_(dsts, srcs)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    reps = max(3, sizes.save_reps)
    layouts = []
    try:
        sync()  # the receiver opens the storages once
        d2d()
        syncs, refs, batched, pings = [], [], [], []
        receiver_s.clear()
        for _ in range(reps):
            refs.append(d2d())
            batched.append(d2d_batched())
            pings.append(ping())
            syncs.append(sync())
            layouts.append(sender.last_layout)
        in_receiver = list(receiver_s)
        # Tensors new at each sync: the sender switches to its buckets.
        fresh_syncs, fresh_layouts = [], []
        for _ in range(reps + 2):
            fresh = {k: v.clone() for k, v in state.items()}
            step += 1
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sender.send(fresh, deliver, step=step)
            fresh_syncs.append(time.perf_counter() - t0)
            fresh_layouts.append(sender.last_layout)
            del fresh
        fresh_syncs, fresh_layouts = fresh_syncs[2:], fresh_layouts[2:]
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        sender.close()
    s, c, f = median(syncs), median(refs), median(fresh_syncs)
    r, p = median(in_receiver), median(pings)
    log(
        f"  ipc sync {s * 1e3:.2f} ms ({'/'.join(sorted(set(layouts)))}) vs D2D copy "
        f"{c * 1e3:.2f} ms ({nbytes / c / 1e9:.1f} GB/s) for {nbytes / 1e9:.2f} GB; "
        f"in the receiver {r * 1e3:.2f} ms, transport {p * 1e3:.2f} ms, the sender's own "
        f"{(s - r - p) * 1e3:.2f} ms; fresh tensors {f * 1e3:.2f} ms "
        f"({'/'.join(sorted(set(fresh_layouts)))})"
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
            "tensors": len(state),
            "sync_s": round(s, 6),
            "d2d_s": round(c, 6),
            "d2d_GBps": round(nbytes / c / 1e9, 3),
            "sync_samples_s": rounded(syncs),
            "d2d_samples_s": rounded(refs),
            "d2d_batched_s": round(median(batched), 6),
            "d2d_batched_over_sync": round(median(batched) / s, 3),
            "layouts": layouts,
            # Where a sync's time goes: the receiver's recv (copy and synchronize
            # included), the transport's round trip (a ping through the same pipe),
            # and the rest, the sender's own work.
            "receiver_s": round(r, 6),
            "transport_s": round(p, 6),
            "sender_own_s": round(s - r - p, 6),
            "fresh_tensors": {
                "sync_s": round(f, 6),
                "d2d_over_sync": round(c / f, 3),
                "samples_s": rounded(fresh_syncs),
                "layouts": fresh_layouts,
                "note": "new tensors at each sync: packed into the sender's buckets, then "
                "copied out (two copies)",
            },
        },
    )
