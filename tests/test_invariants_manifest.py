"""A step's manifest records the files as they are on disk, and a whole step verifies."""

from __future__ import annotations

import json
import os
import zlib

import torch

from obsckpt.store import commit, layout, reader
from obsckpt.store.torchfile import write_torch_file

# Larger than the chunk files are read in, so a checksum spans several reads.
_BIG = (8 << 20) * 2 + 12345


def _manifest_entry(sdir, rel: str) -> dict:
    files = json.loads((sdir / layout.MANIFEST_NAME).read_text())["files"]
    return next(f for f in files if f["path"] == rel)


class TestChecksums:
    """The manifest's CRC32 is zlib's CRC32 of the whole file, however large."""

    def test_a_file_larger_than_a_read_chunk_has_its_whole_crc32(self, tmp_path):
        """The CRC32 the commit records for a file it reads itself covers every byte of it."""
        sdir = layout.step_dir(tmp_path, 2)
        (sdir / "actor").mkdir(parents=True)
        data = os.urandom(_BIG)
        (sdir / "actor" / "model.pt").write_bytes(data)
        commit.finalize_step(sdir, iterations={"checkpoint": 2})
        entry = _manifest_entry(sdir, "actor/model.pt")
        assert entry["size"] == len(data)
        assert int(entry["crc32"], 16) == zlib.crc32(data)
        assert reader.verify_step(sdir) == []

    def test_a_reported_torch_file_larger_than_a_read_chunk_verifies(self, tmp_path):
        """A state-dict file written by the saver (its CRC32 computed while writing) and
        trusted by the commit verifies against the manifest afterwards."""
        sdir = layout.step_dir(tmp_path, 3)
        path = sdir / "actor" / "model.pt"
        state = {"w": torch.arange(_BIG // 4, dtype=torch.float32), "b": torch.ones(7)}
        rec = write_torch_file(state, path)
        data = path.read_bytes()
        assert rec.size == len(data) > 8 << 20 and rec.crc32 == zlib.crc32(data)
        reported = {"actor/model.pt": layout.FileRecord("actor/model.pt", rec.size, rec.crc32)}
        commit.finalize_step(sdir, reported, iterations={"state_dict": 3})
        assert reader.verify_step(sdir) == []
        assert reader.read_iteration(tmp_path, "state_dict") == 3
        loaded = torch.load(path, weights_only=True)
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])


class TestReportedRecords:
    """A worker's report is trusted only while it still describes the file on disk."""

    def test_a_report_whose_size_disagrees_with_the_disk_is_not_trusted(self, tmp_path):
        """A file rewritten (with another size) after its save reported it is recorded as it
        is on disk, so the committed step verifies."""
        sdir = layout.step_dir(tmp_path, 5)
        (sdir / "actor").mkdir(parents=True)
        data = os.urandom(5000)
        (sdir / "actor" / "model.pt").write_bytes(data)
        stale = layout.FileRecord("actor/model.pt", 4000, 0xDEADBEEF)
        records = commit.finalize_step(
            sdir, {"actor/model.pt": stale}, iterations={"checkpoint": 5}
        )
        assert records == [layout.FileRecord("actor/model.pt", 5000, zlib.crc32(data))]
        assert reader.read_manifest(sdir) == records
        assert reader.verify_step(sdir) == []
