"""Staging arenas, prepare() and overlapped saves."""

from __future__ import annotations

import collections
import gc
import logging
import threading
import weakref

import numpy as np
import pytest
import ray
import torch
import torch.distributed as dist
from metrics_helpers import scrape, value

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.errors import SaveError, TensorMutatedError
from obsckpt.staging import Arena, StagingBuffers, StagingCopy
from obsckpt.store.torchfile import write_torch_file

MiB = 1 << 20
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: pinned (cudaHostRegister) arenas and side-stream copies",
)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.rand(MiB // 4 + 3, generator=g),  # just over 1 MiB: page-aligned
        "bf16": torch.rand(3, MiB, generator=g).to(torch.bfloat16),
        "small": torch.rand(10, generator=g),
        "int": torch.arange(7),
        "nested": {"flags": torch.zeros(2 * MiB, dtype=torch.bool), "step": 3},
    }


def _tensors(sd: dict) -> list[torch.Tensor]:
    return [sd["big"], sd["bf16"], sd["small"], sd["int"], sd["nested"]["flags"]]


class TestArena:
    """A slot's buffers are views of one mapping, aligned, reused, resized and released."""

    def test_views_alias_one_mapping_with_storages_of_their_own(self):
        staging = StagingBuffers(pin_memory=False)
        snap = staging.stage(_state())
        arena = staging.arena
        views = _tensors(snap)
        for v in views:
            assert arena.address <= v.data_ptr() < arena.address + arena.nbytes
            assert v.untyped_storage().nbytes() == v.numel() * v.element_size()
        ends = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
        assert all(
            a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:], strict=False)
        )
        # One mapping, the size of the state up to alignment.
        state_bytes = sum(t.numel() * t.element_size() for t in _tensors(_state()))
        assert staging.bytes_allocated == arena.nbytes
        assert state_bytes <= arena.nbytes <= state_bytes * 1.02

    def test_alignment(self):
        staging = StagingBuffers(pin_memory=False)
        snap = staging.stage(_state())
        for key in ("big", "bf16"):
            assert snap[key].data_ptr() % 4096 == 0, key
        assert snap["nested"]["flags"].data_ptr() % 4096 == 0
        assert snap["small"].data_ptr() % 64 == 0 and snap["int"].data_ptr() % 64 == 0
        assert staging.arena.nbytes % 4096 == 0

    def test_reused_while_shapes_match_and_resized_when_they_change(self):
        staging = StagingBuffers(pin_memory=False)
        first = staging.stage(_state(0))
        arena = staging.arena
        second = staging.stage(_state(1))
        assert staging.arena is arena and staging.allocations == 1
        assert second["big"].data_ptr() == first["big"].data_ptr()
        assert torch.equal(second["big"], _state(1)["big"])
        bigger = _state(1)
        bigger["big"] = torch.rand(2 * MiB)
        third = staging.stage(bigger)
        assert staging.allocations == 2 and staging.arena is not arena
        assert arena.released
        assert staging.bytes_allocated >= 8 * MiB and torch.equal(third["big"], bigger["big"])
        dtype_change = dict(bigger, small=bigger["small"].double())
        staging.stage(dtype_change)
        assert staging.allocations == 3

    def test_release_unmaps_once_no_view_is_held(self):
        staging = StagingBuffers(pin_memory=False)
        snap = staging.stage(_state())
        mapping = weakref.ref(staging.arena.mapping())
        arena = staging.arena
        staging.release()
        assert staging.bytes_allocated == 0 and arena.released
        with pytest.raises(RuntimeError, match="released"):
            arena.view(0, (4,), torch.float32)
        # A view still held keeps its memory valid ...
        assert mapping() is not None and torch.equal(snap["big"], _state()["big"])
        del snap
        gc.collect()
        # ... and the mapping goes with the last one.
        assert mapping() is None

    def test_written_file_holds_each_tensor_once(self, tmp_path):
        sd = _state()
        snap = StagingBuffers(pin_memory=False).stage(sd)
        rec = write_torch_file(snap, tmp_path / "m.pt")
        state_bytes = sum(t.numel() * t.element_size() for t in _tensors(sd))
        assert rec.size < state_bytes + 64 * 1024
        loaded = torch.load(tmp_path / "m.pt", weights_only=True)
        for a, b in zip(_tensors(loaded), _tensors(sd), strict=True):
            assert torch.equal(a, b)
        assert loaded["nested"]["step"] == 3

    def test_view_outside_the_mapping_is_refused(self):
        arena = Arena(4096)
        with pytest.raises(ValueError, match="does not fit"):
            arena.view(4000, (100,), torch.uint8)
        with pytest.raises(ValueError, match="size"):
            Arena(-1)


class TestPrepare:
    """prepare() allocates a slot's staging, so the first save allocates nothing."""

    def test_prepare_sizes_the_staging_from_shapes_alone(self):
        staging = StagingBuffers(pin_memory=False)
        meta = {
            k: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for k, t in _state().items()
            if isinstance(t, torch.Tensor)
        }
        meta["nested"] = {"flags": torch.empty(2 * MiB, dtype=torch.bool, device="meta")}
        assert staging.prepare(meta) is True
        assert staging.prepare(meta) is False
        staging.stage(_state())
        assert staging.allocations == 1


class TestStagingCopy:
    """An overlapped copy fails rather than staging a tensor changed before its copy."""

    def test_copy_thread_stages_the_values_of_the_call(self):
        sd = _state()
        expected = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
        staging = StagingBuffers(pin_memory=False)
        snap, copies = staging.plan(sd)
        copier = StagingCopy(staging, copies)
        assert not copier.done.is_set()
        t = threading.Thread(target=copier.run)
        t.start()
        assert copier.wait(30)
        t.join()
        copier.finish()
        for k, v in expected.items():
            assert torch.equal(snap[k], v), k

    def test_mutation_before_the_copy_is_caught(self):
        sd = _state()
        staging = StagingBuffers(pin_memory=False)
        _, copies = staging.plan(sd)
        copier = StagingCopy(staging, copies)
        sd["nested"]["flags"].fill_(True)  # in place, before the copy thread ran
        copier.run()
        with pytest.raises(TensorMutatedError, match=r"'nested\.flags'.*wait_staged"):
            copier.wait(1)
        with pytest.raises(TensorMutatedError):
            copier.finish()

    def test_mutation_after_the_copy_is_allowed(self):
        sd = _state()
        staging = StagingBuffers(pin_memory=False)
        snap, copies = staging.plan(sd)
        copier = StagingCopy(staging, copies)
        copier.run()
        copier.wait(1)
        before = sd["big"].clone()
        sd["big"].add_(1)
        copier.finish()
        assert torch.equal(snap["big"], before)


class _Config(dict):
    """A dict subclass whose constructor takes something else than items."""

    def __init__(self, name: str, **items) -> None:
        super().__init__(**items)
        self.name = name


class TestStructure:
    """A snapshot has the containers, types and values of the state it copies."""

    @pytest.mark.parametrize("overlap", [False, True])
    def test_tied_weights_are_written_once_and_load_back_tied(self, tmp_path, overlap):
        model = torch.nn.Sequential(torch.nn.Embedding(4096, 64), torch.nn.Linear(64, 4096))
        model[1].weight = model[0].weight  # tied input and output embeddings
        sd = model.state_dict()
        assert sd["0.weight"].data_ptr() == sd["1.weight"].data_ptr()
        staging = StagingBuffers(pin_memory=False)
        if overlap:
            snapshot, copies = staging.plan(sd)
            copier = StagingCopy(staging, copies)
            copier.start()
            copier.finish()
        else:
            snapshot = staging.stage(sd)
        path = tmp_path / "model.pt"
        write_torch_file(snapshot, str(path))
        reference = tmp_path / "reference.pt"
        torch.save(sd, reference)
        loaded = torch.load(path, weights_only=True)
        assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()
        assert torch.equal(loaded["1.weight"], sd["1.weight"])
        assert path.stat().st_size <= reference.stat().st_size + 64 * 1024

    def test_dict_subclasses_keep_their_type_and_state(self, tmp_path):
        state = collections.defaultdict(dict)
        state[0]["exp_avg"] = torch.randn(5)
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).state_dict()
        sd = {"state": state, "cfg": _Config("adam", lr=torch.tensor(0.1)), "model": model}
        snap = StagingBuffers(pin_memory=False).stage(sd)
        # The module versions load_state_dict() hands each module's loader.
        assert snap["model"]._metadata == model._metadata
        assert type(snap["state"]) is collections.defaultdict
        assert snap["state"].default_factory is dict
        assert torch.equal(snap["state"][0]["exp_avg"], state[0]["exp_avg"])
        assert type(snap["cfg"]) is _Config and snap["cfg"].name == "adam"
        assert torch.equal(snap["cfg"]["lr"], torch.tensor(0.1))
        write_torch_file(snap, tmp_path / "m.pt")
        loaded = torch.load(tmp_path / "m.pt", weights_only=False)
        assert torch.equal(loaded["state"][0]["exp_avg"], state[0]["exp_avg"])
        assert loaded["model"]._metadata == model._metadata

    @pytest.mark.filterwarnings("ignore::UserWarning")
    def test_quantized_tensors_keep_their_quantization(self, tmp_path):
        staging = StagingBuffers(pin_memory=False)
        for scale in (0.1, 0.5):  # the second save reuses the staging with other parameters
            sd = {
                "per_tensor": torch.quantize_per_tensor(torch.randn(64), scale, 3, torch.quint8),
                "per_channel": torch.quantize_per_channel(
                    torch.randn(3, 8),
                    torch.tensor([scale, 0.2, 0.3]),
                    torch.tensor([0, 1, 2]),
                    0,
                    torch.qint8,
                ),
                "plain": torch.randn(4),
            }
            write_torch_file(staging.stage(sd), tmp_path / "q.pt")
            loaded = torch.load(tmp_path / "q.pt", weights_only=False)
            for key in ("per_tensor", "per_channel"):
                assert torch.equal(loaded[key].dequantize(), sd[key].dequantize()), key
            assert loaded["per_tensor"].q_scale() == scale
            assert torch.equal(
                loaded["per_channel"].q_per_channel_scales(),
                sd["per_channel"].q_per_channel_scales(),
            )
            assert torch.equal(loaded["plain"], sd["plain"])

    def test_dtensor_with_local_shards_on_another_device_than_its_mesh(self):
        """FSDP2 with CPU offload: CPU shards of a CUDA mesh stay in the staging buffers."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            # No CUDA needed: a mesh that is never used to communicate.
            mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
            local = torch.randn(6, 4)
            meta = TensorMeta(local.shape, local.stride(), local.dtype)
            weight = DTensor(
                local, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False
            )
            staging = StagingBuffers(pin_memory=False)
            snap, copies = staging.plan({"w": weight})
            staged = snap["w"].to_local()
            assert staged.device.type == "cpu"
            assert staged.data_ptr() == copies[0][2].data_ptr()  # the buffer the copy fills
            for _, src, buf in copies:
                buf.copy_(src)
            assert torch.equal(staged, local)
            assert snap["w"].device_mesh is mesh and snap["w"].placements == (Shard(0),)
            assert snap["w"].shape == weight.shape
        finally:
            dist.destroy_process_group()


class TestReuse:
    """A slot's buffers are not handed out again while an earlier copy into them may run,
    and a finished copy holds nothing of the state it copied."""

    def test_staging_waits_for_an_unfinished_copy_into_the_same_buffers(self):
        staging = StagingBuffers(pin_memory=False)
        old = {"w": torch.full((1 << 20,), 1.0)}
        _, copies = staging.plan(old)
        copier = StagingCopy(staging, copies)
        go = threading.Event()

        def late_copy(run):  # a copy thread that runs late (its save was abandoned)
            threading.Thread(target=lambda: (go.wait(30), run()), daemon=True).start()

        copier.start(late_copy)
        new = {"w": torch.full((1 << 20,), 2.0)}
        staged = {}
        stager = threading.Thread(target=lambda: staged.update(staging.stage(new)))
        stager.start()
        stager.join(1.0)
        go.set()
        stager.join(30)
        copier.settle()
        assert torch.equal(staged["w"], new["w"])

    def test_a_copy_never_started_does_not_hold_up_the_next_one(self):
        staging = StagingBuffers(pin_memory=False)
        _, copies = staging.plan({"w": torch.ones(8)})
        StagingCopy(staging, copies)  # e.g. its thread could not be started
        staged = {}
        stager = threading.Thread(
            target=lambda: staged.update(staging.stage({"w": torch.zeros(8)})), daemon=True
        )
        stager.start()
        stager.join(30)
        assert torch.equal(staged["w"], torch.zeros(8))

    def test_finished_copy_holds_no_source(self):
        array = np.ones(1 << 16, dtype=np.float32)
        gone = weakref.ref(array)
        sd = {"w": torch.from_numpy(array)}
        staging = StagingBuffers(pin_memory=False)
        snap, copies = staging.plan(sd)
        copier = StagingCopy(staging, copies)
        del array, sd, copies
        copier.run()
        copier.finish()
        gc.collect()
        assert gone() is None
        assert copier.wait(1)  # still answers once its sources are let go
        assert torch.equal(snap["w"], torch.ones(1 << 16))


@pytest.fixture
def coordinator(namespace, tmp_path):
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(tmp_path), metrics_port=0
    )
    ray.get(monitor.status.remote())
    coord = CheckpointCoordinator(monitor, rank=0)
    yield coord, monitor
    coord.close(timeout=60)
    ray.kill(monitor)


def _staging_samples(monitor) -> dict:
    """The staging samples on the monitor's /metrics, once the coordinator's reports arrived."""
    ray.get(monitor.status.remote())  # runs after the reports this process sent before it
    found = scrape(monitor)

    def get(name: str, **labels: str) -> float | None:
        return value(found, name, **labels)

    return get


def _path(root, step: int):
    return root / f"global_step_{step}" / "actor" / "model.pt"


class TestCoordinatorStaging:
    """Through the public API: prepare, cold saves, overlapped saves, close."""

    def test_prepared_first_save_allocates_nothing(self, coordinator, tmp_path, caplog):
        coord, monitor = coordinator
        sd = _state()
        future = coord.prepare("model", sd, background=True)
        assert future.result(timeout=60) == coord.staging_bytes("model")[0] > 0
        with caplog.at_level(logging.INFO, logger="obsckpt.coordinator"):
            handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 1), 1)
            coord.wait_all(timeout=60)
        assert handle.staged
        assert "allocated its staging" not in caplog.text
        get = _staging_samples(monitor)
        assert get("obsckpt_staging_cold_saves_total", slot="model") in (None, 0.0)
        held = coord.staging_bytes()[0]
        assert get("obsckpt_staging_bytes", rank="0", slot="model") == held
        assert get("obsckpt_staging_pinned_bytes", rank="0", slot="model") == 0
        coord.close()
        assert _staging_samples(monitor)("obsckpt_staging_bytes", rank="0", slot="model") == 0
        assert coord.staging_bytes() == (0, 0)

    def test_cold_save_is_logged_and_counted(self, coordinator, tmp_path, caplog):
        coord, monitor = coordinator
        with caplog.at_level(logging.INFO, logger="obsckpt.coordinator"):
            coord.save_state_dict_async("model", _state(), _path(tmp_path, 1), 1)
            coord.save_state_dict_async("model", _state(1), _path(tmp_path, 2), 2)
            coord.wait_all(timeout=60)
        assert caplog.text.count("allocated its staging") == 1
        get = _staging_samples(monitor)
        assert get("obsckpt_staging_cold_saves_total", slot="model") == 1
        assert get("obsckpt_staging_bytes", rank="0", slot="model") == coord.staging_bytes()[0]

    def test_slot_names_that_change_every_step_keep_one_arena(self, coordinator, tmp_path, caplog):
        """A slot named after its step (``model_<N>``) would keep one arena, the size of
        the state, per step until close(): host memory growing without bound. A new slot
        takes over the arena of an idle slot of the same shapes saved at an earlier step."""
        coord, monitor = coordinator
        sd = _state()
        per_arena = None
        with caplog.at_level(logging.INFO, logger="obsckpt.coordinator"):
            for step in range(1, 6):
                coord.save_state_dict_async(f"model_{step}", sd, _path(tmp_path, step), step)
                coord.wait_all(timeout=60)
                held = coord.staging_bytes()[0]
                per_arena = per_arena or held
                assert held == per_arena, (
                    f"step {step}: {held} bytes held, one arena is {per_arena}"
                )
        assert caplog.text.count("allocated its staging") == 1
        assert caplog.text.count("takes over the staging of slot") == 1  # logged once
        for step in range(1, 6):
            assert torch.equal(torch.load(_path(tmp_path, step))["big"], sd["big"])
        get = _staging_samples(monitor)
        assert get("obsckpt_staging_bytes", rank="0", slot="model_4") == 0
        assert get("obsckpt_staging_bytes", rank="0", slot="model_5") == per_arena

    def test_slots_saved_in_one_step_keep_their_own_arenas(self, coordinator, tmp_path):
        coord, _ = coordinator
        sd = _state()
        for step in (1, 2):
            coord.save_state_dict_async("model", sd, _path(tmp_path, step), step)
            coord.wait_all(timeout=60)
            coord.save_state_dict_async("ema", sd, _path(tmp_path, step).with_name("ema.pt"), step)
            coord.wait_all(timeout=60)
        one = coord.staging_bytes("model")[0]
        assert one > 0 and coord.staging_bytes("ema")[0] == one
        assert coord.staging_bytes()[0] == 2 * one

    def test_overlapped_save_writes_the_values_of_the_call(self, coordinator, tmp_path):
        coord, _ = coordinator
        sd = _state()
        expected = _state()
        handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 1), 1, overlap=True)
        handle.wait_staged(timeout=60)
        assert handle.staged
        for t in _tensors(sd):
            t.zero_()  # the optimizer step, after wait_staged
        coord.wait_all(timeout=60)
        loaded = torch.load(_path(tmp_path, 1), weights_only=True)
        for a, b in zip(_tensors(loaded), _tensors(expected), strict=True):
            assert torch.equal(a, b)

    def test_finished_overlapped_save_keeps_no_reference_to_the_state(self, coordinator, tmp_path):
        """A fresh state dict (e.g. a full one offloaded to the CPU) is freed once saved."""
        coord, _ = coordinator
        arrays = [np.full(1 << 16, i, dtype=np.float32) for i in range(3)]
        gone = [weakref.ref(a) for a in arrays]
        sd = {f"w{i}": torch.from_numpy(a) for i, a in enumerate(arrays)}
        del arrays
        handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 1), 1, overlap=True)
        handle.wait_staged(timeout=60)
        coord.wait_all(timeout=60)
        del sd
        gc.collect()
        assert all(ref() is None for ref in gone)  # while the handle is still held
        loaded = torch.load(_path(tmp_path, 1), weights_only=True)
        assert torch.equal(loaded["w2"], torch.full((1 << 16,), 2.0))

    def test_a_save_refused_at_admission_lets_go_of_its_state(self, coordinator, tmp_path):
        """The monitor is gone, so the save never writes: its copy still ends, and the
        caller's tensors are not kept alive by the slot until its next save."""
        coord, monitor = coordinator
        # Known before the monitor goes, as in a job that saved before: the path check
        # passes, and it is the admission that refuses the save.
        coord.link.checkpoint_root()
        ray.kill(monitor, no_restart=True)
        arrays = [np.full(1 << 16, i, dtype=np.float32) for i in range(3)]
        gone = [weakref.ref(a) for a in arrays]
        sd = {f"w{i}": torch.from_numpy(a) for i, a in enumerate(arrays)}
        del arrays
        handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 1), 1, overlap=True)
        with pytest.raises(SaveError, match="failed"):
            coord.wait_all(timeout=60)
        assert handle.staged
        del sd
        gc.collect()
        assert all(ref() is None for ref in gone)
        assert not _path(tmp_path, 1).exists()

    def test_a_snapshot_that_fails_fails_its_registered_step_at_once(
        self, coordinator, tmp_path, monkeypatch
    ):
        coord, monitor = coordinator
        ray.get(monitor.register_thread_count.remote(1, state_dict_thread_count=1))
        ray.get(monitor.monitor_step.remote(1, is_state_dict=True))

        def out_of_memory(self, obj):
            raise MemoryError("cannot allocate the staging arena (injected)")

        monkeypatch.setattr(StagingBuffers, "stage", out_of_memory)
        with pytest.raises(MemoryError, match="injected"):
            coord.save_state_dict_async("model", _state(), _path(tmp_path, 1), 1, True)
        failed = ray.get(monitor.status.remote())["failed"]
        assert [(f["step"], f["kind"]) for f in failed] == [(1, "state_dict")]
        assert "MemoryError" in failed[0]["error"]
        coord.wait_all(timeout=60)  # raised to the caller already, not again

    def test_tensor_changed_before_staging_finished_fails_the_save(
        self, coordinator, tmp_path, monkeypatch
    ):
        coord, _ = coordinator
        go = threading.Event()
        run = StagingCopy.run

        def slow_copy(self):  # the copy thread starts late: the caller got there first
            go.wait(30)
            run(self)

        monkeypatch.setattr(StagingCopy, "run", slow_copy)
        sd = _state()
        handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 1), 1, overlap=True)
        sd["big"].mul_(2)  # the optimizer step, without wait_staged
        go.set()
        with pytest.raises(TensorMutatedError, match="'big'"):
            handle.wait_staged(timeout=60)
        with pytest.raises(SaveError, match="TensorMutatedError"):
            coord.wait_all(timeout=60)
        assert not _path(tmp_path, 1).exists()


class TestSharedSnapshot:
    """StagedSave.hold: the save's own snapshot, lent to a publish (one copy for both)."""

    @pytest.mark.parametrize("overlap", [False, True])
    def test_the_publish_reads_the_snapshot_the_save_writes(self, coordinator, tmp_path, overlap):
        coord, _ = coordinator
        sd = _state()
        expected = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
        handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 1), 1, overlap=overlap)
        with handle.hold(timeout=60) as snap:
            sd["big"].mul_(0)  # the trainer moves on: the snapshot keeps the step's values
            for name, want in expected.items():
                assert torch.equal(snap[name], want)
                assert snap[name].data_ptr() != sd[name].data_ptr()
            staged = {snap[k].data_ptr() for k in expected}
        coord.wait_all(timeout=60)
        assert torch.equal(torch.load(_path(tmp_path, 1))["big"], expected["big"])
        # The snapshot is the slot's staging arena itself: no second copy was made.
        arena = coord._staging["model"]
        lo = arena.arena.address
        hi = lo + arena.arena.nbytes
        assert all(lo <= p < hi for p in staged)

    def test_the_next_save_waits_for_the_publish_holding_the_snapshot(self, coordinator, tmp_path):
        coord, _ = coordinator
        first = _state(1)
        handle = coord.save_state_dict_async("model", first, _path(tmp_path, 1), 1)
        coord.wait_all(timeout=60)
        seen: dict = {}
        release = threading.Event()
        holding = threading.Event()

        def publish() -> None:
            with handle.hold(timeout=60) as snap:
                holding.set()
                release.wait(30)
                seen["big"] = snap["big"].clone()  # read after the next save was called

        t = threading.Thread(target=publish)
        t.start()
        assert holding.wait(30)
        second = threading.Thread(
            target=lambda: coord.save_state_dict_async("model", _state(2), _path(tmp_path, 2), 2)
        )
        second.start()
        second.join(0.5)
        assert second.is_alive()  # waiting to stage over the held snapshot
        release.set()
        t.join(30)
        second.join(30)
        assert not second.is_alive()
        coord.wait_all(timeout=60)
        assert torch.equal(seen["big"], first["big"])
        assert torch.equal(torch.load(_path(tmp_path, 2))["big"], _state(2)["big"])
        # A snapshot staged over is refused by name, never lent.
        with pytest.raises(ValueError, match="slot 'model' step 1 was already overwritten"):
            with handle.hold():
                pass

    def test_publish_staged_hands_the_snapshot_to_the_synchronizer(
        self, coordinator, tmp_path, namespace
    ):
        from obsckpt import Synchronizer
        from obsckpt.sync.publish import publish_staged, publish_staged_async

        coord, _ = coordinator
        sync = Synchronizer.get_actor(namespace=f"{namespace}-sync")
        try:
            sd = _state()
            handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 1), 1)
            sd["big"].add_(1)  # the trainer's next step: the publish still sends step 1
            assert publish_staged(sync, handle, 1)
            got, version = ray.get(sync.get_model_state_dict.remote())
            assert version == 1
            assert torch.equal(got["big"], _state()["big"]) and got["nested"]["step"] == 3
            assert torch.equal(got["bf16"], _state()["bf16"])
            handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 2), 2)
            assert publish_staged_async(sync, handle, 2).result(timeout=60)
            got, version = ray.get(sync.get_model_state_dict.remote())
            assert version == 2 and torch.equal(got["big"], sd["big"])
            coord.wait_all(timeout=60)
            assert torch.equal(torch.load(_path(tmp_path, 2))["big"], sd["big"])
        finally:
            ray.kill(sync)

    def test_the_colocated_sync_sends_the_held_snapshot(self, coordinator, tmp_path):
        """ipc on the CPU (shared-memory buckets): the sync reads the lent snapshot, so the
        rollout gets the step's values while the trainer's tensors have moved on."""
        import pickle

        from obsckpt.sync.ipc import IpcWeightReceiver, IpcWeightSender

        coord, _ = coordinator
        sd = {"w": torch.randn(64, 32), "b": torch.randn(1000).to(torch.bfloat16)}
        want = {k: v.clone() for k, v in sd.items()}
        handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 1), 1)
        for t in sd.values():
            t.zero_()  # the trainer's next step
        (tmp_path / "shm").mkdir()
        sender = IpcWeightSender(device="cpu", bucket_bytes=4 << 10, shm_dir=str(tmp_path / "shm"))
        receiver = IpcWeightReceiver(device="cpu")
        got = {}

        def deliver(payload):
            ack, tensors = receiver.recv(pickle.loads(pickle.dumps(payload)), clone=True)
            got.update(tensors)
            return ack

        try:
            with handle.hold(timeout=60) as snapshot:
                sender.send(snapshot, deliver, step=1)
        finally:
            sender.close()
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
        coord.wait_all(timeout=60)
        assert torch.equal(torch.load(_path(tmp_path, 1))["w"], want["w"])

    def test_a_held_slot_is_neither_released_nor_taken_over(self, coordinator, tmp_path):
        coord, _ = coordinator
        handle = coord.save_state_dict_async("model_1", _state(), _path(tmp_path, 1), 1)
        coord.wait_all(timeout=60)
        with handle.hold(timeout=60) as snap:
            coord.save_state_dict_async("model_2", _state(3), _path(tmp_path, 2), 2)
            coord.wait_all(timeout=60)
            assert torch.equal(snap["big"], _state()["big"])  # not taken over by model_2
            assert coord.staging_bytes("model_1")[0] > 0


@pytest.mark.gpu
@needs_cuda
class TestCuda:
    """Pinned arenas and side-stream copies (run where CUDA is present)."""

    def test_arena_is_registered_pinned_memory_of_the_state_size(self):
        sd = {f"w{i}": torch.randn(1000 + i, 1024, device="cuda") for i in range(8)}
        staging = StagingBuffers(pin_memory=True)
        snap = staging.stage(sd)
        state_bytes = sum(t.numel() * t.element_size() for t in sd.values())
        assert staging.pinned_bytes == staging.bytes_allocated <= state_bytes * 1.02
        assert all(v.is_pinned() for v in snap.values())
        for k in sd:
            assert torch.equal(snap[k], sd[k].cpu())
        staging.release()
        assert staging.pinned_bytes == 0

    def test_side_stream_copy_and_mutation_check(self):
        sd = {f"w{i}": torch.randn(1024, 1024, device="cuda") for i in range(4)}
        expected = {k: v.cpu() for k, v in sd.items()}
        staging = StagingBuffers(pin_memory=True)
        snap, copies = staging.plan(sd)
        copier = StagingCopy(staging, copies)
        assert not copier.done.is_set()  # nothing queued on the caller's thread
        copier.start()
        assert copier.wait(30)  # the caller's stream now waits for the copies
        for t in sd.values():
            t.zero_()
        copier.finish()
        for k in sd:
            assert torch.equal(snap[k], expected[k])
        snap, copies = staging.plan(sd)
        copier = StagingCopy(staging, copies)
        copier.start()
        sd["w0"].add_(1)  # queued without waiting for the copies
        with pytest.raises(TensorMutatedError, match="'w0'"):
            copier.wait(30)
        with pytest.raises(TensorMutatedError):
            copier.finish()

    def test_overlapped_copy_sees_the_work_queued_before_it(self):
        """The copies run after the caller's queued work, though the thread queues them later."""
        a = torch.randn(4096, 4096, device="cuda")
        sd = {"w": torch.zeros(4096, 4096, device="cuda")}
        staging = StagingBuffers(pin_memory=True)
        staging.prepare(sd)
        scratch = torch.empty_like(a)
        torch.cuda.synchronize()
        for _ in range(20):  # keeps the caller's stream busy well past the hand-off
            torch.mm(a, a, out=scratch)
        sd["w"].add_(1)
        snap, copies = staging.plan(sd)
        copier = StagingCopy(staging, copies)
        copier.start()
        assert copier.wait(30)
        copier.finish()
        assert torch.equal(snap["w"], torch.ones(4096, 4096))
        staging.release()

    @pytest.mark.parametrize("overlap", [False, True])
    def test_tied_cuda_weights_are_written_once_and_load_back_tied(self, tmp_path, overlap):
        model = torch.nn.Sequential(torch.nn.Embedding(4096, 64), torch.nn.Linear(64, 4096))
        model[1].weight = model[0].weight
        sd = model.cuda().state_dict()
        expected = sd["0.weight"].cpu()
        staging = StagingBuffers(pin_memory=True)
        if overlap:
            snap, copies = staging.plan(sd)
            assert len(copies) == len(sd) - 1  # the tied weight is copied once
            copier = StagingCopy(staging, copies)
            copier.start()
            copier.finish()
        else:
            snap = staging.stage(sd)
        write_torch_file(snap, str(tmp_path / "model.pt"))
        loaded = torch.load(tmp_path / "model.pt", weights_only=True)
        assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()
        assert torch.equal(loaded["1.weight"], expected)
        staging.release()

    def test_dtensor_on_a_cuda_mesh_is_staged_in_host_memory(self):
        """FSDP2 on GPU: the snapshot's local tensors are the host buffers the copies fill,
        not a GPU copy of them made before they were filled."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
            local = torch.randn(1024, 256, device="cuda")
            meta = TensorMeta(local.shape, local.stride(), local.dtype)
            weight = DTensor(
                local, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False
            )
            expected = local.cpu()
            staging = StagingBuffers(pin_memory=True)
            snap = staging.stage({"w": weight})
            local.zero_()  # the optimizer step, after the snapshot
            staged = snap["w"].to_local()
            assert staged.device.type == "cpu"
            assert torch.equal(staged, expected)
            staging.release()
        finally:
            dist.destroy_process_group()

    def test_overlapped_save_of_a_cuda_state(self, coordinator, tmp_path):
        coord, monitor = coordinator
        sd = {f"w{i}": torch.randn(512, 1024, device="cuda") for i in range(4)}
        expected = {k: v.cpu() for k, v in sd.items()}
        coord.prepare("model", sd)
        handle = coord.save_state_dict_async("model", sd, _path(tmp_path, 1), 1, overlap=True)
        handle.wait_staged(timeout=60)
        for t in sd.values():
            t.zero_()  # queued after the side stream's copies
        coord.wait_all(timeout=60)
        loaded = torch.load(_path(tmp_path, 1), weights_only=True)
        for k in sd:
            assert torch.equal(loaded[k], expected[k]), k
        pinned = _staging_samples(monitor)("obsckpt_staging_pinned_bytes", rank="0", slot="model")
        assert pinned == coord.staging_bytes("model")[1] > 0
