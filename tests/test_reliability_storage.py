"""Storage faults a long job meets, end to end: a full disk (while a rank writes, while the
monitor writes the manifest, while it writes the iteration files), too few inodes, a root
turned read-only, a step directory that refuses new files, a step directory removed before
its commit, and files of a committed step truncated or replaced by hand.

Every fault is real: the checkpoint root is a small tmpfs mounted for the test (needs
root; the tests skip where mounting is refused), filled, remounted read-only or marked
immutable (``chattr +i``, which refuses even root). A local Ray monitor commits the steps
a real coordinator saves with ``save_state_dict_async`` (real torch files).
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from reliability_helpers import assert_root_consistent, scrape

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveError
from obsckpt.cli import main as cli_main
from obsckpt.store import commit, layout

PAGE = 4096
RANK_FILE = "actor/model_world_size_1_rank_0.pt"


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=False)


@pytest.fixture
def small_fs(tmp_path):
    """``mount(path, options)``: a tmpfs at ``path``, unmounted (and made mutable) at the end."""
    mounted: list[Path] = []
    flagged: list[Path] = []

    def mount(path: Path, options: str = "size=4m") -> Path:
        path.mkdir(parents=True, exist_ok=True)
        done = _run("mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path))
        if done.returncode != 0:
            pytest.skip(f"mounting a tmpfs was refused ({done.stderr.strip()}); run as root")
        mounted.append(path)
        return path

    def immutable(path: Path) -> None:
        done = _run("chattr", "+i", str(path))
        if done.returncode != 0:
            pytest.skip(f"chattr +i was refused ({done.stderr.strip()})")
        flagged.append(path)

    mount.immutable = immutable  # type: ignore[attr-defined]
    yield mount
    for path in flagged:
        _run("chattr", "-i", str(path))
    for path in reversed(mounted):
        _run("mount", "-o", "remount,rw", str(path))
        _run("umount", "-l", str(path))


def _fill(root: Path, leave_pages: int = 0) -> Path:
    """Fill the filesystem of ``root``, leaving ``leave_pages`` free pages; returns the filler."""
    filler = root / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while os.write(fd, b"\0" * PAGE):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    size = filler.stat().st_size
    os.truncate(filler, max(0, size - size % PAGE - leave_pages * PAGE))
    return filler


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli_main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _temp_files(root: Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), root)
        for d, _dirs, names in os.walk(root)
        for n in names
        if layout.is_temp_name(n)
    )


class _Job:
    """A monitor actor on the local Ray and one coordinator saving real torch files."""

    def __init__(self, ray, namespace: str, root: Path) -> None:
        self.ray = ray
        self.root = root
        self.monitor = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=root)
        self.address = ray.get(self.monitor.metrics_address.remote())
        self.coord = CheckpointCoordinator(self.monitor, rpc_timeout=30, save_timeout=30)

    def path(self, step: int) -> Path:
        return layout.step_dir(self.root, step) / RANK_FILE

    def write(self, step: int, nbytes: int = 64 << 10) -> SaveError | None:
        """Register one save of ``step`` and run it; the error ``wait_all`` raised, if any."""
        self.ray.get(self.monitor.register_thread_count.remote(step, checkpoint_thread_count=1))
        state = {"w": torch.full((nbytes // 4,), float(step))}
        self.coord.save_state_dict_async("model", state, self.path(step), step)
        try:
            self.coord.wait_all(timeout=30)
        except SaveError as exc:
            return exc
        return None

    def submit(self, step: int) -> None:
        self.ray.get(self.monitor.monitor_step.remote(step, False), timeout=30)

    def save(self, step: int, nbytes: int = 64 << 10) -> SaveError | None:
        error = self.write(step, nbytes)
        self.submit(step)
        return error

    def status(self) -> dict:
        return self.ray.get(self.monitor.status.remote(), timeout=30)

    def failed(self) -> dict[int, str]:
        return {f["step"]: f["error"] for f in self.status()["failed"]}

    def metric(self, name: str, **labels: str) -> float:
        return scrape(self.address).total(name, **labels)

    def close(self) -> None:
        self.coord.close(timeout=10)
        self.ray.kill(self.monitor, no_restart=True)


@pytest.fixture
def job(ray_cluster, namespace, tmp_path, small_fs):
    root = small_fs(tmp_path / "root")
    j = _Job(ray_cluster, namespace, root)
    yield j
    j.close()


def _committed_intact(job: _Job, step: int, before: bytes) -> None:
    """``step`` is still the committed one, whole, with the bytes it had."""
    assert assert_root_consistent(job.root)["checkpoint"] == step
    assert job.path(step).read_bytes() == before
    assert job.status()["latest"]["checkpoint"] == step


class TestFullDisk:
    """A full disk fails the step it hits, with an error naming the file and the cause; the
    committed step stays whole and named, no temp file is left, and once space is freed
    the next step commits."""

    def test_full_while_a_rank_writes(self, job):
        assert job.save(1) is None
        before = job.path(1).read_bytes()
        error = job.save(2, nbytes=8 << 20)  # 8 MiB into what is left of 4 MiB
        assert error is not None and error.step == 2
        assert "No space left on device" in str(error)
        assert str(job.path(2)) in str(error)
        assert error.__cause__.errno == errno.ENOSPC
        assert 2 in job.failed()
        assert job.metric("obsckpt_saves_total", result="error") == 1
        assert job.metric("obsckpt_step_failures_total", kind="checkpoint") == 1
        assert _temp_files(job.root) == []
        _committed_intact(job, 1, before)
        assert job.save(3) is None
        assert assert_root_consistent(job.root)["checkpoint"] == 3

    def test_full_when_the_manifest_is_written(self, job):
        assert job.save(1) is None
        before = job.path(1).read_bytes()
        assert job.write(2) is None
        filler = _fill(job.root)
        job.submit(2)
        assert _temp_files(job.root) == []
        error = job.failed()[2]
        assert "No space left on device" in error
        assert f"global_step_2/{layout.MANIFEST_NAME}" in error
        assert "still names step 1" in error and "Free space" in error
        assert job.metric("obsckpt_step_failures_total", kind="checkpoint") == 1
        assert job.metric("obsckpt_saves_total", result="error") == 0
        assert _temp_files(job.root) == []
        assert not (layout.step_dir(job.root, 2) / layout.MANIFEST_NAME).exists()
        _committed_intact(job, 1, before)
        filler.unlink()
        assert job.save(3) is None
        assert assert_root_consistent(job.root)["checkpoint"] == 3

    def test_full_when_the_iteration_file_is_written(self, job):
        assert job.save(1) is None
        before = job.path(1).read_bytes()
        assert job.write(2) is None
        filler = _fill(job.root, leave_pages=1)  # room for the manifest, not the iteration file
        job.submit(2)
        error = job.failed()[2]
        assert "No space left on device" in error
        assert layout.ITERATION_FILES["checkpoint"] in error
        assert _temp_files(job.root) == []
        _committed_intact(job, 1, before)
        # The CLI does not call the failed step committed.
        code, out, err = _cli("status", str(job.root), "--json")
        assert code == 0, err
        st = json.loads(out)
        assert st["committed"] == [1] and st["uncommitted"] == [2]
        code, out, err = _cli("verify", str(job.root))
        assert code == 0 and "step 1: OK" in out
        filler.unlink()
        assert job.save(3) is None
        assert assert_root_consistent(job.root)["checkpoint"] == 3

    def test_out_of_inodes_while_a_rank_writes(self, ray_cluster, namespace, tmp_path, small_fs):
        root = small_fs(tmp_path / "root", "size=4m,nr_inodes=16")
        job = _Job(ray_cluster, namespace, root)
        try:
            assert job.save(1) is None
            before = job.path(1).read_bytes()
            spare = root / "spare"
            spare.mkdir()
            hogs = []
            while True:
                try:
                    (spare / str(len(hogs))).touch()
                except OSError:
                    break
                hogs.append(len(hogs))
            error = job.save(2)
            assert error is not None and "No space left on device" in str(error)
            assert "global_step_2" in str(error)
            assert 2 in job.failed()
            assert _temp_files(root) == []
            _committed_intact(job, 1, before)
            for p in spare.iterdir():
                p.unlink()
            assert job.save(3) is None
            assert assert_root_consistent(root)["checkpoint"] == 3
        finally:
            job.close()


class TestUnwritable:
    """A root turned read-only, or a step directory that refuses new files, fails the save
    with the path and the cause; nothing committed changes, and once the fault is gone the
    next step commits."""

    def test_root_turned_read_only_before_a_save(self, job):
        assert job.save(1) is None
        before = job.path(1).read_bytes()
        assert _run("mount", "-o", "remount,ro", str(job.root)).returncode == 0
        error = job.save(2)
        assert error is not None and "Read-only file system" in str(error)
        assert "global_step_2" in str(error)
        assert 2 in job.failed()
        assert job.metric("obsckpt_saves_total", result="error") == 1
        assert job.metric("obsckpt_step_failures_total", kind="checkpoint") == 1
        # status and verify still read a read-only root.
        code, out, err = _cli("status", str(job.root))
        assert code == 0 and "latest checkpoint: 1" in out, err
        code, out, err = _cli("verify", str(job.root))
        assert code == 0 and "step 1: OK" in out, err
        assert _run("mount", "-o", "remount,rw", str(job.root)).returncode == 0
        _committed_intact(job, 1, before)
        assert job.save(3) is None
        assert assert_root_consistent(job.root)["checkpoint"] == 3

    def test_step_directory_refuses_new_files(self, job, small_fs):
        assert job.save(1) is None
        before = job.path(1).read_bytes()
        actor = job.path(2).parent
        actor.mkdir(parents=True)
        small_fs.immutable(actor)
        error = job.save(2)
        assert error is not None and "Operation not permitted" in str(error)
        assert str(actor) in str(error)
        assert 2 in job.failed()
        _run("chattr", "-i", str(actor))
        _committed_intact(job, 1, before)
        assert job.save(3) is None
        assert assert_root_consistent(job.root)["checkpoint"] == 3

    def test_root_refuses_new_files_at_commit(self, job, small_fs):
        assert job.save(1) is None
        before = job.path(1).read_bytes()
        assert job.write(2) is None
        small_fs.immutable(job.root)
        job.submit(2)
        error = job.failed()[2]
        assert "Operation not permitted" in error and layout.ITERATION_FILES["checkpoint"] in error
        _run("chattr", "-i", str(job.root))
        assert _temp_files(job.root) == []
        _committed_intact(job, 1, before)
        assert job.save(3) is None
        assert assert_root_consistent(job.root)["checkpoint"] == 3


class TestRemovedByHand:
    """A step directory removed (or renamed) before its commit is never named by the
    iteration file; a root removed while the job runs does not take the job down."""

    def test_step_directory_removed_before_its_commit(self, job):
        assert job.save(1) is None
        before = job.path(1).read_bytes()
        assert job.write(2) is None
        layout.step_dir(job.root, 2).rename(job.root / "moved_away")
        job.submit(2)
        assert "global_step_2" in job.failed()[2]
        _committed_intact(job, 1, before)
        assert job.save(3) is None
        assert assert_root_consistent(job.root)["checkpoint"] == 3

    def test_root_removed_while_the_job_runs(self, ray_cluster, namespace, tmp_path):
        root = tmp_path / "root"
        job = _Job(ray_cluster, namespace, root)
        try:
            assert job.save(1) is None
            root.rename(tmp_path / "moved")
            code, _out, err = _cli("status", str(root))
            assert code == 2 and "no such directory" in err
            # The next save recreates the root; its step is whole there.
            assert job.save(2) is None
            assert assert_root_consistent(root)["checkpoint"] == 2
            code, out, err = _cli("verify", str(tmp_path / "moved"))
            assert code == 0 and "step 1: OK" in out, err
        finally:
            job.close()


class TestDamagedCommittedSteps:
    """Files of committed steps truncated, replaced or half-written by hand: verify names
    each, with exit code 1 and no traceback; the job goes on committing."""

    def test_truncated_replaced_and_half_written(self, job):
        for step in (1, 2, 3):
            assert job.save(step) is None
        size = job.path(1).stat().st_size
        os.truncate(job.path(1), size // 2)
        job.path(2).write_bytes(os.urandom(job.path(2).stat().st_size))
        manifest = layout.step_dir(job.root, 3) / layout.MANIFEST_NAME
        manifest.write_bytes(manifest.read_bytes()[:40])
        code, out, err = _cli("verify", str(job.root), "--all")
        assert code == 1 and "Traceback" not in err
        assert out.splitlines() == [f"step {n}: FAILED, 1 problem(s)" for n in (1, 2, 3)]
        lines = err.splitlines()
        assert lines[0] == (
            f"step 1: {job.path(1)}: truncated ({size // 2} bytes, manifest says {size})"
        )
        assert lines[1].startswith(f"step 2: {job.path(2)}: corrupted (crc32 ")
        assert lines[2].startswith(f"step 3: {manifest}: unreadable manifest (")
        assert len(lines) == 3
        # Without --all the latest committed step is the one checked.
        code, out, _err = _cli("verify", str(job.root))
        assert code == 1 and out == "step 3: FAILED, 1 problem(s)\n"
        # status checks sizes, not checksums: the truncated step and the step whose
        # manifest is unreadable are damaged (exit 1), the same-size rewrite is for verify.
        code, out, err = _cli("status", str(job.root))
        assert code == 1 and "latest checkpoint: 3" in out and err == ""
        assert "problem: step 1 is damaged" in out and "problem: step 3 is damaged" in out
        assert "step 2 is damaged" not in out
        # The job goes on: the next step commits whole.
        assert job.save(4) is None
        assert assert_root_consistent(job.root)["checkpoint"] == 4

    def test_commit_interrupted_after_the_manifest(self, tmp_path):
        """A commit cut between the manifest's rename and the iteration file's (the monitor
        died, or the iteration file's write failed) leaves a manifest: status does not call
        that step committed."""
        from obsckpt.store.torchfile import write_torch_file

        root = tmp_path / "root"
        for step in (1, 2):
            write_torch_file({"w": torch.ones(8)}, layout.step_dir(root, step) / RANK_FILE)
        commit.finalize_step(layout.step_dir(root, 1), iterations={"checkpoint": 1})
        commit.finalize_step(layout.step_dir(root, 2))  # its iteration file never moved
        code, out, err = _cli("status", str(root), "--json")
        assert code == 0, err
        st = json.loads(out)
        assert st["committed"] == [1] and st["uncommitted"] == [2]
        assert "no iteration file names it" in st["steps"][1]["note"]
