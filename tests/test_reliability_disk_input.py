"""Damaged, foreign or hostile files under a checkpoint root: every reader gives a clear
error naming the path, never hangs, never reads outside the step it checks, never runs
code from a file, and never treats a damaged step as whole.

Plain files on disk, no Ray: the readers are the same inside the actors.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from obsckpt.cli import main
from obsckpt.errors import IterationFileError, StateDictLoadError, UnsafeCheckpointError
from obsckpt.integrations.retention import prune, step_of
from obsckpt.store import commit, layout, reader
from obsckpt.sync.shards import load_sharded_state_dict, shard_files

SHARD = "actor/model_world_size_1_rank_0.pt"


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def committed_step(root: Path, step: int, files: dict[str, object] | None = None) -> Path:
    """A step written and committed as the monitor commits one (manifest, iteration files)."""
    sdir = layout.step_dir(root, step)
    for rel, obj in (files or {SHARD: {"w": torch.full((2,), float(step))}}).items():
        path = sdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(obj, bytes):
            path.write_bytes(obj)
        else:
            torch.save(obj, path)
    commit.finalize_step(sdir, iterations={"checkpoint": step, "state_dict": step})
    return sdir


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def without_hanging(fifo: Path, fn, *args, **kwargs):
    """``fn(*args)``, failing the test (not hanging it) if it blocks reading ``fifo``."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        # Open the FIFO's other end and close it: the blocked reader sees end-of-file.
        for _ in range(50):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            t.join(0.1)
            if not t.is_alive():
                break
        pytest.fail(f"reading {fifo} blocked instead of refusing a FIFO")
    if "error" in result:
        raise result["error"]
    return result.get("value")


class TestStepDirectoryNames:
    """Only ``global_step_<N>`` with N written as the writers write it (ASCII digits, no
    leading zero, at most 2**63 - 1) is a step; any other name is not, for every reader:
    it is never reported as a step, never mapped to another directory, never deleted."""

    @pytest.mark.parametrize(
        "name", ["global_step_007", "global_step_\u0663", "global_step_" + "9" * 30]
    )
    def test_other_names_are_not_steps(self, tmp_path, name):
        committed_step(tmp_path, 3)
        (tmp_path / name).mkdir()
        assert reader.steps_on_disk(tmp_path) == [3]
        code, out, err = cli("status", str(tmp_path), "--json")
        assert (code, err) == (0, "")
        assert [s["step"] for s in json.loads(out)["steps"]] == [3]
        code, out, err = cli("verify", str(tmp_path), "--all")
        assert (code, err) == (0, "") and out.startswith("step 3: OK")

    def test_global_step_0_is_a_step(self, tmp_path):
        committed_step(tmp_path, 0)
        assert reader.steps_on_disk(tmp_path) == [0]

    def test_retention_never_maps_a_name_to_another_step(self, tmp_path):
        for step in (7, 8, 9):
            committed_step(tmp_path, step)
        (tmp_path / "global_step_007" / "actor").mkdir(parents=True)
        assert step_of(str(tmp_path / "global_step_007" / "actor")) is None
        saved = [str(tmp_path / f"global_step_{s}" / "actor") for s in ("007", "8", "9")]
        assert prune(saved, 1) == [saved[1]]
        # global_step_8 is superseded and removed whole; global_step_007 is no step, and
        # global_step_7 (a step this list never saved) is not touched through it.
        assert not (tmp_path / "global_step_8").exists()
        assert (tmp_path / "global_step_007" / "actor").is_dir()
        assert reader.steps_on_disk(tmp_path) == [7, 9]


class TestManifestEntries:
    """A manifest entry that is not a relative path inside its step directory, with a
    non-negative integer size and a hex CRC32, or that lists a file twice, makes the
    manifest unreadable: ``verify`` says so by path, reads nothing outside the step and
    never reports the step as whole."""

    @pytest.mark.parametrize(
        "bad, named",
        [
            ({"path": "/etc/hostname"}, "'/etc/hostname'"),
            ({"path": "../../../../../../etc/hostname"}, "'../../../../../../etc/hostname'"),
            ({"path": "actor/../../global_step_4/x"}, "'actor/../../global_step_4/x'"),
            ({"path": 5}, "path 5"),
            ({"path": ["a"]}, "path ['a']"),
            ({"path": ""}, "path ''"),
            ({"size": True}, "size True"),
            ({"size": 1.5}, "size 1.5"),
            ({"size": -1}, "size -1"),
            ({"crc32": 5}, "crc32 5"),
            ({"crc32": "-1"}, "crc32 '-1'"),
            ("entry", "'entry'"),
        ],
    )
    def test_bad_entry_is_named(self, tmp_path, bad, named):
        sdir = committed_step(tmp_path, 3)
        manifest = json.loads((sdir / layout.MANIFEST_NAME).read_text())
        good = manifest["files"][0]
        entry = dict(good, **bad) if isinstance(bad, dict) else bad
        manifest["files"].append(entry)
        (sdir / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
        problems = reader.verify_step(sdir)
        assert len(problems) == 1
        assert problems[0].startswith(f"{sdir / layout.MANIFEST_NAME}: unreadable manifest (")
        assert "entry 1" in problems[0] and named in problems[0], problems[0]
        code, out, err = cli("verify", str(tmp_path))
        assert code == 1 and "FAILED" in out and "Error:" not in err

    def test_an_entry_escaping_the_step_is_never_read(self, tmp_path):
        """The escape names a file whose size and CRC32 match: it still fails."""
        sdir = committed_step(tmp_path, 3)
        other = committed_step(tmp_path, 4)
        size, crc = reader.file_crc32(other / SHARD)
        manifest = json.loads((sdir / layout.MANIFEST_NAME).read_text())
        manifest["files"] = [
            {"path": f"../global_step_4/{SHARD}", "size": size, "crc32": f"{crc:08x}"}
        ]
        (sdir / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
        code, out, err = cli("verify", str(tmp_path), "--step", "3")
        assert code == 1 and "outside" in err and "OK" not in out

    def test_a_file_listed_twice_is_named(self, tmp_path):
        sdir = committed_step(tmp_path, 3)
        manifest = json.loads((sdir / layout.MANIFEST_NAME).read_text())
        manifest["files"].append(dict(manifest["files"][0]))
        (sdir / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
        (problem,) = reader.verify_step(sdir)
        assert f"lists {SHARD!r} twice" in problem

    @pytest.mark.parametrize(
        "text, named",
        [
            ("[]", "not a JSON object"),
            ("null", "not a JSON object"),
            ('{"version": 1}', 'no "files" list'),
            ('{"files": null}', 'no "files" list'),
            ('{"files": {"a": 1}}', 'no "files" list'),
            pytest.param("[" * 100_000, "nested too deeply", id="nested-100000-deep"),
        ],
    )
    def test_bad_shape_is_named(self, tmp_path, text, named):
        sdir = committed_step(tmp_path, 3)
        (sdir / layout.MANIFEST_NAME).write_text(text)
        (problem,) = reader.verify_step(sdir)
        assert "unreadable manifest (" in problem and named in problem, problem
        with pytest.raises(ValueError, match=named):
            reader.read_manifest(sdir)

    def test_extra_keys_are_accepted(self, tmp_path):
        sdir = committed_step(tmp_path, 3)
        manifest = json.loads((sdir / layout.MANIFEST_NAME).read_text())
        manifest["writer"] = "another tool"
        manifest["files"][0]["mtime"] = 1.0
        (sdir / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
        assert reader.verify_step(sdir) == []

    @pytest.mark.parametrize(
        "version, named",
        [
            (2, "manifest format 2, written by a newer obsckpt; this one reads format 1"),
            ("1", "\"version\" is '1', not a manifest format"),
            (True, '"version" is True, not a manifest format'),
            (None, '"version" is None, not a manifest format'),
        ],
    )
    def test_another_format_is_refused_by_name(self, tmp_path, version, named):
        """A later format may mean its entries differently: read as this one, a step
        could verify OK against entries it does not understand."""
        sdir = committed_step(tmp_path, 3)
        manifest = json.loads((sdir / layout.MANIFEST_NAME).read_text())
        assert manifest["version"] == layout.MANIFEST_FORMAT == 1
        manifest["version"] = version
        (sdir / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(ValueError, match=re.escape(named)):
            reader.read_manifest(sdir)
        (problem,) = reader.verify_step(sdir)
        assert named in problem, problem

    def test_newer_format_tells_verify_to_upgrade(self, tmp_path, capsys):
        sdir = committed_step(tmp_path, 3)
        manifest = json.loads((sdir / layout.MANIFEST_NAME).read_text())
        manifest["version"] = 2
        (sdir / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
        assert main(["verify", str(tmp_path)]) != 0
        out = capsys.readouterr()
        assert "Upgrade obsckpt" in out.out + out.err

    def test_a_manifest_without_version_reads_as_this_format(self, tmp_path):
        sdir = committed_step(tmp_path, 3)
        manifest = json.loads((sdir / layout.MANIFEST_NAME).read_text())
        del manifest["version"]
        (sdir / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
        assert reader.verify_step(sdir) == []


class TestNonRegularFiles:
    """A FIFO in place of an iteration file, a manifest, a step's file at commit or a
    shard is an error naming it: no reader blocks on it, and nothing committed changes."""

    def test_iteration_file(self, tmp_path):
        committed_step(tmp_path, 3)
        fifo = tmp_path / layout.ITERATION_FILES["checkpoint"]
        fifo.unlink()
        os.mkfifo(fifo)
        with pytest.raises(IterationFileError, match="not a regular file") as info:
            without_hanging(fifo, reader.read_iteration, tmp_path, "checkpoint")
        assert str(fifo) in str(info.value)
        code, _out, err = without_hanging(fifo, cli, "status", str(tmp_path))
        assert code == 2 and str(fifo) in err

    def test_iteration_file_that_is_a_directory_says_what_to_do(self, tmp_path):
        (tmp_path / layout.ITERATION_FILES["state_dict"]).mkdir()
        with pytest.raises(IterationFileError, match="is a directory, not an iteration file; "):
            reader.read_iteration(tmp_path, "state_dict")

    def test_manifest(self, tmp_path):
        sdir = committed_step(tmp_path, 3)
        fifo = sdir / layout.MANIFEST_NAME
        fifo.unlink()
        os.mkfifo(fifo)
        (problem,) = without_hanging(fifo, reader.verify_step, sdir)
        assert problem.startswith(f"{fifo}: unreadable manifest (") and "not a regular" in problem

    def test_file_of_a_step_at_commit(self, tmp_path):
        committed_step(tmp_path, 3)
        before = snapshot(tmp_path)
        sdir = layout.step_dir(tmp_path, 4)
        sdir.mkdir()
        fifo = sdir / "foreign.pipe"
        os.mkfifo(fifo)
        with pytest.raises(OSError, match="not a regular file") as info:
            without_hanging(
                fifo, commit.finalize_step, sdir, iterations={"checkpoint": 4, "state_dict": 4}
            )
        assert str(fifo) in str(info.value)
        assert snapshot(tmp_path) == before
        assert reader.read_iteration(tmp_path, "checkpoint") == 3

    def test_shard(self, tmp_path):
        model_dir = committed_step(tmp_path, 1) / "actor"
        fifo = model_dir / "model_world_size_1_rank_0.pt"
        fifo.unlink()
        os.mkfifo(fifo)
        with pytest.raises(StateDictLoadError, match="not a regular file") as info:
            without_hanging(fifo, load_sharded_state_dict, model_dir)
        assert str(fifo) in str(info.value)


class _Payload:
    """Unpickling this runs code: it creates the file named in its argument."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


class TestShardsNeverRunCode:
    """Loading a step's shards never runs code from them: every ``torch.load`` is
    ``weights_only=True``, and a file it refuses is an error naming the file and the
    object it refused; DTensor shards load all the same, in a fresh process."""

    def test_pickle_with_code_is_refused(self, tmp_path):
        marker = tmp_path / "ran"
        sdir = committed_step(
            tmp_path, 1, {SHARD: {"w": torch.ones(2), "x": _Payload(str(marker))}}
        )
        with pytest.raises(UnsafeCheckpointError, match="could run code") as info:
            load_sharded_state_dict(sdir / "actor", manifest_dir=sdir)
        assert not marker.exists()
        assert str(sdir / SHARD) in str(info.value)
        assert re.search(
            r"refers to the global (builtins.getattr|pathlib\.\w*Path)", str(info.value)
        )

    def test_not_a_torch_file(self, tmp_path):
        sdir = committed_step(tmp_path, 1, {SHARD: b"hello, not a torch file"})
        with pytest.raises(
            StateDictLoadError, match="cannot be loaded: it is not a file torch.save wrote"
        ) as info:
            load_sharded_state_dict(sdir / "actor", manifest_dir=sdir)
        assert str(sdir / SHARD) in str(info.value)

    def test_dtensor_shards_load_in_a_fresh_process(self, tmp_path):
        # One rank's DTensor shard, written under a fake process group (no gloo to start).
        script = (
            "import os, sys, torch, torch.distributed as dist\n"
            "from torch.distributed.tensor import DeviceMesh, DTensor, Shard\n"
            "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
            "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=1)\n"
            # from_local, not distribute_tensor: the fake group runs no collective, and
            # torch 2.11's distribute_tensor scatters through one, leaving the shard unset.
            "dt = DTensor.from_local(torch.arange(6.0).reshape(2, 3), DeviceMesh('cpu', [0]), "
            "[Shard(0)], run_check=False)\n"
            "assert dt.to_local().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]\n"
            "os.makedirs(sys.argv[1], exist_ok=True)\n"
            "torch.save({'w': dt, 'b': torch.ones(2)}, "
            "os.path.join(sys.argv[1], 'model_world_size_1_rank_0.pt'))\n"
            "dist.destroy_process_group()\n"
        )
        model_dir = tmp_path / "global_step_1" / "actor"
        subprocess.run([sys.executable, "-c", script, str(model_dir)], check=True, timeout=120)
        commit.finalize_step(model_dir.parent, iterations={"checkpoint": 1})
        load = (
            "import sys\n"
            "from obsckpt.sync.shards import load_sharded_state_dict\n"
            "sd = load_sharded_state_dict(sys.argv[1])\n"
            "assert 'torch.distributed.tensor' in sys.modules\n"
            "print(sd['w'].tolist(), sd['b'].tolist())\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", load, str(model_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] [1.0, 1.0]"


class TestShardSet:
    """The shards loaded are one whole world that the step's manifest lists: world size
    0, missing ranks (also of an absurd world size, reported quickly and briefly), shards
    the manifest does not list, and a directory or file in the wrong place are each
    refused by name, never merged into a partial or foreign state dict."""

    def test_world_size_zero(self, tmp_path):
        model_dir = tmp_path / "actor"
        model_dir.mkdir()
        torch.save({"w": torch.ones(2)}, model_dir / "model_world_size_0_rank_0.pt")
        with pytest.raises(StateDictLoadError, match="world size 0"):
            load_sharded_state_dict(model_dir)

    def test_missing_ranks_of_a_huge_world_size(self, tmp_path):
        model_dir = tmp_path / "actor"
        model_dir.mkdir()
        torch.save({"w": torch.ones(2)}, model_dir / "model_world_size_100000_rank_0.pt")
        with pytest.raises(
            StateDictLoadError,
            match=r"ranks \[1, 2, 3, 4, 5, 6, 7, 8, ...\] \(world size 100000, 99999 missing\)",
        ) as info:
            shard_files(model_dir)
        assert len(str(info.value)) < 400

    def test_shards_the_manifest_does_not_list(self, tmp_path):
        """Shards of another world size put in after the commit are not the committed step."""
        shards = {
            f"actor/model_world_size_2_rank_{r}.pt": {"w": torch.full((2,), float(r))}
            for r in range(2)
        }
        sdir = committed_step(tmp_path, 1, shards)
        for rel in shards:
            (sdir / rel).unlink()
        torch.save({"w": torch.full((2,), 7.0)}, sdir / SHARD)
        with pytest.raises(StateDictLoadError, match="not listed in") as info:
            load_sharded_state_dict(sdir / "actor", manifest_dir=sdir)
        assert str(sdir / SHARD) in str(info.value)

    def test_shard_that_is_a_directory(self, tmp_path):
        model_dir = committed_step(tmp_path, 1) / "actor"
        (model_dir / "model_world_size_1_rank_0.pt").unlink()
        (model_dir / "model_world_size_1_rank_0.pt").mkdir()
        with pytest.raises(StateDictLoadError, match="(?i)is a directory|not a regular file"):
            load_sharded_state_dict(model_dir)

    def test_model_dir_that_is_a_file(self, tmp_path):
        (tmp_path / "actor").write_text("x")
        with pytest.raises(StateDictLoadError, match="not a directory") as info:
            load_sharded_state_dict(tmp_path / "actor")
        assert str(tmp_path / "actor") in str(info.value)


class TestReadErrorAdvice:
    """Advice in an error fits its errno: "restore" or "repair" only for a bad file."""

    @pytest.mark.parametrize("code", [errno.EMFILE, errno.EIO, errno.ESTALE, errno.ENFILE])
    def test_a_transient_error_never_says_to_remove_or_replace_the_file(
        self, tmp_path, monkeypatch, code
    ):
        commit.write_iteration(tmp_path, "checkpoint", 3)

        def failing(path, *a, **k):
            raise OSError(code, os.strerror(code), os.fspath(path))

        monkeypatch.setattr(reader, "open_regular", failing)
        with pytest.raises(IterationFileError) as info:
            reader.read_iteration(tmp_path, "checkpoint")
        msg = str(info.value)
        assert errno.errorcode[code] in msg and "transient" in msg
        for word in ("remove", "restore", "repair", "backup"):
            assert word not in msg.lower(), msg
        if code == errno.EMFILE:
            assert "ulimit -n" in msg

    @pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
    def test_a_commit_out_of_descriptors_points_at_the_limit_not_the_disk(self, code):
        from obsckpt.monitor.commit_io import storage_hint

        hint = storage_hint(OSError(code, os.strerror(code)), "/ckpt")
        assert "ulimit -n" in hint and "nothing on disk needs changing" in hint
        for word in ("remove", "restore", "free space"):
            assert word not in hint.lower(), hint

    def test_bad_content_says_how_to_repair_without_deleting(self, tmp_path):
        (tmp_path / layout.ITERATION_FILES["checkpoint"]).write_text("garbage\n")
        with pytest.raises(IterationFileError) as info:
            reader.read_iteration(tmp_path, "checkpoint")
        msg = str(info.value)
        assert f"obsckpt repair {tmp_path}" in msg and "deletes nothing" in msg
        assert "remove it" not in msg


class TestTempNames:
    def test_an_over_long_name_fails_naming_the_name_and_the_limit(self, tmp_path):
        name = "m" * 240 + ".pt"
        with pytest.raises(ValueError) as info:
            layout.temp_name(tmp_path / name)
        msg = str(info.value)
        assert name[:60] in msg and "255" in msg and "243 bytes" in msg
        # The longest name allowed still has a temp name the filesystem takes.
        longest = tmp_path / ("n" * 231)  # NAME_MAX less the longest temp suffix
        commit.atomic_write(longest, b"ok")
        assert longest.read_bytes() == b"ok"

    def test_only_obsckpts_own_temp_names_are_temp_files(self):
        own = os.path.basename(layout.temp_name("/x/model.pt"))
        assert layout.is_temp_name(own)
        for name in (
            "optimizer.tmp",
            "w.safetensors.tmp",
            "data.tmp.77",
            "x.tmp.9.ab12",
            "notes.tmp.77.NOTHEX00",
            "chat_template.tmpl",
        ):
            assert not layout.is_temp_name(name), name
