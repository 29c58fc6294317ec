"""The runner of verl's own checkpoint tests (tests/upstream/verl_checkpoint_tests.py).

``make test-verl-upstream`` runs verl 0.9.1's tests from its sdist; these
check, without the network, that the runner fails where it must: a
documented difference that passes or fails another way, an sdist that does
not match its checksum, a test file it neither selects nor excludes, a
rewrite of verl's LoRA tests that no longer applies, an archive member that
would land outside the work directory.
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "upstream"))
import verl_checkpoint_tests as runner  # noqa: E402

from obsckpt.errors import SavePathError  # noqa: E402
from obsckpt.store.file_records import check_targets  # noqa: E402

DIFFERENCE = next(iter(runner.DIFFERENCES))


def refusal(tmp_path: Path, target: Path) -> SavePathError:
    """The error obsckpt raises for a save of step 1 to ``target`` under root ``tmp_path``."""
    with pytest.raises(SavePathError) as caught:
        check_targets([str(target)], root=str(tmp_path), step=1, slot="model_state_dict")
    return caught.value


class TestJudge:
    def test_documented_refusal_is_the_expected_failure(self, tmp_path):
        error = refusal(tmp_path, tmp_path / "ckpt" / "model_world_size_1_rank_0.pt")
        outcome, why = runner.judge("obsckpt", DIFFERENCE, error)
        assert outcome == "xfailed" and "global_step_<N>" in why, why

    def test_a_difference_that_passes_fails(self):
        outcome, why = runner.judge("obsckpt", DIFFERENCE, None)
        assert outcome == "failed" and "DIFFERENCES" in why and "integrations.md" in why, why

    def test_a_difference_failing_another_way_fails(self, tmp_path):
        # The same error class, for another reason: a save into another step's directory.
        other_step = refusal(tmp_path, tmp_path / "global_step_2" / "actor" / "model.pt")
        assert runner.judge("obsckpt", DIFFERENCE, other_step)[0] == "failed"
        outcome, why = runner.judge("obsckpt", DIFFERENCE, FileNotFoundError("model.pt"))
        assert outcome == "failed" and "FileNotFoundError" in why, why

    def test_other_tests_and_modes_keep_their_outcome(self, tmp_path):
        error = refusal(tmp_path, tmp_path / "ckpt" / "model.pt")
        assert runner.judge("baseline", DIFFERENCE, error) is None
        assert runner.judge("obsckpt-step-dirs", DIFFERENCE, None) is None
        assert runner.judge("obsckpt", "tests/x.py::test_other", error) is None


def sdist_tree(tmp_path: Path, *, extra: str | None = None, lora: str | None = None) -> Path:
    """An archive laid out as verl's sdist, with every known test file (contents made up)."""
    names = [*runner.SELECTED, *runner.EXCLUDED] + ([extra] if extra else [])
    lora_text = lora
    if lora_text is None:
        lora_text = "\n".join(
            old for old, _, count in runner.STEP_DIRS_REWRITES for _ in range(count)
        )
    path = tmp_path / runner.SDIST
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            data = (lora_text if name == runner.LORA_FILE else "").encode()
            info = tarfile.TarInfo(f"verl-{runner.VERL_VERSION}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


class TestSdist:
    def test_checksum_mismatch_is_refused(self, tmp_path):
        archive = sdist_tree(tmp_path)
        with pytest.raises(runner.RunnerError, match=r"has SHA-256 [0-9a-f]{64}, not verl-0\.9\.1"):
            runner.sdist(archive, tmp_path / "cache")

    def test_known_layout_unpacks_with_the_step_dir_variant(self, tmp_path):
        root = runner.unpack_tests(sdist_tree(tmp_path), tmp_path / "work")
        runner.check_files(root)
        variant = (root / runner.STEP_DIRS_FILE).read_text()
        assert 'tmp_path / "global_step_1" / "actor"' in variant
        # Nothing but the save directory changes: the manager commits what it saved.
        assert "commit(" not in variant and variant.count("global_step_1") == 5
        assert not (root.parent / "verl").exists()  # only tests/: the installed verl is imported

    def test_unknown_test_file_is_named(self, tmp_path):
        extra = "tests/checkpoint_engine/test_new_on_cpu.py"
        root = runner.unpack_tests(sdist_tree(tmp_path, extra=extra), tmp_path / "work")
        with pytest.raises(runner.RunnerError, match="test_new_on_cpu.py.*neither selects"):
            runner.check_files(root)

    def test_rewrite_that_no_longer_applies_is_named(self, tmp_path):
        with pytest.raises(runner.RunnerError, match=r"holds 'tmp_path / \"ckpt\"' 0 times, not 3"):
            runner.unpack_tests(sdist_tree(tmp_path, lora=""), tmp_path / "work")

    def test_member_outside_the_tree_is_refused(self, tmp_path):
        path = tmp_path / runner.SDIST
        with tarfile.open(path, "w:gz") as tar:
            info = tarfile.TarInfo(f"verl-{runner.VERL_VERSION}/tests/../../escape.py")
            tar.addfile(info, io.BytesIO(b""))
        with pytest.raises(runner.RunnerError, match="unexpected member"):
            runner.unpack_tests(path, tmp_path / "work")
        assert not (tmp_path / "escape.py").exists()
