"""Small storages are packed; strides, dtypes and shared storages come back as torch.save keeps them.

The writer gives each record a 4 KiB boundary so large tensors can be written
with O_DIRECT; storages under ``PACK_MAX`` are instead copied into one packed
storage per dtype and load back as views into it. Staging keeps strides and
shared storages too, so a staged snapshot is written as the state itself
would be. The file-size, alignment and mixed-state cases are in
``test_reliability_packing.py``, with the helpers here that they share.
"""

from __future__ import annotations

import os
import zipfile

import pytest
import torch

from obsckpt.staging import StagingBuffers, StagingCopy
from obsckpt.store.reader import file_crc32
from obsckpt.store.torchfile import ALIGN, write_torch_file

MiB = 1 << 20


def _mixed_state() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    big = torch.randn(1024, 1024, generator=g)
    return {
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "step": torch.tensor(17, dtype=torch.int64),
        "scalar": torch.tensor(0.25),
        "empty": torch.empty(0, 3),
        "empty_t": torch.empty(3, 0).t(),
        "transposed": torch.randn(4, 9, generator=g).t(),
        "sliced": torch.randn(10, 10, generator=g)[2:7, ::3],
        "views": [base[1:3], base[:, 5], base.t()],  # three views of one storage
        "tied": (base, base),
        "big": big,
        "big_t": big.t(),  # a large storage seen through two views
        "large_bf16": torch.randn(3, MiB, generator=g).to(torch.bfloat16),
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),
        "meta": {"lr": 0.1, "name": "adam"},
    }


def _leaves(obj, key=""):
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{key}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{key}.{i}")


def _assert_same_tensors(loaded, expected) -> None:
    got, want = dict(_leaves(loaded)), dict(_leaves(expected))
    assert got.keys() == want.keys()
    for key, t in want.items():
        assert got[key].dtype == t.dtype, key
        assert got[key].shape == t.shape, key
        assert got[key].stride() == t.stride(), key
        assert torch.equal(got[key], t), key


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _records(path) -> dict[str, tuple[int, int]]:
    """Each tensor record of a torch.save zip: name -> (offset of its bytes, size)."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if "/data/" not in info.filename:
                continue
            f.seek(info.header_offset + 26)
            name_len = int.from_bytes(f.read(2), "little")
            extra_len = int.from_bytes(f.read(2), "little")
            offset = info.header_offset + 30 + name_len + extra_len
            out[info.filename.split("/data/")[1]] = (offset, info.file_size)
    return out


class TestPackedFile:
    """A file with small storages packed loads with plain torch.load, equal in every respect."""

    def test_dtypes_torch_pickles_untyped_and_conjugate_views(self, tmp_path):
        state = {
            "u16": torch.arange(10, dtype=torch.int32).to(torch.uint16)[::2],
            "f8": torch.randn(4, 4).to(torch.float8_e4m3fn).t(),
            "conj": torch.randn(3, dtype=torch.complex64).conj(),
            "neg": torch.randn(3)._neg_view(),
        }
        path = tmp_path / "m.pt"
        write_torch_file(state, path)
        assert len(_records(path)) == 4  # one pack per dtype
        loaded = torch.load(path, weights_only=True)
        for key, t in state.items():
            got = loaded[key]
            assert (got.dtype, got.shape, got.stride()) == (t.dtype, t.shape, t.stride()), key
            assert (got.is_conj(), got.is_neg()) == (t.is_conj(), t.is_neg()), key
            assert torch.equal(got.to(torch.complex64), t.to(torch.complex64)), key

    def test_storage_seen_as_two_dtypes_is_refused_as_torch_save_refuses_it(self, tmp_path):
        t = torch.zeros(4)
        state = {"f": t, "i": t.view(torch.int32)}
        with pytest.raises(RuntimeError, match="view the same data as different types"):
            torch.save(state, tmp_path / "reference.pt")
        with pytest.raises(RuntimeError, match="view the same data as different types"):
            write_torch_file(state, tmp_path / "packed.pt")
        assert os.listdir(tmp_path) == ["reference.pt"]  # the temp file was removed

    @pytest.mark.filterwarnings("ignore::UserWarning")  # TypedStorage is deprecated
    def test_storage_also_pickled_on_its_own_keeps_its_record(self, tmp_path):
        """A storage referenced other than through plain tensors is left to torch.save."""
        t = torch.arange(6, dtype=torch.float32)
        state = {"tensor": t[1:4], "storage": t.storage(), "other": torch.ones(3)}
        path = tmp_path / "m.pt"
        write_torch_file(state, path)
        assert len(_records(path)) == 2  # t's storage on its own, the pack holding "other"
        loaded = torch.load(path, weights_only=False)
        assert torch.equal(loaded["tensor"], t[1:4]) and torch.equal(loaded["other"], torch.ones(3))
        assert _storage(loaded["tensor"]) == loaded["storage"].data_ptr()


class TestStagedSnapshot:
    """Staging keeps each tensor's strides and the storages its tensors share."""

    @pytest.mark.parametrize("overlap", [False, True])
    def test_snapshot_keeps_strides_and_shared_storages(self, tmp_path, overlap):
        state = _mixed_state()
        staging = StagingBuffers(pin_memory=False)
        if overlap:
            snapshot, copies = staging.plan(state)
            copier = StagingCopy(staging, copies)
            copier.start()
            copier.finish()
        else:
            snapshot = staging.stage(state)
        _assert_same_tensors(snapshot, state)
        views = snapshot["views"]
        assert len({_storage(v) for v in views}) == 1
        assert _storage(snapshot["big"]) == _storage(snapshot["big_t"])
        assert snapshot["big"].data_ptr() % ALIGN == 0
        path = tmp_path / "staged.pt"
        rec = write_torch_file(snapshot, path)
        assert file_crc32(path) == (rec.size, rec.crc32)
        loaded = torch.load(path, weights_only=True)
        _assert_same_tensors(loaded, state)
        assert len({_storage(v) for v in loaded["views"]}) == 1
        reference = tmp_path / "reference.pt"
        torch.save(state, reference)
        assert rec.size <= reference.stat().st_size + 64 * 1024

    def test_only_the_covered_part_of_a_storage_is_staged(self):
        whole = torch.randn(4 * MiB)
        staging = StagingBuffers(pin_memory=False)
        snapshot = staging.stage({"head": whole[:10], "strided": whole[100:200:10]})
        assert staging.bytes_allocated == ALIGN  # 200 floats, not 16 MiB
        assert torch.equal(snapshot["head"], whole[:10])
        assert torch.equal(snapshot["strided"], whole[100:200:10])
        assert snapshot["strided"].stride() == (10,)

    def test_buffers_are_reused_until_the_sharing_changes(self):
        staging = StagingBuffers(pin_memory=False)
        base = torch.randn(8, 8)
        first = staging.stage({"a": base, "b": base.t()})
        base2 = torch.randn(8, 8)
        second = staging.stage({"a": base2, "b": base2.t()})
        assert staging.allocations == 1 and second["a"].data_ptr() == first["a"].data_ptr()
        assert torch.equal(second["b"], base2.t())
        third = staging.stage({"a": torch.randn(8, 8), "b": torch.randn(8, 8).t()})
        assert staging.allocations == 2
        assert _storage(third["a"]) != _storage(third["b"])

    def test_prepare_from_meta_tensors_knows_tied_weights(self):
        def model(device: str) -> dict:
            with torch.device(device):
                m = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
            m[1].weight = m[0].weight
            return m.state_dict()

        staging = StagingBuffers(pin_memory=False)
        assert staging.prepare(model("meta")) is True
        snapshot = staging.stage(model("cpu"))
        assert staging.allocations == 1  # the prepared layout was the real one
        assert _storage(snapshot["0.weight"]) == _storage(snapshot["1.weight"])

    def test_a_change_through_another_view_fails_the_overlapped_save(self):
        from obsckpt.errors import TensorMutatedError

        base = torch.randn(64, 64)
        staging = StagingBuffers(pin_memory=False)
        snapshot, copies = staging.plan({"rows": base[:32], "cols": base[:, :32]})
        copier = StagingCopy(staging, copies)
        base[40].add_(1)  # before the copy runs: the state is no longer the call's
        copier.start(lambda run: run())
        with pytest.raises(TensorMutatedError):
            copier.finish()


@pytest.fixture
def cpu_mesh():
    """A one-rank CPU mesh (this process alone in a gloo group), for DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", torch.arange(1), _init_backend=False)
    finally:
        dist.destroy_process_group()


def _sharded(local: torch.Tensor, mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    placement = Shard(0) if local.dim() else Replicate()
    spec = DTensorSpec(mesh, (placement,), TensorMeta(local.shape, local.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


class TestDTensorsOverSharedStorages:
    """FSDP2's optimizer state once loaded: DTensors whose local tensors are views at
    non-zero offsets into one packed storage. A DTensor takes its local tensor's
    offset, which torch alone cannot save."""

    def _loaded_state(self, mesh) -> dict:
        pack = torch.randn(4 + 3 * 32)
        moments = [pack[4 + 32 * i : 4 + 32 * (i + 1)] for i in range(3)]
        steps = [pack[i] for i in range(1, 4)]
        return {
            "state": {
                i: {"step": _sharded(steps[i], mesh), "exp_avg": _sharded(moments[i], mesh)}
                for i in range(3)
            }
        }

    @pytest.mark.parametrize("staged", [False, True])
    def test_saved_again_and_loaded_back(self, tmp_path, cpu_mesh, staged):
        state = self._loaded_state(cpu_mesh)
        assert state["state"][2]["exp_avg"].storage_offset() == 68
        snapshot = StagingBuffers(pin_memory=False).stage(state) if staged else state
        path = tmp_path / "optim.pt"
        write_torch_file(snapshot, path)
        loaded = torch.load(path, weights_only=True)
        for i, entry in state["state"].items():
            for key, value in entry.items():
                got = loaded["state"][i][key]
                assert type(got) is type(value) and got.placements == value.placements
                assert torch.equal(got.to_local(), value.to_local()), (i, key)
        write_torch_file(loaded, tmp_path / "again.pt")  # the save after the resume


class TestMemoryLetGo:
    def test_a_written_snapshot_frees_its_staging_without_the_collector(self, tmp_path):
        """Nothing the writer made (its picklers are classes, reference cycles) keeps
        the snapshot's storages, so releasing the staging unmaps its arena at once."""
        import gc

        staging = StagingBuffers(pin_memory=False)
        snapshot = staging.stage({"big": torch.ones(2 * MiB), "small": torch.ones(3)})
        address = staging.arena.address
        gc.disable()
        try:
            write_torch_file(snapshot, tmp_path / "a.pt")
            del snapshot
            staging.release()
            assert not _mapped(address), "the staging arena is still mapped"
        finally:
            gc.enable()


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


class TestRngStates:
    """RNG and generator states come back usable by torch's setters, which read a state's
    storage from its start: uint8 tensors are never packed."""

    def test_states_restore_the_same_draws(self, tmp_path):
        gen = torch.Generator().manual_seed(7)
        torch.manual_seed(3)
        state = {
            "pad": torch.zeros(40, dtype=torch.uint8),  # would sit first in a uint8 pack
            "cpu": torch.get_rng_state(),
            "gen": gen.get_state(),
            "step": torch.tensor(4.0),
        }
        want_cpu, want_gen = torch.rand(3), torch.rand(3, generator=gen)
        path = tmp_path / "rng.pt"
        write_torch_file(state, path)
        loaded = torch.load(path, weights_only=True)
        torch.set_rng_state(loaded["cpu"])
        other = torch.Generator()
        other.set_state(loaded["gen"])
        assert torch.equal(torch.rand(3), want_cpu)
        assert torch.equal(torch.rand(3, generator=other), want_gen)
        for name in ("pad", "cpu", "gen"):
            assert loaded[name].storage_offset() == 0
            assert loaded[name].untyped_storage().nbytes() == state[name].untyped_storage().nbytes()
