"""Every wait on the save path has a bound, and cleanup never hides the error that failed a save.

The bounds are module constants (minutes in production); here they are made
small, and a real writer or copy thread is held on an Event so the wait
outlives its bound.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest
import torch

import obsckpt.staging as staging_mod
import obsckpt.store.torchfile as torchfile
from obsckpt.errors import ObsckptError, SaveTimeoutError, WaitTimeoutError
from obsckpt.staging import StagingBuffers, StagingCopy
from obsckpt.store.torchfile import write_torch_file


def _fds_to(name: str) -> list[str]:
    """This process's descriptors open on a file whose path contains ``name``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since it was listed
            continue
        if name in target:
            found.append(target)
    return found


@pytest.fixture
def held_writes(monkeypatch):
    """The sink's writes block until the returned Event is set (a hung filesystem)."""
    gate = threading.Event()
    pwrite = torchfile._PipelinedSink._pwrite

    def held(self, buf, n, offset):
        gate.wait(30)
        pwrite(self, buf, n, offset)

    monkeypatch.setattr(torchfile._PipelinedSink, "_pwrite", held)
    monkeypatch.setattr(torchfile, "WAIT_TIMEOUT_S", 0.3)
    yield gate
    gate.set()


class TestWriterWaits:
    """A write that hangs fails the save with WaitTimeoutError after the bound, and the
    file's descriptor is closed once the write returns."""

    @pytest.mark.parametrize("hung", ["file", "directory"])
    def test_a_hung_fsync_of_the_file_or_its_directory_is_bounded(
        self, tmp_path, monkeypatch, hung
    ):
        """An fsync on network storage that stops answering: the save fails naming the
        file (the fsync runs on a pool thread, which it keeps while the storage hangs)."""
        from obsckpt.errors import FsyncTimeoutError
        from obsckpt.store import commit

        gate = threading.Event()
        real = commit.fsync_dir if hung == "directory" else commit.fsync_file

        def hanging(path):
            gate.wait(30)
            real(path)

        monkeypatch.setattr(commit, "FSYNC_TIMEOUT_S", 0.3)
        monkeypatch.setattr(commit, "fsync_dir" if hung == "directory" else "fsync_file", hanging)
        path = tmp_path / "model.pt"
        t0 = time.monotonic()
        try:
            with pytest.raises(FsyncTimeoutError, match=r"after 0\.3 s") as info:
                write_torch_file({"w": torch.randn(100)}, path)
        finally:
            gate.set()
        assert time.monotonic() - t0 < 10
        assert f"writing {path}" in str(info.value)
        if hung == "file":
            assert not path.exists() and os.listdir(tmp_path) == []  # temp removed
        else:
            assert path.exists()  # renamed; whether it is durable is unknown: not reported

    def test_join_of_a_hung_writer_thread_is_bounded(self, tmp_path, held_writes):
        path = tmp_path / "model.pt"
        t0 = time.monotonic()
        with pytest.raises(WaitTimeoutError, match=r"no write finished in 0\.3 s") as info:
            write_torch_file({"w": torch.randn(100)}, path)
        assert time.monotonic() - t0 < 10
        assert isinstance(info.value, (ObsckptError, TimeoutError))
        assert str(tmp_path) in str(info.value) and "helper threads" in str(info.value)
        assert os.listdir(tmp_path) == []  # the temp file is gone, nothing renamed
        # Its descriptor stays open while the write hangs (its number cannot be handed to
        # another file under the write), and is closed once the write returns.
        assert len(_fds_to("model.pt.tmp.")) == 1
        held_writes.set()
        deadline = time.monotonic() + 10
        while _fds_to("model.pt.tmp.") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _fds_to("model.pt.tmp.") == []

    def test_wait_for_a_free_chunk_is_bounded(self, tmp_path, held_writes, monkeypatch):
        monkeypatch.setattr(torchfile, "_IO_CHUNK", 64 << 10)
        monkeypatch.setattr(torchfile, "_IO_CHUNKS", 1)
        # Above the packing threshold and below the direct-write size: copied through chunks.
        state = {f"t{i}": torch.randn(100_000 // 4) for i in range(4)}
        with pytest.raises(WaitTimeoutError, match="a chunk to be written and freed"):
            write_torch_file(state, tmp_path / "model.pt")

    def test_a_slow_write_that_progresses_is_not_a_hang(self, tmp_path, monkeypatch):
        monkeypatch.setattr(torchfile, "WAIT_TIMEOUT_S", 0.5)
        monkeypatch.setattr(torchfile, "_IO_CHUNK", 64 << 10)
        monkeypatch.setattr(torchfile, "_IO_CHUNKS", 1)
        pwrite = torchfile._PipelinedSink._pwrite

        def slow(self, buf, n, offset):
            time.sleep(0.05)  # 20+ pieces: 1 s and more in all, 0.05 s apart
            pwrite(self, buf, n, offset)

        monkeypatch.setattr(torchfile._PipelinedSink, "_pwrite", slow)
        state = {f"t{i}": torch.randn(100_000 // 4) for i in range(12)}
        write_torch_file(state, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=True)
        assert all(torch.equal(loaded[k], v) for k, v in state.items())

    def test_a_pause_of_the_saving_thread_is_not_a_hang(self, tmp_path, monkeypatch):
        """The bound counts from the last piece handed over or finished: a free chunk
        found after the saver itself paused longer than the bound is taken."""
        monkeypatch.setattr(torchfile, "WAIT_TIMEOUT_S", 0.2)
        monkeypatch.setattr(torchfile, "_IO_CHUNK", 64 << 10)
        monkeypatch.setattr(torchfile, "_IO_CHUNKS", 1)
        path = tmp_path / "raw.bin"
        sink = torchfile._PipelinedSink(str(path))
        try:
            sink.write(b"a" * (64 << 10))  # fills the one chunk: handed to the writers
            time.sleep(0.5)  # e.g. a slow device-to-host copy of the next storage
            sink.write(b"b" * (64 << 10))
            sink.finish()
        finally:
            sink.close()
        assert path.read_bytes() == b"a" * (64 << 10) + b"b" * (64 << 10)


class TestStagingWaits:
    """The writer's and the next save's waits for an overlapped copy are bounded."""

    @staticmethod
    def _held_copy(gate: threading.Event) -> tuple[StagingBuffers, StagingCopy, threading.Thread]:
        staging = StagingBuffers(pin_memory=False)
        _, copies = staging.plan({"w": torch.randn(1000), "b": torch.randn(10)})
        copier = StagingCopy(staging, copies)
        thread = threading.Thread(target=lambda: (gate.wait(30), copier.run()))
        copier.start(lambda run: thread.start())
        return staging, copier, thread

    def test_finish_is_bounded(self, monkeypatch):
        monkeypatch.setattr(staging_mod, "STAGING_TIMEOUT_S", 0.2)
        gate = threading.Event()
        _, copier, thread = self._held_copy(gate)
        with pytest.raises(WaitTimeoutError, match=r"the writer waited 0\.2 s .* 2 storages"):
            copier.finish()
        gate.set()
        thread.join(10)
        copier.finish()  # the copy ended: the wait returns

    def test_settle_before_the_buffers_are_reused_is_bounded(self, monkeypatch):
        monkeypatch.setattr(staging_mod, "STAGING_TIMEOUT_S", 0.2)
        gate = threading.Event()
        staging, copier, thread = self._held_copy(gate)
        with pytest.raises(WaitTimeoutError, match="the next use of its staging buffers"):
            copier.settle()
        # The next snapshot into the same buffers waits for that copy too, and gives up.
        with pytest.raises(WaitTimeoutError, match="copy thread had not finished"):
            staging.stage({"w": torch.randn(1000), "b": torch.randn(10)})
        gate.set()
        thread.join(10)
        snapshot = staging.stage({"w": torch.ones(1000), "b": torch.ones(10)})
        assert torch.equal(snapshot["w"], torch.ones(1000))

    def test_wait_staged_without_a_timeout_is_bounded(self, monkeypatch):
        """The training thread's wait before it changes its tensors: STAGING_TIMEOUT_S."""
        from obsckpt.slot_staging import StagedSave

        monkeypatch.setattr(staging_mod, "STAGING_TIMEOUT_S", 0.2)
        gate = threading.Event()
        _, copier, thread = self._held_copy(gate)
        t0 = time.monotonic()
        with pytest.raises(
            SaveTimeoutError, match=r"slot 'model' step 3 did not finish within 0\.2 s"
        ):
            StagedSave("model", 3, copier).wait_staged()
        assert time.monotonic() - t0 < 5
        gate.set()
        thread.join(10)
        StagedSave("model", 3, copier).wait_staged()

    def test_a_copy_never_started_is_reported_as_such(self, monkeypatch):
        monkeypatch.setattr(staging_mod, "STAGING_TIMEOUT_S", 0.1)
        staging = StagingBuffers(pin_memory=False)
        _, copies = staging.plan({"w": torch.randn(10)})
        with pytest.raises(WaitTimeoutError, match=r"had not finished \(or started\)"):
            StagingCopy(staging, copies).finish()


class TestCleanupKeepsTheError:
    """A failed write whose temp file cannot be removed raises the write's error; the
    removal's failure is logged once."""

    @pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.EIO])
    def test_unlink_failure_does_not_mask_the_write_error(
        self, tmp_path, monkeypatch, caplog, code
    ):
        unlink = os.unlink
        refused = []

        def failing_unlink(path, *args, **kwargs):
            if ".tmp." in os.fspath(path):
                refused.append(os.fspath(path))
                raise OSError(code, os.strerror(code), os.fspath(path))
            return unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "unlink", failing_unlink)
        state = {"w": torch.randn(10), "not_picklable": lambda: None}
        with caplog.at_level(logging.WARNING, logger="obsckpt.store.torchfile"):
            with pytest.raises(Exception) as info:  # noqa: PT011 - the type is pickle's
                write_torch_file(state, tmp_path / "model.pt")
        assert not isinstance(info.value, OSError), info.value
        assert "lambda" in str(info.value)
        [record] = [r for r in caplog.records if r.name == "obsckpt.store.torchfile"]
        assert refused[0] in record.getMessage() and os.strerror(code) in record.getMessage()
        assert len(refused) == 1

    def test_write_error_keeps_its_errno_when_cleanup_fails(self, tmp_path, monkeypatch, caplog):
        def full(self, buf, n, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(torchfile._PipelinedSink, "_pwrite", full)
        unlink = os.unlink

        def failing_unlink(path, *args, **kwargs):
            if ".tmp." in os.fspath(path):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "unlink", failing_unlink)
        with caplog.at_level(logging.WARNING, logger="obsckpt.store.torchfile"):
            with pytest.raises(OSError) as info:
                write_torch_file({"w": torch.randn(10)}, tmp_path / "model.pt")
        assert info.value.errno == errno.ENOSPC
        assert sum("could not remove the temp file" in r.getMessage() for r in caplog.records) == 1
