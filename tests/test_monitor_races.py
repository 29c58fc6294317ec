"""Notifications that arrive while the monitor commits, and failures on every path.

The monitor is used in-process (its RPCs are async methods, driven with
asyncio.run) with a fresh registry; a commit's file I/O runs in a thread, as in
the actor, and is held at a gate so that notifications can be sent while it
runs, as they are in a busy job. Files are real and really fsynced.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from obsckpt import CheckpointMonitor, NotificationError, SaveStrategy
from obsckpt.monitor import SystemClock
from obsckpt.store import commit, layout, reader


class CommitGate:
    """Holds each commit's I/O until the test lets it through, and says which step it is."""

    def __init__(self, monkeypatch) -> None:
        self.entered: queue.Queue[int] = queue.Queue()
        self._go = threading.Semaphore(0)
        self.fail_next = False
        real = commit.finalize_step

        def gated(sdir, *args, **kwargs):
            self.entered.put(int(layout.STEP_DIR_RE.match(Path(sdir).name).group(1)))
            if not self._go.acquire(timeout=20):
                raise AssertionError(f"the test never let the commit of {sdir} through")
            if self.fail_next:
                self.fail_next = False
                raise OSError(5, "Input/output error (injected)")
            return real(sdir, *args, **kwargs)

        monkeypatch.setattr(commit, "finalize_step", gated)

    async def committing(self) -> int:
        """Wait until a commit's I/O has started; returns its step."""
        return await asyncio.to_thread(self.entered.get, True, 10.0)

    def let_through(self) -> None:
        self._go.release()


@pytest.fixture
def gate(monkeypatch) -> CommitGate:
    return CommitGate(monkeypatch)


def monitor(root: Path, strategy=SaveStrategy.UNRESTRICTED, clock=None) -> CheckpointMonitor:
    return CheckpointMonitor(
        strategy,
        default_local_dir=root,
        metrics_port=None,
        registry=CollectorRegistry(),
        clock=clock,
    )


def failures(m: CheckpointMonitor, kind: str) -> float:
    return m.metrics.registry.get_sample_value("obsckpt_step_failures_total", {"kind": kind})


def write(root: Path, step: int, name: str, data: bytes = b"x" * 64) -> None:
    path = layout.step_dir(root, step) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


async def save(m, step: int, slot: str, kind: str = "checkpoint", ok: bool = True, **kw) -> dict:
    """One save of ``slot``: admitted, then finished (``ok`` or failed)."""
    admitted = await m.notify_started("n", "j", step=step, slot=slot, kind=kind, **kw)
    if admitted.get("skipped"):
        return admitted
    await m.notify_finished(
        step,
        kind == "state_dict",
        ticket=admitted["ticket"],
        slot=slot,
        ok=ok,
        error=None if ok else "boom",
    )
    return admitted


async def whole_checkpoint(m, root: Path, step: int) -> None:
    """A full checkpoint of ``step`` with one save, registered and finished (not submitted)."""
    write(root, step, "model.pt")
    await m.register_thread_count(step, checkpoint_thread_count=1)
    await save(m, step, "model")


def test_a_step_that_changes_during_another_commit_is_judged_again(tmp_path, gate):
    """Steps 2 and 3 are whole while step 1 commits; during step 2's commit a state-dict
    save of step 3 starts and fails. Step 3 must not be committed from the stale list."""
    root = tmp_path / "root"
    m = monitor(root)

    async def run() -> None:
        await whole_checkpoint(m, root, 1)
        first = asyncio.create_task(m.monitor_step(1))
        assert await gate.committing() == 1
        for step in (2, 3):
            await whole_checkpoint(m, root, step)
            await m.monitor_step(step)  # returns at once: a commit is running
        gate.let_through()
        assert await gate.committing() == 2
        # Step 3 was ready when step 2's commit began; now a state dict of it fails.
        write(root, 3, "sd.pt")
        await save(m, 3, "sd", kind="state_dict", ok=False)
        gate.let_through()
        await asyncio.wait_for(first, 30)

    asyncio.run(run())
    assert reader.read_iteration(root, "checkpoint") == 2
    assert reader.read_iteration(root, "state_dict") == 2
    assert m.tracker.latest == {"checkpoint": 2, "state_dict": 2}
    assert sorted((s, k) for s, k, _ in m.tracker.failed()) == [
        (3, "checkpoint"),
        (3, "state_dict"),
    ]
    assert failures(m, "checkpoint") == 1 and failures(m, "state_dict") == 1


def test_a_state_dict_save_during_its_checkpoint_commit_is_not_admitted(tmp_path, gate):
    """While step 2's full checkpoint commits (sealing its state dict too), a state-dict
    save of step 2 that asked not to re-save is skipped, and a Trinity-style one counts
    as a re-save: neither is counted into the committed step."""
    root = tmp_path / "root"
    m = monitor(root)

    async def run() -> tuple[dict, dict]:
        write(root, 2, "model.pt")
        write(root, 2, "optim.pt")
        await m.register_thread_count(2, checkpoint_thread_count=1, state_dict_thread_count=1)
        await save(m, 2, "model", kind="state_dict")
        await save(m, 2, "optim")
        commit = asyncio.create_task(m.monitor_step(2))
        assert await gate.committing() == 2
        # The skipped save's answer waits for the commit that lists the directory: only
        # then is it known whether files it does not list are strays to remove.
        skipping = asyncio.create_task(
            m.notify_started("n", "j", step=2, slot="model", kind="state_dict", unless_closed=True)
        )
        trinity = await m.notify_started("n", "j", step=2, slot="model", kind="state_dict")
        assert not skipping.done()
        gate.let_through()
        await asyncio.wait_for(commit, 30)
        skipped = await asyncio.wait_for(skipping, 30)
        await m.notify_finished(2, True, ticket=trinity["ticket"], slot="model")
        return skipped, trinity

    skipped, trinity = asyncio.run(run())
    # Not settled: the Trinity-style re-save still holds a ticket for step 2.
    assert skipped == {"skipped": True, "latest": 2, "settled": False}
    assert trinity["resave"] is True
    assert m.tracker.latest == {"checkpoint": 2, "state_dict": 2}
    assert reader.read_iteration(root, "state_dict") == 2
    assert reader.verify_step(layout.step_dir(root, 2)) == []
    assert not m.core.tickets and m.tracker.pending() == []
    assert failures(m, "checkpoint") == 0 and failures(m, "state_dict") == 0


async def _state_dict_failed_before_checkpoint_registered(m, root):
    # Trinity's order: the state dict's save runs (and fails) before the checkpoint's
    # saves are registered; the checkpoint then fails when it would be ready.
    write(root, 5, "sd.pt")
    await m.register_thread_count(5, state_dict_thread_count=1)
    await save(m, 5, "sd", kind="state_dict", ok=False)
    await whole_checkpoint(m, root, 5)
    await m.monitor_step(5)


async def _state_dict_commit_fails_with_its_checkpoint_open(m, root, gate):
    write(root, 5, "sd.pt")
    await m.register_thread_count(5, state_dict_thread_count=1, checkpoint_thread_count=1)
    await save(m, 5, "sd", kind="state_dict")
    admitted = await m.notify_started("n", "j", step=5, slot="model")  # still writing
    gate.fail_next = True
    gate.let_through()
    await m.monitor_step(5, True)
    await m.notify_finished(5, False, ticket=admitted["ticket"], slot="model")
    await m.monitor_step(5)


async def _more_finishes_than_registered(m, root):
    write(root, 5, "model.pt")
    await m.register_thread_count(5, checkpoint_thread_count=1)
    await save(m, 5, "model")
    await save(m, 5, "model")
    with pytest.raises(NotificationError):
        await m.monitor_step(5)


@pytest.mark.parametrize(
    "scenario",
    [
        _state_dict_failed_before_checkpoint_registered,
        _state_dict_commit_fails_with_its_checkpoint_open,
        _more_finishes_than_registered,
    ],
    ids=lambda f: f.__name__.strip("_").replace("_", " "),
)
def test_every_failed_step_is_counted_once(tmp_path, gate, scenario):
    root = tmp_path / "root"
    m = monitor(root)
    if scenario is _state_dict_commit_fails_with_its_checkpoint_open:
        asyncio.run(scenario(m, root, gate))
    else:
        gate.let_through()  # no commit is reached; nothing waits at the gate
        asyncio.run(scenario(m, root))
    failed = [k for _s, k, _p in m.tracker.failed()]
    assert failed, "the scenario must fail a step"
    for kind in layout.KINDS:
        assert failures(m, kind) == failed.count(kind), (kind, failed)
    assert reader.read_iteration(root, "checkpoint") is None


def test_a_cancelled_admission_leaves_nothing_behind(tmp_path):
    """A save waiting for admission whose RPC is cancelled: its ticket, the in-flight
    gauge and the step's count are undone, and the step fails instead of hanging."""
    root = tmp_path / "root"
    m = monitor(root, SaveStrategy.SINGLE_THREAD)

    def in_flight() -> float:
        return m.metrics.registry.get_sample_value(
            "obsckpt_saves_in_flight", {"kind": "checkpoint"}
        )

    async def run() -> None:
        await m.register_thread_count(1, checkpoint_thread_count=2)
        first = await m.notify_started("n", "j", step=1, slot="model", pid=1)
        waiting = asyncio.create_task(m.notify_started("n", "j", step=1, slot="optim", pid=2))
        await asyncio.sleep(0.05)
        assert in_flight() == 1  # admitted saves only, not the one waiting
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert [t.slot for t in m.core.tickets] == ["model"]
        write(root, 1, "model.pt")
        await m.notify_finished(1, False, ticket=first["ticket"], slot="model")
        await m.monitor_step(1)

    asyncio.run(run())
    assert in_flight() == 0 and not m.core.tickets
    assert [(s, k) for s, k, _ in m.tracker.failed()] == [(1, "checkpoint")]
    assert m.tracker.pending() == []


def test_a_release_right_after_a_cancelled_admission_wait_is_not_disturbed(tmp_path):
    """The queued save's RPC is cancelled and, before its handler has run, the save
    ahead of it finishes: that finish is counted and its step commits."""
    root = tmp_path / "root"
    m = monitor(root, SaveStrategy.SINGLE_THREAD)

    async def run() -> None:
        await m.register_thread_count(1, checkpoint_thread_count=1)
        first = await m.notify_started("n", "j", step=1, slot="model", pid=1)
        waiting = asyncio.create_task(m.notify_started("n", "j", step=2, slot="model", pid=2))
        await asyncio.sleep(0.05)
        waiting.cancel()  # its wait is cancelled now; its handler runs at the next await
        write(root, 1, "model.pt")
        await m.notify_finished(1, False, ticket=first["ticket"], slot="model")
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await m.monitor_step(1)

    asyncio.run(run())
    assert reader.read_iteration(root, "checkpoint") == 1
    assert not m.core.tickets and m.admission.waiting == 0


def test_a_cancelled_rpc_does_not_stop_its_commit(tmp_path, gate):
    """The RPC whose notification made a step whole is cancelled during the commit's
    I/O: the commit still completes (the step is not left "committing")."""
    root = tmp_path / "root"
    m = monitor(root)

    async def run() -> None:
        await whole_checkpoint(m, root, 1)
        rpc = asyncio.create_task(m.monitor_step(1))
        assert await gate.committing() == 1
        rpc.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rpc
        gate.let_through()
        for _ in range(200):  # the commit goes on without the RPC that started it
            if m.tracker.latest["checkpoint"] == 1:
                break
            await asyncio.sleep(0.05)

    asyncio.run(run())
    assert reader.read_iteration(root, "checkpoint") == 1
    assert m.tracker.latest["checkpoint"] == 1 and m.tracker.pending() == []


def test_commit_lag_of_a_full_checkpoint_counts_from_its_state_dict_save(tmp_path, gate):
    """The state dict's save started 60 s ago, the checkpoint's 30 s ago: the lag of the
    full checkpoint is 60 s, observed for both iteration files its commit moved."""
    root = tmp_path / "root"
    ago = 0.0

    class Behind(SystemClock):
        def monotonic(self) -> float:
            return time.time() - ago

    m = monitor(root, clock=Behind())

    def lag(kind: str) -> tuple[float, float]:
        get = m.metrics.registry.get_sample_value
        labels = {"kind": kind}
        return (
            get("obsckpt_commit_lag_seconds_count", labels),
            get("obsckpt_commit_lag_seconds_sum", labels),
        )

    async def run() -> None:
        nonlocal ago
        write(root, 4, "sd.pt")
        write(root, 4, "optim.pt")
        await m.register_thread_count(4, state_dict_thread_count=1, checkpoint_thread_count=1)
        ago = 60.0
        await save(m, 4, "sd", kind="state_dict")
        ago = 30.0
        await save(m, 4, "optim")
        ago = 0.0
        gate.let_through()
        await m.monitor_step(4)

    asyncio.run(run())
    assert m.tracker.latest == {"checkpoint": 4, "state_dict": 4}
    for kind in layout.KINDS:
        count, total = lag(kind)
        assert count == 1 and 60.0 <= total < 90.0, (kind, count, total)


def test_a_save_that_failed_before_admission_fails_its_step_at_once(tmp_path):
    """Its snapshot could not be taken: the registered step fails now instead of waiting
    for a save that never comes, and no other save's ticket is released."""
    root = tmp_path / "root"
    m = monitor(root)

    async def run() -> None:
        await m.register_thread_count(1, state_dict_thread_count=1)
        await m.monitor_step(1, is_state_dict=True)
        anonymous = await m.notify_started("n", "j")  # a Trinity caller's save, no step
        with pytest.raises(ValueError, match="ok must be False"):
            await m.notify_finished(1, True, slot="model", admitted=False)
        await m.notify_finished(
            1, True, slot="model", rank=0, ok=False, error="MemoryError", admitted=False
        )
        assert [t.ticket for t in m.core.tickets] == [anonymous["ticket"]]

    asyncio.run(run())
    assert [(s, k) for s, k, _ in m.tracker.failed()] == [(1, "state_dict")]
    assert failures(m, "state_dict") == 1
    saves = m.metrics.registry.get_sample_value(
        "obsckpt_saves_total", {"slot": "model", "kind": "state_dict", "result": "error"}
    )
    assert saves == 1


def test_a_step_with_no_saves_is_never_named_by_an_iteration_file(tmp_path):
    """Submitted with nothing registered, it has nothing on disk: it fails, saying so."""
    root = tmp_path / "root"
    m = monitor(root)
    asyncio.run(m.monitor_step(5, is_state_dict=True))
    assert reader.read_iteration(root, "state_dict") is None
    assert [(s, k) for s, k, _ in m.tracker.failed()] == [(5, "state_dict")]
    assert "nothing to commit" in m.tracker.failed()[0][2].error


def test_a_step_whose_saves_wrote_no_files_still_commits(tmp_path):
    """Saves that finished ok make a step whole, whether or not they wrote under it."""
    root = tmp_path / "root"
    m = monitor(root)

    async def run() -> None:
        await m.register_thread_count(3, checkpoint_thread_count=1)
        await save(m, 3, "model")
        await m.monitor_step(3)

    asyncio.run(run())
    assert reader.read_iteration(root, "checkpoint") == 3
