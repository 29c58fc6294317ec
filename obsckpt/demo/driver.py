"""``obsckpt demo``'s driver process: the job runs in a session of its own.

A terminal, ``timeout``, ``kill -- -PGID`` or a CI runner signals a whole
process group, and the local Ray cluster a driver starts (GCS, raylet) is in
the driver's group: such a signal would stop the cluster under the driver. So
the ``obsckpt demo`` process starts the job as a driver process in a new
session (:func:`run_detached`), passes the stop signals on to it, and cleans up
what is left of that session once the driver has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import TextIO

from obsckpt.demo.root import committed_on_disk, demo_root
from obsckpt.demo.signals import STOP_SIGNALS, signal_name, stop_reason
from obsckpt.errors import CliError
from obsckpt.options import OBSCKPT_DEMO_DRIVER

# After SIGTERM or SIGHUP, how long the driver has to stop before it is killed
# (it takes a few seconds: a step, at most 10 s of saves in flight, the shutdown).
KILL_AFTER_S = 30


def run_detached(ckpt_dir: str, err: TextIO) -> int:
    """Run this command again as the demo's driver, in a session of its own; its exit code.

    SIGINT, SIGTERM and SIGHUP reach this process alone, which passes them on to
    the driver; the driver then stops its cluster in order. Should the driver not
    end within KILL_AFTER_S of SIGTERM or SIGHUP, its process group is killed (a
    commit is atomic: that loses saves in flight, never a committed step).

    Args:
        ckpt_dir: the run's checkpoint root, for the last line when the driver
            wrote none.
        err: where that line goes.
    """
    t_start = time.monotonic()
    first: list[int] = []  # the first stop signal
    driver: subprocess.Popen | None = None

    def pass_on(signum, _frame) -> None:
        if not first:
            first.append(signum)
            if signum != signal.SIGINT:  # a second Ctrl-C, not a timer, stops a Ctrl-C'd run
                signal.alarm(KILL_AFTER_S)
        if driver is not None:
            try:
                driver.send_signal(signum)
            except ProcessLookupError:
                pass

    def overdue(_signum, _frame) -> None:
        if driver is not None:
            try:
                os.killpg(driver.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGALRM, overdue)
    for sig in STOP_SIGNALS:
        signal.signal(sig, pass_on)
    code = -first[0] if first else None  # stopped before the driver started: none starts
    if code is None:
        driver = subprocess.Popen(
            # This command again, as it was started (`obsckpt ...`, `python -m obsckpt ...`).
            [sys.executable, *sys.orig_argv[1:]],
            # The driver runs the job rather than starting a driver of its own.
            env=dict(os.environ, **{OBSCKPT_DEMO_DRIVER: str(os.getpid())}),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        if first:  # came while it was being started
            driver.send_signal(first[0])
        code = driver.wait()
        signal.alarm(0)
        end_session(driver.pid)
    if code >= 0:
        return code
    # The driver wrote no last line: killed before it took the signals, by SIGKILL,
    # or here when overdue.
    stopped_by = first[0] if first else -code
    if first and code == -signal.SIGKILL and stopped_by != signal.SIGKILL:
        err.write(
            f"obsckpt demo: the job did not stop within {KILL_AFTER_S} s of "
            f"{signal_name(stopped_by)}; killed it\n"
        )
    committed = committed_on_disk(demo_root(ckpt_dir))["checkpoint"]
    err.write(
        f"demo {stop_reason(stopped_by)}: committed checkpoint "
        f"{'none' if committed is None else committed}, "
        f"{time.monotonic() - t_start:.1f} s\n"
    )
    return 128 + stopped_by


def become_driver(supervisor: str) -> None:
    """Set up the demo's driver process, started by :func:`run_detached`.

    Until the demo takes the stop signals (run_demo, after its imports), each
    ends the process, and the `obsckpt demo` process writes the last line. If
    that process is killed outright (SIGKILL, out of memory) it cannot pass a
    signal on: the driver then gets SIGTERM, and shuts its Ray cluster down.

    Raises:
        CliError: ``supervisor`` (OBSCKPT_DEMO_DRIVER's value) is not this process's parent.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    # Checked after prctl: a parent that dies from here on sends SIGTERM.
    if str(os.getppid()) != supervisor:
        raise CliError(
            f"{OBSCKPT_DEMO_DRIVER}={supervisor!r} is set, but this process was not started by "
            f"the `obsckpt demo` process it names; unset {OBSCKPT_DEMO_DRIVER} (obsckpt demo "
            "sets it for its own driver process only)"
        )


def end_session(sid: int) -> None:
    """Kill whatever is left in the driver's session once the driver has exited.

    Its Ray processes are in it (the driver leads it; Ray's workers lead process
    groups of their own in it). The driver shuts them down, but a raylet stopped
    while it was starting may leave its agents behind, and a driver killed
    outright leaves workers until they notice their raylet is gone. Returns once
    they are gone (at most a few seconds).
    """
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 3.0
    while True:
        left = session_members(sid)
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def session_members(sid: int) -> list[int]:
    """The live processes of session ``sid`` (Linux: read from /proc; elsewhere none)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    members = []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] not in ("Z", "X"):
            members.append(int(name))
    return members
