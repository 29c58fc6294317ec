"""A resume is bit-exact: the demo SIGKILLed at step k (after a step, and mid-save) and
resumed ends at step N with the uninterrupted run's weights, optimizer state, RNGs, data
order and weight versions (2 FSDP2 ranks on gloo, the demo's model)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest

from obsckpt.cli import write_result_json
from obsckpt.demo import DemoConfig, run_demo
from obsckpt.demo.root import committed_on_disk

N = 4


def config(root, **kw) -> DemoConfig:
    return DemoConfig(
        save_every=1,
        device="cpu",
        world_size=2,
        ckpt_dir=str(root),
        metrics_port=None,
        progress=False,
        keep=0,
        **kw,
    )


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory):
    """The uninterrupted run, and its --result-json."""
    tmp = tmp_path_factory.mktemp("reference")
    result = run_demo(config(tmp / "ckpt", steps=N), err=io.StringIO(), handle_signals=False)
    assert result.exit_code == 0 and result.last_step == N
    path = tmp / "reference.json"
    write_result_json(result, path)
    return result, path


@pytest.mark.slow
class TestKilledAndResumedRunMatches:
    """SIGKILL at step k (`obsckpt demo --kill-at`), then --resume to step N: every bit of the
    training state at N is the uninterrupted run's, and `--check-resume` says so."""

    @pytest.mark.parametrize("kill_at", ["2", "3:save"])
    def test_bit_exact(self, ray_cluster, reference, tmp_path, kill_at):
        ref, ref_json = reference
        root = tmp_path / "ckpt"
        address = ray_cluster.get_runtime_context().gcs_address
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        killed = subprocess.run(
            [sys.executable, "-m", "obsckpt", "demo", "--address", address, "--steps", str(N),
             "--save-every", "1", "--device", "cpu", "--world-size", "2", "--no-metrics",
             "--no-progress", "--keep", "0", "--ckpt-dir", str(root), "--kill-at", kill_at],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert killed.returncode == 128 + signal.SIGKILL, killed.stderr
        assert "--kill-at: SIGKILL" in killed.stderr
        assert "terminated by SIGKILL" in killed.stderr
        committed = committed_on_disk(root)["checkpoint"]
        k = int(kill_at.split(":")[0])
        if kill_at.endswith(":save"):
            assert committed == k - 1  # the step being written never commits
        else:
            assert committed in (k - 1, k)  # the kill may land before step k's commit

        err = io.StringIO()
        result = run_demo(
            config(root, steps=N - committed, resume=True, check_resume=str(ref_json)),
            err=err,
            handle_signals=False,
        )
        assert result.exit_code == 0, err.getvalue()
        assert result.resumed_from == committed and result.last_step == N
        assert result.republished_version == committed
        assert result.final_digest == ref.final_digest
        assert result.data_digests == ref.data_digests[committed:]
        assert result.rollout_versions == ref.rollout_versions[committed:]
        assert result.resume_check.startswith("resume check: matched"), result.resume_check
        assert "resume check: matched the uninterrupted run bit for bit at step 4" in (
            err.getvalue()
        )


@pytest.mark.slow
class TestCheckResumeSeesADifference:
    """--check-resume fails a run that is not the reference's (another seed): exit 1, and the
    line names the first step whose data differs."""

    def test_other_seed(self, ray_cluster, reference, tmp_path):
        _ref, ref_json = reference
        err = io.StringIO()
        result = run_demo(
            config(tmp_path / "ckpt", steps=N, seed=1, check_resume=str(ref_json)),
            err=err,
            handle_signals=False,
        )
        assert result.exit_code == 1 and result.stop_reason == "resume mismatch"
        assert "resume check: MISMATCH at step 1: the ranks trained on other data" in (
            err.getvalue()
        )
