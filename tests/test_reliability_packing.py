"""Small tensors do not bloat a file, and every tensor loads back as it was saved.

The writer gives each record a 4 KiB boundary so large tensors can be written
with O_DIRECT. Given to every storage, that boundary made an optimizer state of
thousands of tiny tensors (a step and two small moments per parameter) about 14
times torch.save's file (17.8 MB against 1.3 MB for 4,200 tensors). Storages
under ``PACK_MAX`` are now packed, one record per dtype, while large ones keep
their 4 KiB-aligned records; and non-contiguous tensors (transposes, slices,
views of one storage) come back with their strides and shared storages, not as
contiguous copies.

Plain files, no Ray: each file is read back with plain ``torch.load``. The
states and the zip-record reader are ``test_torchfile_packing``'s.
"""

from __future__ import annotations

import torch
from test_torchfile_packing import (
    _assert_same_tensors,
    _mixed_state,
    _records,
    _storage,
)

import obsckpt.tree
from obsckpt.store.reader import file_crc32
from obsckpt.store.torchfile import ALIGN, write_torch_file


def _optimizer_state(params: int) -> dict:
    """An Adam-like state: per parameter a scalar int64 step and two small moments."""
    g = torch.Generator().manual_seed(1)
    return {
        "state": {
            i: {
                "step": torch.tensor(i, dtype=torch.int64),
                "exp_avg": torch.randn(24, generator=g),
                "exp_avg_sq": torch.rand(24, generator=g),
            }
            for i in range(params)
        },
        "param_groups": [{"lr": 1e-3, "params": list(range(params))}],
    }


class TestPackedFile:
    """A file with small storages packed is about torch.save's size, keeps large records
    aligned, and loads with plain torch.load, equal in every respect."""

    def test_many_small_tensors_cost_no_more_than_torch_save(self, tmp_path, monkeypatch):
        state = _optimizer_state(1400)  # 4,200 tensors
        reference = tmp_path / "reference.pt"
        torch.save(state, reference)
        rec = write_torch_file(state, tmp_path / "packed.pt")
        assert rec.size <= 1.2 * reference.stat().st_size
        _assert_same_tensors(torch.load(tmp_path / "packed.pt", weights_only=True), state)
        # Without packing each one costs a page of alignment: the check above can fail.
        monkeypatch.setattr(obsckpt.tree, "PACK_MAX", 0)
        unpacked = write_torch_file(state, tmp_path / "unpacked.pt")
        assert unpacked.size > 5 * reference.stat().st_size

    def test_one_record_per_dtype_of_small_storages_and_large_ones_page_aligned(self, tmp_path):
        state = _mixed_state()
        path = tmp_path / "mixed.pt"
        write_torch_file(state, path)
        reference = tmp_path / "reference.pt"
        torch.save(state, reference)
        records = _records(path)
        # float32, bfloat16 and int64 packs (one holding every small float32 storage,
        # the 0-byte ones included), and the two large storages.
        assert len(records) == 5, records
        assert len(_records(reference)) == 11
        large = {t.untyped_storage().nbytes() for t in (state["big"], state["large_bf16"])}
        assert {size for _, size in records.values()} >= large
        for offset, size in records.values():
            if size in large:
                assert offset % ALIGN == 0

    def test_mixed_state_loads_back_equal_with_strides_and_sharing(self, tmp_path):
        state = _mixed_state()
        path = tmp_path / "mixed.pt"
        rec = write_torch_file(state, path)
        assert file_crc32(path) == (rec.size, rec.crc32)
        for mmap in (False, True):
            loaded = torch.load(path, weights_only=True, mmap=mmap)
            _assert_same_tensors(loaded, state)
            views = loaded["views"]
            # Views of one storage share one again, at the same distances apart.
            assert len({_storage(v) for v in views}) == 1
            assert {_storage(t) for t in loaded["tied"]} == {_storage(views[0])}
            assert views[0].storage_offset() - views[2].storage_offset() == 8
            assert _storage(loaded["big"]) == _storage(loaded["big_t"])
            assert type(loaded["param"]) is torch.nn.Parameter
            assert loaded["meta"] == {"lr": 0.1, "name": "adam"}
        loaded["views"][2][1, 1] = 123.0  # base[1, 1] seen through the other views too
        assert loaded["views"][0][0, 1] == 123.0 and loaded["tied"][0][1, 1] == 123.0
