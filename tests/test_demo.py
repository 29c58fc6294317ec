"""``obsckpt demo`` end to end: 2 FSDP2 ranks on gloo, background saves, weight sync, summary."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

import psutil
import pytest
import torch
from docs_samples import block_with, missing_shapes
from reliability_helpers import RunsCode, rewrite_manifest

from obsckpt.cli import main
from obsckpt.demo import DemoConfig, run_demo
from obsckpt.demo.plan import resolve_plan
from obsckpt.demo.result import finish_line
from obsckpt.demo.root import MARKER, prepare_root
from obsckpt.demo.summary import Histogram, Scrape
from obsckpt.errors import DemoError
from obsckpt.store import commit, layout, reader
from obsckpt.store.commit import finalize_step


@pytest.mark.slow
class TestDemoRun:
    """A 4-step run saving every 2 steps commits step 4 whole, and the rollout saw every version."""

    def test_end_to_end(self, ray_cluster, tmp_path):
        root = tmp_path / "my ckpt"  # a space: the printed command must still work
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
        assert reader.read_iteration(root, "checkpoint") == 4
        sdir = layout.step_dir(root, 4)
        assert reader.verify_step(sdir) == []
        names = {r.path for r in reader.read_manifest(sdir)}
        for rank in range(2):
            for kind in ("model", "optim", "extra_state"):
                assert f"actor/{kind}_world_size_2_rank_{rank}.pt" in names
            assert f"resume/rank_{rank}.pt" in names

        # The summary comes from the job's own /metrics.
        summary = result.summary
        assert summary is not None
        # 2 checkpoints x 2 ranks x (model, optimizer, extra state, resume record).
        assert summary["saves_failed"] == 0 and summary["saves_ok"] == 16
        assert summary["model_version"] == {"trainer": 4, "rollout": 4}
        what = [r.what for r in summary["rows"]]
        assert "save optim" in what and "broadcast (gloo)" in what
        assert "commit lag (checkpoint)" in what
        table = out.getvalue()
        assert "p50" in table and "committed: checkpoint 4" in table
        assert "metrics: http://127.0.0.1:" in err.getvalue()
        assert f"(inspect with `obsckpt status '{root}'`)" in err.getvalue()
        # What it does while it starts, before the first step (Ray was up already).
        assert_in_order(
            err.getvalue(),
            [
                r"building the model on 2 ranks\.\.\.",
                r"ranks ready in \d+\.\d s",
                r"obsckpt demo: 2 FSDP2 ranks ",
                r"\[#+\.*\] step 1/4 ",
            ],
        )
        assert "Ray" not in err.getvalue().partition("ranks ready")[0]

        # The CLI agrees with the run.
        code_out = io.StringIO()
        assert main(["verify", str(root)], out=code_out, err=io.StringIO()) == 0
        assert code_out.getvalue().startswith("step 4: OK")

        # docs/demo.md's sample run and summary have the shape of what this run printed:
        # the same lines, rows and columns, other figures (Ray was up already here, and
        # this root's name has a space, so it is quoted).
        printed = err.getvalue() + table + finish_line(result) + "\n"
        run_sample = block_with("demo.md", "$ obsckpt demo --steps 6 --save-every 3")[1:]
        run_sample = [
            line
            for line in run_sample
            if not line.startswith(("starting a local Ray", "Ray up in", "checkpoints: "))
        ]
        assert missing_shapes(run_sample, printed) == []
        assert missing_shapes(block_with("demo.md", "count"), printed) == []
        status_out = io.StringIO()
        assert main(["status", str(root), "--json"], out=status_out) == 0
        st = json.loads(status_out.getvalue())
        assert st["committed"] == [2, 4] and st["uncommitted"] == []


def assert_in_order(text: str, patterns: list[str]) -> None:
    """Each pattern matches the start of a line of ``text``, each on a later line."""
    lines = text.splitlines()
    at = -1
    for pattern in patterns:
        later = [i for i, line in enumerate(lines) if i > at and re.match(pattern, line)]
        assert later, f"no line {pattern!r} after line {at} of:\n{text}"
        at = later[0]


def demo_step(root: Path, step: int, *, full: bool = True, commit: bool = True) -> Path:
    """A step as the demo (2 ranks) writes it: model shards, and optimizer state when full."""
    actor = layout.step_dir(root, step) / "actor"
    actor.mkdir(parents=True)
    kinds = ("model", "optim", "extra_state") if full else ("model",)
    for rank in range(2):
        for kind in kinds:
            (actor / f"{kind}_world_size_2_rank_{rank}.pt").write_bytes(b"w" * (100 + step))
    if commit:
        finalize_step(actor.parent)
    return actor.parent


def demo_root(tmp_path: Path) -> Path:
    """A root an earlier demo run wrote: its marker, full checkpoint 4, state dict 6, step 8
    never committed (a checkpoint-sync run stopped between full checkpoints)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / MARKER).write_text("{}\n")
    demo_step(root, 2)
    demo_step(root, 4)
    demo_step(root, 5, full=False)
    demo_step(root, 6, full=False)
    demo_step(root, 8, full=False, commit=False)
    commit.write_iteration(root, "checkpoint", 4)
    commit.write_iteration(root, "state_dict", 6)
    return root


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


class TestForeignRootIsNeverTouched:
    """A root without the demo's marker that is not empty is refused, with --resume too,
    before anything in it is deleted or written; the message does not suggest --resume."""

    @staticmethod
    def foreign(tmp_path: Path, what: str) -> Path:
        root = tmp_path / "mine"
        root.mkdir()
        if what == "checkpoints":
            actor = root / "global_step_100" / "actor"
            actor.mkdir(parents=True)
            (actor / "model.pt").write_text("precious\n")
            (root / "latest_state_dict_iteration.txt").write_text("100\n")
        elif what == "checkpoint iteration file":
            (root / "latest_checkpointed_iteration.txt").write_text("5\n")
        elif what == "state-dict iteration file":
            (root / "latest_state_dict_iteration.txt").write_text("5\n")
        else:
            (root / "notes.txt").write_text("mine\n")
        return root

    @pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
    @pytest.mark.parametrize(
        "what",
        ["checkpoints", "checkpoint iteration file", "state-dict iteration file", "other files"],
    )
    def test_refused_and_left_alone(self, tmp_path, what, resume):
        root = self.foreign(tmp_path, what)
        before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        said = []
        with pytest.raises(DemoError) as info:
            prepare_root(DemoConfig(ckpt_dir=str(root), resume=resume, world_size=2), said.append)
        msg = str(info.value)
        assert str(root) in msg and MARKER in msg and "--ckpt-dir" in msg
        assert "--resume" not in msg
        assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
        assert not (root / MARKER).exists() and said == []

    def test_an_empty_directory_is_taken(self, tmp_path):
        root = tmp_path / "empty"
        root.mkdir()
        got, resumed, state_dict = prepare_root(
            DemoConfig(ckpt_dir=str(root), resume=True, world_size=2), lambda _: None
        )
        assert (got, resumed, state_dict) == (root.resolve(), 0, None)
        assert tree(root) == {MARKER}


class TestResumeKeepsCommittedSteps:
    """--resume in the demo's own root deletes only steps above both iteration files;
    a fresh run in it starts over."""

    def test_state_dict_newer_than_the_checkpoint(self, tmp_path):
        root = demo_root(tmp_path)
        said = []
        got, resumed, state_dict = prepare_root(
            DemoConfig(ckpt_dir=str(root), resume=True, world_size=2), said.append
        )
        assert (resumed, state_dict) == (4, 6)
        assert reader.steps_on_disk(root) == [2, 4, 5, 6]
        assert reader.read_iteration(root, "checkpoint") == 4
        assert reader.read_iteration(root, "state_dict") == 6
        for step in (2, 4, 5, 6):
            assert reader.verify_step(layout.step_dir(root, step)) == []
        assert any("uncommitted steps [8]" in s for s in said), said

    def test_no_checkpoint_but_a_state_dict(self, tmp_path):
        root = demo_root(tmp_path)
        (root / layout.ITERATION_FILES["checkpoint"]).unlink()
        got, resumed, state_dict = prepare_root(
            DemoConfig(ckpt_dir=str(root), resume=True, world_size=2), lambda _: None
        )
        assert (resumed, state_dict) == (0, 6)
        assert reader.steps_on_disk(root) == [2, 4, 5, 6]
        assert reader.read_iteration(root, "state_dict") == 6

    def test_without_resume_the_demo_starts_over(self, tmp_path):
        root = demo_root(tmp_path)
        got, resumed, state_dict = prepare_root(
            DemoConfig(ckpt_dir=str(root), world_size=2), lambda _: None
        )
        assert (resumed, state_dict) == (0, None)
        assert tree(root) == {MARKER}


class TestCkptDirErrors:
    """A --ckpt-dir that cannot be used is named as the flag, before Ray starts."""

    def test_a_file(self, tmp_path):
        f = tmp_path / "some_file"
        f.write_text("x")
        out, err = io.StringIO(), io.StringIO()
        code = main(["demo", "--ckpt-dir", str(f), "--steps", "1"], out=out, err=err)
        assert code == 2
        line = err.getvalue()
        assert line.count("\n") == 1
        assert f"--ckpt-dir {f} is a file, not a directory" in line
        assert "default_local_dir" not in line
        assert f.read_text() == "x"


def _stop_between_full_checkpoints(root: Path, step: int, checkpoint: int) -> None:
    """Make ``step`` a committed state dict newer than the committed checkpoint ``checkpoint``,
    as a checkpoint-sync run stopped after ``step`` leaves it (the iteration file goes back)."""
    sdir = layout.step_dir(root, step)
    for f in (sdir / "actor").iterdir():
        if f.name.startswith(("optim_", "extra_state_")):
            f.unlink()
    (sdir / layout.MANIFEST_NAME).unlink()
    commit.finalize_step(sdir)
    commit.atomic_write(root / layout.ITERATION_FILES["checkpoint"], f"{checkpoint}\n".encode())


@pytest.mark.slow
class TestResumeWithCheckpointSync:
    """A checkpoint-sync run stopped between full checkpoints resumes from the full one:
    the newer committed state dict stays, the steps up to it are trained again without
    state-dict saves, and the rollout gets every version after it."""

    def test_resume_end_to_end(self, ray_cluster, tmp_path):
        root = tmp_path / "ckpt"
        common = dict(
            sync_method="checkpoint",
            device="cpu",
            ckpt_dir=str(root),
            metrics_host="127.0.0.1",
            commit_timeout=60.0,
            progress=False,
        )
        first = run_demo(
            DemoConfig(steps=3, save_every=2, **common),
            out=io.StringIO(),
            err=io.StringIO(),
            handle_signals=False,
        )
        assert first.exit_code == 0 and first.checkpoint_steps == [2, 3]
        _stop_between_full_checkpoints(root, 3, checkpoint=2)

        err = io.StringIO()
        resumed = dict(common, progress=True)
        result = run_demo(
            DemoConfig(steps=3, save_every=3, resume=True, **resumed),
            out=io.StringIO(),
            err=err,
            handle_signals=False,
        )
        assert result.exit_code == 0, err.getvalue()
        assert (result.resumed_from, result.first_step, result.last_step) == (2, 3, 5)
        assert "step 3 is trained again without state-dict saves" in err.getvalue()
        # Steps 3 to 5 of a run that ends at step 5 (not "step 5/3").
        progress = [ln for ln in err.getvalue().splitlines() if ln.startswith("[")]
        assert progress and progress[-1].startswith("[" + "#" * 24 + "] step 5/5"), progress
        assert all("/5 " in ln for ln in progress), progress
        # Step 3 is a full checkpoint again; 4 a state dict, 5 the last full checkpoint.
        assert result.checkpoint_steps == [3, 5]
        assert result.rollout_versions == [4, 5]
        assert result.committed == {"checkpoint": 5, "state_dict": 5}
        # The earlier run's full checkpoint 2 is kept (--keep 3); state dict 4 was rotated.
        assert reader.steps_on_disk(root) == [2, 3, 5]
        code_out = io.StringIO()
        assert main(["verify", str(root), "--all"], out=code_out, err=io.StringIO()) == 0
        assert code_out.getvalue().count(": OK") == 3
        status_out = io.StringIO()
        assert main(["status", str(root), "--json"], out=status_out) == 0
        assert json.loads(status_out.getvalue())["problems"] == []


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


@pytest.mark.slow
def test_duration_memory_sync_and_result_json(ray_cluster, tmp_path, monkeypatch):
    """`obsckpt demo --steps 0 --duration` counts from the first step (start-up takes longer
    than this duration), saves the step that ends it, and --result-json holds what was printed.
    Relative --file-sd and --result-json paths are the caller's, made absolute."""
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "ckpt"
    out, err = io.StringIO(), io.StringIO()
    code = main(
        [
            "demo",
            "--steps",
            "0",
            "--duration",
            "0.001",
            "--sync-method",
            "memory",
            "--device",
            "cpu",
            "--ckpt-dir",
            str(root),
            "--metrics-host",
            "127.0.0.1",
            "--file-sd",
            "sd/targets.json",
            "--result-json",
            "result.json",
            "--no-progress",
        ],
        out=out,
        err=err,
    )
    text = err.getvalue()
    assert code == 0, text
    assert f"file_sd: {tmp_path / 'sd' / 'targets.json'}\n" in text
    assert (tmp_path / "sd" / "targets.json").is_file()
    assert text.endswith("\n") and "demo duration: step 1, committed checkpoint 1, " in text
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["stop_reason"] == "duration" and data["exit_code"] == 0
    assert (data["first_step"], data["last_step"]) == (1, 1)
    assert data["checkpoint_steps"] == [1] and data["rollout_versions"] == [1]
    assert data["committed"] == {"checkpoint": 1, "state_dict": 1}
    assert reader.read_iteration(root, "checkpoint") == 1
    assert reader.verify_step(layout.step_dir(root, 1)) == []
    # The JSON's summary is the table that was printed, row by row.
    summary = data["summary"]
    assert summary["model_version"] == {"trainer": 1, "rollout": 1}
    table = out.getvalue()
    for row in summary["rows"]:
        line = next(ln for ln in table.splitlines() if ln.startswith(row["what"] + " "))
        for cell in ("count", "p50", "p95", "max", "mean"):
            assert row[cell] in line, (row, line)
    assert "state-dict upload" in [r["what"] for r in summary["rows"]]
    assert "model version: trainer 1, rollout 1" in table


class TestRootChecks:
    """What prepare_root refuses, and its dry run (checks before Ray starts) changes nothing."""

    def test_dry_run_removes_nothing(self, tmp_path):
        root = demo_root(tmp_path)
        before = tree(root)
        for resume in (False, True):
            got = prepare_root(
                DemoConfig(ckpt_dir=str(root), resume=resume, world_size=2),
                pytest.fail,
                dry_run=True,
            )
            assert got == ((root.resolve(), 4, 6) if resume else (root.resolve(), 0, None))
        assert tree(root) == before

    def test_resume_from_a_damaged_step_is_refused(self, tmp_path):
        """Loading it would fail in a trainer rank with a remote traceback, or load bad state."""
        root = demo_root(tmp_path)
        shard = layout.step_dir(root, 4) / "actor" / "optim_world_size_2_rank_1.pt"
        shard.write_bytes(b"x" * 3)
        before = tree(root)
        with pytest.raises(DemoError) as info:
            prepare_root(DemoConfig(ckpt_dir=str(root), resume=True, world_size=2), pytest.fail)
        msg = str(info.value)
        assert "--resume: committed step 4" in msg and "does not match its manifest" in msg
        assert f"{shard}: truncated" in msg and "obsckpt verify" in msg
        assert tree(root) == before  # step 8, never committed, is not removed either

    def test_resume_with_another_world_size_is_refused(self, tmp_path):
        root = demo_root(tmp_path)
        with pytest.raises(DemoError, match=r"not saved by 3 ranks \(found world sizes \['2'\]\)"):
            prepare_root(DemoConfig(ckpt_dir=str(root), resume=True, world_size=3), pytest.fail)


class TestProgress:
    def test_a_resumed_run_counts_to_its_last_step(self):
        from obsckpt.demo.progress import Progress

        stream = io.StringIO()
        p = Progress(3, stream=stream, interactive=False)
        p.set_range(4, 7)  # resumed at 4, --steps 3
        p.update(5, loss=1.0, committed=4, in_flight=0, pending=0, rollout_version=5)
        line = stream.getvalue().splitlines()[-1]
        assert line.startswith("[########................] step 5/7"), line

    def test_a_duration_fills_the_bar_when_it_ends_the_run_first(self):
        import time

        from obsckpt.demo.progress import Progress

        stream = io.StringIO()
        p = Progress(40, stream=stream, interactive=False, interval=0.0)
        p.set_range(0, 40)
        p.set_duration(10.0, time.monotonic() - 5.0)  # half of --duration 10 gone
        p.update(2, loss=1.0, committed=None, in_flight=0, pending=0, rollout_version=2)
        line = stream.getvalue().splitlines()[-1]
        assert line.startswith("[############............] step 2/40 (5/10s)"), line
        p.set_duration(10.0, time.monotonic() - 30.0)  # over: the last step ran
        p.update(3, loss=1.0, committed=None, in_flight=0, pending=0, rollout_version=3)
        line = stream.getvalue().splitlines()[-1]
        assert line.startswith("[########################] step 3/40 (10/10s)"), line

    def test_duration_without_steps(self):
        import time

        from obsckpt.demo.progress import Progress

        stream = io.StringIO()
        p = Progress(None, stream=stream, interactive=False, interval=0.0)
        p.set_duration(20.0, time.monotonic() - 5.0)
        p.update(7, loss=1.0, committed=None, in_flight=0, pending=0, rollout_version=7)
        line = stream.getvalue().splitlines()[-1]
        assert line.startswith("[######..................] step 7 (5/20s)"), line


def test_summary_shows_no_version_before_one_is_reported():
    """The model-version series are created at 0; a run that synced nothing shows '-'."""
    from obsckpt.demo.summary import format_table, summarize

    text = (
        "# TYPE obsckpt_model_version gauge\n"
        'obsckpt_model_version{role="trainer"} 0\n'
        'obsckpt_model_version{role="rollout"} 0\n'
    )
    summary = summarize(Scrape(text), {"checkpoint": None, "state_dict": None})
    assert summary["model_version"] == {"trainer": None, "rollout": None}
    assert "model version: trainer -, rollout -" in format_table(summary)


def demo_ranks(pid: int, timeout: float = 60.0) -> list:
    """The trainer rank processes of the demo whose driver is ``pid`` (its own cluster's
    workers: Ray titles them ``ray::TrainerRank``)."""
    import time

    def ranks() -> list:
        found = []
        for p in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::TrainerRank"):
                    found.append(p)
        return found

    deadline = time.monotonic() + timeout
    while len(found := ranks()) < 2:
        assert time.monotonic() < deadline, f"the demo's two ranks not found: {found}"
        time.sleep(0.1)
    return found


@pytest.mark.slow
def test_second_ctrl_c_stops_at_once(tmp_path):
    """Two Ctrl-Cs: exit 130, and the last line names the checkpoint the iteration file
    names (read from disk: the monitor is not asked), which is whole."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    root = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "obsckpt.cli", "demo", "--steps", "0", "--save-every", "1"]
    cmd += ["--device", "cpu", "--ckpt-dir", str(root), "--metrics-host", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, RAY_DEDUP_LOGS="0"),
    )
    lines: list[str] = []
    first_seen = threading.Event()

    def read_stderr() -> None:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("received SIGINT"):
                first_seen.set()

    stderr_reader = threading.Thread(target=read_stderr, daemon=True)
    stderr_reader.start()
    try:
        deadline = time.monotonic() + 240
        while reader.read_iteration(root, "checkpoint") is None:
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "no commit within 240 s"
            time.sleep(0.2)
        # The demo's ranks are held (SIGSTOP) while the two signals come, so the step in
        # progress cannot end between them: on a loaded machine the first one's step and
        # drain could otherwise be over before the second is sent, and the run would end as
        # one Ctrl-C ends it.
        ranks = demo_ranks(proc.pid)
        for rank in ranks:
            rank.suspend()
        try:
            proc.send_signal(signal.SIGINT)
            # Two signals sent at once arrive as one: the second goes once the first is
            # handled, while the step in progress still runs.
            assert first_seen.wait(60), "".join(lines)
            proc.send_signal(signal.SIGINT)
            until = time.monotonic() + 60
            while not any(line.startswith("stopped at once") for line in lines):
                assert time.monotonic() < until, "".join(lines)
                time.sleep(0.05)
        finally:
            for rank in ranks:
                with contextlib.suppress(psutil.Error):
                    rank.resume()
        proc.wait(timeout=120)
        stderr_reader.join(30)
        err = "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    committed = reader.read_iteration(root, "checkpoint")
    last = err.strip().splitlines()[-1]
    assert last.startswith("demo aborted: step"), err
    assert f", committed checkpoint {committed}, " in last, err
    assert "stopped at once: saves still in flight are left uncommitted" in err
    assert "Traceback" not in err
    # What it did while it started: Ray, then the ranks, each timed, before the job's line.
    assert_in_order(
        err,
        [
            rf"starting a local Ray cluster \({max(os.cpu_count() or 1, 3)} CPUs\)\.\.\.",
            r"Ray up in \d+\.\d s",
            r"building the model on 2 ranks\.\.\.",
            r"ranks ready in \d+\.\d s",
            r"obsckpt demo: 2 FSDP2 ranks ",
            r"received SIGINT",
        ],
    )
    assert reader.verify_step(layout.step_dir(root, committed)) == []


@pytest.mark.slow
class TestResumeNeverRunsCodeFromDisk:
    """--resume from a step whose file was replaced by a code-running pickle (its manifest
    rewritten to match, as whoever can write the shard can do) fails naming the file and
    the global; the pickle's code never runs."""

    def test_crafted_pickle(self, ray_cluster, tmp_path):
        root = tmp_path / "ckpt"
        common = dict(
            sync_method="checkpoint",
            device="cpu",
            ckpt_dir=str(root),
            metrics_host="127.0.0.1",
            commit_timeout=60.0,
            progress=False,
        )
        first = run_demo(
            DemoConfig(steps=2, save_every=2, **common),
            out=io.StringIO(),
            err=io.StringIO(),
            handle_signals=False,
        )
        assert first.exit_code == 0 and first.checkpoint_steps == [2]
        sdir = layout.step_dir(root, 2)
        extra = sdir / "actor" / "extra_state_world_size_2_rank_0.pt"
        marker = tmp_path / "code-ran"
        torch.save({"rng": RunsCode(str(marker)), "lr_scheduler": None}, extra)
        rewrite_manifest(sdir)

        with pytest.raises(DemoError) as info:
            run_demo(
                DemoConfig(steps=1, save_every=2, resume=True, **common),
                out=io.StringIO(),
                err=io.StringIO(),
                handle_signals=False,
            )
        said = str(info.value)
        assert re.search(
            r"--resume: committed step 2 cannot be loaded: .*extra_state_world_size_2_rank_0\.pt "
            r"refers to the global (io|builtins)\.open",
            said,
        ), said
        assert "\n" not in said and "Traceback" not in said
        assert not marker.exists()


class TestKillAndCheckFlags:
    """--kill-at K[:save] and --check-resume REF are parsed and checked before Ray starts;
    a bad value is one line naming the flag (exit 2)."""

    def test_kill_at_forms(self):
        from obsckpt.cli import build_parser

        parse = build_parser().parse_args
        assert parse(["demo", "--kill-at", "3"]).kill_at == (3, False)
        assert parse(["demo", "--kill-at", "4:save"]).kill_at == (4, True)
        assert parse(["demo"]).kill_at is None

    @pytest.mark.parametrize("value", ["0", "x", "3:later", "-1:save"])
    def test_bad_kill_at(self, value, tmp_path, capsys):
        code = main(["demo", "--ckpt-dir", str(tmp_path / "c"), f"--kill-at={value}"])
        assert code == 2
        line = capsys.readouterr().err.splitlines()[-1]
        assert line.endswith(f"--kill-at: must be a step K >= 1 or K:save, got {value!r}")
        assert not (tmp_path / "c").exists()

    def test_kill_in_save_needs_a_saving_step(self):
        with pytest.raises(ValueError, match=r"multiple of save_every \(2\); got kill_at 3"):
            DemoConfig(save_every=2, kill_at=3, kill_in_save=True)
        DemoConfig(save_every=2, kill_at=4, kill_in_save=True)

    @pytest.mark.parametrize("content", [None, "not json", '{"last_step": 4}'])
    def test_unusable_reference_is_refused_before_ray(self, tmp_path, content):
        ref = tmp_path / "ref.json"
        if content is not None:
            ref.write_text(content)
        root = tmp_path / "ckpt"
        err = io.StringIO()
        code = main(
            ["demo", "--device", "cpu", "--ckpt-dir", str(root), "--check-resume", str(ref)],
            err=err,
        )
        assert code == 2, err.getvalue()
        assert f"--check-resume {ref}" in err.getvalue() and "--result-json" in err.getvalue()
        assert not root.exists() or list(root.iterdir()) == []
