"""obsckpt.store.checked_read: a file read once into private memory, its CRC32 computed on the way,
deserialised from that memory without a second copy. Plain files, no Ray."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from obsckpt.errors import UnverifiedCheckpointError
from obsckpt.store import checked_read, commit, layout, loading
from obsckpt.store.torchfile import write_torch_file


def _read(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return checked_read.read_checked(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "size",
    [
        0,
        1,
        checked_read.CHUNK - 1,
        checked_read.CHUNK,
        checked_read.CHUNK + 1,
        3 * checked_read.CHUNK + 17,
    ],
)
def test_bytes_and_crc32_match_the_file(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    storage, crc = _read(path)
    assert crc == zlib.crc32(data)
    assert storage.nbytes() == size
    assert bytes(checked_read.memory_of(storage)) == data


def test_a_file_shorter_than_said_is_an_error(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EOFError, match="ended at byte 100"):
            checked_read.read_checked(fd, 3 * checked_read.CHUNK)
    finally:
        os.close(fd)


def _committed(root, state, name="actor/model_world_size_1_rank_0.pt"):
    sdir = layout.step_dir(root, 1)
    path = sdir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_torch_file(state, path)
    commit.finalize_step(sdir, iterations={"checkpoint": 1})
    return path


class TestDeserialisedFromTheCheckedMemory:
    def test_tensors_share_one_private_buffer_and_ignore_later_writes(self, tmp_path):
        big = torch.arange(3 * checked_read.CHUNK // 4, dtype=torch.float32)  # several chunks
        state = {"big": big, "small": torch.ones(5, dtype=torch.bfloat16), "n": 7}
        path = _committed(tmp_path, state)
        got = loading.load(path)
        assert torch.equal(got["big"], big) and torch.equal(got["small"], state["small"])
        assert got["n"] == 7
        # One allocation holds the file; each tensor's storage is its record within it.
        ptrs = [got[k].untyped_storage().data_ptr() for k in ("big", "small")]
        assert ptrs[0] != ptrs[1] and abs(ptrs[0] - ptrs[1]) < os.path.getsize(path)
        # Private memory: overwriting (or deleting) the file afterwards changes nothing loaded.
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\xff" * 4096)
        path.unlink()
        assert torch.equal(got["big"], big)
        # Tensors are writable, as torch.load's are.
        got["big"][0] = -1.0
        assert got["big"][0].item() == -1.0

    def test_a_flipped_byte_in_the_last_chunk_is_found_before_deserialising(self, tmp_path):
        big = torch.arange(3 * checked_read.CHUNK // 4, dtype=torch.float32)
        path = _committed(tmp_path, {"big": big})
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(size - 100)
            byte = f.read(1)
            f.seek(size - 100)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(UnverifiedCheckpointError, match="corrupted"):
            loading.load(path)

    def test_rng_states_restore_from_their_own_storage_start(self, tmp_path):
        """torch.set_rng_state reads a state from its storage's start: each loaded
        tensor's storage must begin at its own record, not at the buffer's start."""
        torch.manual_seed(1234)
        state = {"pad": torch.randn(1000), "rng": torch.get_rng_state()}
        expected = torch.rand(4)
        path = _committed(tmp_path, state)
        got = loading.load(path)
        torch.set_rng_state(got["rng"])
        assert torch.equal(torch.rand(4), expected)

    def test_torchscript_archives_are_refused(self, tmp_path):
        scripted = torch.jit.script(torch.nn.Linear(2, 2))
        sdir = layout.step_dir(tmp_path, 1)
        sdir.mkdir(parents=True)
        torch.jit.save(scripted, str(sdir / "scripted.pt"))
        commit.finalize_step(sdir, iterations={"checkpoint": 1})
        with pytest.raises(UnverifiedCheckpointError, match="not a file torch.save wrote"):
            loading.load(sdir / "scripted.pt")

    def test_map_location_moves_as_torch_load_does(self, tmp_path):
        path = _committed(tmp_path, {"w": torch.ones(3)})
        got = loading.load(path, map_location="meta")
        assert got["w"].device.type == "meta" and got["w"].shape == (3,)
