"""`obsckpt demo` stopped from outside, as a terminal, `timeout`, a container stop or a CI
runner stops it: SIGTERM or SIGHUP, to its process or to its whole process group.

Whenever it comes, the demo ends within seconds with one last line naming the signal and
the committed checkpoint, exits 128 + the signal's number, prints no traceback, leaves no
Ray process running, and every committed step in its root still verifies.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from obsckpt.cli import main
from obsckpt.store import commit, layout, reader

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads process sessions from /proc"
)

# A stop takes a few seconds (on a busy 2-core machine too); a wait for a cluster that
# is gone took a minute.
STOP_WITHIN_S = 30.0


def processes() -> list[tuple[int, int, int, str, str]]:
    """(pid, parent, session, state, command) of every process."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        found.append((int(name), int(fields[1]), int(fields[3]), fields[0], cmd))
    return found


def sessions_below(pid: int) -> tuple[set[int], list[str]]:
    """The sessions of ``pid`` and of every process below it, and their commands."""
    procs = processes()
    tree = {pid}
    grew = True
    while grew:
        before = len(tree)
        tree |= {p for p, parent, *_ in procs if parent in tree}
        grew = len(tree) > before
    return {s for p, _, s, *_ in procs if p in tree}, [c for p, *_, c in procs if p in tree]


def running_in(sessions: set[int]) -> list[str]:
    """Processes of these sessions that still run (a zombie is only waiting to be reaped)."""
    return [f"{p} {cmd}" for p, _, s, state, cmd in processes() if s in sessions and state != "Z"]


class Demo:
    """`obsckpt demo` in a session of its own, as a job runner starts it; with ``terminal``,
    its output goes to a pseudo-terminal that is its controlling terminal, as in a shell."""

    def __init__(self, root: Path, *args: str, terminal: bool = False) -> None:
        cmd = [sys.executable, "-m", "obsckpt", "demo", "--device", "cpu", "--no-progress"]
        cmd += ["--ckpt-dir", str(root), "--metrics-host", "127.0.0.1", *args]
        # A RAY_ADDRESS left in the environment, naming no cluster: the demo starts its
        # own all the same (joining one is what --address is for).
        env = dict(os.environ, RAY_DEDUP_LOGS="0", RAY_ADDRESS="127.0.0.1:1")
        self.lines: list[str] = []
        self._out: list[str] = []
        self.terminal: int | None = None
        if terminal:
            self.terminal, tty = pty.openpty()
            self.proc = subprocess.Popen(
                cmd,
                stdin=tty,
                stdout=tty,
                stderr=tty,
                start_new_session=True,
                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
                env=env,
            )
            os.close(tty)
            streams = [(self.terminal, self.lines)]
            read = self._read_terminal
        else:
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env=env,
            )
            streams = [(self.proc.stderr, self.lines), (self.proc.stdout, self._out)]
            read = self._read
        self._readers = [
            threading.Thread(target=read, args=stream, daemon=True) for stream in streams
        ]
        for thread in self._readers:
            thread.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def _read_terminal(self, fd: int, into: list[str]) -> None:
        while self.terminal is not None:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    into.append(os.read(fd, 65536).decode(errors="replace"))
                except OSError:
                    return

    @property
    def err(self) -> str:
        return "".join(self.lines)

    @property
    def out(self) -> str:
        return "".join(self._out)

    def wait_for(self, ready, what: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.err}"
            assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{self.err}"
            time.sleep(0.05)

    def stop(self, how: str) -> tuple[int, float, set[int]]:
        """Stop the demo (``SIGTERM to the group``, or ``hang-up`` of its terminal); its
        exit code, the seconds it took to exit, and the sessions its processes were in."""
        sessions, _ = sessions_below(self.proc.pid)
        sent = time.monotonic()
        if how == "hang-up":
            terminal, self.terminal = self.terminal, None
            for thread in self._readers:
                thread.join(5)
            os.close(terminal)  # the kernel sends SIGHUP to the terminal's session
        else:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"still running 120 s after {how}:\n{self.err}")
        took = time.monotonic() - sent
        for thread in self._readers:
            thread.join(5)  # the last lines
        return code, took, sessions

    def kill(self) -> None:
        if self.terminal is not None:
            os.close(self.terminal)
            self.terminal = None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def earlier_run(tmp_path: Path) -> Path:
    """The root of an earlier 2-rank demo run: its marker and committed checkpoint 2."""
    root = tmp_path / "ckpt"
    actor = layout.step_dir(root, 2) / "actor"
    actor.mkdir(parents=True)
    (root / "obsckpt-demo.json").write_text("{}\n")
    for rank in range(2):
        for kind in ("model", "optim", "extra_state"):
            (actor / f"{kind}_world_size_2_rank_{rank}.pt").write_bytes(b"w" * (300 + rank))
    commit.finalize_step(actor.parent)
    commit.write_iteration(root, "checkpoint", 2)
    return root


def assert_stopped_cleanly(code: int, took: float, sessions: set[int], root: Path, sig: int):
    name = signal.Signals(sig).name
    assert code == 128 + sig, f"exit {code} after {name}"
    assert took < STOP_WITHIN_S, f"{took:.1f} s to stop after {name}"
    assert running_in(sessions) == [], "left running after the demo exited"
    out = io.StringIO()
    assert main(["verify", str(root), "--all"], out=out, err=out) == 0, out.getvalue()


def assert_last_line(demo: Demo, sig: int, root: Path) -> str:
    """The output has no traceback; its last line names the signal and what is committed."""
    err = demo.err
    assert "Traceback" not in err + demo.out, err
    last = err.strip().splitlines()[-1]
    committed = reader.read_iteration(root, "checkpoint")
    assert last.startswith(f"demo terminated by {signal.Signals(sig).name}: "), err
    assert f"committed checkpoint {committed if committed is not None else 'none'}, " in last
    return last


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to the group", "hang-up"])
def test_stop_while_ray_starts(tmp_path, how):
    """Stopped while its Ray cluster starts: the start-up is abandoned at once, and the
    earlier run's committed checkpoint it was to resume from is kept whole. A terminal
    that hangs up sends SIGHUP, and takes what the demo would print with it."""
    root = earlier_run(tmp_path)
    demo = Demo(root, "--resume", "--steps", "1", terminal=how == "hang-up")
    try:

        def ray_starting() -> bool:
            return any("gcs_server" in c for c in sessions_below(demo.proc.pid)[1])

        demo.wait_for(ray_starting, "GCS process", timeout=60)
        code, took, sessions = demo.stop(how)
    finally:
        demo.kill()
    sig = signal.SIGHUP if how == "hang-up" else signal.SIGTERM
    assert_stopped_cleanly(code, took, sessions, root, sig)
    if how != "hang-up":
        last = assert_last_line(demo, sig, root)
        assert "no step trained, committed checkpoint 2, " in last
    assert reader.read_iteration(root, "checkpoint") == 2


@pytest.mark.slow
def test_sigterm_to_the_group_while_saves_are_in_flight(tmp_path):
    """SIGTERM to the whole group mid-training (a full checkpoint every step): the step
    under way finishes, its saves commit, the summary is printed, and the last line
    names the checkpoint the iteration file names. (Weights reach the rollout by ipc,
    shared-memory buckets on CPU: every version arrives.)"""
    root = tmp_path / "ckpt"
    result = tmp_path / "result.json"
    demo = Demo(
        root,
        *("--steps", "0", "--save-every", "1", "--world-size", "1", "--sync-method", "ipc"),
        *("--result-json", str(result)),
    )
    try:
        demo.wait_for(lambda: reader.read_iteration(root, "checkpoint") is not None, "commit")
        code, took, sessions = demo.stop("SIGTERM to the group")
    finally:
        demo.kill()
    assert_stopped_cleanly(code, took, sessions, root, signal.SIGTERM)
    last = assert_last_line(demo, signal.SIGTERM, root)
    err = demo.err
    assert "received SIGTERM: stopping after this step" in err, err
    assert "weight sync ipc (shared memory)" in err
    assert "ipc sync (shm)" in demo.out and "committed: checkpoint" in demo.out, demo.out
    data = json.loads(result.read_text())
    steps = data["last_step"]
    assert data["exit_code"] == 143 and data["stop_reason"] == "terminated by SIGTERM"
    assert (data["device"], data["sync_method"]) == ("cpu", "ipc")
    assert data["rollout_versions"] == list(range(1, steps + 1))
    # The step under way when SIGTERM came was saved and committed.
    assert reader.read_iteration(root, "checkpoint") == steps
    assert last.startswith(
        f"demo terminated by SIGTERM: step{'s 1-' if steps > 1 else ' '}{steps},"
    )


def signal_self(sig: int) -> None:
    """Send ``sig`` to this process; its handler has run when this returns."""
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # Python runs handlers between bytecodes of the main thread


class TestStopByPhase:
    """A stop signal abandons the start-up at once (though not in the middle of removing
    an earlier run's steps), lets a training step finish, and sets the exit code to
    128 + the signal; a second Ctrl-C stops at once, a second SIGTERM changes nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    @staticmethod
    def not_taken(signum, _frame):
        raise AssertionError(f"{signal.Signals(signum).name} did not reach the demo's handler")

    @pytest.fixture
    def stop(self):
        from obsckpt.demo.signals import StopSignals

        # A signal the demo does not take fails the test, not the test process.
        outer = {sig: signal.signal(sig, self.not_taken) for sig in self.SIGNALS}
        notes: list[str] = []
        stop = StopSignals(notes.append)
        stop.notes = notes
        stop.install()
        yield stop
        stop.restore()
        for sig, handler in outer.items():
            signal.signal(sig, handler)

    @pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
    def test_start_up_is_abandoned_at_once(self, stop, sig):
        from obsckpt.demo.signals import StartupStopped

        with pytest.raises(StartupStopped):
            signal_self(sig)
        assert stop.signum == sig and stop.exit_code() == 128 + sig

    def test_a_held_section_finishes_first(self, stop):
        from obsckpt.demo.signals import StartupStopped

        finished = False
        with pytest.raises(StartupStopped):
            with stop.held():
                signal_self(signal.SIGTERM)
                finished = True
        assert finished

    def test_training_stops_after_the_step(self, stop):
        stop.phase = "training"
        signal_self(signal.SIGHUP)
        assert stop.event.is_set() and stop.exit_code() == 129
        assert stop.notes == [
            "received SIGHUP: stopping after this step; saves in flight get 10 s to finish "
            "and commit"
        ]
        signal_self(signal.SIGTERM)  # already stopping
        assert stop.signum == signal.SIGHUP and len(stop.notes) == 1
        with pytest.raises(KeyboardInterrupt):
            signal_self(signal.SIGINT)

    def test_handlers_are_given_back(self, stop):
        stop.install()  # again, as after ray.init
        stop.restore()
        assert {signal.getsignal(sig) for sig in self.SIGNALS} == {self.not_taken}


@pytest.mark.slow
@pytest.mark.parametrize("scraped", [True, False], ids=["while scraped", "never scraped"])
def test_sigterm_withdraws_the_file_sd_target(tmp_path, scraped):
    """A clean stop withdraws the demo's target from --file-sd, whether or not a scraper
    polls /metrics (the monitor then waits for its last scrape, within the stop's few
    seconds): Prometheus must not go on scraping a dead address (ObsckptMonitorDown)."""
    import http.client

    from obsckpt.telemetry.server import read_file_sd_targets

    root = tmp_path / "ckpt"
    sd = tmp_path / "targets.json"
    demo = Demo(root, *("--steps", "0", "--file-sd", str(sd)))
    try:
        demo.wait_for(lambda: sd.exists() and read_file_sd_targets(sd), "file_sd target")
        (target,) = read_file_sd_targets(sd)
        scraper = None
        if scraped:
            # As Prometheus scrapes: over a connection it keeps open between scrapes.
            host, port = target.rsplit(":", 1)
            scraper = http.client.HTTPConnection(host, int(port), timeout=10)
            for _ in range(3):  # polled every 1.5 s: the monitor waits for a last scrape
                scraper.request("GET", "/metrics")
                assert b"obsckpt_" in scraper.getresponse().read()
                time.sleep(1.5)
        code, took, sessions = demo.stop("SIGTERM to the group")
        if scraper is not None:
            scraper.close()
    finally:
        demo.kill()
    assert code == 128 + signal.SIGTERM, demo.err
    assert took < STOP_WITHIN_S
    assert read_file_sd_targets(sd) == [], f"{sd} still names the stopped demo"


def test_the_stop_withdraws_a_restarted_monitors_target(tmp_path):
    """The group's SIGTERM can end the monitor's process; Ray restarts it, and the new
    monitor publishes a new address under the same root. When it cannot shut down in
    the stop's seconds, the driver (which knows only the first address) withdraws the
    root's targets once nothing listens there; other roots' targets stay."""
    from obsckpt.demo.cluster import shutdown
    from obsckpt.sync.group import free_port
    from obsckpt.telemetry.server import publish_file_sd, read_file_sd_targets

    sd = tmp_path / "targets.json"
    # Ports nothing listens on: the first monitor's and the restarted one's, both ended.
    first, restarted = (f"127.0.0.1:{free_port()}" for _ in range(2))
    other = "192.0.2.1:9400"  # another job's monitor on another machine
    publish_file_sd(sd, other, {}, root="/elsewhere")
    publish_file_sd(sd, first, {}, root=str(tmp_path / "ckpt"))
    publish_file_sd(sd, restarted, {}, root=str(tmp_path / "ckpt"))  # the restart's
    shutdown([], None, False, patient=False, file_sd=str(sd), address=first)
    assert restarted in read_file_sd_targets(sd)  # by address alone: the restart's stays
    shutdown(
        [],
        None,
        False,
        patient=False,
        file_sd=str(sd),
        address=first,
        sd_root=str(tmp_path / "ckpt"),
    )
    assert read_file_sd_targets(sd) == [other]
