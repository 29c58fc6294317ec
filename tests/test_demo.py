"""``obsckpt demo`` end to end: 2 FSDP2 ranks on gloo, background saves, weight sync, summary."""

from __future__ import annotations

import io
import json

import pytest
import torch

from obsckpt import commit as disk
from obsckpt.cli import main
from obsckpt.demo import DemoConfig, run_demo
from obsckpt.demo.job import DemoError, resolve_plan
from obsckpt.demo.summary import Histogram, Scrape


@pytest.mark.slow
class TestDemoRun:
    """A 4-step run saving every 2 steps commits step 4 whole, and the rollout saw every version."""

    def test_end_to_end(self, ray_cluster, tmp_path):
        root = tmp_path / "ckpt"
        out, err = io.StringIO(), io.StringIO()
        # The CPU plan, also on a GPU machine (the GPU plan: test_demo_on_gpu).
        cfg = DemoConfig(
            steps=4, save_every=2, device="cpu", ckpt_dir=str(root), metrics_host="127.0.0.1"
        )
        result = run_demo(cfg, out=out, err=err, handle_signals=False)

        assert result.exit_code == 0, err.getvalue()
        assert result.stop_reason == "completed"
        assert result.checkpoint_steps == [2, 4]
        assert result.committed == {"checkpoint": 4, "state_dict": 4}
        assert result.rollout_versions == [1, 2, 3, 4]
        assert disk.read_iteration(root, "checkpoint") == 4
        sdir = disk.step_dir(root, 4)
        assert disk.verify_step(sdir) == []
        names = {r.path for r in disk.read_manifest(sdir)}
        for rank in range(2):
            for kind in ("model", "optim", "extra_state"):
                assert f"actor/{kind}_world_size_2_rank_{rank}.pt" in names

        # The summary comes from the job's own /metrics.
        summary = result.summary
        assert summary is not None
        assert summary["saves_failed"] == 0 and summary["saves_ok"] == 12
        assert summary["model_version"] == {"trainer": 4, "rollout": 4}
        what = [r.what for r in summary["rows"]]
        assert "save optim" in what and "broadcast (gloo)" in what
        assert "commit lag (checkpoint)" in what
        table = out.getvalue()
        assert "p50" in table and "committed: checkpoint 4" in table
        assert "metrics: http://127.0.0.1:" in err.getvalue()

        # The CLI agrees with the run.
        code_out = io.StringIO()
        assert main(["verify", str(root)], out=code_out, err=io.StringIO()) == 0
        assert code_out.getvalue().startswith("step 4: OK")
        status_out = io.StringIO()
        assert main(["status", str(root), "--json"], out=status_out) == 0
        st = json.loads(status_out.getvalue())
        assert st["committed"] == [2, 4] and st["uncommitted"] == []


class TestPlan:
    """The demo trains on the GPUs it finds: one GPU colocates the rollout, more broadcast."""

    def test_cpu_keeps_two_ranks_and_broadcast(self):
        for gpus, device in ((0, "auto"), (4, "cpu")):
            cfg = resolve_plan(DemoConfig(device=device), gpus=gpus)
            assert (cfg.device, cfg.world_size, cfg.sync_method) == ("cpu", 2, "broadcast")

    def test_one_gpu_runs_one_rank_with_ipc(self):
        cfg = resolve_plan(DemoConfig(), gpus=1)
        assert (cfg.device, cfg.world_size, cfg.sync_method) == ("cuda", 1, "ipc")

    def test_more_gpus_broadcast_over_nccl(self):
        cfg = resolve_plan(DemoConfig(), gpus=2)
        assert (cfg.device, cfg.world_size, cfg.sync_method) == ("cuda", 1, "broadcast")
        cfg = resolve_plan(DemoConfig(), gpus=8)
        assert (cfg.device, cfg.world_size, cfg.sync_method) == ("cuda", 2, "broadcast")

    def test_impossible_plans_say_why(self):
        with pytest.raises(DemoError, match="needs a GPU per trainer rank"):
            resolve_plan(DemoConfig(sync_method="broadcast"), gpus=1)
        with pytest.raises(DemoError, match="one trainer rank sharing its GPU"):
            resolve_plan(DemoConfig(sync_method="ipc", world_size=2), gpus=1)
        with pytest.raises(DemoError, match="no CUDA device"):
            resolve_plan(DemoConfig(device="cuda"), gpus=0)


@pytest.mark.slow
def test_ipc_sync_on_cpu(ray_cluster, tmp_path):
    """The colocated (ipc) sync through the demo: shared-memory buckets on CPU, every version."""
    out, err = io.StringIO(), io.StringIO()
    cfg = DemoConfig(
        steps=2,
        save_every=2,
        world_size=1,
        sync_method="ipc",
        device="cpu",
        ckpt_dir=str(tmp_path / "ckpt"),
        metrics_host="127.0.0.1",
    )
    result = run_demo(cfg, out=out, err=err, handle_signals=False)
    assert result.exit_code == 0, err.getvalue()
    assert result.rollout_versions == [1, 2]
    assert result.device == "cpu" and result.sync_method == "ipc"
    assert "weight sync ipc (shared memory)" in err.getvalue()
    assert "ipc sync (shm)" in [r.what for r in result.summary["rows"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the demo's GPU plan needs CUDA")
def test_demo_on_gpu(ray_cluster, tmp_path):
    """On a GPU machine the default demo trains on it and syncs with ipc (1 GPU) or NCCL."""
    out, err = io.StringIO(), io.StringIO()
    cfg = DemoConfig(
        steps=4, save_every=2, ckpt_dir=str(tmp_path / "ckpt"), metrics_host="127.0.0.1"
    )
    result = run_demo(cfg, out=out, err=err, handle_signals=False)
    assert result.exit_code == 0, err.getvalue()
    assert result.rollout_versions == [1, 2, 3, 4]
    assert result.device.startswith("cuda"), result.device
    gpus = torch.cuda.device_count()
    want = "ipc sync (cuda_ipc)" if gpus == 1 else "broadcast (nccl)"
    assert want in [r.what for r in result.summary["rows"]], out.getvalue()


class TestSummaryMath:
    """Quantiles follow PromQL's histogram_quantile on the scraped buckets."""

    def test_quantiles_from_buckets(self):
        h = Histogram(
            buckets=[(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (float("inf"), 10.0)], count=10.0, sum=4.0
        )
        assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)
        assert h.quantile(0.95) == pytest.approx(0.5 + 0.5 * (9.5 - 6) / 4)
        assert h.max_bound() == 1.0
        assert h.mean == pytest.approx(0.4)
        assert Histogram().quantile(0.5) is None

    def test_scrape_groups_by_label(self):
        text = (
            "# TYPE obsckpt_save_duration_seconds histogram\n"
            'obsckpt_save_duration_seconds_bucket{slot="optim",kind="checkpoint",le="0.5"} 3\n'
            'obsckpt_save_duration_seconds_bucket{slot="optim",kind="checkpoint",le="+Inf"} 4\n'
            'obsckpt_save_duration_seconds_count{slot="optim",kind="checkpoint"} 4\n'
            'obsckpt_save_duration_seconds_sum{slot="optim",kind="checkpoint"} 2.5\n'
        )
        hs = Scrape(text).histograms("obsckpt_save_duration_seconds", by="slot")
        assert set(hs) == {"optim"}
        assert hs["optim"].count == 4 and hs["optim"].quantile(0.5) == pytest.approx(1 / 3)
