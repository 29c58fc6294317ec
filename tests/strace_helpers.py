"""Running a Python driver under strace and reading back the calls it made, in order.

strace comes from the Debian package ``strace``; tests that use it fail, not
skip, without it (they are marked ``needs_strace``), since what they check is
otherwise unchecked.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)")
_FD_PATH = re.compile(r"^\d+<(.*?)>")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


@dataclass
class Call:
    index: int  # order of completion
    name: str
    args: str

    @property
    def fd_path(self) -> str | None:
        """The path of the call's first argument, a file descriptor (strace -y)."""
        m = _FD_PATH.match(self.args)
        return m.group(1) if m else None

    @property
    def paths(self) -> list[str]:
        """The quoted strings among the arguments (the paths of openat, mkdir, rename)."""
        return _QUOTED.findall(self.args)


def parse_strace(text: str) -> list[Call]:
    """Completed calls in completion order; unfinished calls count when they resume."""
    calls: list[Call] = []
    pending: dict[tuple[str, str], str] = {}
    for raw in text.splitlines():
        m = _LINE.match(raw)
        if not m:
            continue
        pid, rest = m.groups()
        if rest.endswith("<unfinished ...>"):
            if c := _CALL.match(rest):
                pending[(pid, c.group(1))] = c.group(2)
        elif r := _RESUMED.match(rest):
            name = r.group(1)
            calls.append(Call(len(calls), name, pending.pop((pid, name), "") + r.group(2)))
        elif c := _CALL.match(rest):
            calls.append(Call(len(calls), c.group(1), c.group(2)))
    return calls


def strace_path(what: str) -> str:
    """strace's path; fails the test, naming ``what`` goes unchecked, where it is missing."""
    path = shutil.which("strace")
    if path is None:
        pytest.fail(
            "strace not found: install Debian's `strace` package (apt-get install -y strace); "
            f"without it {what} is unchecked"
        )
    return path


def run_traced(strace: str, tmp_path: Path, driver: str, syscalls: str, *args: str) -> list[Call]:
    """Run the Python source ``driver`` with ``args`` under strace, tracing ``syscalls``."""
    trace = tmp_path / "strace.txt"
    script = tmp_path / "driver.py"
    script.write_text(driver)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [
            strace,
            "-f",
            "-y",
            "-qq",
            "-o",
            str(trace),
            "-e",
            f"trace={syscalls}",
            sys.executable,
            str(script),
            *args,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, f"strace run failed ({done.returncode}): {done.stderr[-3000:]}"
    return parse_strace(trace.read_text())
