"""Colocated weight sync between two Ray actors: the protocol over shared-memory buffers on CPU.

On a GPU machine the same protocol runs over CUDA IPC handles (the gpu-marked test).
The comparison, metrics and in-process sender/receiver set-up are ``broadcast_helpers``'.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import time
from pathlib import Path

import pytest
import ray
import torch
from broadcast_helpers import ipc_pair, new_metrics, same_bits

import obsckpt.sync.ipc
from obsckpt.errors import BroadcastError, BroadcastTimeoutError
from obsckpt.sync.ipc import IpcWeightReceiver, IpcWeightSender


def model(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd shapes, one tensor larger than a bucket."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "embed": torch.randn(37, 11, generator=g),
        "bf16": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**62), 2**62, (13,), generator=g, dtype=torch.int64),
        "scalar": torch.randn((), generator=g),
        "big": torch.randn(40, 41, generator=g),  # 6,560 bytes: a bucket of its own
        "t": torch.randn(6, 9, generator=g).t(),  # not contiguous
    }
    for i in range(10):
        out[f"norm.{i}"] = torch.randn(1 + i, generator=g)
    return {k: v.to(device) for k, v in out.items()}


class Trainer:
    def __init__(self, device: str) -> None:
        from obsckpt.telemetry import tracing

        tracing.setup_tracing("trainer", exporter="memory")
        self.metrics = new_metrics()
        self.device = device
        self.sender = IpcWeightSender(
            device=device, bucket_bytes=4 << 10, timeout_s=60, metrics=self.metrics
        )

    def set_timeout(self, seconds: float) -> None:
        self.sender.timeout_s = seconds

    def sync(self, rollout, step: int, seed: int) -> dict:
        t0 = time.monotonic()
        try:
            r = self.sender.send(
                model(seed, self.device), lambda p: rollout.receive.remote(p), step=step
            )
            return {"ok": True, "nbytes": r.nbytes, "backend": r.backend, "method": r.mode}
        except (BroadcastError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - t0}

    def sync_in_place(self, rollout, step: int, seed: int, dense: bool = False) -> dict:
        """Update one model in place (as an optimizer step does), then send it.

        ``dense``: without the model's one non-contiguous tensor, which the
        sender copies afresh at each sync (a new storage, so a new layout).
        """
        fresh = model(seed, self.device)
        if dense:
            del fresh["t"]
        if not hasattr(self, "kept"):
            self.kept = fresh
        with torch.no_grad():
            for k, v in self.kept.items():
                v.copy_(fresh[k])
        r = self.sender.send(self.kept, lambda p: rollout.receive.remote(p), step=step)
        return {"layout": self.sender.last_layout, "handles": r.collectives}

    def sample(self, name: str, labels: dict) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def spans(self) -> list[tuple[str, str, dict]]:
        from obsckpt.telemetry import tracing

        return [(s["name"], s["status"], s["attributes"]) for s in tracing.finished_spans()]

    def close(self) -> None:
        self.sender.close()


class Rollout:
    def __init__(self, device: str, wait: bool = True) -> None:
        from obsckpt.telemetry import tracing

        tracing.setup_tracing("rollout", exporter="memory")
        self.receiver = IpcWeightReceiver(device=device)
        self.wait = wait  # False: answer once the copy is queued (CUDA)
        self.weights: dict[str, torch.Tensor] = {}
        self.delay = 0.0
        self.errors: list[str] = []

    def set_delay(self, seconds: float) -> None:
        self.delay = seconds

    def restart(self) -> None:
        """What a restarted rollout has: a new receiver, no weights, no errors yet."""
        self.receiver.close()
        self.receiver = IpcWeightReceiver(device=self.receiver.device)
        self.weights, self.errors = {}, []

    def receive(self, payload) -> dict:
        time.sleep(self.delay)
        try:
            ack, out = self.receiver.recv(
                payload, into=self.weights or None, clone=not self.weights, wait=self.wait
            )
        except BroadcastError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            raise
        if not self.weights:
            self.weights = out
        return ack

    def state(self) -> tuple[int | None, dict[str, torch.Tensor], list[str]]:
        return self.receiver.last_step, {k: v.cpu() for k, v in self.weights.items()}, self.errors

    def replays_a_graph(self) -> bool:
        return self.receiver._graph is not None

    def spans(self) -> list[tuple[str, str, dict]]:
        from obsckpt.telemetry import tracing

        return [(s["name"], s["status"], s["attributes"]) for s in tracing.finished_spans()]


@contextlib.contextmanager
def colocated(device: str, num_gpus: float, wait: bool = True):
    """A trainer and a rollout actor sharing ``device``; the sender closed, both killed after."""
    opts = dict(num_cpus=0, num_gpus=num_gpus, max_concurrency=2)
    trainer = ray.remote(Trainer).options(**opts).remote(device)
    rollout = ray.remote(Rollout).options(**opts).remote(device, wait)
    try:
        yield trainer, rollout
    finally:
        ray.get(trainer.close.remote())
        for a in (trainer, rollout):
            ray.kill(a)


def run_protocol(device: str, num_gpus: float, wait: bool = True) -> None:
    backend = "cuda_ipc" if device.startswith("cuda") else "shm"
    with colocated(device, num_gpus, wait) as (trainer, rollout):
        # Two versions: the buckets are reused, the rollout's weights filled in place.
        for step, seed in ((1, 1), (2, 2)):
            r = ray.get(trainer.sync.remote(rollout, step, seed))
            assert r.get("ok"), r
            assert r["backend"] == backend and r["method"] == "ipc"
            last, weights, errors = ray.get(rollout.state.remote())
            assert last == step and errors == []
            assert same_bits(model(seed), weights) == []

        # Versions never go backwards.
        r = ray.get(trainer.sync.remote(rollout, 2, 3))
        assert r["error"].startswith("ValueError") and "not newer" in r["error"]

        # A rollout that answers after the sender's deadline: the sender raises in time,
        # the rollout then refuses the payload and keeps the weights it had.
        ray.get([trainer.set_timeout.remote(1.0), rollout.set_delay.remote(3.0)])
        r = ray.get(trainer.sync.remote(rollout, 3, 3))
        assert r["error"].startswith("BroadcastTimeoutError"), r
        assert r["elapsed"] < 1.0 + 2.0
        deadline = time.monotonic() + 60
        while True:
            last, weights, errors = ray.get(rollout.state.remote())
            if errors or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert errors and "after the sender's deadline" in errors[0], errors
        assert last == 2 and same_bits(model(2), weights) == []

        # The next sync works.
        ray.get([trainer.set_timeout.remote(60.0), rollout.set_delay.remote(0.0)])
        r = ray.get(trainer.sync.remote(rollout, 4, 4))
        assert r.get("ok"), r
        last, weights, _ = ray.get(rollout.state.remote())
        assert last == 4 and same_bits(model(4), weights) == []

        # Metrics and spans, as for a broadcast.
        labels = {"backend": backend, "method": "ipc"}
        count = ray.get(trainer.sample.remote("obsckpt_broadcast_duration_seconds_count", labels))
        assert count == 3
        nbytes = sum(v.numel() * v.element_size() for v in model(1).values())
        assert ray.get(trainer.sample.remote("obsckpt_broadcast_bytes_total", labels)) == 3 * nbytes
        failed = dict(labels, reason="timeout")
        assert ray.get(trainer.sample.remote("obsckpt_broadcast_failures_total", failed)) == 1
        sent = [s for s in ray.get(trainer.spans.remote()) if s[0] == "obsckpt.broadcast"]
        assert [s[1] for s in sent] == ["UNSET", "UNSET", "ERROR", "UNSET"]
        assert sent[0][2]["obsckpt.method"] == "ipc" and sent[0][2]["obsckpt.bytes"] == nbytes
        got = [s for s in ray.get(rollout.spans.remote()) if s[0] == "obsckpt.broadcast"]
        assert [s[1] for s in got] == ["UNSET", "UNSET", "ERROR", "UNSET"]

        # A restarted rollout (a fresh receiver) holds no layout: it refuses the short
        # payload, and the sender describes the layout again within the same sync.
        ray.get(rollout.restart.remote())
        r = ray.get(trainer.sync.remote(rollout, 5, 5))
        assert r.get("ok"), r
        last, weights, errors = ray.get(rollout.state.remote())
        assert last == 5 and same_bits(model(5), weights) == []
        assert len(errors) == 1 and "never sent" in errors[0], errors
        assert ray.get(trainer.sample.remote("obsckpt_broadcast_failures_total", failed)) == 1
        assert (
            ray.get(trainer.sample.remote("obsckpt_broadcast_duration_seconds_count", labels)) == 4
        )
        sent = [s for s in ray.get(trainer.spans.remote()) if s[0] == "obsckpt.broadcast"]
        assert sent[-1][1] == "UNSET" and sent[-1][2]["obsckpt.ipc_described_again"] is True


def test_ipc_protocol_on_shared_memory(ray_cluster):
    """Version check, buckets, timeout, metrics and spans over shared-memory buffers."""
    run_protocol("cpu", 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
@pytest.mark.parametrize("wait", [True, False], ids=["wait", "answer-before-copy"])
def test_ipc_protocol_on_cuda(ray_cluster, wait):
    """The same protocol over CUDA IPC handles, trainer and rollout sharing one GPU; the
    rollout answers after its copy, or once it is queued (the sender waits for its event)."""
    run_protocol("cuda:0", 0.5, wait)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_ipc_layouts_on_cuda(ray_cluster):
    """Tensors kept in place: one copy from the trainer's storages, opened once; new tensors
    at each sync: the sender's buckets; back in place: direct again, with fresh handles."""
    tensors = len(model(0))
    with colocated("cuda:0", 0.5, wait=False) as (trainer, rollout):
        seen = []
        plan = [("kept", 1), ("kept", 2), ("kept", 3), ("new", 4), ("new", 5), ("kept", 6)]
        plan += [("kept", 7), ("kept", 8)]
        for what, step in plan:
            if what == "kept":
                r = ray.get(trainer.sync_in_place.remote(rollout, step, step))
                seen.append((r["layout"], r["handles"]))
            else:
                r = ray.get(trainer.sync.remote(rollout, step, step))
                assert r.get("ok"), r
                seen.append(("buckets", None))
            last, weights, errors = ray.get(rollout.state.remote())
            assert last == step and errors == [], (step, errors)
            assert same_bits(model(step), weights) == [], step
        # Sync 1 hands out every storage; later in-place syncs only the copy of the
        # one non-contiguous tensor. After new tensors, one sync sees the storages
        # new again (buckets), the next goes direct with fresh handles.
        assert seen[:3] == [("direct", tensors), ("direct", 1), ("direct", 1)], seen
        assert seen[5][0] == "buckets", seen
        assert seen[6:] == [("direct", tensors), ("direct", 1)], seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and IPC need a GPU")
def test_ipc_copies_replayed_as_a_cuda_graph(ray_cluster):
    """The rollout's copies captured as a CUDA graph from the second sync on (direct and
    buckets layouts), answering before the copy finishes: every version arrives whole,
    and a layout change drops the graph before a new one is captured."""
    with colocated("cuda:0", 0.5, wait=False) as (trainer, rollout):
        plan = [("kept", s) for s in range(1, 6)] + [("new", s) for s in range(6, 10)]
        plan += [("kept", s) for s in range(10, 14)]
        seen = []
        for what, step in plan:
            if what == "kept":
                r = ray.get(trainer.sync_in_place.remote(rollout, step, step, dense=True))
                layout = r["layout"]
            else:  # new tensors, the non-contiguous one too (a layout of its own)
                r = ray.get(trainer.sync.remote(rollout, step, step))
                assert r.get("ok"), r
                layout = "new"
            last, weights, errors = ray.get(rollout.state.remote())
            want = model(step)
            del want["t"]  # the rollout's weights are the first sync's: no "t"
            assert last == step and errors == [], (step, errors)
            assert same_bits(want, weights) == [], step
            seen.append((layout, ray.get(rollout.replays_a_graph.remote())))
        # Kept in place: direct throughout. The first sync fills fresh tensors, the
        # second copies into them, the third captures those very copies.
        assert seen[:5] == [("direct", False)] * 2 + [("direct", True)] * 3, seen
        # New tensors (the sender's buckets): captured from the second such sync on.
        assert seen[5:9] == [("new", False)] + [("new", True)] * 3, seen
        # Back in place: buckets once, then direct; a graph once the layout repeats.
        assert seen[9:] == [("buckets", False), ("direct", False)] + [("direct", True)] * 2, seen


def test_receiver_refuses_a_foreign_payload(tmp_path):
    sender = IpcWeightSender(device="cpu", bucket_bytes=1 << 10, shm_dir=str(tmp_path))
    receiver = IpcWeightReceiver()
    payloads = []
    sender.send(model(1), lambda p: payloads.append(p) or {"step": 5}, step=5)
    ack, out = receiver.recv(payloads[0], clone=True)
    assert ack["step"] == 5 and same_bits(model(1), out) == []
    with pytest.raises(BroadcastError, match="versions never go backwards"):
        receiver.recv(payloads[0])
    sender.close()
    assert list(tmp_path.iterdir()) == []  # the shared-memory files are gone
    with pytest.raises(BroadcastTimeoutError, match="after the sender's deadline"):
        stale = IpcWeightSender(device="cpu", timeout_s=0.01, shm_dir=str(tmp_path))
        late = []
        with pytest.raises(BroadcastError):
            stale.send(model(1), lambda p: late.append(p) or {"step": -1}, step=1)
        time.sleep(0.05)
        IpcWeightReceiver().recv(late[0])


@pytest.fixture
def handle_table(monkeypatch):
    """CUDA IPC handles replaced by a table of storages that both sides read (one process)."""
    table: dict[int, torch.UntypedStorage] = {}

    def share(self, storage):
        table[storage.data_ptr()] = storage
        return ("cuda", storage.data_ptr())

    def open_storage(self, handle, payload):
        return torch.empty(0, dtype=torch.uint8).set_(table[handle[1]])

    monkeypatch.setattr(IpcWeightSender, "_share_storage", share)
    monkeypatch.setattr(IpcWeightReceiver, "_open_storage", open_storage)
    return table


def test_layout_choice_and_storage_bookkeeping(tmp_path, handle_table):
    """The direct layout's choices and ids, in one process on the CPU.

    CUDA IPC handles need a GPU (see test_ipc_layouts_on_cuda); here a handle
    names a storage in a table both sides read, and everything else (layout
    choice, storage ids, live sets, cached views, fallback to buckets) is the
    real code, with the payload pickled on the way as it is between processes.
    """
    import pickle

    sender = IpcWeightSender(device="cpu", bucket_bytes=4 << 10, shm_dir=str(tmp_path))
    sender.backend = "cuda_ipc"  # what a CUDA device sets
    receiver = IpcWeightReceiver(device="cpu")
    payloads = []

    def deliver(p):
        payloads.append(pickle.loads(pickle.dumps(p)))
        return receiver.recv(payloads[-1])[0]

    kept = model(0)
    steps = iter(range(1, 100))

    def sync_in_place(seed):
        want = {k: v.reshape(kept[k].shape) for k, v in model(seed).items() if k in kept}
        for k, v in want.items():
            kept[k].copy_(v)
        step = next(steps)
        sender.send(kept, deliver, step=step)
        assert receiver.last_step == step
        assert same_bits(want, {k: receiver._area[k] for k in want}) == []
        return sender.last_layout, len(payloads[-1].storages)

    def sync_new(seed):
        sender.send(model(seed), deliver, step=next(steps))
        assert same_bits(model(seed), receiver._area) == []
        return sender.last_layout, len(payloads[-1].storages)

    n = len(kept)
    assert sync_in_place(1) == ("direct", n)  # every storage handed out once
    assert sync_in_place(2) == ("direct", 1)  # only the non-contiguous tensor's copy
    del kept["t"]  # every tensor dense and in place: the same views, nothing opened
    assert sync_in_place(3) == ("direct", 0) and payloads[-1].described
    sources = receiver._sources
    # Nothing changed: the payload names the layout the receiver holds, and no more.
    assert sync_in_place(4) == ("direct", 0) and receiver._sources is sources
    assert not payloads[-1].described and payloads[-1].meta == payloads[-1].views == ()
    assert payloads[-1].layout_id == payloads[-2].layout_id
    assert len(receiver._storages) == n - 1
    # The same storage and offset, another shape: described again, never a stale view.
    kept["embed"] = kept["embed"].view(11, 37)
    assert sync_in_place(5) == ("direct", 0) and payloads[-1].described
    assert receiver._area["embed"].shape == (11, 37)
    # A receiver that was never sent the layout (a restarted rollout) refuses the
    # payload; the sender describes the layout again in the same sync, every
    # storage handed out afresh.
    receiver = IpcWeightReceiver(device="cpu")
    assert sync_in_place(6) == ("direct", n - 1) and payloads[-1].described
    assert not payloads[-2].described and payloads[-2].step == payloads[-1].step == 6
    assert payloads[-1].layout_id != payloads[-2].layout_id
    assert sync_in_place(7) == ("direct", 0) and not payloads[-1].described
    # New tensors at each sync: buckets, and the receiver lets the storages go.
    assert sync_new(8) == ("buckets", 0)
    assert receiver._storages == {} and len(receiver._opened) > 0
    assert sync_new(9) == ("buckets", 0) and not payloads[-1].described
    kept = model(0)
    assert sync_in_place(10) == ("buckets", 0)  # new storages once more: no history yet
    assert sync_in_place(11) == ("direct", n)  # they stayed: direct, under fresh ids
    assert payloads[-1].described
    ids = {sid for sid, _ in payloads[-1].storages}
    assert ids.isdisjoint(sid for p in payloads[:4] for sid, _ in p.storages)
    sender.close()
    receiver.close()


def test_receiver_targets_follow_into(tmp_path):
    """The receiver keeps its list of targets between syncs, but never past a change to into=."""
    with ipc_pair(tmp_path, bucket_bytes=1 << 10, receiver_device=None) as (sender, receiver):
        mine = {k: torch.zeros_like(v) for k, v in model(0).items()}

        def sync(step, into):
            sender.send(model(step), lambda p: receiver.recv(p, into=into)[0], step=step)

        sync(1, mine)
        sync(2, mine)
        assert same_bits(model(2), mine) == []
        replaced = mine["embed"]
        mine["embed"] = torch.zeros_like(replaced)  # a new tensor under the same name
        sync(3, mine)
        assert (
            same_bits(model(3), mine) == []
            and same_bits({"embed": model(2)["embed"]}, {"embed": replaced}) == []
        )
        sync(4, dict(mine))  # another mapping of the same tensors
        assert same_bits(model(4), mine) == []
        mine["embed"].resize_(11, 37)  # resized in place: refused, not broadcast into
        with pytest.raises(BroadcastError, match="into= has"):
            sync(5, mine)


class _Stream:
    """Stands in for a CUDA stream: logs what is queued on it and host waits."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def synchronize(self) -> None:
        self.log.append(("synchronize", None))


class _Event:
    """Stands in for an interprocess CUDA event: completes after ``pending`` queries."""

    opened: dict[bytes, _Event] = {}

    def __init__(self) -> None:
        self.pending = 0
        self.queries = 0

    def record(self, stream: _Stream) -> None:
        stream.log.append(("record", self))

    def wait(self, stream: _Stream) -> None:
        stream.log.append(("wait", self))

    def ipc_handle(self) -> bytes:
        handle = f"event-{id(self)}".encode()
        _Event.opened[handle] = self
        return handle

    def query(self) -> bool:
        self.queries += 1
        self.pending -= 1
        return self.pending < 0


def test_answer_before_the_copy_finishes(tmp_path, handle_table, monkeypatch):
    """recv(wait=False): the receiver answers once its copy is queued, the sender waits
    for the receiver's event (and, when it gives up, orders its stream after the event).

    CUDA streams and interprocess events need a GPU (test_ipc_protocol_on_cuda runs
    them); here stand-ins log what each side queues and waits for, and the rest is
    the real protocol: the first sync hands the event over (the receiver still waits),
    later ones answer at once; a restarted receiver hands over a new event; a copy
    that does not finish in time, or a receiver that queued its copy too late, leaves
    the sender's stream waiting for the event.
    """
    from obsckpt.sync.ipc import streams as ipc_streams

    streams = {"rollout": _Stream(), "trainer": _Stream()}
    side = {"now": "trainer"}
    monkeypatch.setattr(ipc_streams, "current_stream", lambda device: streams[side["now"]])
    monkeypatch.setattr(ipc_streams, "new_event", _Event)
    monkeypatch.setattr(ipc_streams, "open_event", lambda device, handle: _Event.opened[handle])
    monkeypatch.setattr(
        ipc_streams, "cuda_devices", lambda ts: {torch.device("cpu")} if ts else set()
    )
    sender = IpcWeightSender(device="cpu", bucket_bytes=4 << 10, shm_dir=str(tmp_path))
    sender.backend = "cuda_ipc"  # what a CUDA device sets
    receiver = IpcWeightReceiver(device="cpu")
    kept = model(0)
    del kept["t"]
    acks = []

    def deliver(payload, wait=False, late=False):
        side["now"] = "rollout"
        try:
            if late:  # the copy is queued after the deadline
                payload = dataclasses.replace(payload, deadline=time.monotonic() + 0.05)
                real = receiver._check_deadline

                def check(p, what, *rest):
                    if what != "arrived":
                        time.sleep(0.1)
                    real(p, what, *rest)

                receiver._check_deadline = check
            acks.append(receiver.recv(payload, wait=wait)[0])
            return acks[-1]
        finally:
            receiver.__dict__.pop("_check_deadline", None)
            side["now"] = "trainer"

    def sync(step, **kw):
        for t in kept.values():
            t.add_(1)
        streams["rollout"].log.clear()
        streams["trainer"].log.clear()
        sender.send(kept, lambda p: deliver(p, **kw), step=step)
        assert same_bits(kept, receiver._area) == []
        return [what for what, _ in streams["rollout"].log]

    # The first sync hands the event over and waits; the next answer at once.
    assert sync(1) == ["record", "synchronize"] and acks[-1]["event"][1] is not None
    token, event = acks[-1]["event"][0], receiver._done[1]
    event.pending = 3  # the copy is still running when the answer comes
    assert sync(2) == ["record"] and acks[-1]["event"] == (token, None)
    assert event.queries == 4 and streams["trainer"].log == []
    assert receiver.last_step == 2
    # wait=True: the receiver waits for its copy, the answer names no event.
    assert sync(3, wait=True) == ["synchronize"] and "event" not in acks[-1]

    # A copy that does not finish within the sender's deadline: the sender raises and
    # its stream waits for the event before anything it does next.
    sender.timeout_s = 0.2
    event.pending = 10**9
    with pytest.raises(BroadcastTimeoutError, match="queued its copy"):
        sync(4)
    assert streams["trainer"].log == [("wait", event)]
    event.pending = 0
    # A copy queued after the deadline: the receiver refuses, the sender's stream waits.
    # The copy will still land in the receive area: its weights are not a known version.
    sender.timeout_s = 60
    assert receiver.weights_valid
    with pytest.raises(BroadcastTimeoutError, match="was queued.*possibly torn bytes of step 5"):
        sync(5, late=True)
    assert streams["trainer"].log == [("wait", event)] and receiver.last_step == 4
    assert receiver.weights_valid is False

    # A rollout known to be gone: its event went with it, and nothing waits for it.
    def gone(payload):
        try:
            raise ray.exceptions.ActorDiedError()
        except ray.exceptions.RayError as exc:
            raise BroadcastError("the rollout died") from exc

    streams["trainer"].log.clear()
    with pytest.raises(BroadcastError, match="died"):
        sender.send(kept, gone, step=6)
    assert streams["trainer"].log == []

    # A restarted receiver hands over an event of its own on its first sync.
    receiver = IpcWeightReceiver(device="cpu")
    assert sync(7) == ["record", "synchronize"]
    assert acks[-1]["event"][0] != token and sender._done[0] == acks[-1]["event"][0]
    assert sync(8) == ["record"] and receiver.last_step == 8
    # An answer naming an event this sender was never handed is a protocol error.
    with pytest.raises(BroadcastError, match="never handed"):
        sender._wait_copied({"step": 9, "event": ("someone-else", None)}, time.monotonic() + 1)
    sender.close()
    receiver.close()


class _Graph:
    """Stands in for a captured CUDA graph of copies: replay() copies each pair."""

    def __init__(self, dsts, srcs) -> None:
        self.dsts, self.srcs, self.replays = dsts, srcs, 0
        self.addresses = [d.data_ptr() for d in dsts]  # what a real graph would write to

    def replay(self) -> None:
        assert [d.data_ptr() for d in self.dsts] == self.addresses, "written to stale memory"
        self.replays += 1
        for d, s in zip(self.dsts, self.srcs, strict=True):
            d.copy_(s)


def test_receiver_replays_its_copies_as_a_graph(tmp_path, monkeypatch, caplog):
    """The second sync in a row between the same targets and sources captures the copies
    as a CUDA graph, which later syncs replay; other targets (clone=True, a new into=, a
    new layout) drop it, tensors that are not dense twins never go in one, and a capture
    that fails leaves the receiver copying one by one. The weights are right throughout.

    CUDA graphs need a GPU (test_ipc_layouts_on_cuda and the ipc benchmark run them);
    here a stand-in graph replays the copies on CPU and the rest is the real receiver.
    """
    from obsckpt.sync.ipc import streams as ipc_streams

    captured: list[_Graph] = []

    def capture(device, dsts, srcs):
        if fail["now"]:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(_Graph(dsts, srcs))
        return captured[-1]

    fail = {"now": False}
    monkeypatch.setattr(ipc_streams, "graphs_on", lambda device: True)
    monkeypatch.setattr(ipc_streams, "capture_copies", capture)
    monkeypatch.setattr(ipc_streams, "cuda_devices", lambda ts: {torch.device("cpu")})
    monkeypatch.setattr(ipc_streams, "current_stream", lambda device: _Stream())
    sender = IpcWeightSender(device="cpu", bucket_bytes=4 << 10, shm_dir=str(tmp_path))
    receiver = IpcWeightReceiver(device="cpu")
    state = {"n": 0}

    def sync(step, extra=None, **kw):
        sent = {**model(step), **(extra or {})}
        got = {}

        def deliver(p):
            ack, got["w"] = receiver.recv(p, **kw)
            return ack

        sender.send(sent, deliver, step=step)
        assert same_bits(sent, got["w"]) == []
        state["n"] = step
        return len(captured), sum(g.replays for g in captured)

    assert sync(1) == (0, 0)  # first time: copied one by one
    assert sync(2) == (1, 1)  # the same lists again: captured, replayed
    assert sync(3) == (1, 2) and sync(4) == (1, 3)
    assert sync(5, clone=True) == (1, 3) and receiver._graph is None  # fresh tensors
    assert sync(6) == (1, 3)  # the area again, but not twice in a row yet
    assert sync(7) == (2, 4)
    dense = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in model(0).items()}
    assert sync(8, into=dense) == (2, 4) and sync(9, into=dense) == (3, 5)
    assert same_bits(model(9), dense) == []
    # A target given other memory (param.data = ...): never written through the old
    # address; copied one by one, then captured again with the new one.
    old = dense["embed"].data
    dense["embed"].data = torch.zeros_like(old)
    assert sync(10, into=dense) == (3, 5) and receiver._graph is None
    assert (
        same_bits(model(10), dense) == [] and same_bits({"e": model(9)["embed"]}, {"e": old}) == []
    )
    assert sync(11, into=dense) == (4, 6) and same_bits(model(11), dense) == []
    # Targets that are not dense twins of the sources (a transposed tensor) never are.
    mixed = {k: torch.zeros_like(v) for k, v in model(0).items()}
    assert not mixed["t"].is_contiguous()
    assert sync(12, into=mixed) == (4, 6) and sync(13, into=mixed) == (4, 6)
    assert same_bits(model(13), mixed) == []
    # A new layout (a tensor more) drops the graph and its lists: the new ones go in one.
    more = {"extra": torch.arange(5.0)}
    assert sync(14, extra=more) == (4, 6) and receiver._graph is None
    assert sync(15, extra=more) == (5, 7) and sync(16, extra=more) == (5, 8)
    # A capture that fails: copied one by one from then on, said once.
    receiver = IpcWeightReceiver(device="cpu")
    fail["now"] = True
    with caplog.at_level("INFO", logger="obsckpt.sync.ipc.receiver"):
        assert sync(17) == (5, 8) and sync(18) == (5, 8) and sync(19) == (5, 8)
    assert receiver._graphs is False
    assert [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()] == [
        "obsckpt: the ipc receiver copies tensor by tensor: capturing its copies as a CUDA "
        "graph failed (RuntimeError: operation not permitted when stream is capturing)"
    ]
    sender.close()
    receiver.close()


def test_copy_finished_late_leaves_weights_marked_unknown(tmp_path, monkeypatch):
    """A copy that ends after the sender's deadline has already overwritten the rollout's
    weights: the refusal says so, last_step stays and weights_valid is False until the
    next accepted sync. With clone=True the held weights are untouched."""
    from obsckpt.sync.ipc import receiver as receiver_module

    with ipc_pair(tmp_path, receiver_device=None) as (sender, receiver):
        mine = {k: torch.zeros_like(v) for k, v in model(0).items()}
        real_copy = receiver_module.copy_many

        def slow_copy(dsts, srcs):  # a copy that takes longer than the sender has left
            real_copy(dsts, srcs)
            time.sleep(0.2)

        def late(p, **kw):
            monkeypatch.setattr(receiver_module, "copy_many", slow_copy)
            try:
                late_payload = dataclasses.replace(p, deadline=time.monotonic() + 0.1)
                return receiver.recv(late_payload, **kw)[0]
            finally:
                monkeypatch.setattr(receiver_module, "copy_many", real_copy)

        sender.send(model(1), lambda p: receiver.recv(p, into=mine)[0], step=1)
        assert receiver.last_step == 1 and receiver.weights_valid
        with pytest.raises(BroadcastTimeoutError, match="possibly torn bytes of step 2") as err:
            sender.send(model(2), lambda p: late(p, into=mine), step=2)
        assert "into=" in str(err.value) and "last_step stays 1" in str(err.value)
        assert receiver.last_step == 1 and receiver.weights_valid is False
        assert same_bits(model(2), mine) == []  # what the late copy wrote: unverified
        # The next accepted sync makes them a known version again.
        sender.send(model(3), lambda p: receiver.recv(p, into=mine)[0], step=3)
        assert receiver.last_step == 3 and receiver.weights_valid
        assert same_bits(model(3), mine) == []
        # Copied late into fresh tensors: the held weights were not touched.
        with pytest.raises(BroadcastTimeoutError, match="the weights are unchanged"):
            sender.send(model(4), lambda p: late(p, clone=True), step=4)
        assert receiver.last_step == 3 and receiver.weights_valid
        assert same_bits(model(3), mine) == []


def _deleted_mappings(paths: set[str]) -> list[str]:
    """Which of ``paths`` this process still maps although the file was deleted."""
    with open("/proc/self/maps") as f:
        return [
            line.split(maxsplit=5)[-1].strip()
            for line in f
            if "(deleted)" in line and line.split(maxsplit=5)[-1].split()[0] in paths
        ]


def test_receiver_unmaps_buffers_of_earlier_layouts():
    """Each layout change (and a restarted sender) hands out new buckets; the receiver
    unmaps those no longer named, so no deleted /dev/shm file stays mapped."""
    receiver = IpcWeightReceiver(device="cpu")
    created: set[str] = set()
    sender = IpcWeightSender(device="cpu", bucket_bytes=4 << 10)  # real /dev/shm files
    for step in range(1, 4):
        weights = dict(model(step), extra=torch.randn(100 * step))  # a new layout each sync
        sender.send(weights, lambda p: receiver.recv(p)[0], step=step)
        created |= set(sender._paths)
        assert set(receiver._opened) == set(sender._paths), step
        assert _deleted_mappings(created) == [], step
    sender.close()  # a restarted trainer: a new sender, new buffers, the same rollout
    sender = IpcWeightSender(device="cpu", bucket_bytes=4 << 10)
    sender.send(model(9), lambda p: receiver.recv(p)[0], step=9)
    created |= set(sender._paths)
    assert set(receiver._opened) == set(sender._paths)
    assert _deleted_mappings(created) == []
    sender.close()
    receiver.close()
    assert _deleted_mappings(created) == []


def test_files_of_a_dead_sender_are_removed():
    """A killed trainer's /dev/shm files are removed by the next sender that allocates,
    never those of a live process, nor of one that holds its file's lock."""
    import fcntl
    import os
    import subprocess
    import uuid

    shm = "/dev/shm"
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    name = lambda pid: os.path.join(shm, f"obsckpt-ipc-{pid}-{uuid.uuid4().hex}")  # noqa: E731
    orphan, alive, locked = name(dead.pid), name(live.pid), name(dead.pid)
    fds = []
    try:
        for path in (orphan, alive, locked):
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            os.ftruncate(fds[-1], 4096)
        # A live sender in another PID namespace sharing /dev/shm holds its file's lock.
        fcntl.flock(fds[2], fcntl.LOCK_SH)
        sender = IpcWeightSender(device="cpu", bucket_bytes=4 << 10)
        sender.send(model(1), lambda p: IpcWeightReceiver().recv(p)[0], step=1)
        assert not os.path.exists(orphan)
        assert os.path.exists(alive) and os.path.exists(locked)
        assert all(os.path.exists(p) for p in sender._paths)  # its own files
        sender.close()
    finally:
        live.kill()
        live.wait()
        for fd in fds:
            os.close(fd)
        for path in (orphan, alive, locked):
            if os.path.exists(path):
                os.unlink(path)


def test_shared_memory_buckets_are_reserved_when_made(tmp_path):
    """A bucket file's pages are reserved when it is made, not at the first write: on a
    full tmpfs a sparse file would kill the trainer with SIGBUS while it packs."""
    import os

    sender = IpcWeightSender(device="cpu", shm_dir=str(tmp_path))
    try:
        path = sender._shm_file(1 << 20)
        assert os.stat(path).st_blocks * 512 >= 1 << 20
    finally:
        sender.close()
    assert os.listdir(tmp_path) == []


def _small_tmpfs(path) -> str | None:
    """Mount a 1 MiB tmpfs on ``path``; None when mounted, else why it could not be."""
    import os
    import subprocess

    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        return f"mounting a small tmpfs failed (CAP_SYS_ADMIN?): {p.stderr.strip()}"
    return None


def test_full_shared_memory_is_an_error_not_a_crash(tmp_path):
    """Buckets larger than what /dev/shm holds (Docker's default is 64 MiB): the send raises,
    saying where and what to do, leaves no file behind, and the process lives on."""
    import os
    import subprocess
    import sys

    shm = tmp_path / "shm"
    shm.mkdir()
    why_not = _small_tmpfs(shm)
    if why_not is not None:
        pytest.skip(why_not)
    script = f"""
import torch
from obsckpt.sync.group import BroadcastError
from obsckpt.sync.ipc import IpcWeightReceiver, IpcWeightSender
sender = IpcWeightSender(device="cpu", shm_dir={str(shm)!r}, bucket_bytes=1 << 20)
receiver = IpcWeightReceiver()
weights = {{f"w{{i}}": torch.randn(256 * 1024) for i in range(4)}}  # 4 MiB in a 1 MiB tmpfs
try:
    sender.send(weights, lambda p: receiver.recv(p)[0], step=1)
except BroadcastError as exc:
    print("ERROR", exc)
"""
    try:
        p = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 0, (p.returncode, p.stderr[-2000:])  # not -7: SIGBUS
        assert "ERROR" in p.stdout and "no room for a 1.0 MiB bucket" in p.stdout, p.stdout
        assert "--shm-size" in p.stdout and "shm_dir=" in p.stdout
        assert os.listdir(shm) == []
    finally:
        subprocess.run(["umount", str(shm)], check=False)


def test_any_dtype_and_unique_names_over_shared_memory(tmp_path):
    """Float8, wide unsigned, complex, 0-d, zero-size and tied tensors arrive bit-identical;
    a name given twice is refused before anything is handed over."""
    g = torch.Generator().manual_seed(5)
    tied = torch.randn(4, 3, generator=g, requires_grad=True)
    weights = {
        "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "u32": torch.tensor([0, 2**32 - 1]).to(torch.uint32),
        "c64": torch.randn(5, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(True),
        "zero": torch.empty(0, 2, dtype=torch.int16),
        "embed.weight": tied,
        "lm_head.weight": tied,
    }
    with ipc_pair(tmp_path, bucket_bytes=64) as (sender, receiver):
        acks: list = []

        def deliver(p):
            ack, out = receiver.recv(p)
            acks.append(out)
            return ack

        sender.send(weights, deliver, step=1)
        got = acks[-1]
        assert list(got) == list(weights)
        for name, t in weights.items():
            want = t.detach().reshape(-1).view(torch.uint8)
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), want), name
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        with pytest.raises(ValueError, match=r"\['a'\] appear more than once"):
            sender.send([("a", torch.ones(2)), ("a", torch.zeros(2))], deliver, step=2)
        assert sender.last_step == 1 and receiver.last_step == 1
        sender.send({"a": torch.ones(2)}, deliver, step=2)  # still usable
        assert acks[-1]["a"].tolist() == [1.0, 1.0]


def test_ipc_modules_do_not_import_the_broadcaster():
    """The ipc sync shares the wire module (version rule, result) with the broadcast, not the
    NCCL broadcaster itself: no module of obsckpt.sync.ipc imports obsckpt.sync.broadcast*."""
    found = []
    for path in sorted(Path(obsckpt.sync.ipc.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found += [(path.name, n) for n in names if n.startswith("obsckpt.sync.broadcast")]
    assert found == []
