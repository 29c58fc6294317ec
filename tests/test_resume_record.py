"""The resume record: RNGs, data position, weight version and user state, committed with the step."""

from __future__ import annotations

import asyncio
import random
import time
import warnings

import numpy as np
import pytest
import ray
import torch

from obsckpt import (
    CheckpointCoordinator,
    CheckpointMonitor,
    ResumeRecordError,
    SaveError,
    UnverifiedCheckpointError,
)
from obsckpt.resume import (
    ResumeRecord,
    capture_rng,
    load_resume_record,
    record_path,
    restore_resume_record,
    restore_rng,
    save_resume_record,
)
from obsckpt.store import layout, reader
from obsckpt.store.loading import safe_torch_load


def draws() -> tuple:
    """One draw from each generator the record restores."""
    return (
        torch.rand(4).tolist(),
        np.random.rand(3).tolist(),
        np.random.standard_normal(),  # leaves a cached Gaussian behind in NumPy's state
        random.random(),
        random.gauss(0, 1),
    )


def loader(seed: int = 7):
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return StatefulDataLoader(
            list(range(10)),
            batch_size=3,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )


def batches(dl, n: int, it=None) -> tuple[list[list[int]], object]:
    """``n`` batches from ``dl``, starting a new epoch whenever one ends."""
    out = []
    it = it if it is not None else iter(dl)
    while len(out) < n:
        try:
            out.append(next(it).tolist())
        except StopIteration:
            it = iter(dl)
    return out, it


class TestRngRoundTrip:
    """capture_rng then restore_rng gives the same draws from torch, NumPy and Python random,
    and the captured state loads with weights_only=True."""

    def test_same_draws_after_restore(self, tmp_path):
        torch.manual_seed(1)
        np.random.seed(2)
        random.seed(3)
        draws()
        state = capture_rng()
        path = tmp_path / "rng.pt"
        torch.save(state, path)
        want = draws()
        torch.manual_seed(99)
        np.random.seed(99)
        random.seed(99)
        restore_rng(safe_torch_load(str(path), path))
        assert draws() == want

    def test_a_state_without_a_generator_is_refused_by_name(self):
        state = capture_rng()
        del state["numpy"]
        with pytest.raises(ResumeRecordError, match="numpy"):
            restore_rng(state)


class TestRecordHoldsPlainValuesOnly:
    """What weights_only=True could not load back is refused when the record is made, by key."""

    @pytest.mark.parametrize(
        "user,where",
        [
            ({"opt": object()}, "user['opt'] is a object"),
            ({"ids": np.arange(3)}, "user['ids'] is a ndarray"),
            ({"a": [1, {"b": np.int64(3)}]}, "user['a'][1]['b'] is a int64"),
        ],
    )
    def test_refused(self, user, where):
        with pytest.raises(ValueError, match=r"\(dict, list, tuple") as info:
            ResumeRecord(step=1, user=user)
        assert where in str(info.value)

    def test_bad_step_and_version(self):
        with pytest.raises(ValueError, match="global_step"):
            ResumeRecord(step=-1)
        with pytest.raises(ValueError, match="weight_version"):
            ResumeRecord(step=1, weight_version=1.5)

    def test_record_path(self, tmp_path):
        assert record_path(tmp_path, 12, 3) == tmp_path / "global_step_12" / "resume" / "rank_3.pt"
        with pytest.raises(ValueError, match="rank"):
            record_path(tmp_path, 1, -1)


def make_monitor(namespace, root):
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(root), metrics_port=None
    )
    ray.get(monitor.status.remote())
    return monitor


def wait_committed(monitor, step, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = ray.get(monitor.status.remote())
        if status["latest"]["checkpoint"] == step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not committed after {timeout} s: {status}")


class TestCommittedWithTheStep:
    """The record is one more save of the step: listed in its manifest, loaded back verified,
    and a step whose record could not be saved does not commit."""

    def test_save_commit_load_restore(self, ray_cluster, namespace, tmp_path):
        root = tmp_path / "ckpt"
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)

        torch.manual_seed(5)
        np.random.seed(5)
        random.seed(5)
        dl = loader()
        seen, it = batches(dl, 5)  # into the second epoch
        record = ResumeRecord.capture(
            4,
            data=dl,
            weight_version=4,
            user={"tokens_seen": 160, "loss_sum": torch.tensor(12.5, dtype=torch.float64)},
        )
        coord.link.register_thread_count(4, checkpoint_thread_count=1)
        coord.save_state_dict_async(
            "model", {"w": torch.ones(8)}, layout.model_dir(root, 4) / "model.pt", 4
        )
        save_resume_record(coord, record)
        asyncio.run(coord.register_and_monitor(4))
        coord.wait_all(30)
        wait_committed(monitor, 4)
        # What the uninterrupted run does next: the rest of the epoch (torchdata 0.11 does
        # not restore the generator the next epoch's shuffle draws from; docs/reliability.md).
        want_batches, _ = batches(dl, 3, it)
        want_draws = draws()

        sdir = layout.step_dir(root, 4)
        assert "resume/rank_0.pt" in {r.path for r in reader.read_manifest(sdir)}
        assert reader.verify_step(sdir) == []

        # A fresh process's state: other RNGs, a new loader at its start.
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        fresh = loader()
        got = restore_resume_record(root, 4, 0, data_loader=fresh)
        assert got.weight_version == 4 and got.step == 4
        assert got.user["tokens_seen"] == 160
        assert torch.equal(got.user["loss_sum"], torch.tensor(12.5, dtype=torch.float64))
        assert batches(fresh, 3)[0] == want_batches
        assert draws() == want_draws

        # A rank that saved none, and a record changed after its commit, are refused.
        with pytest.raises(ResumeRecordError, match="no resume record for rank 1"):
            load_resume_record(root, 4, 1)
        path = record_path(root, 4, 0)
        data = bytearray(path.read_bytes())
        data[-40] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(UnverifiedCheckpointError, match="corrupted"):
            load_resume_record(root, 4, 0)
        coord.close()

    def test_a_step_whose_record_fails_does_not_commit(self, ray_cluster, namespace, tmp_path):
        root = tmp_path / "ckpt"
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        coord.link.register_thread_count(2, checkpoint_thread_count=1)
        coord.save_state_dict_async(
            "model", {"w": torch.ones(8)}, layout.model_dir(root, 2) / "model.pt", 2
        )
        # A directory where the record's file goes: its write fails.
        record_path(root, 2, 0).mkdir(parents=True)
        save_resume_record(coord, ResumeRecord.capture(2, weight_version=2))
        asyncio.run(coord.register_and_monitor(2))
        with pytest.raises(SaveError) as info:
            coord.wait_all(30)
        assert info.value.slot == "resume" and info.value.step == 2
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = ray.get(monitor.status.remote())
            if 2 in [f["step"] for f in status["failed"]]:
                break
            time.sleep(0.05)
        assert status["latest"]["checkpoint"] is None, status
        assert reader.read_iteration(root, "checkpoint") is None
        assert not (layout.step_dir(root, 2) / layout.MANIFEST_NAME).exists()
        coord.close()

    def test_a_coordinator_without_rank_is_refused(self, ray_cluster, namespace, tmp_path):
        monitor = make_monitor(namespace, tmp_path / "ckpt")
        coord = CheckpointCoordinator(monitor, rank=None)
        coord.rank = None
        with pytest.raises(ValueError, match="no rank"):
            save_resume_record(coord, ResumeRecord(step=1))
