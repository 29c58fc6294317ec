"""Delta weight sync: the encoding, and the protocol between real gloo processes.

The codec tests run in this process; the protocol runs a sender and two
receivers, each a process of its own, over a real weight-sync group: 55
steps of a real AdamW on fp32 master weights published in bf16, fp16 and
fp32, the receivers' weights compared bit for bit with the sender's after
every sync, a chunk corrupted on the wire and a tensor corrupted after the
apply both caught.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from broadcast_helpers import new_group, new_metrics, run_ranks

from obsckpt.errors import WeightSyncCorruptError
from obsckpt.sync import delta
from obsckpt.sync import delta_kernels as kernels
from obsckpt.sync.buckets import tensor_meta
from obsckpt.sync.delta_broadcast import DeltaBroadcaster
from obsckpt.sync.delta_memory import MemorySyncClient

# ----------------------------------------------------------------------
# The encoding
# ----------------------------------------------------------------------


def _changed(base: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    mask = torch.rand(base.shape, generator=g) < fraction
    new[mask] = (torch.randn(int(mask.sum()), generator=g) * 3).to(base.dtype)
    return new


def _roundtrip(news, bases, chunk_bytes=1 << 12):
    plan, payload = delta.encode_delta(news, bases, chunk_bytes=chunk_bytes)
    assert delta.check_chunks(payload, plan) == []
    delta.check_plan(plan, tensor_meta((str(i), t) for i, t in enumerate(news)), payload.numel())
    targets = [b.clone() for b in bases]
    wire = delta.DeltaPlan.from_wire(plan.to_wire())
    delta.apply_delta(targets, wire, payload)
    for t, n in zip(targets, news, strict=True):
        assert torch.equal(delta.bits(t), delta.bits(n))
    return plan, payload


class TestEncoding:
    """Every encoding test runs with both host kernels: numba's and numpy's."""

    @pytest.fixture(autouse=True, params=["numba", "numpy"])
    def kernel(self, request, monkeypatch):
        monkeypatch.setenv(kernels.KERNEL_ENV, request.param)
        assert kernels.kernel_name() == request.param
        return request.param

    @pytest.mark.parametrize(
        "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8]
    )
    def test_roundtrip_is_bit_exact(self, dtype):
        base = (torch.randn(300, 77) * 4).to(dtype)
        plan, _ = _roundtrip([_changed(base, 0.03)], [base])
        assert 0.015 < plan.fraction < 0.045

    @pytest.mark.parametrize(
        "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8]
    )
    @pytest.mark.parametrize("length", [1, 7, 4096 + 3])
    def test_word_compare_finds_every_changed_value(self, monkeypatch, dtype, length):
        """Values are compared eight bytes at a time, then one by one in the words that
        changed: the positions found are a plain compare's, for a length that is no
        multiple of a word (changes in its tail included), a view starting off a word's
        boundary, and blocks cut anywhere."""
        monkeypatch.setattr(delta, "BLOCK", 1000 + 1)
        g = torch.Generator().manual_seed(length)
        store = (torch.randn(length + 1, generator=g) * 4).to(dtype)
        base = store[1:]  # one element past the storage's start: no word alignment
        new = _changed(base, 0.05, seed=length)
        new[-1] = new[-1] + 1 if dtype != torch.int8 else new[-1] ^ 1
        for o in range(0, length, delta.BLOCK):
            n, b = (
                delta._host_bits(new)[o : o + delta.BLOCK],
                delta._host_bits(base)[o : o + delta.BLOCK],
            )
            pos, values, bases = delta._changed(n, b)
            want = np.flatnonzero(n != b)
            assert pos.tolist() == want.tolist()
            assert values.tolist() == n[want].tolist() and bases.tolist() == b[want].tolist()
        _roundtrip([new], [base.clone()])

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.int8])
    def test_the_device_encoder_gives_the_same_payload(self, monkeypatch, dtype):
        """On a GPU the delta is found with torch operations where the tensors live; run
        here on the CPU, it must give the host encoder's payload byte for byte."""
        monkeypatch.setattr(delta, "BLOCK", 5000)
        base = (torch.randn(400, 77) * 4).to(dtype)
        new = _changed(base, 0.03)
        new.view(-1)[13_000:13_010] = new.view(-1)[13_000:13_010] + 1  # small moves too
        new.view(-1)[-1] = 1
        host_plan, host_payload = delta.encode_delta(
            [new, base[:2]], [base, base[:2]], chunk_bytes=999
        )
        monkeypatch.setattr(delta, "_on_device", lambda t: True)
        plan, payload = _roundtrip([new, base[:2]], [base, base[:2]], chunk_bytes=999)
        assert plan.to_wire() == host_plan.to_wire()
        assert torch.equal(payload, host_payload)

    def test_payload_is_under_twice_the_changed_values(self):
        base = torch.randn(1000, 100).to(torch.bfloat16)
        plan, payload = _roundtrip([_changed(base, 0.02)], [base])
        assert plan.nbytes == payload.numel()
        assert plan.nbytes <= 1.6 * plan.changed_bytes  # 3 bytes per bf16 entry
        assert plan.nbytes <= 0.05 * base.numel() * 2

    def test_small_moves_cost_two_bytes_each(self):
        """A bf16 value nudged by a few units in its last place goes as one signed byte."""
        base = (torch.randn(500, 200) * 0.02).to(torch.bfloat16)
        new = base.clone()
        g = torch.Generator().manual_seed(1)
        moved = torch.rand(base.shape, generator=g) < 0.03
        step = torch.randint(-3, 4, base.shape, generator=g, dtype=torch.int16)
        new.view(torch.int16)[moved] += step[moved]
        plan, payload = _roundtrip([new], [base])
        assert all(whole == 0 for _, _, _, whole in plan.blocks)
        assert plan.nbytes <= 1.05 * plan.changed_bytes

    @pytest.mark.parametrize(
        ("dtype", "small"), [(torch.int8, 2), (torch.int32, 2), (torch.int64, 4)]
    )
    def test_large_moves_go_whole_and_wrapping_ones_stay_exact(self, dtype, small):
        """max -> min is a large move, sent whole; for 8-byte values the difference is
        taken modulo 2**64, where it is 1, and added back the same way."""
        info = torch.iinfo(dtype)
        base = torch.tensor([info.max, info.min, 5, info.max - 3], dtype=dtype)
        new = torch.tensor([info.min, info.max, 6, info.max], dtype=dtype)
        plan, _ = _roundtrip([new], [base])
        assert plan.blocks == [(0, 0, small, 4 - small)]

    def test_long_unchanged_runs_are_bridged(self):
        base = torch.zeros(100_000, dtype=torch.bfloat16)
        new = base.clone()
        new[0], new[5000], new[99_999] = 1, 2, 3
        plan, _ = _roundtrip([new], [base])
        assert plan.changed == 3
        assert sum(a + b for _, _, a, b in plan.blocks) == 3 + (99_999 - 5000) // 255 + 5000 // 255

    def test_gap_stream_matches_a_plain_walk(self):
        """Gaps of 1 to 255, a bridging entry 255 ahead for every longer stretch, and
        numpy.insert's indices of those entries, as a position-by-position walk gives."""
        rng = np.random.default_rng(3)
        for trial in range(40):
            size = int(rng.integers(1, 400))
            pos = np.unique(rng.integers(0, 10 ** int(rng.integers(2, 6)), size))
            want_gaps, want_added, prev = [], [], -1
            for i, p in enumerate(pos.tolist()):
                while p - prev > delta.GAP_MAX:
                    want_gaps.append(delta.GAP_MAX)
                    want_added.append(i)
                    prev += delta.GAP_MAX
                want_gaps.append(p - prev)
                prev = p
            gaps, added = delta._gap_stream(pos)
            assert gaps.dtype == np.uint8 and gaps.tolist() == want_gaps, trial
            assert (added is None and not want_added) or added.tolist() == want_added, trial

    def test_blocks_split_a_tensor(self, monkeypatch):
        monkeypatch.setattr(delta, "BLOCK", 1000)
        base = torch.randn(10_500).to(torch.float16)
        plan, _ = _roundtrip([_changed(base, 0.05)], [base])
        assert [k for _, k, _, _ in plan.blocks] == list(range(11))

    def test_bits_not_values(self):
        base = torch.tensor([0.0, float("nan"), 1.0, -0.0])
        new = torch.tensor([-0.0, float("nan"), 1.0, -0.0])
        plan, _ = _roundtrip([new], [base])
        assert plan.changed == 1  # -0.0 replaced 0.0; the same NaN is no change

    def test_nothing_changed_sends_nothing(self):
        base = torch.randn(64, 64)
        plan, payload = _roundtrip([base.clone(), base[:3].clone()], [base, base[:3]])
        assert plan.blocks == [] and payload.numel() == 0 and plan.chunks == []

    def test_a_flipped_byte_fails_its_chunk(self):
        base = torch.randn(400, 100).to(torch.bfloat16)
        plan, payload = delta.encode_delta([_changed(base, 0.05)], [base], chunk_bytes=1000)
        payload[2500] ^= 0x10
        assert delta.check_chunks(payload, plan) == [2]

    def test_a_plan_that_does_not_fit_is_refused(self):
        base = torch.randn(10, 10)
        plan, payload = delta.encode_delta([_changed(base, 0.5)], [base], chunk_bytes=64)
        small = tensor_meta([("w", torch.empty(3))])
        with pytest.raises(ValueError, match="does not fit 'w'"):
            delta.check_plan(plan, small, payload.numel())
        with pytest.raises(ValueError, match="names tensor #0, but the sync has 0"):
            delta.check_plan(plan, [], payload.numel())

    def test_digests_sample_by_step_and_take_all_when_full(self):
        meta = tensor_meta((str(i), torch.empty(1)) for i in range(100))
        a = delta.digest_indices(meta, 7, sample=4, full=False)
        assert a == delta.digest_indices(meta, 7, sample=4, full=False) and len(a) == 4
        assert a != delta.digest_indices(meta, 8, sample=4, full=False)
        assert delta.digest_indices(meta, 7, sample=4, full=True) == list(range(100))

    def test_sampled_digests_read_at_most_a_sixteenth_of_the_state(self):
        meta = tensor_meta(
            [("big", torch.empty(1000))] + [(str(i), torch.empty(10)) for i in range(40)]
        )
        for step in range(20):
            picked = delta.digest_indices(meta, step, sample=8, full=False)
            assert picked and sum(meta[i].nbytes for i in picked) <= max(
                meta[picked[0]].nbytes, sum(m.nbytes for m in meta) / 16
            )

    @pytest.mark.parametrize("bad", [0, -1, True, 1.5])
    def test_settings_are_checked(self, bad):
        g = new_group()
        try:
            with pytest.raises(ValueError, match="full_every must be a positive int"):
                DeltaBroadcaster(g, full_every=bad)
        finally:
            g.close()


# ----------------------------------------------------------------------
# The protocol, between processes
# ----------------------------------------------------------------------

STEPS = 55
FULL_EVERY = 10
CORRUPT_WIRE_AT = 23  # a delta chunk flipped on the wire
CORRUPT_HELD_AT = 36  # receiver 1's weights damaged before this sync's delta lands


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 master weights as a rollout gets them: bf16 and fp16 (mixed precision), fp32."""
    p = dict(model.named_parameters())
    return {
        "0.weight": p["0.weight"].detach().to(torch.bfloat16),
        "0.bias": p["0.bias"].detach().to(torch.float16),
        "2.weight": p["2.weight"].detach().to(torch.bfloat16),
        "2.bias": p["2.bias"].detach().clone(),
    }


def _crcs(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {
        n: zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()) for n, t in state.items()
    }


def _delta_ranks(rank: int, port: int) -> dict:
    from obsckpt.sync import delta_broadcast

    group = new_group(rank, port, world_size=3, timeout_s=60)
    metrics = new_metrics() if rank == 0 else None
    b = DeltaBroadcaster(
        group, bucket_bytes=4096, full_every=FULL_EVERY, digest_tensors=1, metrics=metrics
    )
    out: dict = {"crcs": {}, "errors": {}, "results": {}}
    try:
        if rank == 0:
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            x = torch.randn(32, 64)
            real = DeltaBroadcaster._broadcast_now
            for step in range(STEPS):
                if step:
                    opt.zero_grad()
                    model(x).square().mean().backward()
                    opt.step()
                state = _published(model)
                if step == CORRUPT_WIRE_AT:

                    def flipped(self, t, deadline, what, _real=real):
                        if what == "delta chunk":
                            t = t.clone()
                            t[t.numel() // 2] ^= 0xFF
                        return _real(self, t, deadline, what)

                    delta_broadcast.DeltaBroadcaster._broadcast_now = flipped  # type: ignore[method-assign]
                r = b.send(state, step=step)
                delta_broadcast.DeltaBroadcaster._broadcast_now = real  # type: ignore[method-assign]
                out["crcs"][step] = _crcs(state)
                out["results"][step] = (
                    r.encoding,
                    r.sent_bytes,
                    r.state_bytes,
                    r.changed_fraction,
                    r.corrupt,
                    r.rollout_version,
                )
            reg = metrics.registry
            out["metrics"] = {
                check: reg.get_sample_value(
                    "obsckpt_weight_sync_corrupt_total", {"method": "broadcast", "check": check}
                )
                for check in ("checksum", "digest")
            }
            out["metrics"]["lag"] = reg.get_sample_value(
                "obsckpt_weight_sync_version_lag", {"method": "broadcast"}
            )
            out["metrics"]["delta_bytes"] = reg.get_sample_value(
                "obsckpt_weight_sync_sent_bytes_total", {"method": "broadcast", "encoding": "delta"}
            )
            out["metrics"]["phases"] = sorted(
                s.labels["sync_phase"]
                for m in reg.collect()
                if m.name == "obsckpt_last_weight_sync_phase_seconds"
                for s in m.samples
            )
        else:
            into = (
                {n: torch.empty_like(t) for n, t in _published(_model()).items()}
                if rank == 2
                else None
            )
            for step in range(STEPS):
                if rank == 1 and step == CORRUPT_HELD_AT:
                    held = b._held
                    meta = tensor_meta(held.items())
                    [i] = delta.digest_indices(meta, step, sample=1, full=False)
                    t = held[meta[i].name].view(-1)
                    t[:16] = t[:16] * 3 + 1  # damaged after the last apply, wire checks pass
                try:
                    got = b.recv(into=into)
                except WeightSyncCorruptError as exc:
                    out["errors"][step] = (str(exc), b.last_step, b.weights_valid)
                    continue
                if into is not None:
                    assert all(got[n] is into[n] for n in into)
                out["crcs"][step] = _crcs(got)
                out["results"][step] = b.last_step
    finally:
        group.close()
    return out


@pytest.fixture(scope="module")
def synced():
    return run_ranks(_delta_ranks, world_size=3, timeout=240)


class TestDeltaProtocol:
    def test_receivers_hold_the_senders_bits_after_every_sync(self, synced):
        sent = synced[0]["crcs"]
        for rank in (1, 2):
            failed = set(synced[rank]["errors"])
            for step in range(STEPS):
                if step in failed:
                    continue
                assert synced[rank]["crcs"][step] == sent[step], (rank, step)
        assert set(synced[2]["errors"]) == {CORRUPT_WIRE_AT}
        assert set(synced[1]["errors"]) == {CORRUPT_WIRE_AT, CORRUPT_HELD_AT}

    def test_full_first_every_k_and_after_a_failure(self, synced):
        enc = {s: r[0] for s, r in synced[0]["results"].items()}
        full = sorted(s for s, e in enc.items() if e == "full")
        assert full[:2] == [0, FULL_EVERY]
        assert CORRUPT_WIRE_AT + 1 in full and CORRUPT_HELD_AT + 1 in full
        assert sum(e == "delta" for e in enc.values()) >= STEPS - 10

    def test_deltas_are_small(self, synced):
        for step, (enc, sent, size, fraction, _, _) in synced[0]["results"].items():
            if enc == "delta" and step not in (CORRUPT_WIRE_AT,):
                assert sent <= 0.2 * size, (step, sent, size, fraction)
                assert fraction is not None and fraction < 0.1

    def test_a_chunk_corrupted_on_the_wire_is_caught_before_the_apply(self, synced):
        enc, _, _, _, corrupt, oldest = synced[0]["results"][CORRUPT_WIRE_AT]
        assert (enc, corrupt, oldest) == ("delta", "checksum", CORRUPT_WIRE_AT - 1)
        for rank in (1, 2):
            message, held, valid = synced[rank]["errors"][CORRUPT_WIRE_AT]
            assert "checksum check" in message and "nothing was applied" in message
            assert (held, valid) == (CORRUPT_WIRE_AT - 1, True)

    def test_a_tensor_damaged_after_the_apply_is_caught_by_its_digest(self, synced):
        enc, _, _, _, corrupt, oldest = synced[0]["results"][CORRUPT_HELD_AT]
        assert (enc, corrupt, oldest) == ("delta", "digest", CORRUPT_HELD_AT - 1)
        message, held, valid = synced[1]["errors"][CORRUPT_HELD_AT]
        assert "digest check" in message and (held, valid) == (CORRUPT_HELD_AT - 1, False)
        assert synced[2]["results"][CORRUPT_HELD_AT] == CORRUPT_HELD_AT

    def test_metrics(self, synced):
        m = synced[0]["metrics"]
        assert (m["checksum"], m["digest"]) == (1.0, 1.0)
        assert m["lag"] == 0.0 and m["delta_bytes"] > 0
        assert m["phases"] == ["apply", "encode", "snapshot", "verify", "wire"]


def _resume_ranks(rank: int, port: int) -> dict:
    from obsckpt.errors import BroadcastError

    group = new_group(rank, port, world_size=2, timeout_s=60)
    b = DeltaBroadcaster(group, bucket_bytes=4096, full_every=100)
    out: dict = {"log": []}
    try:
        if rank == 0:
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            x = torch.randn(32, 64)
            snapshots = {}
            for step in range(6):
                if step:
                    opt.zero_grad()
                    model(x).square().mean().backward()
                    opt.step()
                snapshots[step] = _published(model)
                out["log"].append(("send", step, b.send(snapshots[step], step=step).encoding))
            # A stale step without a resume: refused by the receiver, the group kept.
            with pytest.raises(ValueError, match="not newer"):
                b.send(snapshots[3], step=3)
            # The trainer crashed after step 5 and resumed from the checkpoint of step 3.
            b.resume_from(3)
            for step in (3, 4):
                r = b.send(snapshots[step], step=step)
                out["log"].append(("send", step, r.encoding, r.rollout_version))
                out["crcs"] = _crcs(snapshots[step])
        else:
            for _ in range(8):
                try:
                    got = b.recv()
                except BroadcastError as exc:  # pragma: no cover - reported
                    out["log"].append(("error", str(exc)))
                    continue
                out["log"].append(("recv", b.last_step))
            out["crcs"] = _crcs(got)
    finally:
        b.close()
        group.close()
    return out


def test_a_resumed_trainer_sends_its_committed_version_in_full_and_versions_rise_from_there():
    out = run_ranks(_resume_ranks, world_size=2, timeout=180)
    sent = out[0]["log"]
    assert [e[2] for e in sent[:6]] == ["full"] + ["delta"] * 5
    assert sent[6:] == [("send", 3, "full", 3), ("send", 4, "delta", 4)]
    assert [e[1] for e in out[1]["log"]] == [0, 1, 2, 3, 4, 5, 3, 4]
    assert out[1]["crcs"] == out[0]["crcs"]


# ----------------------------------------------------------------------
# The Synchronizer's memory sync
# ----------------------------------------------------------------------


class _DamagedInFlight(MemorySyncClient):
    """A client whose next delta payload arrives with one byte flipped."""

    flip = False

    def _apply(self, plan, payload):
        if self.flip and payload.numel():
            payload = payload.clone()
            payload[payload.numel() // 3] ^= 0x40
            self.flip = False
        return super()._apply(plan, payload)


def test_memory_sync_sends_deltas_checked_bit_for_bit(namespace):
    import ray
    from metrics_helpers import samples

    from obsckpt import Synchronizer

    sync = Synchronizer.get_actor(namespace=namespace)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randn(32, 64)
    into = {n: torch.empty_like(t) for n, t in _published(model).items()}
    clients = {
        "own": _DamagedInFlight(sync, digest_tensors=100),
        "into": MemorySyncClient(sync, into=into, digest_tensors=100),
        "late": MemorySyncClient(sync),  # updates every third version only
    }
    seen: dict[str, list] = {name: [] for name in clients}
    errors: dict[str, list[int]] = {name: [] for name in clients}
    for step in range(1, 26):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        state = _published(model)
        assert ray.get(sync.set_model_state_dict.remote(state, step))
        if step == 9:
            clients["own"].flip = True
        if step == 14:  # damaged between syncs: the next delta's digests catch it
            t = clients["into"].weights["0.weight"].view(-1)
            t[:16] = t[:16] * 3 + 1
        for name, client in clients.items():
            if name == "late" and step % 3:
                continue
            try:
                version = client.update()
            except WeightSyncCorruptError:
                errors[name].append(step)
                continue
            assert version == step
            assert _crcs(client.weights) == _crcs(state), (name, step)
            seen[name].append(step)
    assert errors == {"own": [9], "into": [14], "late": []}
    assert seen["own"] == [s for s in range(1, 26) if s != 9]
    assert seen["late"] == [3, 6, 9, 12, 15, 18, 21, 24]
    # A client's answers: whole first, after a failure and every 20th version; else deltas.
    status = samples(ray.get(sync.metrics_text.remote()))
    key = lambda *kv: ("obsckpt_weight_sync_corrupt_total", tuple(sorted(kv)))  # noqa: E731
    assert status[key(("check", "checksum"), ("method", "memory"))] == 1
    assert status[key(("check", "digest"), ("method", "memory"))] == 1
    sent = {
        enc: status[
            ("obsckpt_weight_sync_sent_bytes_total", (("encoding", enc), ("method", "memory")))
        ]
        for enc in ("full", "delta")
    }
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    # Whole: the two regular clients' first, the update after each failure, version 20
    # (every 20th) for both, and every one of the late client's 8 (never one behind).
    assert sent["full"] == state_bytes * (2 + 2 + 2 + 8)
    assert 0 < sent["delta"] < 0.2 * state_bytes * 30


def _big_move_states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(300, 100, generator=g).to(torch.bfloat16)} for _ in range(3)]
    states[2] = {"w": states[1]["w"].clone()}
    states[2]["w"].view(-1)[:10] += 1  # a small move after a large one
    return states


def _complex_states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = {
        "w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "c": torch.randn(8, dtype=torch.complex128, generator=g),
    }
    return [{k: v + step for k, v in base.items()} for step in range(3)]


def _sequence_ranks(states: Any, rank: int, port: int) -> dict:
    """Sync ``states()`` as steps 0, 1, ...: rank 0's encodings, rank 1's bit-exactness."""
    group = new_group(rank, port, world_size=2, timeout_s=60)
    b = DeltaBroadcaster(group, bucket_bytes=4096)
    out: dict = {}
    try:
        for step, state in enumerate(states()):
            if rank == 0:
                out[step] = b.send(state, step=step).encoding
            else:
                out[step] = _crcs(b.recv()) == _crcs(state)
    finally:
        b.close()
        group.close()
    return out


def test_a_delta_larger_than_half_the_state_goes_whole():
    out = run_ranks(functools.partial(_sequence_ranks, _big_move_states), timeout=120)
    assert out[0] == {0: "full", 1: "full", 2: "delta"}
    assert out[1] == {0: True, 1: True, 2: True}


def test_memory_sync_after_a_resume_sends_the_whole_state(namespace):
    """Versions restart at a resume: a client holding the old run's version 3 is not
    current when the resumed run publishes its own version 3."""
    import ray

    from obsckpt import Synchronizer

    sync = Synchronizer.get_actor(namespace=namespace)
    g = torch.Generator().manual_seed(0)
    run = {s: {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16)} for s in range(1, 4)}
    client = MemorySyncClient(sync)
    for step in (1, 2, 3):
        assert ray.get(sync.set_model_state_dict.remote(run[step], step))
        assert client.update() == step
    # The trainer crashed and resumed from step 2; its step 3 differs from the lost one.
    resumed = {"w": run[3]["w"].clone()}
    resumed["w"].view(-1)[:5] += 1
    assert ray.get(sync.set_model_state_dict.remote(None, 2))  # resume_from(2)
    assert ray.get(sync.set_model_state_dict.remote(resumed, 3))
    answer = ray.get(sync.get_model_state_dict_update.remote(3, epoch=client.epoch))
    assert answer["encoding"] == "full" and answer["epoch"] == client.epoch + 1
    assert client.update() == 3
    assert _crcs(client.weights) == _crcs(resumed)
    assert client.epoch == 1


def test_a_dtype_without_an_integer_twin_goes_whole():
    """complex128 values (16 bytes) have no integer view to take differences of."""
    out = run_ranks(functools.partial(_sequence_ranks, _complex_states), timeout=120)
    assert out[0] == {0: "full", 1: "full", 2: "full"}
    assert out[1] == {0: True, 1: True, 2: True}
