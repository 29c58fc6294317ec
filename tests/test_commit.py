"""The on-disk contract: iteration files, atomic writes, manifests, verification."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from obsckpt import validators
from obsckpt.errors import CheckpointDirError, IterationFileError
from obsckpt.store import commit, layout, reader


class TestIterationFile:
    """Iteration files hold one integer, are replaced atomically and never go backwards."""

    def test_round_trip_and_no_temp_left(self, tmp_path):
        assert reader.read_iteration(tmp_path, "checkpoint") is None
        commit.write_iteration(tmp_path, "checkpoint", 12)
        assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "12\n"
        assert reader.read_iteration(tmp_path, "checkpoint") == 12
        assert sorted(os.listdir(tmp_path)) == ["latest_checkpointed_iteration.txt"]

    def test_never_backwards(self, tmp_path):
        commit.write_iteration(tmp_path, "state_dict", 9)
        with pytest.raises(ValueError, match="names step 9; refusing to move it back to 7"):
            commit.write_iteration(tmp_path, "state_dict", 7)
        assert reader.read_iteration(tmp_path, "state_dict") == 9

    @pytest.mark.parametrize("content", ["abc", "-3", "", "1.5", "7 8", "1" * 80, "٣"])
    def test_garbage_is_a_clear_error_naming_the_file(self, tmp_path, content):
        (tmp_path / "latest_checkpointed_iteration.txt").write_text(content)
        with pytest.raises(IterationFileError, match="latest_checkpointed_iteration.txt"):
            reader.read_iteration(tmp_path, "checkpoint")

    def test_verl_style_reader_can_parse_it(self, tmp_path):
        commit.write_iteration(tmp_path, "checkpoint", 3)
        # verl reads the file with int(f.read()).
        assert int((tmp_path / "latest_checkpointed_iteration.txt").read_text()) == 3


class TestRoot:
    """An unusable checkpoint root is refused with the path named."""

    def test_root_that_is_a_file(self, tmp_path):
        f = tmp_path / "file"
        f.write_text("x")
        with pytest.raises(CheckpointDirError, match="is a file"):
            commit.ensure_root(f)

    def test_unwritable_root(self, tmp_path):
        # /proc refuses new files for every user, root included.
        with pytest.raises(CheckpointDirError, match="not writable"):
            commit.ensure_root("/proc/obsckpt-test")


class TestNames:
    @pytest.mark.parametrize("bad", ["", "../x", "a/b", ".", "..", "-x", "a b", "x" * 200, 3, None])
    def test_unsafe_slot_names_are_refused(self, bad):
        with pytest.raises(ValueError, match="slot name"):
            validators.validate_slot(bad)

    @pytest.mark.parametrize("good", ["model", "optim.0", "extra_state", "hf-model"])
    def test_safe_slot_names(self, good):
        assert validators.validate_slot(good) == good


class TestManifest:
    """A step's manifest records every file; verification finds missing, truncated and flipped bytes."""

    def make_step(self, root):
        sdir = layout.step_dir(root, 4)
        (sdir / "actor").mkdir(parents=True)
        (sdir / "actor" / "model.pt").write_bytes(os.urandom(5000))
        (sdir / "actor" / "optim.pt").write_bytes(os.urandom(300))
        (sdir / "actor" / "half.pt.tmp.123.0123abcd").write_bytes(b"partial")
        return sdir

    def test_finalize_writes_manifest_skipping_temp_files(self, tmp_path):
        sdir = self.make_step(tmp_path)
        records = commit.finalize_step(sdir)
        assert [r.path for r in records] == ["actor/model.pt", "actor/optim.pt"]
        manifest = json.loads((sdir / "manifest.json").read_text())
        assert [f["path"] for f in manifest["files"]] == ["actor/model.pt", "actor/optim.pt"]
        assert reader.verify_step(sdir) == []

    def test_remove_strays_leaves_what_the_manifest_lists(self, tmp_path):
        """A committed step's unlisted files go (a host's temp file of a skipped
        re-save); listed files, the manifest and obsckpt's own temp files stay."""
        sdir = self.make_step(tmp_path)
        commit.finalize_step(sdir)
        (sdir / "actor" / "model.safetensors.tmp").write_bytes(b"streamed")
        (sdir / "late").mkdir()
        (sdir / "late" / "x.json").write_bytes(b"{}")
        assert commit.remove_strays(sdir) == ["actor/model.safetensors.tmp", "late/x.json"]
        assert reader.verify_step(sdir) == []
        assert (sdir / "actor" / "half.pt.tmp.123.0123abcd").exists()
        assert commit.remove_strays(sdir) == []

    def test_remove_strays_touches_nothing_without_a_manifest(self, tmp_path):
        sdir = self.make_step(tmp_path)
        (sdir / "actor" / "model.safetensors.tmp").write_bytes(b"streamed")
        assert commit.remove_strays(sdir) == []
        assert (sdir / "actor" / "model.safetensors.tmp").exists()

    def test_only_temp_suffixes_are_left_out(self, tmp_path):
        """Any name but obsckpt's own temp names is a file of the step, recorded and verified."""
        sdir = self.make_step(tmp_path)
        (sdir / "hf").mkdir()
        names = ("chat_template.tmpl", "data.tmp.json", "w.safetensors.tmp", "x.tmp.9.ab12")
        for name in (*names, "y.pt.tmp.9.0123abcd"):
            (sdir / "hf" / name).write_bytes(b"t")
        records = commit.finalize_step(sdir)
        # Only obsckpt's own temp names (<name>.tmp.<pid>.<8 hex>) are left out.
        assert [r.path for r in records] == [
            "actor/model.pt",
            "actor/optim.pt",
            "hf/chat_template.tmpl",
            "hf/data.tmp.json",
            "hf/w.safetensors.tmp",
            "hf/x.tmp.9.ab12",
        ]
        (sdir / "hf" / "chat_template.tmpl").unlink()
        assert reader.verify_step(sdir) == [f"{sdir / 'hf' / 'chat_template.tmpl'}: missing"]

    def test_scratch_directories_are_left_out_whole(self, tmp_path):
        """Files still being built aside (an HF export) when the step commits are not
        listed: listed, they would be missing once moved into place."""
        sdir = self.make_step(tmp_path)
        scratch = Path(commit.scratch_dir(sdir / "huggingface"))
        assert scratch.parent == sdir and layout.is_temp_name(scratch.name)
        (scratch / "sub").mkdir()
        (scratch / "config.json").write_text("{}")
        (scratch / "sub" / "tokenizer.json").write_text("{}")
        records = commit.finalize_step(sdir)
        assert [r.path for r in records] == ["actor/model.pt", "actor/optim.pt"]
        shutil.rmtree(scratch)
        assert reader.verify_step(sdir) == []
        # A file moved in after the commit is not part of the step: verify names it.
        (sdir / "config.json").write_text("{}")
        assert reader.verify_step(sdir) == [f"{sdir / 'config.json'}: not listed in the manifest"]

    def test_verify_names_unreadable_files_and_goes_on(self, tmp_path):
        sdir = self.make_step(tmp_path)
        commit.finalize_step(sdir)
        model = sdir / "actor" / "model.pt"
        model.unlink()
        model.symlink_to("/proc/self/mem")  # a regular file whose read fails with EIO
        (sdir / "actor" / "optim.pt").write_bytes(b"z" * 300)
        problems = reader.verify_step(sdir)
        assert problems[0].startswith(f"{model}: unreadable (") and len(problems) == 2
        assert problems[1].startswith(f"{sdir / 'actor' / 'optim.pt'}: corrupted")
        (sdir / "manifest.json").unlink()
        (sdir / "manifest.json").mkdir()
        assert reader.verify_step(sdir) == [
            f"{sdir / 'manifest.json'}: unreadable manifest (Is a directory)"
        ]

    def test_manifest_is_one_file_per_line_and_phases_are_timed(self, tmp_path):
        sdir = self.make_step(tmp_path)
        (sdir / "top.bin").write_bytes(b"abc")
        timings: dict[str, float] = {}
        records = commit.finalize_step(sdir, iterations={"checkpoint": 7}, timings=timings)
        assert [r.path for r in records] == ["actor/model.pt", "actor/optim.pt", "top.bin"]
        lines = (sdir / "manifest.json").read_text().splitlines()
        assert sum('"path"' in line for line in lines) == 3  # one record per line
        assert reader.read_manifest(sdir) == records
        assert set(timings) == {"scan", "round1", "round2", "publish"}
        assert all(v >= 0 for v in timings.values())
        assert reader.read_iteration(tmp_path, "checkpoint") == 7

    def test_reported_records_are_trusted_when_size_matches(self, tmp_path):
        sdir = self.make_step(tmp_path)
        fake = layout.FileRecord("actor/model.pt", 5000, 0xDEADBEEF)
        records = {r.path: r for r in commit.finalize_step(sdir, {"actor/model.pt": fake})}
        assert records["actor/model.pt"].crc32 == 0xDEADBEEF

    def test_verify_catches_truncation_missing_and_flipped_bytes(self, tmp_path):
        sdir = self.make_step(tmp_path)
        commit.finalize_step(sdir)
        model = sdir / "actor" / "model.pt"
        data = bytearray(model.read_bytes())
        data[100] ^= 0xFF
        model.write_bytes(bytes(data))
        (sdir / "actor" / "optim.pt").unlink()
        problems = reader.verify_step(sdir)
        assert any("model.pt: corrupted" in p for p in problems)
        assert any("optim.pt: missing" in p for p in problems)
        model.write_bytes(bytes(data[:10]))
        assert any("model.pt: truncated" in p for p in reader.verify_step(sdir))

    def test_steps_on_disk(self, tmp_path):
        for name in ("global_step_3", "global_step_10", "global_step_x", "other"):
            (tmp_path / name).mkdir()
        (tmp_path / "global_step_5").write_text("a file, not a step")
        assert reader.steps_on_disk(tmp_path) == [3, 10]


class TestFsyncAtShutdown:
    """Files are fsynced even at interpreter shutdown, when thread pools take no new work
    (a save still running past the exit wait)."""

    def test_fsync_many_in_an_exit_handler(self, tmp_path):
        paths = [tmp_path / "a", tmp_path / "b"]
        for p in paths:
            p.write_bytes(b"x")
        script = (
            "import atexit, sys\n"
            "from obsckpt import commit\n"
            f"targets = [({str(paths[0])!r}, False), ({str(paths[1])!r}, False), "
            f"({str(tmp_path)!r}, True)]\n"
            "atexit.register(lambda: (commit.fsync_many(targets), print('fsynced')))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "fsynced", done.stderr
