"""Durability order of a commit, observed with strace on a real process.

A subprocess drives one commit through a CheckpointMonitor used directly (no
Ray); strace records its fsync, rename and openat calls. The order must be:
every data file and directory of the step fsynced and the manifest in place →
the iteration file's temp file fsynced → renamed over the iteration file →
the root directory fsynced.

strace comes from the Debian package ``strace``; this test fails, not skips,
without it, since the ordering is otherwise unchecked.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from strace_helpers import Call, run_traced, strace_path

from obsckpt.store import layout, reader

DRIVER = textwrap.dedent(
    """
    import asyncio, os, sys
    from obsckpt.monitor import CheckpointMonitor

    root = sys.argv[1]
    actor = os.path.join(root, "global_step_1", "actor")
    os.makedirs(actor)
    for name in ("model.pt", "optim.pt"):
        # Written without fsync: making them durable is the commit's job.
        with open(os.path.join(actor, name), "wb") as f:
            f.write(os.urandom(1 << 16))
    monitor = CheckpointMonitor(default_local_dir=root, metrics_port=None)

    async def main():
        await monitor.register_thread_count(1, checkpoint_thread_count=2)
        for slot in ("model", "optim"):
            t = await monitor.notify_started("node", "job", step=1, slot=slot)
            await monitor.notify_finished(1, False, ticket=t["ticket"], slot=slot)
        await monitor.monitor_step(1, False)

    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def strace() -> str:
    return strace_path("the durability order of commits")


@pytest.mark.needs_strace
class TestCommitDurabilityOrder:
    """Data is durable before the iteration file names it, and the rename itself is made durable."""

    def test_fsync_before_rename_then_dir_fsync(self, strace, tmp_path):
        root = Path(os.path.realpath(tmp_path)) / "root"
        calls = _traced(strace, tmp_path, DRIVER, str(root))
        assert reader.read_iteration(root, "checkpoint") == 1

        sdir = root / "global_step_1"
        syncs = [c for c in calls if c.name in ("fsync", "fdatasync") and c.fd_path]
        renames = [c for c in calls if c.name.startswith("rename")]

        def rename_to(target: Path) -> Call:
            found = [c for c in renames if c.paths and c.paths[-1] == str(target)]
            assert len(found) == 1, (
                f"expected one rename onto {target}: {[c.args for c in renames]}"
            )
            return found[0]

        def last_sync(path: Path, before: int) -> Call:
            found = [c for c in syncs if c.fd_path == str(path) and c.index < before]
            assert found, f"{path} was not fsynced before call #{before}"
            return found[-1]

        for kind in layout.KINDS:
            iteration = root / layout.ITERATION_FILES[kind]
            commit = rename_to(iteration)
            tmp = Path(commit.paths[0])
            assert tmp.parent == root and tmp.name.startswith(iteration.name + ".tmp")
            # Every data file and directory of the step, and the manifest, before the rename.
            for data in (sdir / "actor" / "model.pt", sdir / "actor" / "optim.pt"):
                last_sync(data, commit.index)
            for directory in (sdir / "actor", sdir):
                last_sync(directory, commit.index)
            manifest = rename_to(sdir / layout.MANIFEST_NAME)
            assert manifest.index < commit.index
            last_sync(Path(manifest.paths[0]), manifest.index)
            # The new iteration file's own bytes are durable before it is renamed into place ...
            last_sync(tmp, commit.index)
            # ... and the rename is made durable by fsyncing the root afterwards.
            after = [c for c in syncs if c.fd_path == str(root) and c.index > commit.index]
            assert after, f"{root} was not fsynced after renaming {iteration.name}"

    def test_a_saved_directory_is_made_durable_by_the_saving_process(self, strace, tmp_path):
        """``paths=[directory]``: every file and directory under it is fsynced by the process
        that wrote them before the save reports its records (the monitor may be on another node,
        where an fsync cannot reach this node's page cache)."""
        hf = Path(os.path.realpath(tmp_path)) / "global_step_3" / "actor" / "huggingface"
        calls = _traced(strace, tmp_path, SAVE_DRIVER, str(hf))
        done = [c for c in calls if c.name == "openat" and c.paths[:1] == [str(hf) + ".done"]]
        assert len(done) == 1, "the driver did not finish"
        synced = {c.fd_path for c in calls if c.name == "fsync" and c.index < done[0].index}
        expected = {
            str(hf / "model.safetensors"),
            str(hf / "sub" / "tokenizer.json"),
            str(hf / "sub"),
            str(hf),
            str(hf.parent),
        }
        assert expected <= synced, f"not fsynced before the save returned: {expected - synced}"
        assert str(hf / "model.safetensors.tmp.7.0123abcd") not in synced


SAVE_DRIVER = textwrap.dedent(
    """
    import os, sys
    from obsckpt.store.file_records import run_and_record as _run_and_record

    hf = sys.argv[1]

    def save():
        os.makedirs(os.path.join(hf, "sub"))
        for rel in ("model.safetensors", "sub/tokenizer.json", "model.safetensors.tmp.7.0123abcd"):
            with open(os.path.join(hf, rel), "wb") as f:  # no fsync: the save's job
                f.write(os.urandom(4096))

    records = _run_and_record(save, [hf])
    assert sorted(os.path.relpath(r.path, hf) for r in records) == [
        "model.safetensors", os.path.join("sub", "tokenizer.json")
    ], records
    open(hf + ".done", "w").close()  # marks the return in the trace
    """
)


def _traced(strace: str, tmp_path: Path, driver: str, *args: str) -> list[Call]:
    """Run ``driver`` under strace (fsync, rename and openat calls); its calls in order."""
    return run_traced(
        strace, tmp_path, driver, "fsync,fdatasync,rename,renameat,renameat2,openat", *args
    )
