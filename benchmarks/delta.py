"""Delta weight sync: bytes and time of a delta against a full sync, on a realistic RL step.

The change pattern is a real one: fp32 master weights, one AdamW step at
lr 1e-6 (with weight decay), published in bf16 as FSDP mixed precision does.
Two states are measured:

* the tiny Llama (transformers' ``LlamaForCausalLM``, 3.4 M parameters,
  trained on a fixed batch), several steps;
* a synthetic state of ``state_bytes`` of bf16 weights (1 GiB in the full
  run), initialised as a transformer's (normal, std 0.02; norms at 1),
  stepped by AdamW on random gradients.

``delta_payload_vs_full``: the delta's bytes over the whole state's (target
<= 0.05), with the bytes of the values that changed (``delta_payload_vs_changed``,
target <= 2). ``delta_sync_vs_full``: a delta sync's time over a full
bucketed broadcast of the same state, two processes on gloo over loopback,
each sample the slower side, interleaved repetition by repetition (target
<= 0.5); before each sample the sender's base has finished moving to the last
delta's version (a job does that in the background, while training goes on).
"""

from __future__ import annotations

import os
import time
import traceback

from benchmarks.common import Result, Sizes, median, rounded, run_pair
from obsckpt.sync.delta_kernels import kernel_name

# Square bf16 matrices of a 4096-wide model (32 MiB each) and its norms.
_MATRIX_COLS = 4096


def _tiny_llama_steps(steps: int = 6) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from obsckpt.sync import delta

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    batch = torch.randint(0, cfg.vocab_size, (8, 64))
    prev = [p.detach().to(torch.bfloat16) for p in model.parameters()]
    out = []
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        new = [p.detach().to(torch.bfloat16) for p in model.parameters()]
        plan, _ = delta.encode_delta(new, prev, chunk_bytes=64 << 20)
        full = sum(t.numel() * t.element_size() for t in new)
        out.append(
            {
                "fraction": plan.fraction,
                "payload": plan.nbytes,
                "changed_bytes": plan.changed_bytes,
                "full": full,
            }
        )
        prev = new
    return out


def synthetic_pair(nbytes: int, seed: int = 0):
    """Two consecutive bf16 publications of a synthetic state: AdamW at lr 1e-6 on fp32
    masters. Returns ``(names, before, after)``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    numel = nbytes // 2
    rows = max(1, min(_MATRIX_COLS, numel // _MATRIX_COLS // 8))
    names, masters = [], []
    left = numel
    i = 0
    while left > 0:
        n = min(left, rows * _MATRIX_COLS)
        if i % 8 == 7:  # a norm's weight, at 1
            t = torch.ones(min(n, _MATRIX_COLS))
        else:
            t = torch.empty(n).normal_(0.0, 0.02, generator=g)
        masters.append(torch.nn.Parameter(t))
        names.append(f"layers.{i // 8}.w{i % 8}")
        left -= t.numel()
        i += 1
    opt = torch.optim.AdamW(masters, lr=1e-6, weight_decay=0.01, foreach=False)

    def step() -> None:
        for p in masters:
            p.grad = torch.empty_like(p).normal_(0.0, 1e-3, generator=g)
        opt.step()

    step()  # Adam's first step moves every value by lr: a second is the steady state
    before = [p.detach().to(torch.bfloat16) for p in masters]
    step()
    after = [p.detach().to(torch.bfloat16) for p in masters]
    return names, before, after


def _payload_rows(sizes: Sizes, log) -> tuple[list[Result], dict]:
    from obsckpt.sync import delta

    llama = _tiny_llama_steps()
    fractions = [s["payload"] / s["full"] for s in llama]
    vs_changed = [s["payload"] / s["changed_bytes"] for s in llama]
    log(
        f"  tiny Llama: changed {median([s['fraction'] for s in llama]):.4f} of values, "
        f"payload {median(fractions):.4f} of full, {median(vs_changed):.3f}x the changed values"
    )
    t0 = time.perf_counter()
    names, before, after = synthetic_pair(sizes.state_bytes)
    made = time.perf_counter() - t0
    plan, _ = delta.encode_delta(after, before, chunk_bytes=256 << 20)
    full = sum(t.numel() * t.element_size() for t in after)
    big = {
        "bytes": full,
        "tensors": len(names),
        "changed_fraction": round(plan.fraction, 5),
        "payload_bytes": plan.nbytes,
        "payload_vs_changed": round(plan.nbytes / plan.changed_bytes, 3),
        "make_s": round(made, 1),
    }
    log(
        f"  synthetic {full / 2**30:.2f} GiB: changed {plan.fraction:.4f}, payload "
        f"{plan.nbytes / full:.4f} of full, {plan.nbytes / plan.changed_bytes:.3f}x changed"
    )
    details = {
        "tiny_llama": {
            "params": llama[0]["full"] // 2,
            "steps": len(llama),
            "changed_fraction": rounded([s["fraction"] for s in llama]),
            "payload_vs_full": rounded(fractions),
            "payload_vs_changed": rounded(vs_changed),
        },
        "synthetic": big,
        "encoding": "1-byte gaps; a move of at most 127 in the bits as one signed byte, "
        "any other as the new bits",
    }
    limit = "the changed values themselves: 2 bytes per changed bf16 value"
    rows = [
        Result(
            "delta_payload_vs_full",
            median(fractions),
            "<=",
            0.05,
            unit="x",
            limit=limit,
            details=details,
        ),
        Result(
            "delta_payload_vs_full_synthetic",
            plan.nbytes / full,
            "<=",
            0.05,
            unit="x",
            limit=limit,
            details=big,
        ),
        Result(
            "delta_payload_vs_changed",
            max(median(vs_changed), plan.nbytes / plan.changed_bytes),
            "<=",
            2.0,
            unit="x",
            limit=limit,
            details={"tiny_llama": median(vs_changed), "synthetic": big["payload_vs_changed"]},
        ),
    ]
    return rows, {"names": names, "before": before, "after": after}


def _worker(rank: int, port: int, nbytes: int, reps: int, q) -> None:
    try:
        import torch

        from obsckpt.sync.broadcast import WeightBroadcaster
        from obsckpt.sync.delta_broadcast import DeltaBroadcaster
        from obsckpt.sync.group import WeightSyncGroup

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        group = WeightSyncGroup(
            host="127.0.0.1", port=port, rank=rank, world_size=2, backend="gloo"
        )
        plain = WeightBroadcaster(group)
        deltas = DeltaBroadcaster(group, full_every=1_000_000)
        tick = torch.zeros(1)
        if rank == 0:
            names, before, after = synthetic_pair(nbytes)
            states = [dict(zip(names, before, strict=True)), dict(zip(names, after, strict=True))]
        step = 0

        def timed(fn) -> float:
            if rank == 0:
                # The sender's base moves to the last delta's version in the background
                # (while training goes on, in a job): finished before the next sample,
                # so that no sample, full or delta, shares the cores with it.
                deltas._settle_base()
            group.broadcast(tick, 0)
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        def full_sync(state) -> None:
            if rank == 0:
                plain.send(state)
            else:
                plain.recv()

        def delta_sync(state) -> object:
            nonlocal step
            step += 1
            if rank == 0:
                return deltas.send(state, step=step)
            return deltas.recv()

        # Warm-up: buffers, receive areas, and the delta's base (a full sync of state 0).
        full_sync(states[0] if rank == 0 else None)
        first = delta_sync(states[0] if rank == 0 else None)
        samples: dict[str, list[float]] = {"full": [], "delta": []}
        phases: list[dict] = []
        for rep in range(reps):
            state = states[(rep + 1) % 2] if rank == 0 else None
            order = ("full", "delta") if rep % 2 == 0 else ("delta", "full")
            for kind in order:
                if kind == "full":
                    samples["full"].append(timed(lambda s=state: full_sync(s)))
                else:
                    got = {}
                    samples["delta"].append(timed(lambda s=state, g=got: g.update(r=delta_sync(s))))
                    if rank == 0:
                        r = got["r"]
                        if r.encoding != "delta" or not r.verified:
                            raise RuntimeError(f"expected a verified delta, got {r}")
                        phases.append(
                            {**r.phases, "sent": r.sent_bytes, "fraction": r.changed_fraction}
                        )
        check = None
        if rank == 1:
            held = deltas._held or {}
            check = [int(t.view(torch.int16).sum()) for t in list(held.values())[:4]]
        else:
            last = states[reps % 2]
            check = [int(t.view(torch.int16).sum()) for t in list(last.values())[:4]]
        q.put(
            (
                rank,
                {
                    "samples": samples,
                    "phases": phases,
                    "check": check,
                    "first": getattr(first, "encoding", None),
                },
            )
        )
        group.close()
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": traceback.format_exc()}))


def _sync_row(sizes: Sizes, log) -> Result:
    nbytes = sizes.state_bytes
    reps = max(2, sizes.save_reps)
    out = run_pair(_worker, (nbytes, reps), "delta", 1800.0)
    if out[0]["check"] != out[1]["check"]:
        raise RuntimeError("the receiver's weights differ from the sender's after the deltas")
    per = {
        k: [max(a, b) for a, b in zip(out[0]["samples"][k], out[1]["samples"][k], strict=True)]
        for k in ("full", "delta")
    }
    med = {k: median(v) for k, v in per.items()}
    phases = out[0]["phases"]
    phase_med = {
        k: round(median([p[k] for p in phases if k in p]), 4)
        for k in ("encode", "wire", "snapshot", "apply", "verify")
    }
    log(f"  gloo: full {med['full']:.3f} s, delta {med['delta']:.3f} s; phases {phase_med}")
    return Result(
        "delta_sync_vs_full",
        med["delta"] / med["full"],
        "<=",
        0.5,
        unit="x",
        limit="encoding on the host: comparing every value with the base (memory bandwidth, "
        "two cores here, shared with the receiver)",
        details={
            "bytes": nbytes,
            "reps": reps,
            "full_s": round(med["full"], 4),
            "delta_s": round(med["delta"], 4),
            "full_samples_s": rounded(per["full"]),
            "delta_samples_s": rounded(per["delta"]),
            "delta_phases_s": phase_med,
            "sent_bytes": phases[-1]["sent"] if phases else None,
            "changed_fraction": phases[-1]["fraction"] if phases else None,
            "cores": os.cpu_count(),
            "kernel": kernel_name(),
        },
    )


def run_delta(sizes: Sizes, log) -> list[Result]:
    rows, _ = _payload_rows(sizes, log)
    rows.append(_sync_row(sizes, log))
    return rows
