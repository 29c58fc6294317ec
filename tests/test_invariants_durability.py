"""Durable order of writes, observed with strace on a real process.

An iteration file may name a step only once the step's directory entry is
durable, and a state-dict file a save reports is durable under its name
before the save returns (the commit trusts such a report and may run on
another node, where it could not make this node's writes durable).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from strace_helpers import Call, run_traced, strace_path

from obsckpt.store import layout, reader


def _trace(tmp_path: Path, driver: str, *args: str) -> list[Call]:
    """The driver's calls, in completion order."""
    strace = strace_path("the durable order of writes")
    calls = run_traced(
        strace,
        tmp_path,
        textwrap.dedent(driver),
        "fsync,fdatasync,rename,renameat,renameat2,mkdir,mkdirat,openat",
        *args,
    )
    return calls


def _index(calls, pred, what: str) -> int:
    found = [c.index for c in calls if pred(c)]
    assert len(found) == 1, f"expected one {what}, found {len(found)}"
    return found[0]


COMMIT_DRIVER = """
    import os, sys
    from obsckpt.store import commit, layout, reader

    root = sys.argv[1]
    sdir = layout.step_dir(root, 4)
    os.makedirs(sdir / "actor")
    with open(sdir / "actor" / "model.pt", "wb") as f:  # not fsynced: the commit's job
        f.write(os.urandom(1 << 14))
    commit.finalize_step(sdir, iterations={"checkpoint": 4})
"""

TORCH_DRIVER = """
    import sys, torch
    from obsckpt.store.torchfile import write_torch_file

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
        assert reader.read_iteration(root, "checkpoint") == 4
        sdir = str(root / "global_step_4")
        iteration = str(root / layout.ITERATION_FILES["checkpoint"])
        made = _index(
            calls,
            lambda c: c.name.startswith("mkdir") and c.paths[-1:] == [sdir],
            f"mkdir of {sdir}",
        )
        renamed = _index(
            calls,
            lambda c: c.name.startswith("rename") and c.paths[-1:] == [iteration],
            f"rename onto {iteration}",
        )
        between = [
            i
            for i, c in enumerate(calls)
            if c.name in ("fsync", "fdatasync") and c.fd_path == str(root)
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
            lambda c: c.name == "openat" and c.paths[:1] == [f"{target}.done"],
            "open of the marker file",
        )
        renamed = _index(
            calls,
            lambda c: c.name.startswith("rename") and c.paths[-1:] == [str(target)],
            f"rename onto {target}",
        )
        tmp = calls[renamed].paths[0]
        assert Path(tmp).parent == target.parent and Path(tmp).name.startswith("model.pt.tmp")
        syncs = [(c.index, c.fd_path) for c in calls if c.name in ("fsync", "fdatasync")]
        assert any(i < renamed and path == tmp for i, path in syncs), (
            f"{tmp} was not fsynced before it was renamed to {target.name}"
        )
        assert any(renamed < i < returned and path == str(target.parent) for i, path in syncs), (
            f"{target.parent} was not fsynced after the rename, before the write returned"
        )
