"""Save threads: reused between saves, never queued behind a busy one."""

from __future__ import annotations

import os
import threading
import time

import pytest

from obsckpt.save_threads import SaveThreads


def _run_one(pool: SaveThreads, name: str) -> tuple[str, int]:
    seen: list[tuple[str, int]] = []
    done = threading.Event()

    def job() -> None:
        seen.append((threading.current_thread().name, threading.get_ident()))
        done.set()

    pool.submit(job, name)
    assert done.wait(10), f"{name} never ran"
    return seen[0]


def _wait_idle(pool: SaveThreads, n: int) -> None:
    deadline = time.monotonic() + 10
    while pool._idle < n:
        assert time.monotonic() < deadline, f"only {pool._idle} of {n} threads went idle"
        time.sleep(0.001)


def test_threads_are_reused_and_named_while_running():
    pool = SaveThreads()
    name1, ident1 = _run_one(pool, "obsckpt-save-model-step1")
    _wait_idle(pool, 1)
    name2, ident2 = _run_one(pool, "obsckpt-save-model-step2")
    assert (name1, name2) == ("obsckpt-save-model-step1", "obsckpt-save-model-step2")
    assert ident1 == ident2
    assert pool._started == 1
    _wait_idle(pool, 1)
    idle = [t.name for t in threading.enumerate() if t.ident == ident1]
    assert idle == ["obsckpt-save-idle-1"]


def test_a_hung_save_does_not_hold_back_the_next():
    pool = SaveThreads()
    release = threading.Event()
    started = threading.Event()

    def hang() -> None:
        started.set()
        release.wait(30)

    pool.submit(hang, "obsckpt-save-model-step1")
    assert started.wait(10)
    t0 = time.monotonic()
    _run_one(pool, "obsckpt-save-optim-step1")  # must not wait for the hung one
    assert time.monotonic() - t0 < 5
    assert pool._started == 2
    release.set()
    _wait_idle(pool, 2)
    # Both threads are idle now: a burst of saves reuses them before starting more.
    gate = threading.Barrier(3, timeout=10)
    for i in range(3):
        pool.submit(gate.wait, f"obsckpt-save-s{i}-step2")
    _wait_idle(pool, 3)
    assert pool._started == 3


def test_a_failing_job_leaves_its_thread_usable():
    pool = SaveThreads()

    def boom() -> None:
        raise RuntimeError("save body raised outside the coordinator's handler")

    pool.submit(boom, "obsckpt-save-x-step1")
    _wait_idle(pool, 1)
    _run_one(pool, "obsckpt-save-x-step2")
    assert pool._started == 1


def test_forked_child_starts_its_own_threads():
    from obsckpt import save_threads

    _run_one(save_threads.THREADS, "obsckpt-save-parent-step1")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's idle threads do not exist here
        try:
            ok = save_threads.THREADS._idle == 0
            name, _ = _run_one(save_threads.THREADS, "obsckpt-save-child-step1")
            ok = ok and name == "obsckpt-save-child-step1"
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    os.close(r)
    assert status == 0


def test_a_thread_that_cannot_start_raises_and_leaves_nothing_queued(monkeypatch):
    pool = SaveThreads()

    def refuse(self):
        raise RuntimeError("can't start new thread")

    ran = []
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pool.submit(lambda: ran.append(1), "obsckpt-save-x-step1")
    monkeypatch.undo()
    assert pool._started == 0 and pool._work.empty()
    _run_one(pool, "obsckpt-save-x-step2")
    _wait_idle(pool, 1)
    assert ran == []  # the refused save never runs later behind another's back


_EXITING_SCRIPT = """
import sys, threading, time
from obsckpt.save_threads import THREADS

def save():
    if sys.argv[2] == "hang":
        threading.Event().wait()
    time.sleep(1.0)
    with open(sys.argv[1], "w") as f:
        f.write("written")

THREADS.submit(save, "obsckpt-save-model-step1")
"""  # the main thread ends at once, without waiting for the save


class TestExit:
    """A process that exits with saves running waits for them, for a bounded time."""

    def _run(self, tmp_path, mode: str, wait_s: str):
        import subprocess
        import sys

        out = tmp_path / "model.pt"
        env = {**os.environ, "OBSCKPT_EXIT_WAIT_S": wait_s}
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", _EXITING_SCRIPT, str(out), mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return proc, out, time.monotonic() - t0

    def test_a_running_save_finishes_before_the_process_exits(self, tmp_path):
        proc, out, _ = self._run(tmp_path, "finish", "30")
        assert proc.returncode == 0, proc.stderr
        assert out.read_text() == "written"
        assert "1 saves running (obsckpt-save-model-step1)" in proc.stderr

    def test_a_hung_save_holds_the_exit_only_for_the_bound(self, tmp_path):
        proc, out, took = self._run(tmp_path, "hang", "0.5")
        assert proc.returncode == 0, proc.stderr
        assert not out.exists() and took < 20
        assert "their steps will not commit" in proc.stderr
