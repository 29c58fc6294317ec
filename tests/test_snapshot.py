"""save_state_dict_async's snapshot: what is saved is what the tensors held at the call."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import torch

from obsckpt.staging import StagingBuffers
from obsckpt.store.torchfile import write_torch_file


class TestStaging:
    """Staged copies are independent of the caller's tensors and reuse their buffers."""

    def test_mutation_after_stage_does_not_change_the_copy(self):
        sd = {"w": torch.randn(64, 64), "nested": {"b": torch.arange(10)}, "meta": [1, "x"]}
        expected = {"w": sd["w"].clone(), "b": sd["nested"]["b"].clone()}
        staging = StagingBuffers()
        snap = staging.stage(sd)
        sd["w"].mul_(0)
        sd["nested"]["b"].add_(5)
        sd["meta"].append("y")
        assert torch.equal(snap["w"], expected["w"])
        assert torch.equal(snap["nested"]["b"], expected["b"])
        assert snap["meta"] == [1, "x"]

    def test_buffers_are_reused_while_shapes_match(self):
        staging = StagingBuffers()
        sd = {"a": torch.zeros(1000), "b": torch.zeros(3, 3, dtype=torch.bfloat16)}
        first = staging.stage(sd)
        allocated = staging.bytes_allocated
        second = staging.stage({"a": torch.ones(1000), "b": torch.ones(3, 3, dtype=torch.bfloat16)})
        assert second["a"].data_ptr() == first["a"].data_ptr()
        # One arena: both buffers, the small one at a 64-byte offset, rounded to a page.
        assert staging.bytes_allocated == allocated == 4096
        assert second["b"].data_ptr() - second["a"].data_ptr() == 4000 + 32
        staging.stage({"a": torch.ones(10)})
        assert staging.bytes_allocated == 4096 and staging.allocations == 2


class TestWrite:
    def test_written_file_loads_and_record_matches_bytes(self, tmp_path):
        import zlib

        sd = {"w": torch.randn(128, 3), "step": 4}
        path = tmp_path / "sub" / "model.pt"
        rec = write_torch_file(sd, path)
        data = path.read_bytes()
        assert rec.size == len(data) and rec.crc32 == zlib.crc32(data)
        loaded = torch.load(path)
        assert torch.equal(loaded["w"], sd["w"]) and loaded["step"] == 4
        assert [p.name for p in path.parent.iterdir()] == ["model.pt"]

    def test_two_writes_of_one_path_at_once_leave_one_of_them_whole(self, tmp_path):
        """Two saves of one process writing one file (a state-dict save and a full
        checkpoint of the same step): each has its own temp file, both succeed, and the
        file is one of the two writes, matching that write's record."""
        import zlib

        path = tmp_path / "model.pt"
        states = [{"w": torch.full((3 << 20,), float(i))} for i in range(2)]
        for _ in range(5):
            records: list = [None, None]

            def write(i: int, records=records) -> None:
                records[i] = write_torch_file(states[i], path)

            threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert None not in records, "a write failed"
            data = path.read_bytes()
            [won] = [i for i, r in enumerate(records) if r.crc32 == zlib.crc32(data)]
            assert records[won].size == len(data)
            assert torch.equal(torch.load(path)["w"], states[won]["w"])
            assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def _loads_back(path, expected: dict) -> None:
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == list(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


class TestDirectWrite:
    """Large staged tensors go to disk from their own (page-aligned) memory, without a copy."""

    def test_large_staging_buffers_are_page_aligned(self):
        sd = {
            "big": torch.randn(1024, 1024),
            "bf16": torch.randn(3, 1 << 20).to(torch.bfloat16),
            "flags": torch.zeros(2 << 20, dtype=torch.bool),
            "small": torch.randn(10),
        }
        snap = StagingBuffers(pin_memory=False).stage(sd)
        for key in ("big", "bf16", "flags"):
            assert snap[key].data_ptr() % 4096 == 0, key
            assert snap[key].is_contiguous() and torch.equal(snap[key], sd[key])
        assert torch.equal(snap["small"], sd["small"])

    def test_staged_state_is_written_without_copies_and_reads_back(self, tmp_path):
        import zlib

        from obsckpt.store.torchfile import _PipelinedSink, _torch_save

        # Sizes that are not multiples of the page: each record's tail goes through the chunks.
        sd = {
            "a": torch.randn(1000, 1000),
            "b": torch.randn(7),
            "c": torch.randn(3_000_001),
            "d": torch.randn(4096, 1024).to(torch.bfloat16),
        }
        snap = StagingBuffers(pin_memory=False).stage(sd)
        path = tmp_path / "direct.pt"
        sink = _PipelinedSink(str(path))
        try:
            _torch_save(snap, sink)
            sink.finish()
        finally:
            sink.close()
        data = path.read_bytes()
        assert len(data) == sink.size and zlib.crc32(data) == sink.crc
        _loads_back(path, sd)
        big = sum(sd[k].nbytes for k in "acd")
        if sink.direct:
            # everything of the large tensors but their last partial page
            assert big - 3 * 4096 < sink.direct_bytes <= big
        else:  # a filesystem without O_DIRECT: the same bytes, through the page cache
            assert sink.direct_bytes == 0

    def test_unstaged_state_reads_back_the_same(self, tmp_path):
        import zlib

        sd = {"x": torch.randn(2_000_000), "y": torch.arange(5)}
        rec = write_torch_file(sd, tmp_path / "plain.pt")
        data = (tmp_path / "plain.pt").read_bytes()
        assert rec.size == len(data) and rec.crc32 == zlib.crc32(data)
        _loads_back(tmp_path / "plain.pt", sd)

    def test_memory_not_owned_by_the_saved_object_is_written_before_write_returns(self, tmp_path):
        import mmap

        from obsckpt.store.torchfile import _PipelinedSink

        # Like a temporary copy torch makes of a device tensor: freed once write() returns.
        buf = mmap.mmap(-1, 2 << 20)
        buf[:] = b"\x5a" * len(buf)
        sink = _PipelinedSink(str(tmp_path / "raw.bin"))
        try:
            sink.write(memoryview(buf))
            buf[:] = b"\x00" * len(buf)  # the caller reuses its memory
            sink.finish()
        finally:
            sink.close()
        assert (tmp_path / "raw.bin").read_bytes() == b"\x5a" * (2 << 20)

    def test_reserved_blocks_are_trimmed_to_the_written_size(self, tmp_path):
        from obsckpt.store.torchfile import _PipelinedSink

        sink = _PipelinedSink(str(tmp_path / "reserved.bin"))
        try:
            sink.reserve(64 << 20)
            sink.write(b"obsckpt" * 1000)
            sink.finish()
        finally:
            sink.close()
        assert (tmp_path / "reserved.bin").read_bytes() == b"obsckpt" * 1000


# Runs in a child process: before the fix a failed write aborted the process.
_FAILING_DISK = textwrap.dedent(
    """
    import errno, gc, json, os, sys
    import torch
    import obsckpt.store.torchfile as torchfile
    from obsckpt.staging import StagingBuffers

    root = sys.argv[1]
    pwrite = os.pwrite
    results = []
    for fail_after in (0, 1, 3, 6):
        calls = [0]

        def full_disk(fd, data, offset):
            calls[0] += 1
            if calls[0] > fail_after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return pwrite(fd, data, offset)

        torchfile.os.pwrite = full_disk
        sd = {f"w{i}": torch.randn(3 << 20) for i in range(6)}
        sd["small"] = torch.randn(5)
        snap = StagingBuffers(pin_memory=False).stage(sd)
        path = os.path.join(root, f"model{fail_after}.pt")
        try:
            torchfile.write_torch_file(snap, path)
            results.append({"fail_after": fail_after, "raised": None})
        except Exception as exc:
            cause = exc.__cause__
            results.append({
                "fail_after": fail_after,
                "raised": type(exc).__name__,
                "message": str(exc),
                "errno": getattr(cause, "errno", None),
            })
            del exc
        torchfile.os.pwrite = pwrite
        gc.collect()  # frees what the failed write left, torch's writer included
    print(json.dumps({"results": results, "left": sorted(os.listdir(root))}))
    """
)


class TestWriteFailure:
    """A write the disk refuses raises that error, naming the file, and leaves no file behind."""

    def test_full_disk_raises_its_error_and_the_process_goes_on(self, tmp_path):
        proc = subprocess.run(
            [sys.executable, "-c", _FAILING_DISK, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        for result in found["results"]:
            assert result["raised"] == "OSError", result
            assert result["errno"] == 28, result  # ENOSPC, not an error of the cleanup
            assert f"model{result['fail_after']}.pt" in result["message"], result
        assert found["left"] == []
