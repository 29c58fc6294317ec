"""Weight broadcast over a dedicated gloo group between real processes.

The rank processes, groups and broadcasters are set up by ``broadcast_helpers``.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from broadcast_helpers import (
    MARGIN_S,
    broadcaster,
    failure_report,
    new_group,
    new_metrics,
    rank_device,
    run_ranks,
    same_bits,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from obsckpt.errors import BroadcastError, BroadcastTimeoutError
from obsckpt.sync.broadcast import WeightBroadcaster
from obsckpt.sync.buckets import TensorMeta, plan_buckets, tensor_meta
from obsckpt.sync.group import WeightSyncGroup, free_port

SMALL_BUCKET = 4 << 10  # forces many buckets and a few lone tensors


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes and odd shapes, with values whose bits a lossy path would change."""
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    out = {
        "embed.weight": torch.randn(37, 11, generator=g),
        "scalar": torch.randn((), generator=g),
        "layers.0.attn.bf16": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
        "layers.0.specials": special,
        "layers.0.bf16_specials": special.to(torch.bfloat16),
        "positions": torch.randint(-(2**62), 2**62, (13,), generator=g, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "half": torch.randn(9, 3, generator=g).to(torch.float16),
        "big.alone": torch.randn(40, 41, generator=g),  # 6,560 bytes > SMALL_BUCKET
        "transposed": torch.randn(6, 9, generator=g).t(),  # not contiguous
        "mask": torch.rand(17, generator=g) > 0.5,
    }
    for i in range(40):
        out[f"layers.{i}.norm"] = torch.randn(1 + i % 7, generator=g)
    return out


def relayout() -> dict[str, torch.Tensor]:
    """model_tensors(3)'s floating tensors and one more: a layout the sender has not seen."""
    out = {n: t for n, t in model_tensors(3).items() if t.is_floating_point()}
    out["extra"] = torch.arange(15.0).reshape(5, 3)
    return out


# ----------------------------------------------------------------------
# Child processes
# ----------------------------------------------------------------------


def _roundtrip(rank: int, port: int) -> dict:
    from obsckpt.telemetry import tracing

    first, second = model_tensors(1), model_tensors(2)
    report: dict = {}
    metrics = new_metrics() if rank == 0 else None
    sending = dict(bucket_bytes=SMALL_BUCKET, metrics=metrics) if rank == 0 else {}
    with broadcaster(rank, port, group_timeout_s=60, **sending) as b:
        if rank == 0:
            r1 = b.send(first, step=7)
            r2 = b.send(second, mode="per_tensor", step=8)
            # A lazy generator with its metadata given up front, as FSDP2 gathering yields it.
            meta = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in second.items()]
            b.send(((n, t) for n, t in second.items()), meta=meta, step=9)
            b.send(first, step=10)
            b.send(second, step=11)
            # Another layout, as parameters that require grad: packed anew, not by autograd.
            b.send({n: torch.nn.Parameter(t) for n, t in relayout().items()}, step=12)
            reg = metrics.registry
            report["bytes_total"] = reg.get_sample_value(
                "obsckpt_broadcast_bytes_total", {"backend": "gloo", "method": "broadcast"}
            )
            report["last_bytes"] = reg.get_sample_value(
                "obsckpt_last_broadcast_bytes", {"backend": "gloo", "method": "broadcast"}
            )
            report["duration_count"] = reg.get_sample_value(
                "obsckpt_broadcast_duration_seconds_count",
                {"backend": "gloo", "method": "broadcast"},
            )
            report["nbytes"] = r1.nbytes
            report["collectives"] = r1.collectives
            report["per_tensor_collectives"] = r2.collectives
        else:
            got = b.recv()
            report["bucketed"] = same_bits(first, got)
            report["step"] = b.last_step
            report["per_tensor"] = same_bits(second, b.recv(clone=True))
            report["lazy"] = same_bits(second, b.recv(clone=True))
            # into=: the receiver's own tensors are filled in place.
            into = {n: torch.zeros_like(t.contiguous()) for n, t in first.items()}
            ids = {n: t.data_ptr() for n, t in into.items()}
            out = b.recv(into=into)
            report["into"] = same_bits(first, out)
            report["into_in_place"] = all(
                out[n].data_ptr() == ids[n] for n in into if into[n].numel()
            )
            # The default receive area is overwritten in place by the next broadcast.
            area = b.recv()
            report["area_reused"] = (
                area["embed.weight"].data_ptr() == got["embed.weight"].data_ptr()
            )
            report["area"] = same_bits(second, area)
            report["relayout"] = same_bits(relayout(), b.recv(clone=True))
        report["spans"] = [
            (s["name"], s["attributes"].get("obsckpt.bytes"), s["attributes"].get("obsckpt.step"))
            for s in tracing.finished_spans()
        ]
    return report


def _silent_peers(rank: int, port: int) -> dict:
    """Rank 1 joins but does not receive; then rank 0 does not send. Both must time out."""
    report: dict = {}
    tensors = {"w": torch.randn(1 << 20)}  # large enough that gloo waits for the receiver
    with broadcaster(rank, port, timeout_s=1.5) as b:
        if rank == 0:
            t0 = time.monotonic()
            try:
                b.send(tensors)
                report["error"] = None
            except BroadcastTimeoutError as exc:
                report["error"] = str(exc)
            report["elapsed"] = time.monotonic() - t0
            try:
                b.send(tensors)
            except BroadcastError as exc:
                report["after"] = str(exc)
            time.sleep(4)  # stay away while rank 1 waits for a broadcast that never comes
        else:
            time.sleep(2.5)  # joined, but not receiving
            t0 = time.monotonic()
            try:
                b.recv()
                report["error"] = None
            except BroadcastError as exc:
                report["error"] = str(exc)
            report["elapsed"] = time.monotonic() - t0
    return report


def _formation(world_size: int, timeout_s: float):
    def join(rank: int, port: int) -> dict:
        t0 = time.monotonic()
        try:
            new_group(rank, port, world_size=world_size, timeout_s=timeout_s)
            error = None
        except BroadcastTimeoutError as exc:
            error = str(exc)
        return {"error": error, "elapsed": time.monotonic() - t0}

    return join


def _join_two_of_three(rank: int, port: int) -> dict:
    # Long enough for both present members to start and connect on a loaded machine.
    return _formation(3, 6.0)(rank, port)


def _join_rank1_alone(rank: int, port: int) -> dict:
    return _formation(2, 2.0)(1, port)


BIG = {"w": torch.arange(4 << 20, dtype=torch.float32)}  # 16 MiB: more than socket buffers hold


def _reform_and_send(rank: int, port: int, backend: str = "gloo") -> list[str]:
    """A new two-member group on a fresh port; returns the names whose bits differ."""
    with broadcaster(rank, port, backend=backend) as b:
        if rank == 0:
            b.send({k: v.to(b.group.device) for k, v in BIG.items()}, step=2)
            return []
        return same_bits(BIG, {k: v.cpu() for k, v in b.recv().items()})


def _peer_dies(rank: int, ports: tuple[int, int], backend: str = "gloo") -> dict:
    """Rank 1 of three takes the header's first message and dies; 0 and 2 form a new group."""
    import os

    device = rank_device(rank, backend)
    metrics = new_metrics() if rank == 0 else None
    with broadcaster(
        rank, ports[0], world_size=3, backend=backend, timeout_s=3.0, metrics=metrics
    ) as b:
        if rank == 1:
            b.group.broadcast(torch.empty(3, dtype=torch.int64, device=device))  # the preamble
            os._exit(17)
        t0 = time.monotonic()
        exc = None
        try:
            b.send({k: v.to(device) for k, v in BIG.items()}, step=1) if rank == 0 else b.recv()
        except BroadcastError as e:
            exc = e
        report = failure_report(b, metrics, exc, t0)
    report["after"] = _reform_and_send(0 if rank == 0 else 1, ports[1], backend)
    return report


def _peer_stalls(rank: int, ports: tuple[int, int], backend: str = "gloo") -> dict:
    """Rank 1 is frozen (SIGSTOP) while it receives; both sides raise, then re-form."""
    import os
    import subprocess

    device = rank_device(rank, backend)
    metrics = new_metrics() if rank == 0 else None
    with broadcaster(rank, ports[0], backend=backend, timeout_s=1.5, metrics=metrics) as b:
        t0 = time.monotonic()
        exc = None
        if rank == 1:
            pid = os.getpid()
            # Frozen from 0.3 s to 3.8 s: the sender starts at 0.8 s and gives up at 2.3 s.
            subprocess.Popen(
                ["sh", "-c", f"sleep 0.3; kill -STOP {pid}; sleep 3.5; kill -CONT {pid}"]
            )
        else:
            time.sleep(0.8)
        try:
            b.send({k: v.to(device) for k, v in BIG.items()}, step=1) if rank == 0 else b.recv()
        except BroadcastError as e:
            exc = e
        report = failure_report(b, metrics, exc, t0)
    report["after"] = _reform_and_send(rank, ports[1], backend)
    return report


# ----------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def roundtrip() -> dict[int, dict]:
    return run_ranks(_roundtrip)  # type: ignore[return-value]


class TestBitIdentical:
    """Whatever the mode, the receiver ends up with the sender's exact bits, names and shapes."""

    def test_bucketed(self, roundtrip):
        assert roundtrip[1]["bucketed"] == []
        assert roundtrip[1]["step"] == 7

    def test_per_tensor(self, roundtrip):
        assert roundtrip[1]["per_tensor"] == []

    def test_lazy_generator_with_meta(self, roundtrip):
        assert roundtrip[1]["lazy"] == []

    def test_into_fills_in_place(self, roundtrip):
        assert roundtrip[1]["into"] == []
        assert roundtrip[1]["into_in_place"]

    def test_receive_area_is_reused(self, roundtrip):
        assert roundtrip[1]["area"] == []
        assert roundtrip[1]["area_reused"]

    def test_a_new_layout_of_parameters_that_require_grad(self, roundtrip):
        assert roundtrip[1]["relayout"] == []


class TestTelemetry:
    """The sender records each broadcast's duration and bytes; both sides trace it."""

    def test_metrics(self, roundtrip):
        sender = roundtrip[0]
        expected = sum(t.numel() * t.element_size() for t in model_tensors(1).values())
        assert sender["nbytes"] == expected
        assert sender["duration_count"] == 6
        per_call = [
            expected,
            *[sum(t.numel() * t.element_size() for t in model_tensors(2).values())] * 2,
        ]
        last = sum(t.numel() * t.element_size() for t in relayout().values())
        assert sender["bytes_total"] == sum(per_call) + expected + per_call[1] + last
        # The last sync's bytes (relayout() at step 12), kept until the next.
        assert sender["last_bytes"] == last

    def test_collectives(self, roundtrip):
        """Bucketed: one collective per bucket of the plan; per tensor: one per tensor.

        How much faster the buckets are is measured by the benchmark
        bucketed_vs_per_tensor (benchmarks/broadcast.py), not timed here.
        """
        sender = roundtrip[0]
        plan = plan_buckets(tensor_meta(model_tensors(1).items()), SMALL_BUCKET)
        assert 3 < sender["collectives"] == len(plan) < len(model_tensors(1))
        assert sender["per_tensor_collectives"] == len(model_tensors(2))

    def test_spans(self, roundtrip):
        for rank in (0, 1):
            spans = [s for s in roundtrip[rank]["spans"] if s[0] == "obsckpt.broadcast"]
            assert len(spans) == 6
            assert spans[0][1] == roundtrip[0]["nbytes"]
            assert spans[0][2] == 7


class TestTimeouts:
    """A broadcast that cannot finish raises within its timeout on every side; never hangs."""

    def test_receiver_never_joins(self):
        t0 = time.monotonic()
        with pytest.raises(BroadcastTimeoutError, match=r"could not form.*ranks \[1\] did not"):
            WeightSyncGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=2, timeout_s=2.0)
        assert time.monotonic() - t0 < 2.0 + MARGIN_S

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="an NCCL group needs a GPU")
    def test_receiver_never_joins_nccl(self):
        """NCCL connects lazily: only the store barrier and the first collective prove formation."""
        t0 = time.monotonic()
        with pytest.raises(BroadcastTimeoutError, match=r"ranks \[1\] did not arrive"):
            WeightSyncGroup(
                host="127.0.0.1",
                port=free_port(),
                rank=0,
                world_size=2,
                backend="nccl",
                timeout_s=2.0,
            )
        assert time.monotonic() - t0 < 2.0 + MARGIN_S

    def test_silent_peers(self):
        out = run_ranks(_silent_peers, timeout=180)
        sender, receiver = out[0], out[1]
        assert sender["error"] and "did not finish within 1.5 s" in sender["error"]
        assert sender["elapsed"] < 5
        assert "broken" in sender["after"]
        assert receiver["error"] is not None
        assert receiver["elapsed"] < 5


class TestFormation:
    """A group forms only when every member checked in; a missing one is named, in time."""

    def test_missing_member_is_named_on_every_member(self):
        out = run_ranks(_join_two_of_three, timeout=180)
        for rank in (0, 1):
            assert "ranks [2] did not arrive" in out[rank]["error"], out
            assert out[rank]["elapsed"] < 6.0 + MARGIN_S

    def test_missing_store_host_is_named(self):
        out = run_ranks(_join_rank1_alone, world_size=1, timeout=180)
        assert "rank 0's store" in out[0]["error"], out
        assert out[0]["elapsed"] < 2.0 + MARGIN_S


class TestFreePort:
    """A store's port is picked below the kernel's ephemeral range (where an outgoing
    connection's local end could take it before the store binds it), and is bindable."""

    def test_picked_below_the_ephemeral_range_and_bindable(self):
        import socket

        from obsckpt.sync import group

        low = group._ephemeral_low()
        ports = {free_port() for _ in range(20)}
        assert all(group._PICK_LOW <= p < low for p in ports), (ports, low)
        assert len(ports) > 1  # random, not one port for every caller
        with socket.socket() as s:
            s.bind(("127.0.0.1", ports.pop()))

    def test_a_narrow_range_falls_back_to_the_kernels_choice(self, monkeypatch):
        from obsckpt.sync import group

        monkeypatch.setattr(group, "_ephemeral_low", lambda: group._PICK_LOW + 10)
        assert not group._PICK_LOW <= free_port() < group._PICK_LOW + 10


NCCL = pytest.param(
    "nccl",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(
            torch.cuda.device_count() < 3,
            reason="an NCCL group of three needs three GPUs (NCCL refuses two ranks on one "
            "device); the gloo case runs the same protocol on CPU",
        ),
    ],
)
NCCL_PAIR = pytest.param(
    "nccl",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(
            torch.cuda.device_count() < 2,
            reason="an NCCL pair needs two GPUs (NCCL refuses two ranks on one device); the "
            "gloo case runs the same protocol on CPU",
        ),
    ],
)


class TestPeerFailure:
    """A peer that dies or freezes mid-broadcast: every live side raises in time, the failure
    is counted and traced, the group is broken, and a new group works."""

    @pytest.mark.parametrize("backend", ["gloo", NCCL])
    def test_peer_dies_mid_broadcast(self, backend):
        fn = functools.partial(_peer_dies, backend=backend)
        out = run_ranks(fn, world_size=3, timeout=180, ports=2, dies=(1,))
        sender, receiver = out[0], out[2]
        for side in (sender, receiver):
            assert side["error"] and side["broken"], out
            assert side["elapsed"] < 3.0 + MARGIN_S, out
            assert side["span_status"] == ["ERROR"], out
            assert side["after"] == [], out
            if not side["error"].startswith("BroadcastTimeoutError"):
                # A peer gone is a failure, not a timeout: the message must not say it ran out of time.
                assert "did not finish within" not in side["error"], side["error"]
                assert "failed " in side["error"] and "peer gone" in side["error"], side
        assert sum(sender["failures"].values()) == 1, sender["failures"]

    @pytest.mark.parametrize("backend", ["gloo", NCCL_PAIR])
    def test_peer_stalls_mid_broadcast(self, backend):
        out = run_ranks(functools.partial(_peer_stalls, backend=backend), timeout=180, ports=2)
        sender, receiver = out[0], out[1]
        assert sender["error"].startswith("BroadcastTimeoutError"), sender
        assert "did not finish within 1.5 s" in sender["error"]
        assert sender["elapsed"] < 0.8 + 1.5 + MARGIN_S
        assert sender["failures"] == {"timeout": 1.0, "error": 0.0}
        assert receiver["error"] and receiver["broken"], receiver
        for side in (sender, receiver):
            assert side["span_status"] == ["ERROR"]
            assert side["after"] == []


class TestPlan:
    """Buckets hold one dtype, never exceed the bucket size (except lone tensors), cover every tensor once."""

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(
            st.tuples(
                st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
                st.integers(0, 300),
            ),
            max_size=40,
        ),
        st.integers(8, 1024),
    )
    def test_plan_properties(self, specs, bucket_bytes):
        meta = [TensorMeta(f"t{i}", dt, (n,)) for i, (dt, n) in enumerate(specs)]
        plan = plan_buckets(meta, bucket_bytes)
        seen = sorted(i for b in plan for i in b.indices)
        assert seen == list(range(len(meta)))
        for b in plan:
            assert all(meta[i].dtype == b.dtype for i in b.indices)
            assert b.solo or b.nbytes <= bucket_bytes
            assert sum(meta[i].numel for i in b.indices) == b.numel
            assert list(b.offsets) == sorted(b.offsets)
        lasts = [b.indices[-1] for b in plan]
        assert lasts == sorted(lasts)

    def test_group_arguments_are_validated(self):
        with pytest.raises(ValueError, match="backend"):
            WeightSyncGroup(host="127.0.0.1", port=1, rank=0, world_size=2, backend="mpi")
        with pytest.raises(ValueError, match="rank"):
            WeightSyncGroup(host="127.0.0.1", port=1, rank=2, world_size=2)


# ----------------------------------------------------------------------
# A broadcast that fails after it began: the group is broken, never out of step
# ----------------------------------------------------------------------


def _failing_senders(rank: int, ports: tuple[int, int]) -> dict:
    """On two groups in turn, the sender's lazy stream fails midway: it raises, then it
    yields a tensor more than its header announced. Receivers must never take either."""
    report: dict = {}
    a, c = torch.arange(6, dtype=torch.float32), torch.arange(6, dtype=torch.float32) + 100
    meta = tensor_meta([("a", a), ("c", c)])  # 24 bytes each: one bucket each

    def raises():
        yield "a", a + 1
        raise RuntimeError("full_tensor() failed on another rank")

    def extra():
        yield "a", a + 2
        yield "c", c + 2
        yield "d", c

    for case, port, stream in (("raises", ports[0], raises), ("extra", ports[1], extra)):
        metrics = new_metrics() if rank == 0 else None
        with broadcaster(rank, port, bucket_bytes=16, timeout_s=1.5, metrics=metrics) as b:
            exc = None
            t0 = time.monotonic()
            if rank == 0:
                b.send({"a": a, "c": c}, step=1)
                try:
                    b.send(stream(), meta=meta, step=2)
                except Exception as e:  # noqa: BLE001 - reported to the test
                    exc = e
                cause = exc.__cause__ if exc is not None else None
                report[case] = failure_report(b, metrics, exc, t0)
                report[case]["type"] = type(exc).__name__
                report[case]["cause"] = f"{type(cause).__name__}: {cause}" if cause else None
                report[case]["last_step"] = b.last_step
            else:
                held = b.recv()
                try:
                    b.recv()
                except Exception as e:  # noqa: BLE001 - reported to the test
                    exc = e
                report[case] = failure_report(b, None, exc, t0)
                report[case]["last_step"] = b.last_step
                report[case]["weights_valid"] = b.weights_valid
                report[case]["held_a"] = held["a"].tolist()
    return report


def _into_parameters(rank: int, port: int) -> dict:
    """recv(into=...) fills a module's parameters, which require grad, in place."""

    def net(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])

    with broadcaster(rank, port, bucket_bytes=96, timeout_s=10) as b:
        sent = {k: v.detach() for k, v in net(1).state_dict().items()}
        if rank == 0:
            b.send(sent, step=1)
            b.send(sent, step=2, mode="per_tensor")
            return {}
        model = net(2)
        params = dict(model.named_parameters())
        report = {}
        for mode in ("bucketed", "per_tensor"):
            for p in params.values():
                p.data.zero_()
            out = b.recv(into=params)
            report[mode] = same_bits(sent, {k: v.detach() for k, v in out.items()})
        report["requires_grad"] = all(p.requires_grad for p in model.parameters())
        report["valid"] = b.weights_valid
    return report


def _versions(rank: int, port: int) -> dict:
    """The sender refuses a step not newer than its last; a receiver refuses an older step
    from another sender after reading it whole, keeping its weights and the group usable."""
    sd = lambda v: {"a": torch.full((16,), float(v)), "b": torch.full((3,), float(v))}  # noqa: E731
    report: dict = {}
    with broadcaster(rank, port, bucket_bytes=64, timeout_s=10) as b:
        if rank == 0:
            b.send(sd(5), step=5)
            for step in (5, 3):
                try:
                    b.send(sd(step), step=step)
                except ValueError as exc:
                    report.setdefault("refused", []).append(str(exc))
            b.send(sd(6), step=6)
            # A second sender on the same group (a restarted trainer's, say) sends an older step.
            other = WeightBroadcaster(b.group, bucket_bytes=64, timeout_s=10)
            other.send(sd(4), step=4)
            other.send(sd(7), step=7)
        else:
            held = b.recv()
            report["first"] = (b.last_step, held["a"][0].item())
            held = b.recv()
            report["second"] = (b.last_step, held["a"][0].item())
            try:
                b.recv()
            except BroadcastError as exc:
                report["error"] = str(exc)
            report["kept"] = (
                b.last_step,
                held["a"][0].item(),
                held["b"][0].item(),
                b.weights_valid,
            )
            got = b.recv()
            report["after"] = (b.last_step, got["a"][0].item(), b.group.broken)
    return report


def _mid_broadcast(rank: int, ports: tuple[int, ...]) -> dict:
    """The cases below in one pair of processes (each on groups of its own)."""
    return {
        "failing": _failing_senders(rank, ports[:2]),
        "into": _into_parameters(rank, ports[2]),
        "versions": _versions(rank, ports[3]),
    }


@pytest.fixture(scope="module")
def mid_broadcast() -> dict[int, dict]:
    return run_ranks(_mid_broadcast, timeout=180, ports=4)  # type: ignore[return-value]


class TestFailureMidBroadcast:
    """Whatever fails once a broadcast began breaks the group on the failing side (counted,
    traced, raised as BroadcastError from the original); no receiver takes it as weights."""

    @pytest.mark.parametrize("case", ["raises", "extra"])
    def test_sender_breaks_the_group(self, mid_broadcast, case):
        sender = mid_broadcast[0]["failing"][case]
        assert sender["type"] == "BroadcastError", sender
        assert sender["broken"], sender
        assert sender["failures"] == {"timeout": 0.0, "error": 1.0}, sender
        assert sender["span_status"][-1] == "ERROR", sender
        assert sender["last_step"] == 1, sender
        if case == "raises":
            assert sender["cause"] == "RuntimeError: full_tensor() failed on another rank"
            assert "now broken" in sender["error"]
        else:
            assert "yields more than the 2 tensors" in sender["error"], sender

    @pytest.mark.parametrize("case", ["raises", "extra"])
    def test_receiver_never_takes_it(self, mid_broadcast, case):
        receiver = mid_broadcast[1]["failing"][case]
        assert receiver["error"] and receiver["broken"], receiver
        assert receiver["elapsed"] < 1.5 + MARGIN_S, receiver
        assert receiver["span_status"][-1] == "ERROR", receiver
        # The receive area was written bucket by bucket: not a known version any more.
        assert receiver["last_step"] == 1 and receiver["weights_valid"] is False, receiver

    def test_into_parameters_that_require_grad(self, mid_broadcast):
        assert mid_broadcast[1]["into"] == {
            "bucketed": [],
            "per_tensor": [],
            "requires_grad": True,
            "valid": True,
        }


class TestVersions:
    """Versions never go backwards: the sender refuses before any collective, a receiver
    after reading the broadcast whole, so the group stays in step and the weights unchanged."""

    def test_versions(self, mid_broadcast):
        sender, receiver = mid_broadcast[0]["versions"], mid_broadcast[1]["versions"]
        assert len(sender["refused"]) == 2, sender
        assert "step 5 is not newer than step 5" in sender["refused"][0]
        assert "step 3 is not newer than step 5" in sender["refused"][1]
        assert receiver["first"] == (5, 5.0) and receiver["second"] == (6, 6.0), receiver
        assert "refused the weights of step 4" in receiver["error"], receiver
        assert "holds step 6" in receiver["error"]
        assert receiver["kept"] == (6, 6.0, 6.0, True), receiver
        assert receiver["after"] == (7, 7.0, None), receiver


class TestArguments:
    """Bad arguments are refused at construction, naming the value."""

    def test_src_must_be_a_rank_of_the_group(self):
        group = new_group()
        try:
            for src in (1, -1):
                with pytest.raises(ValueError, match=rf"src must be .* \[0, 1\), got {src}"):
                    WeightBroadcaster(group, src=src)
            with pytest.raises(ValueError, match="step must be a non-negative integer"):
                WeightBroadcaster(group).send({"w": torch.ones(1)}, step=-2)
            assert group.broken is None  # nothing was sent
        finally:
            group.close()


class TestFormationDeadline:
    """A member that checks in late and stalls: formation still ends within timeout_s, naming it."""

    def test_late_member_is_named_within_the_timeout(self):
        import threading
        from datetime import timedelta

        import torch.distributed as dist

        port, timeout_s = free_port(), 3.0
        done = threading.Event()

        def late_member() -> None:
            time.sleep(2.3)  # checks in shortly before the deadline, then stalls
            store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
            dist.PrefixStore("obsckpt-weight-sync", store).set("arrived/1", "x")
            done.wait(15)

        threading.Thread(target=late_member, daemon=True).start()
        t0 = time.monotonic()
        try:
            with pytest.raises(BroadcastTimeoutError, match=r"ranks \[1\] checked in but never"):
                new_group(port=port, world_size=2, timeout_s=timeout_s)
            assert time.monotonic() - t0 < timeout_s + MARGIN_S
        finally:
            done.set()


_EXIT_AFTER_BREAK = """
from obsckpt.sync.group import WeightSyncGroup, free_port
g = WeightSyncGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1, backend="gloo",
                    timeout_s=10)
g.mark_broken("a broadcast failed")  # what any failed broadcast does, just before the process exits
"""


class TestAbortIsJoined:
    """A broken group's abort never outlives close(), nor the process's exit."""

    def test_close_waits_for_the_abort(self):
        import threading

        group = new_group()
        finished = threading.Event()

        class SlowAbort:  # gloo's abort may wait for the collective in flight
            def __init__(self, pg) -> None:
                self.pg = pg

            def abort(self) -> None:
                time.sleep(0.5)
                self.pg.abort()
                finished.set()

        group._pg = SlowAbort(group._pg)
        group.mark_broken("a broadcast failed")
        group.close()
        assert finished.is_set()

    def test_exit_right_after_a_break_is_clean(self):
        import subprocess
        import sys

        p = subprocess.run(
            [sys.executable, "-c", _EXIT_AFTER_BREAK], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 0, p.stderr[-2000:]  # not -6: SIGABRT inside gloo's abort


# ----------------------------------------------------------------------
# Any dtype, odd shapes, tied and duplicate names; the group's resources after close
# ----------------------------------------------------------------------


def exotic_tensors() -> dict[str, torch.Tensor]:
    """Dtypes gloo has no type for (float8, wide unsigned), complex, 0-d, zero-size, tied."""
    g = torch.Generator().manual_seed(3)
    tied = torch.randn(5, 3, generator=g, requires_grad=True)
    return {
        "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "f8.e5m2": torch.randn(2, 2, generator=g).to(torch.float8_e5m2),
        "u16": torch.arange(7).to(torch.uint16),
        "u32": torch.tensor([0, 2**32 - 1]).to(torch.uint32),
        "u64": torch.arange(3).to(torch.uint64),
        "c64": torch.randn(6, generator=g, dtype=torch.complex64),
        "c128.big": torch.randn(300, generator=g, dtype=torch.complex128),  # alone
        "scalar.bool": torch.tensor(True),
        "scalar.f8": torch.tensor(0.5).to(torch.float8_e4m3fn),
        "zero.i32": torch.empty(0, 3, dtype=torch.int32),  # a bucket of no bytes
        "embed.weight": tied,  # the same tensor under two names
        "lm_head.weight": tied,
    }


def _any_dtype(rank: int, port: int) -> dict:
    with broadcaster(rank, port, bucket_bytes=1024, timeout_s=20) as b:
        sent = exotic_tensors()
        report: dict = {}
        if rank == 0:
            b.send(sent, step=1)
            b.send(sent, step=2, mode="per_tensor")
            b.send({}, step=3)  # an empty state dict is a broadcast too
            try:
                b.send([("a", torch.ones(2)), ("a", torch.zeros(2))], step=4)
            except ValueError as exc:
                report["duplicate"] = str(exc)
            report["broken_after_duplicate"] = b.group.broken
            b.send({"after": torch.ones(2)}, step=4)
        else:
            report["bucketed"] = same_bits(sent, b.recv(clone=True))
            into = {n: torch.zeros_like(t.detach()) for n, t in sent.items()}
            report["per_tensor"] = same_bits(sent, b.recv(into=into))
            report["empty"] = (b.recv(), b.last_step)
            report["after"] = (same_bits({"after": torch.ones(2)}, b.recv()), b.last_step)
        report["broken"] = b.group.broken
    return report


class TestAnyDtype:
    """Every dtype travels bit-identical (as bytes), and names stay one per tensor."""

    def test_exotic_dtypes_shapes_and_names(self):
        out = run_ranks(_any_dtype, timeout=180)
        sender, receiver = out[0], out[1]
        assert receiver["bucketed"] == [] and receiver["per_tensor"] == [], receiver
        assert receiver["empty"] == ({}, 3), receiver
        # A name sent twice is refused before any collective: the group stays usable.
        assert "['a'] appear more than once" in sender["duplicate"], sender
        assert sender["broken_after_duplicate"] is None
        assert receiver["after"] == ([], 4), receiver
        assert sender["broken"] is None and receiver["broken"] is None


class TestClose:
    """close() lets go of everything the group holds; a closed group says so when used."""

    @staticmethod
    def _port_free(port: int) -> bool:
        import socket

        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    def test_close_frees_the_store_port_and_use_after_close_is_clear(self):
        port = free_port()
        group = new_group(port=port)
        group.close()
        group.close()  # twice: nothing more to do
        assert self._port_free(port)
        with pytest.raises(BroadcastError, match="was closed; create a new group"):
            group.broadcast(torch.ones(1))
        # The same port can host a new group at once.
        again = new_group(port=port)
        again.close()

    def test_failed_formation_frees_the_store_port(self):
        port = free_port()
        with pytest.raises(BroadcastTimeoutError) as info:
            new_group(port=port, world_size=2, timeout_s=1.0)
        assert info.value is not None  # the caller still holds the error
        assert self._port_free(port)

    def test_non_contiguous_tensor_is_refused_before_the_collective(self):
        group = new_group()
        try:
            with pytest.raises(ValueError, match="contiguous"):
                group.broadcast(torch.ones(3, 4).t())
            assert group.broken is None
        finally:
            group.close()
