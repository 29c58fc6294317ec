"""save_state_dict_async's snapshot: what is saved is what the tensors held at the call."""

from __future__ import annotations

import torch

from obsckpt.snapshot import StagingBuffers, write_torch_file


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
        assert staging.bytes_allocated == allocated == 1000 * 4 + 9 * 2
        staging.stage({"a": torch.ones(10)})
        assert staging.bytes_allocated == 10 * 4


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
