"""obsckpt.loading: a file loads only from a committed step, listed and matching its manifest,
deserialised with weights_only and the named allowlist. Plain files, no Ray."""

from __future__ import annotations

import json
import os
import pickle
import random
import threading

import numpy as np
import pytest
import torch
from reliability_helpers import RunsCode

from obsckpt.errors import UnsafeCheckpointError, UnverifiedCheckpointError
from obsckpt.store import commit, layout, loading, reader
from obsckpt.store.torchfile import write_torch_file

SHARD = "actor/model_world_size_1_rank_0.pt"


def committed(root, step: int, files: dict[str, object] | None = None, *, iteration=True):
    sdir = layout.step_dir(root, step)
    for rel, obj in (files or {SHARD: {"w": torch.arange(6.0)}}).items():
        path = sdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(obj, bytes):
            path.write_bytes(obj)
        else:
            write_torch_file(obj, path)
    commit.finalize_step(sdir, iterations={"checkpoint": step} if iteration else {})
    return sdir


class TestWhatIsLoaded:
    def test_a_committed_file_loads_equal(self, tmp_path):
        sdir = committed(tmp_path, 3)
        got = loading.load(sdir / SHARD)
        assert torch.equal(got["w"], torch.arange(6.0))
        # It lives in memory of its own, not in the file: the file can go.
        (sdir / SHARD).unlink()
        assert got["w"].sum().item() == 15.0

    def test_verl_extra_state_loads_rng_and_scheduler_but_nothing_else(self, tmp_path):
        """What verl's extra_state holds needs NumPy globals: allowed, by name."""
        state = {
            "lr_scheduler": {"base_lrs": [0.1], "last_epoch": 3, "_step_count": 4},
            "rng": {
                "cpu": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "random": random.getstate(),
            },
        }
        sdir = committed(tmp_path, 1, {"actor/extra_state_world_size_1_rank_0.pt": state})
        got = loading.load(sdir / "actor/extra_state_world_size_1_rank_0.pt")
        assert got["lr_scheduler"] == state["lr_scheduler"]
        assert (got["rng"]["numpy"][1] == state["rng"]["numpy"][1]).all()
        assert got["rng"]["random"] == state["rng"]["random"]

    def test_a_pickle_that_runs_code_is_refused_naming_the_global(self, tmp_path):
        marker = tmp_path / "ran"
        sdir = committed(tmp_path, 1, {SHARD: {"w": RunsCode(str(marker))}})
        with pytest.raises(UnsafeCheckpointError) as info:
            loading.load(sdir / SHARD)
        assert str(sdir / SHARD) in str(info.value)
        assert "refers to the global" in str(info.value) and "open" in str(info.value)
        assert not marker.exists()

    @pytest.mark.parametrize(
        "wording",
        [
            "Unsupported global: GLOBAL evil.thing was not an allowed global by default",
            "Weights only load failed: unsupported GLOBAL evil.thing was not allowed",
        ],
    )
    def test_both_wordings_of_a_refused_global_are_named(self, tmp_path, monkeypatch, wording):
        sdir = committed(tmp_path, 1)

        def refuse(*args, **kwargs):
            raise pickle.UnpicklingError(wording)

        monkeypatch.setattr(loading.checked_read, "torch_load_buffer", refuse)
        with pytest.raises(UnsafeCheckpointError, match="refers to the global evil.thing"):
            loading.load(sdir / SHARD)
        monkeypatch.setattr(loading, "_ORIGINAL_LOAD", refuse)  # torch's legacy format
        with pytest.raises(UnsafeCheckpointError, match="refers to the global evil.thing"):
            loading.safe_torch_load(str(sdir / SHARD), sdir / SHARD)

    def test_not_a_torch_file(self, tmp_path):
        sdir = committed(tmp_path, 1, {SHARD: b"hello"})
        with pytest.raises(UnverifiedCheckpointError, match="not a file torch.save wrote"):
            loading.load(sdir / SHARD)

    def test_a_file_torch_save_wrote_itself_loads_too(self, tmp_path):
        sdir = layout.step_dir(tmp_path, 1)
        (sdir / "actor").mkdir(parents=True)
        torch.save({"w": torch.ones(3)}, sdir / SHARD)
        torch.save({"w": torch.ones(2)}, sdir / "legacy.pt", _use_new_zipfile_serialization=False)
        commit.finalize_step(sdir, iterations={"checkpoint": 1})
        assert loading.load(sdir / SHARD)["w"].tolist() == [1.0, 1.0, 1.0]
        assert loading.load(sdir / "legacy.pt")["w"].tolist() == [1.0, 1.0]

    def test_without_proc_the_path_itself_is_read(self, tmp_path, monkeypatch):
        monkeypatch.setattr(loading, "_PROC_FD", False)
        sdir = committed(tmp_path, 1)
        step = loading.CommittedStep.of(sdir)
        assert step.read_bytes(sdir / SHARD) == (sdir / SHARD).read_bytes()

    def test_a_file_written_into_while_it_loads_is_dropped(self, tmp_path, monkeypatch):
        sdir = committed(tmp_path, 1)
        real = loading.checked_read.read_checked

        def read_while_someone_writes(fd, size):
            got = real(fd, size)
            with open(sdir / SHARD, "r+b") as f:  # in place: same inode, same size
                f.seek(100)
                f.write(b"\0")
            return got

        monkeypatch.setattr(loading.checked_read, "read_checked", read_while_someone_writes)
        with pytest.raises(UnverifiedCheckpointError, match="changed while it was loaded"):
            loading.load(sdir / SHARD)


class TestWhatIsRefused:
    def test_a_flipped_byte(self, tmp_path):
        sdir = committed(tmp_path, 1)
        data = bytearray((sdir / SHARD).read_bytes())
        data[-100] ^= 0x01
        (sdir / SHARD).write_bytes(bytes(data))
        with pytest.raises(UnverifiedCheckpointError, match=r"is corrupted: crc32 [0-9a-f]{8}"):
            loading.load(sdir / SHARD)

    @pytest.mark.parametrize("change", ["truncated", "grown"])
    def test_a_file_of_another_size(self, tmp_path, change):
        sdir = committed(tmp_path, 1)
        data = (sdir / SHARD).read_bytes()
        (sdir / SHARD).write_bytes(data[:-1] if change == "truncated" else data + b"x")
        with pytest.raises(UnverifiedCheckpointError, match=f"is {change}"):
            loading.load(sdir / SHARD)

    def test_a_file_the_manifest_does_not_list(self, tmp_path):
        sdir = committed(tmp_path, 1)
        torch.save({"w": torch.zeros(1)}, sdir / "actor" / "added.pt")
        with pytest.raises(UnverifiedCheckpointError, match="added.pt is not listed in"):
            loading.load(sdir / "actor" / "added.pt")

    def test_a_listed_file_that_is_gone(self, tmp_path):
        sdir = committed(tmp_path, 1)
        (sdir / SHARD).unlink()
        with pytest.raises(UnverifiedCheckpointError, match="is missing, but .* lists it"):
            loading.load(sdir / SHARD)

    def test_a_step_without_manifest(self, tmp_path):
        sdir = committed(tmp_path, 1)
        (sdir / layout.MANIFEST_NAME).unlink()
        with pytest.raises(UnverifiedCheckpointError, match="never committed by obsckpt"):
            loading.load(sdir / SHARD)

    def test_a_manifest_no_iteration_file_reaches(self, tmp_path):
        """A commit cut after its manifest: the step is not committed."""
        committed(tmp_path, 1)
        sdir = committed(tmp_path, 2, iteration=False)
        with pytest.raises(UnverifiedCheckpointError, match=r"step 2 .* is not committed.*: 1\)"):
            loading.load(sdir / SHARD)

    def test_a_manifest_of_a_newer_format(self, tmp_path):
        sdir = committed(tmp_path, 1)
        doc = json.loads((sdir / layout.MANIFEST_NAME).read_text())
        doc["version"] = 99
        (sdir / layout.MANIFEST_NAME).write_text(json.dumps(doc))
        with pytest.raises(UnverifiedCheckpointError, match="written by a newer obsckpt"):
            loading.load(sdir / SHARD)

    def test_a_path_outside_any_step(self, tmp_path):
        torch.save({"w": torch.zeros(1)}, tmp_path / "loose.pt")
        with pytest.raises(UnverifiedCheckpointError, match="not inside a global_step_<N>"):
            loading.load(tmp_path / "loose.pt")

    def test_a_remote_path(self):
        with pytest.raises(UnverifiedCheckpointError, match="is remote"):
            loading.CommittedStep.of("hdfs://nn/ckpt/global_step_1/actor")


class TestVerifiedTorchLoad:
    """Code that calls torch.load itself (verl's managers) is sent through the checks."""

    def test_loads_inside_the_step_are_checked_and_weights_only(self, tmp_path):
        marker = tmp_path / "ran"
        sdir = committed(
            tmp_path, 1, {SHARD: {"w": torch.ones(2)}, "actor/x.pt": {"w": RunsCode(str(marker))}}
        )
        with loading.verified_torch_load(sdir / "actor"):
            assert torch.load(sdir / SHARD, weights_only=False)["w"].tolist() == [1.0, 1.0]
            with pytest.raises(UnsafeCheckpointError):
                torch.load(str(sdir / "actor/x.pt"), weights_only=False)
            with pytest.raises(UnverifiedCheckpointError, match="outside the step"):
                torch.load(tmp_path / "elsewhere.pt")
        assert not marker.exists()
        assert torch.load is loading._ORIGINAL_LOAD

    def test_other_threads_loads_are_untouched(self, tmp_path):
        sdir = committed(tmp_path, 1)
        loose = tmp_path / "loose.pt"
        torch.save({"w": torch.zeros(1)}, loose)
        got = []
        with loading.verified_torch_load(sdir):
            t = threading.Thread(target=lambda: got.append(torch.load(loose)))
            t.start()
            t.join()
        assert got and got[0]["w"].tolist() == [0.0]


class TestVerifyAll:
    def test_every_file_of_a_directory(self, tmp_path):
        sdir = committed(tmp_path, 1, {SHARD: {"w": torch.ones(1)}, "actor/dist/a.distcp": b"x"})
        step = loading.CommittedStep.of(sdir / "actor")
        assert step.verify_all(sdir / "actor") == 2
        (sdir / "actor/dist/b.distcp").write_bytes(b"y")
        with pytest.raises(UnverifiedCheckpointError, match="b.distcp is not listed"):
            step.verify_all(sdir / "actor")
        os.unlink(sdir / "actor/dist/b.distcp")
        os.unlink(sdir / "actor/dist/a.distcp")
        with pytest.raises(UnverifiedCheckpointError, match="a.distcp is missing"):
            step.verify_all(sdir / "actor")

    def test_read_bytes_checks_too(self, tmp_path):
        sdir = committed(tmp_path, 1, {"actor/model.safetensors": b"0123456789"})
        step = loading.CommittedStep.of(sdir)
        assert step.read_bytes(sdir / "actor/model.safetensors") == b"0123456789"
        assert reader.verify_step(sdir) == []
