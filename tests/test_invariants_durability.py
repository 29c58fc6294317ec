"""Durable order of writes, observed with strace on a real process.

An iteration file may name a step only once the step's directory entry is
durable, and a state-dict file a save reports is durable under its name
before the save returns (the commit trusts such a report and may run on
another node, where it could not make this node's writes durable).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from obsckpt import commit as disk

_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)")
_FD_PATH = re.compile(r"^\d+<(.*?)>")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments) of the completed calls, in completion order."""
    calls: list[tuple[str, str]] = []
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
            calls.append((r.group(1), pending.pop((pid, r.group(1)), "") + r.group(2)))
        elif c := _CALL.match(rest):
            calls.append((c.group(1), c.group(2)))
    return calls


def _fsynced(args: str) -> str | None:
    m = _FD_PATH.match(args)
    return m.group(1) if m else None


def _trace(tmp_path: Path, driver: str, *args: str) -> list[tuple[str, str]]:
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("strace not found: install Debian's `strace` package (apt-get install strace)")
    trace = tmp_path / "strace.txt"
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(driver))
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
            "trace=fsync,fdatasync,rename,renameat,renameat2,mkdir,mkdirat,openat",
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
    assert done.returncode == 0, f"driver failed ({done.returncode}): {done.stderr[-3000:]}"
    return _calls(trace.read_text())


def _index(calls, pred, what: str) -> int:
    found = [i for i, (name, args) in enumerate(calls) if pred(name, args)]
    assert len(found) == 1, f"expected one {what}, found {len(found)}"
    return found[0]


COMMIT_DRIVER = """
    import os, sys
    from obsckpt import commit as disk

    root = sys.argv[1]
    sdir = disk.step_dir(root, 4)
    os.makedirs(sdir / "actor")
    with open(sdir / "actor" / "model.pt", "wb") as f:  # not fsynced: the commit's job
        f.write(os.urandom(1 << 14))
    disk.finalize_step(sdir, iterations={"checkpoint": 4})
"""

TORCH_DRIVER = """
    import sys, torch
    from obsckpt.torchfile import write_torch_file

    path = sys.argv[1]
    write_torch_file({"w": torch.arange(1 << 18, dtype=torch.float32)}, path)
    open(path + ".done", "w").close()  # marks the return in the trace
"""


@pytest.mark.needs_strace
class TestDurableOrder:
    def test_the_step_directory_is_durable_in_the_root_before_an_iteration_file_names_it(
        self, tmp_path
    ):
        """The root is fsynced after the step's directory was created in it and before the
        iteration file is renamed to name the step: a crash cannot keep the iteration file
        and lose ``global_step_<N>``."""
        root = Path(os.path.realpath(tmp_path)) / "root"
        root.mkdir()
        calls = _trace(tmp_path, COMMIT_DRIVER, str(root))
        assert disk.read_iteration(root, "checkpoint") == 4
        sdir = str(root / "global_step_4")
        iteration = str(root / disk.ITERATION_FILES["checkpoint"])
        made = _index(
            calls,
            lambda n, a: n.startswith("mkdir") and _QUOTED.findall(a)[-1:] == [sdir],
            f"mkdir of {sdir}",
        )
        renamed = _index(
            calls,
            lambda n, a: n.startswith("rename") and _QUOTED.findall(a)[-1:] == [iteration],
            f"rename onto {iteration}",
        )
        between = [
            i
            for i, (name, args) in enumerate(calls)
            if name in ("fsync", "fdatasync") and _fsynced(args) == str(root)
        ]
        assert any(made < i < renamed for i in between), (
            f"{root} was not fsynced between creating {sdir} and renaming {iteration}"
        )

    def test_a_torch_file_is_durable_under_its_name_when_its_write_returns(self, tmp_path):
        """write_torch_file fsyncs the temp file before renaming it over the target, and
        fsyncs the directory after the rename, all before it returns."""
        target = Path(os.path.realpath(tmp_path)) / "global_step_1" / "actor" / "model.pt"
        calls = _trace(tmp_path, TORCH_DRIVER, str(target))
        assert target.is_file()
        returned = _index(
            calls,
            lambda n, a: n == "openat" and _QUOTED.findall(a)[:1] == [f"{target}.done"],
            "open of the marker file",
        )
        renamed = _index(
            calls,
            lambda n, a: n.startswith("rename") and _QUOTED.findall(a)[-1:] == [str(target)],
            f"rename onto {target}",
        )
        tmp = _QUOTED.findall(calls[renamed][1])[0]
        assert Path(tmp).parent == target.parent and Path(tmp).name.startswith("model.pt.tmp")
        syncs = [
            (i, _fsynced(args))
            for i, (name, args) in enumerate(calls)
            if name in ("fsync", "fdatasync")
        ]
        assert any(i < renamed and path == tmp for i, path in syncs), (
            f"{tmp} was not fsynced before it was renamed to {target.name}"
        )
        assert any(renamed < i < returned and path == str(target.parent) for i, path in syncs), (
            f"{target.parent} was not fsynced after the rename, before the write returned"
        )
