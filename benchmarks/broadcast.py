"""Weight-sync broadcast: bucketed vs per-tensor vs one raw broadcast of the same bytes.

Two processes (sender rank 0, receiver rank 1) form a
:class:`obsckpt.sync.group.WeightSyncGroup` and broadcast a
mixture-of-experts-like model: many small tensors (norms, biases, routers,
some in float32) and a few large expert matrices carrying most of the bytes.
Per repetition, after a one-element broadcast that lines both sides up, each
transfer is timed on both sides, in an order that reverses every other
repetition; a sample is the slower side. The transfers: obsckpt's bucketed
broadcast; the reference per-tensor loop (one ``broadcast`` per tensor, each
waited for, as the reference implementation does: on NCCL the wait only
orders the stream); one raw broadcast of a ready buffer of the same bytes;
and obsckpt's own ``mode="per_tensor"`` (in the details only: its checks
and bounded waits make it a weaker baseline than the reference loop, and on
NCCL it polls each collective's completion from the host).
Each rank gets half the cores for torch's intra-op threads, as torchrun
would give two ranks on one machine.
With CUDA and at least two GPUs the same runs on NCCL.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import traceback

from benchmarks.common import Result, Sizes, median, rounded, run_pair, skipped


def moe_layout(ntensors: int, nbytes: int, seed: int = 0) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of ``ntensors`` tensors totalling about ``nbytes``.

    About 3% of the tensors are experts holding 85% of the bytes; the rest are
    small (1 KiB to 256 KiB, log-uniform), a few dozen of them float32.
    """
    rng = random.Random(seed)
    n_large = max(1, ntensors * 3 // 100)
    n_small = ntensors - n_large
    small_total = nbytes * 0.15
    raw = [math.exp(rng.uniform(math.log(1 << 10), math.log(256 << 10))) for _ in range(n_small)]
    scale = small_total / sum(raw) if raw else 0.0
    layout = []
    for i, b in enumerate(raw):
        fp32 = i % 60 == 0  # router / gate weights kept in float32
        item = 4 if fp32 else 2
        numel = max(1, int(b * scale) // item)
        layout.append((f"layers.{i // 30}.small.{i}", "float32" if fp32 else "bfloat16", (numel,)))
    large_total = nbytes - sum(math.prod(s) * (4 if d == "float32" else 2) for _, d, s in layout)
    cols = 1024
    rows = max(1, int(large_total // n_large // 2 // cols))
    for j in range(n_large):
        layout.append((f"layers.{j}.mlp.experts.{j}.w", "bfloat16", (rows, cols)))
    rng.shuffle(layout)  # experts and small tensors interleave, as in a real model
    return layout


def _build(layout, fill: bool):
    import torch

    out = {}
    for name, dtype, shape in layout:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        if fill:
            t.uniform_()
        out[name] = t
    return out


def _neighbour(what: str, stop: threading.Event) -> None:
    """Load one core until ``stop``: memory copies, or arithmetic that stays in cache."""
    import torch

    if what == "copy":
        src = torch.ones(64 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        while not stop.is_set():
            dst.copy_(src)
    else:
        a = torch.randn(128, 128)
        while not stop.is_set():
            for _ in range(50):
                a = torch.tanh(a @ a)


def _worker(rank: int, port: int, backend: str, layout, reps: int, q) -> None:
    try:
        import torch

        from obsckpt.sync.broadcast import WeightBroadcaster
        from obsckpt.sync.group import WeightSyncGroup

        # Two ranks on one machine: half the cores each for intra-op threads (one
        # each on two cores); more oversubscribes the cores and OpenMP spins.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        group = WeightSyncGroup(
            host="127.0.0.1", port=port, rank=rank, world_size=2, backend=backend
        )
        device = group.device
        state = _build(layout, fill=rank == 0)
        if backend == "nccl":
            state = {k: v.to(device) for k, v in state.items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if rank == 0:
            raw.random_(0, 255)
        tick = torch.zeros(1, device=device)
        bc = WeightBroadcaster(group, src=0)

        def sync() -> None:
            group.broadcast(tick, 0)
            if backend == "nccl":
                torch.cuda.synchronize()

        def timed(fn) -> tuple[float, float]:
            """Wall seconds and this process's CPU seconds (all its threads, gloo's included)."""
            sync()
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn()
            if backend == "nccl":
                torch.cuda.synchronize()
            return time.perf_counter() - t0, time.process_time() - c0

        tensors = list(state.values())

        def reference() -> None:
            # The reference implementation's loop: one torch.distributed.broadcast per
            # tensor, each waited for (on NCCL wait() only orders the stream), into
            # the tensors the receiver already holds. No header, no checks.
            for t in tensors:
                group.broadcast_async(t, 0).wait()

        def op(kind: str):
            if kind == "raw":
                return lambda: group.broadcast(raw, 0)
            if kind == "per_tensor":
                return reference
            mode = "per_tensor" if kind == "per_tensor_mode" else kind
            if rank == 0:
                return lambda: bc.send(state, mode=mode)
            return lambda: bc.recv()

        kinds = ("per_tensor", "bucketed", "raw", "per_tensor_mode")
        for kind in kinds:  # warm-up: buffers, receive area, gloo pairs
            timed(op(kind))
        # One checked transfer: the receiver's tensors must equal the sender's.
        sync()
        received = bc.recv() if rank == 1 else bc.send(state, mode="bucketed")
        sync()
        samples = {k: [] for k in kinds}
        cpu = {k: [] for k in kinds}
        for rep in range(reps):
            order = kinds if rep % 2 == 0 else tuple(reversed(kinds))
            for kind in order:
                wall, used = timed(op(kind))
                samples[kind].append(wall)
                cpu[kind].append(used)
        # The packing copy alone (each bucket's tensors copied into views of a warm
        # buffer, as the sender does), without any transfer: the part of a bucketed
        # broadcast that a raw one of a ready buffer does not have.
        pack: list[float] = []
        if rank == 0:
            from obsckpt.sync.buckets import plan_buckets, tensor_meta

            plan = [
                b for b in plan_buckets(tensor_meta(state.items()), bc.bucket_bytes) if not b.solo
            ]
            outs = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in plan]
            views = [
                [
                    out_[o : o + tensors[i].numel()].view(tensors[i].shape)
                    for i, o in zip(b.indices, b.offsets, strict=True)
                ]
                for b, out_ in zip(plan, outs, strict=True)
            ]

            def pack_all() -> None:
                for bucket, dst in zip(plan, views, strict=True):
                    torch._foreach_copy_(dst, [tensors[i] for i in bucket.indices])
                if backend == "nccl":
                    torch.cuda.synchronize()

            pack_all()
            for _ in range(reps):
                t0 = time.perf_counter()
                pack_all()
                pack.append(time.perf_counter() - t0)
            del outs
        # What limits the raw broadcast itself: the same transfer while a thread
        # of the sender copies memory (as packing does) or computes in cache.
        neighbours = {}
        if backend == "gloo":
            for what in ("none", "copy", "compute"):
                stop = threading.Event()
                worker = None
                if rank == 0 and what != "none":
                    worker = threading.Thread(target=_neighbour, args=(what, stop), daemon=True)
                    worker.start()
                neighbours[what] = [timed(op("raw"))[0] for _ in range(reps)]
                stop.set()
                if worker is not None:
                    worker.join()
        checksum = None
        if rank == 1:
            checksum = float(sum(float(t.float().sum()) for t in list(received.values())[:8]))
        elif rank == 0:
            checksum = float(sum(float(t.float().sum()) for t in list(state.values())[:8]))
        q.put(
            (
                rank,
                {
                    "samples": samples,
                    "cpu": cpu,
                    "neighbours": neighbours,
                    "pack": pack,
                    "nbytes": nbytes,
                    "checksum": checksum,
                    "buckets": bc.bucket_bytes,
                },
            )
        )
        group.close()
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": traceback.format_exc()}))


def _run_pair(backend: str, layout, reps: int, timeout: float = 900.0) -> dict:
    out = run_pair(_worker, (backend, layout, reps), "broadcast", timeout)
    if abs(out[0]["checksum"] - out[1]["checksum"]) > 1e-3 * max(1.0, abs(out[0]["checksum"])):
        raise RuntimeError("the receiver's tensors differ from the sender's")
    return out


def _results(prefix: str, backend: str, out: dict, ntensors: int, limit: str) -> list[Result]:
    kinds = ("per_tensor", "bucketed", "raw", "per_tensor_mode")
    # A sample is the slower of the two sides.
    per = {
        k: [max(a, b) for a, b in zip(out[0]["samples"][k], out[1]["samples"][k], strict=True)]
        for k in kinds
    }
    med = {k: median(v) for k, v in per.items()}
    # CPU seconds of one operation, both ranks together.
    cpu = {
        k: median([a + b for a, b in zip(out[0]["cpu"][k], out[1]["cpu"][k], strict=True)])
        for k in kinds
    }
    nbytes = out[0]["nbytes"]
    common = {
        "backend": backend,
        "tensors": ntensors,
        "bytes": nbytes,
        "bucket_bytes": out[0]["buckets"],
        "reps": len(per["raw"]),
        **{f"{k}_s": round(v, 6) for k, v in med.items()},
        **{f"{k}_GBps": round(nbytes / v / 1e9, 3) for k, v in med.items()},
        **{f"{k}_samples_s": rounded(per[k]) for k in kinds},
    }
    pack_s = median(out[0]["pack"])
    paired = [
        r / b for r, b in zip(per["raw"], per["bucketed"], strict=True)
    ]  # same repetition, adjacent in time
    vs_raw: dict = {
        "pack_s": round(pack_s, 6),
        "pack_note": "the sender's copy of every bucket into warm buffers, timed alone",
        "bound_if_pack_not_overlapped": round(med["raw"] / (med["raw"] + pack_s), 3),
        "paired_ratio_median": round(median(paired), 3),
        "paired_ratios": rounded(paired),
    }
    if backend == "gloo":
        # On CPU every byte costs work on some core (the packing copy, the socket
        # copies on both sides); a broadcast cannot finish before its CPU seconds
        # spread over all the machine's cores.
        cores = os.cpu_count() or 1
        sides = {
            w: zip(out[0]["neighbours"][w], out[1]["neighbours"][w], strict=True)
            for w in ("none", "copy", "compute")
        }
        slowed = {
            f"raw_with_{w}_neighbour_s": round(median([max(a, b) for a, b in pairs]), 6)
            for w, pairs in sides.items()
        }
        vs_raw |= {
            **slowed,
            "cores": cores,
            **{f"{k}_cpu_s": round(v, 6) for k, v in cpu.items()},
            "raw_cores_busy": round(cpu["raw"] / med["raw"], 2),
            "bucketed_cores_busy": round(cpu["bucketed"] / med["bucketed"], 2),
            "bound_if_cpu_fully_parallel": round(med["raw"] * cores / cpu["bucketed"], 3),
        }
    per_tensor_details = {
        **common,
        "per_tensor_note": "per_tensor is the reference loop (one broadcast per tensor, "
        "waited for, into the receiver's own tensors); per_tensor_mode is obsckpt's "
        "mode='per_tensor' (a header, per-tensor checks and bounded waits), timed alongside",
        "bucketed_vs_per_tensor_mode": round(med["per_tensor_mode"] / med["bucketed"], 3),
    }
    return [
        Result(
            f"{prefix}bucketed_vs_per_tensor",
            med["per_tensor"] / med["bucketed"],
            ">=",
            2,
            unit="x",
            limit=limit,
            details=per_tensor_details,
        ),
        Result(
            f"{prefix}broadcast_vs_raw",
            med["raw"] / med["bucketed"],
            ">=",
            0.8,
            unit="x",
            limit=limit,
            details={
                **{k: v for k, v in common.items() if not k.endswith("_samples_s")},
                **vs_raw,
            },
        ),
    ]


def run_broadcast(sizes: Sizes, log) -> list[Result]:
    layout = moe_layout(sizes.bcast_tensors, sizes.bcast_bytes)
    out = _run_pair("gloo", layout, sizes.bcast_reps)
    res = _results(
        "", "gloo", out, len(layout), "gloo over loopback TCP, sender and receiver sharing 2 cores"
    )
    for r in res:
        log(
            f"  {r.name}: {r.value:.2f} (per-tensor {r.details['per_tensor_s']:.3f} s, bucketed {r.details['bucketed_s']:.3f} s, raw {r.details['raw_s']:.3f} s)"
        )
    return res


def run_nccl_broadcast(sizes: Sizes, log) -> list[Result]:
    import torch

    names = ("nccl_bucketed_vs_per_tensor", "nccl_broadcast_vs_raw")
    bounds = ((">=", 2.0), (">=", 0.8))
    reason = None
    if not torch.cuda.is_available():
        reason = "CUDA is not available"
    elif torch.cuda.device_count() < 2:
        reason = f"NCCL needs 2 GPUs for 2 ranks; {torch.cuda.device_count()} present"
    elif not torch.distributed.is_nccl_available():
        reason = "torch was built without NCCL"
    if reason:
        return [
            skipped(n, op, b, reason, unit="x") for n, (op, b) in zip(names, bounds, strict=True)
        ]
    layout = moe_layout(sizes.bcast_tensors, sizes.bcast_bytes)
    out = _run_pair("nccl", layout, sizes.bcast_reps)
    res = _results("nccl_", "nccl", out, len(layout), "NCCL between two GPUs (NVLink or PCIe)")
    for r in res:
        log(f"  {r.name}: {r.value:.2f}")
    return res


if __name__ == "__main__":  # pragma: no cover - manual check of the layout
    lay = moe_layout(2000, 256 << 20)
    total = sum(math.prod(s) * (4 if d == "float32" else 2) for _, d, s in lay)
    print(len(lay), total / 2**20, "MiB", os.cpu_count())
