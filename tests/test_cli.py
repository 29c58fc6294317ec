"""The ``obsckpt status`` and ``obsckpt verify`` commands on real checkpoint directories."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.cli import main
from obsckpt.store import commit, layout, reader


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def make_step(root: Path, step: int, *, commit: bool = True) -> Path:
    """A step with verl's file names, finalized and committed as the monitor would."""
    sdir = layout.step_dir(root, step)
    actor = sdir / "actor"
    actor.mkdir(parents=True)
    for rank in range(2):
        for kind in ("model", "optim", "extra_state"):
            data = bytes((step * 31 + rank * 7 + i) % 251 for i in range(4096 + 100 * rank))
            (actor / f"{kind}_world_size_2_rank_{rank}.pt").write_bytes(data)
    (actor / "huggingface").mkdir()
    (actor / "huggingface" / "config.json").write_text('{"model_type": "qwen2"}\n')
    if commit:
        commit_step(root, step)
    return sdir


def commit_step(root: Path, step: int) -> None:
    """Finalize a step and name it in both iteration files, as the monitor commits one."""
    commit.finalize_step(layout.step_dir(root, step))
    commit.write_iteration(root, "checkpoint", step)
    commit.write_iteration(root, "state_dict", step)


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    make_step(root, 2)
    make_step(root, 4)
    return root


class TestVerify:
    """verify passes a whole step and names every missing, truncated or corrupted file."""

    def test_latest_committed_step_verifies(self, root):
        code, out, err = run("verify", str(root))
        assert code == 0, err
        assert out.startswith("step 4: OK, 7 files")
        assert err == ""

    def test_truncated_missing_and_flipped_files_are_named(self, root):
        actor = layout.step_dir(root, 4) / "actor"
        truncated = actor / "model_world_size_2_rank_0.pt"
        truncated.write_bytes(truncated.read_bytes()[:1000])
        missing = actor / "optim_world_size_2_rank_1.pt"
        missing.unlink()
        flipped = actor / "extra_state_world_size_2_rank_1.pt"
        data = bytearray(flipped.read_bytes())
        data[100] ^= 0xFF
        data[2000] ^= 0x01
        flipped.write_bytes(bytes(data))

        code, out, err = run("verify", str(root))
        assert code == 1
        assert "step 4: FAILED, 3 problem(s)" in out
        lines = err.strip().splitlines()
        assert len(lines) == 3
        assert any(str(truncated) in ln and "truncated (1000 bytes" in ln for ln in lines)
        assert any(str(missing) in ln and "missing" in ln for ln in lines)
        assert any(str(flipped) in ln and "corrupted" in ln for ln in lines)
        # The older step is untouched and still verifies on its own.
        assert run("verify", str(root), "--step", "2")[0] == 0

    def test_all_checks_every_step_with_a_manifest(self, root):
        (layout.step_dir(root, 2) / "actor" / "model_world_size_2_rank_1.pt").unlink()
        code, out, err = run("verify", str(root), "--all")
        assert code == 1
        assert "step 2: FAILED" in out and "step 4: OK" in out
        assert "model_world_size_2_rank_1.pt: missing" in err

    @pytest.mark.parametrize(
        "mode", [["--all"], [], ["--step", "2"]], ids=["all", "latest", "step"]
    )
    def test_a_step_an_iteration_file_names_must_be_on_disk(self, root, mode):
        shutil.rmtree(layout.step_dir(root, 4))
        code, out, err = run("verify", str(root), *mode)
        assert code == 1
        assert "step 4: FAILED, not on disk" in out
        assert (
            f"step 4: {layout.step_dir(root, 4)} is missing, but latest_checkpointed_iteration.txt "
            "and latest_state_dict_iteration.txt name it"
        ) in err
        if mode != []:
            assert "step 2: OK" in out

    def test_json_gives_each_step_and_its_problems(self, root):
        (layout.step_dir(root, 2) / "actor" / "model_world_size_2_rank_1.pt").unlink()
        commit.write_iteration(root, "state_dict", 6)
        code, out, err = run("verify", str(root), "--all", "--json")
        assert code == 1 and err == ""
        report = json.loads(out)
        assert report["root"] == str(root.resolve()) and report["ok"] is False
        by_step = {s["step"]: s for s in report["steps"]}
        assert sorted(by_step) == [2, 4, 6]
        assert by_step[2]["result"] == "failed"
        assert "model_world_size_2_rank_1.pt: missing" in by_step[2]["problems"][0]
        assert by_step[4]["result"] == "ok" and by_step[4]["files"] == 7
        assert by_step[4]["bytes"] == sum(
            r.size for r in reader.read_manifest(layout.step_dir(root, 4))
        )
        assert by_step[6]["result"] == "failed" and by_step[6]["on_disk"] is False

    def test_a_step_only_the_state_dict_file_names_must_be_on_disk(self, root):
        commit.write_iteration(root, "state_dict", 6)
        code, out, err = run("verify", str(root))
        assert code == 1
        assert "step 4: OK" in out and "step 6: FAILED, not on disk" in out
        assert "but latest_state_dict_iteration.txt names it" in err

    @pytest.mark.parametrize("foreign", [False, True], ids=["obsckpt root", "verl root"])
    def test_status_names_an_iteration_file_whose_step_is_not_whole(self, tmp_path, foreign):
        """No manifest and a rank's shard missing: status says so and exits 1, as verify does."""
        root = tmp_path / "ckpt"
        make_step(root, 2, commit=not foreign)
        make_step(root, 4, commit=False)
        (layout.model_dir(root, 4) / "model_world_size_2_rank_1.pt").unlink()
        commit.write_iteration(root, "checkpoint", 4)
        code, out, _ = run("status", str(root))
        assert code == 1, out
        (line,) = [ln for ln in out.splitlines() if ln.lstrip().startswith("4 ")]
        assert "not whole" in line and "committed" not in line.split()[1]
        assert "actor/model_world_size_2_rank_1.pt missing" in out
        assert f"`obsckpt repair {root}` points it at step 2" in out
        assert run("verify", str(root))[0] == 1
        st = json.loads(run("status", str(root), "--json")[1])
        assert st["steps"][-1]["state"] == "not whole" and st["problems"]

    def test_a_step_whose_files_vanished_is_damaged_not_retention(self, root):
        """A step holding only its manifest is `damaged` in status and fails verify --all:
        obsckpt's retention removes whole step directories, so something else removed these."""
        shutil.rmtree(layout.step_dir(root, 2) / "actor")
        st = json.loads(run("status", str(root), "--json")[1])
        assert st["steps"][0]["state"] == "damaged"
        code, out, err = run("verify", str(root), "--all")
        assert code == 1
        assert out.splitlines()[0].startswith("step 2: FAILED")
        assert "are gone" in err and "not obsckpt's retention" not in out
        assert "step 4: OK, 7 files, 24.3 KiB match the manifest" in out

    def test_a_file_the_manifest_does_not_list_fails(self, root):
        extra = layout.step_dir(root, 4) / "actor" / "optimizer.tmp"
        extra.write_bytes(b"added after the commit")
        code, out, err = run("verify", str(root), "--step", "4")
        assert code == 1, out
        assert f"{extra}: not listed in the manifest" in err

    def test_a_file_a_save_names_like_a_temp_file_is_data(self, root):
        """Only obsckpt's own temp names are left out; `optimizer.tmp` is checked."""
        step = layout.step_dir(root, 4) / "actor"
        (step / "optimizer.tmp").write_bytes(b"x")
        (step / f"model.pt.tmp.{os.getpid()}.0123abcd").write_bytes(b"half")
        problems = reader.verify_step(layout.step_dir(root, 4))
        assert problems == [f"{step / 'optimizer.tmp'}: not listed in the manifest"]

    def test_step_without_manifest_fails(self, root):
        make_step(root, 6, commit=False)
        code, _out, err = run("verify", str(root), "--step", "6")
        assert code == 1
        assert "missing manifest" in err


class TestStatus:
    """status lists committed and uncommitted steps, with sizes, ages and why a step is not committed."""

    def test_committed_steps(self, root):
        code, out, err = run("status", str(root), "--json")
        assert code == 0, err
        st = json.loads(out)
        assert st["latest"] == {"checkpoint": 4, "state_dict": 4}
        assert st["committed"] == [2, 4]
        assert st["uncommitted"] == []
        step4 = st["steps"][1]
        assert step4["kind"] == "checkpoint" and step4["note"] == "latest checkpoint"
        assert step4["bytes"] > 6 * 4096 and step4["age_s"] >= 0
        code, text, _ = run("status", str(root))
        assert code == 0
        assert "latest checkpoint: 4" in text and "committed" in text

    def test_uncommitted_step_of_an_interrupted_save(self, ray_cluster, namespace, tmp_path):
        """A save that never finishes (its job was killed) leaves a step status calls uncommitted."""
        root = tmp_path / "ckpt"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=str(root), metrics_port=None
        )
        ray.get(monitor.status.remote())
        coord = CheckpointCoordinator(monitor, rank=0)
        actor = root / "global_step_1" / "actor"

        def write(name):
            def save():
                actor.mkdir(parents=True, exist_ok=True)
                (actor / name).write_bytes(b"x" * 5000)

            return save

        coord.save_async("model", write("model_world_size_1_rank_0.pt"), 1)
        asyncio.run(coord.register_and_monitor(1, checkpoint_thread_count=1))
        coord.wait_all(timeout=60)
        ray.get(monitor.status.remote())

        gate = threading.Event()
        started = threading.Event()
        step2 = root / "global_step_2" / "actor"

        def stuck():
            step2.mkdir(parents=True, exist_ok=True)
            # Half of a file, as a writer killed mid-save leaves it.
            (step2 / f"optim_world_size_1_rank_0.pt.tmp.{os.getpid()}.0badf00d").write_bytes(
                b"y" * 777
            )
            started.set()
            gate.wait(60)

        coord.save_async("optim", stuck, 2)
        asyncio.run(coord.register_and_monitor(2, checkpoint_thread_count=1))
        assert started.wait(30)
        for _ in range(100):
            if reader.read_iteration(root, "checkpoint") == 1:
                break
            threading.Event().wait(0.1)
        ray.kill(monitor)  # the job dies with step 2's save in flight
        try:
            code, out, err = run("status", str(root), "--json")
            assert code == 0, err
            st = json.loads(out)
            assert st["latest"]["checkpoint"] == 1
            assert st["committed"] == [1]
            assert st["uncommitted"] == [2]
            step2_info = st["steps"][1]
            assert step2_info["state"] == "uncommitted"
            assert "abandoned" in step2_info["note"]
            assert step2_info["temp_files"] == 1
            assert "partly written" in step2_info["note"]
            code, text, _ = run("status", str(root))
            assert "uncommitted" in text and "never committed" in text
        finally:
            gate.set()

    def test_iteration_file_naming_a_missing_step_is_a_problem(self, root):
        """status exits 1 when it reports a problem (0 for a healthy root, above)."""
        commit.write_iteration(root, "checkpoint", 8)
        code, out, _ = run("status", str(root), "--json")
        assert code == 1
        assert json.loads(out)["problems"] == [
            "latest_checkpointed_iteration.txt names step 8, which is not on disk"
        ]
        code, text, _ = run("status", str(root))
        assert code == 1
        assert "problem: latest_checkpointed_iteration.txt names step 8" in text


class TestRootsWrittenBeforeObsckpt:
    """A root that verl's own checkpointing wrote (no manifests) is not reported as failed
    saves: its older steps are ``foreign`` (whole or not cannot be told), and a step that
    failed after obsckpt started committing there is still ``uncommitted``."""

    @staticmethod
    def verl_step(root: Path, step: int) -> None:
        actor = layout.step_dir(root, step) / "actor"
        actor.mkdir(parents=True)
        for kind in ("model", "optim", "extra_state"):
            (actor / f"{kind}_world_size_1_rank_0.pt").write_bytes(b"v" * 1000)

    def test_a_root_verl_wrote(self, tmp_path):
        root = tmp_path / "ckpt"
        for step in (5, 10):
            self.verl_step(root, step)
        (root / "latest_checkpointed_iteration.txt").write_text("10")
        code, out, err = run("status", str(root), "--json")
        assert code == 0, err
        st = json.loads(out)
        assert (st["committed"], st["uncommitted"], st["foreign"]) == ([10], [], [5])
        step5 = st["steps"][0]
        assert step5["state"] == "foreign" and "before obsckpt committed" in step5["note"]
        assert "no manifest (not written by obsckpt)" in st["steps"][1]["note"]
        code, out, err = run("verify", str(root))
        assert code == 1
        assert "no step of this root has one, so it was not committed by obsckpt" in err
        # Told apart from a step that failed its check.
        assert out == "step 10: NOT VERIFIABLE, not written by obsckpt (no manifest)\n"
        report = json.loads(run("verify", str(root), "--json")[1])
        assert report["ok"] is False and report["steps"][0]["result"] == "unverifiable"

    def test_steps_after_obsckpt_took_over(self, tmp_path):
        root = tmp_path / "ckpt"
        root.mkdir()
        self.verl_step(root, 5)
        make_step(root, 10)
        self.verl_step(root, 12)  # an obsckpt save that failed: no manifest, never committed
        make_step(root, 14)
        code, out, err = run("status", str(root), "--json")
        assert code == 0, err
        st = json.loads(out)
        assert (st["committed"], st["uncommitted"], st["foreign"]) == ([10, 14], [12], [5])
        code, out, err = run("verify", str(root))
        assert code == 0, err


class TestErrors:
    """A directory that cannot be used gives one line on stderr and exit code 2, for both commands."""

    @pytest.mark.parametrize("command", ["status", "verify"])
    def test_missing_directory(self, tmp_path, command):
        code, out, err = run(command, str(tmp_path / "nope"))
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and "no such directory" in err

    @pytest.mark.parametrize("command", ["status", "verify"])
    def test_a_file_is_not_a_directory(self, tmp_path, command):
        f = tmp_path / "file"
        f.write_text("x")
        code, _out, err = run(command, str(f))
        assert code == 2 and err.count("\n") == 1 and "not a directory" in err

    @pytest.mark.parametrize("command", ["status", "verify"])
    def test_not_a_checkpoint_root(self, tmp_path, command):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "notes.txt").write_text("hello")
        code, _out, err = run(command, str(tmp_path / "other"))
        assert code == 2 and err.count("\n") == 1 and "not a checkpoint root" in err

    @pytest.mark.parametrize("command", ["status", "verify"])
    def test_unreadable_iteration_file(self, root, command):
        (root / "latest_checkpointed_iteration.txt").write_text("garbage\n")
        code, _out, err = run(command, str(root))
        assert code == 2 and err.count("\n") == 1
        assert "latest_checkpointed_iteration.txt" in err and "not a step number" in err

    def test_verify_a_step_that_is_not_on_disk(self, root):
        code, _out, err = run("verify", str(root), "--step", "3")
        assert code == 2 and err.count("\n") == 1 and "step 3 is not on disk" in err

    @pytest.mark.parametrize(
        "value, why",
        [
            ("-1", "from 0 to 2**63 - 1"),
            (str(2**63), "from 0 to 2**63 - 1"),
            ("x", "must be a step number, got 'x'"),
        ],
    )
    def test_verify_a_step_that_is_not_a_step_number(self, root, capsys, value, why):
        code, out, err = run("verify", str(root), "--step", value)
        assert code == 2 and out == "" and err == ""
        usage = capsys.readouterr().err
        assert "argument --step:" in usage and why in usage
        assert "Traceback" not in usage and "ValueError" not in usage

    @pytest.mark.needs_install
    def test_entry_point_exit_code(self, tmp_path):
        import subprocess
        import sys

        exe = Path(sys.executable).with_name("obsckpt")
        assert exe.exists(), f"no console script {exe}: install the package (make setup)"
        proc = subprocess.run(
            [str(exe), "verify", str(tmp_path / "nope")], capture_output=True, text=True
        )
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


class TestPythonDashM:
    """``python -m obsckpt`` is the ``obsckpt`` command, exit codes included."""

    def test_version_and_exit_code(self, tmp_path):
        import obsckpt

        done = subprocess.run(
            [sys.executable, "-m", "obsckpt", "--version"], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"obsckpt {obsckpt.__version__}"
        missing = subprocess.run(
            [sys.executable, "-m", "obsckpt", "status", str(tmp_path / "nope")],
            capture_output=True,
            text=True,
        )
        assert missing.returncode == 2 and "no such directory" in missing.stderr


class TestDemoWithoutItsExtra:
    """Without the demo extra, `obsckpt demo` exits at once with one line naming it, before Ray starts."""

    HIDE = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {hidden!r}:\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from obsckpt.cli import main\n"
        "code = main(['demo', '--steps', '1'])\n"
        "assert 'ray' not in sys.modules, 'Ray was imported'\n"
        "sys.exit(code)\n"
    )

    @pytest.mark.parametrize("hidden", [{"verl"}, {"verl", "transformers"}])
    def test_one_line_naming_the_extra(self, hidden, tmp_path):
        proc = subprocess.run(
            [sys.executable, "-c", self.HIDE.format(hidden=hidden)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert "obsckpt[demo]" in lines[0]
        for name in hidden:
            assert name in lines[0]
        assert proc.stdout == ""


class TestDemoFlags:
    """A bad `obsckpt demo` value is refused before anything starts, naming the flag as typed."""

    @pytest.mark.parametrize(
        "flag, value, why",
        [
            ("--steps", "-1", "argument --steps: must be an integer >= 0, got -1"),
            ("--save-every", "0", "argument --save-every: must be an integer >= 1, got 0"),
            ("--world-size", "0", "argument --world-size: must be an integer >= 1, got 0"),
            ("--keep", "-2", "argument --keep: must be an integer >= 0, got -2"),
            ("--duration", "0", "argument --duration: must be a positive, finite number"),
            ("--duration", "nan", "argument --duration: must be a positive, finite number"),
            ("--duration", "inf", "argument --duration: must be a positive, finite number"),
            ("--metrics-port", "abc", "argument --metrics-port: must be a port number 0-65535"),
            ("--seed", str(2**64), "argument --seed: must be a seed from 0 to 4294967295"),
            ("--seed", "-1", "argument --seed: must be a seed from 0 to 4294967295"),
        ],
    )
    def test_bad_values(self, tmp_path, capsys, flag, value, why):
        root = tmp_path / "ckpt"
        code, out, err = run("demo", "--ckpt-dir", str(root), flag, value)
        usage = capsys.readouterr().err
        assert code == 2 and out == "" and err == ""
        assert why in usage, usage
        assert "_port" not in usage and "_int" not in usage and "or None" not in usage
        assert not root.exists()

    def test_the_seed_range_is_the_demos(self):
        from obsckpt.cli import MAX_SEED
        from obsckpt.demo import DemoConfig
        from obsckpt.demo.config import MAX_SEED as DEMO_MAX_SEED

        assert MAX_SEED == DEMO_MAX_SEED
        DemoConfig(seed=MAX_SEED)
        with pytest.raises(ValueError, match="seed must be from 0"):
            DemoConfig(seed=MAX_SEED + 1)


def earlier_demo_run(tmp_path: Path) -> Path:
    """The root of an earlier demo run: its marker and committed step 2."""
    from obsckpt.demo.root import MARKER

    root = tmp_path / "ckpt"
    root.mkdir()
    (root / MARKER).write_text("{}\n")
    make_step(root, 2)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


class TestDemoRefusesBeforeStarting:
    """Paths and endpoints the demo cannot use fail at once with one line and exit 2, before
    Ray starts and before an earlier run's checkpoints are removed (it starts over without
    --resume)."""

    def demo(self, root: Path, *extra: str) -> tuple[int, str]:
        code, out, err = run("demo", "--ckpt-dir", str(root), "--steps", "1", *extra)
        assert out == ""
        assert err.count("\n") == 1, err
        return code, err

    def test_kill_at_a_step_that_saves_nothing_names_the_flags(self, tmp_path):
        code, err = self.demo(tmp_path / "run", "--kill-at", "5:save", "--save-every", "10")
        assert code == 2
        assert "--kill-at 5:save" in err and "--save-every 10" in err
        assert "--kill-at 10:save" in err  # a step that works
        assert "kill_in_save" not in err and "kill_at" not in err

    def test_settings_are_named_by_their_flags(self):
        from obsckpt.demo.config import flag_names

        assert flag_names("save_every must be positive; kill_at 3") == (
            "--save-every must be positive; --kill-at 3"
        )

    def test_result_json_in_a_missing_directory(self, tmp_path):
        root = earlier_demo_run(tmp_path)
        before = snapshot(root)
        target = tmp_path / "no" / "such" / "result.json"
        code, err = self.demo(root, "--result-json", str(target))
        assert code == 2
        assert f"--result-json {target}: {target.parent} is not an existing directory" in err
        assert snapshot(root) == before

    def test_result_json_that_is_a_directory(self, tmp_path):
        root = earlier_demo_run(tmp_path)
        code, err = self.demo(root, "--result-json", str(tmp_path))
        assert code == 2 and f"--result-json {tmp_path} is a directory" in err

    def test_file_sd_that_is_a_directory(self, tmp_path):
        root = earlier_demo_run(tmp_path)
        before = snapshot(root)
        code, err = self.demo(root, "--file-sd", str(tmp_path))
        assert code == 2 and f"--file-sd {tmp_path} is a directory" in err
        assert snapshot(root) == before

    def test_file_sd_under_a_file(self, tmp_path):
        root = earlier_demo_run(tmp_path)
        blocker = tmp_path / "blocker"
        blocker.write_text("x")
        code, err = self.demo(root, "--file-sd", str(blocker / "sd" / "targets.json"))
        assert code == 2 and f"{blocker} is a file, not a directory" in err

    def test_metrics_port_in_use(self, tmp_path):
        import socket

        root = earlier_demo_run(tmp_path)
        before = snapshot(root)
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            code, err = self.demo(root, "--metrics-host", "127.0.0.1", "--metrics-port", str(port))
        assert code == 2
        assert f"--metrics-port {port}: 127.0.0.1:{port} is already in use" in err
        assert "--no-metrics" in err
        assert snapshot(root) == before  # the earlier run is still there

    def test_bracketed_ipv6_metrics_host_is_an_address(self):
        import socket

        from obsckpt.demo.endpoints import check_metrics_endpoint
        from obsckpt.errors import DemoError

        check_metrics_endpoint("[::1]", 0)  # as the metrics server takes it
        with socket.socket(socket.AF_INET6) as busy:
            busy.bind(("::1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(DemoError, match=rf"\[::1\]:{port} is already in use"):
                check_metrics_endpoint("[::1]", port)

    def test_metrics_host_that_is_not_an_address(self, tmp_path):
        root = earlier_demo_run(tmp_path)
        code, err = self.demo(root, "--metrics-host", "no-such-host.invalid")
        assert code == 2 and "--metrics-host 'no-such-host.invalid' is not an address" in err


class TestUrls:
    """Every URL the command takes, from a flag or the environment, is checked as it is
    parsed: one line naming it, the value, what is wrong and a good one, after the usage."""

    @pytest.fixture(autouse=True)
    def _no_url_variables(self, monkeypatch):
        for name in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OBSCKPT_RUNBOOK_URL",
        ):
            monkeypatch.delenv(name, raising=False)

    @pytest.mark.parametrize(
        "value",
        [
            "http://localhost:4318",
            "https://collector.example.com/v1/traces",
            "HTTP://127.0.0.1:4318",
            "http://[::1]:4318/",
            "https://user@host:65535/p?q=1#frag",
        ],
    )
    def test_good_urls(self, value):
        from obsckpt.validators import validate_url

        assert validate_url(value, "--x") == value

    @pytest.mark.parametrize(
        "value, why, example",
        [
            ("localhost:4318", "no scheme", "http://localhost:4318"),
            ("127.0.0.1:4318", "no scheme", "http://127.0.0.1:4318"),
            ("[::1]:4318", "no scheme", "http://[::1]:4318"),
            ("docs/runbook.md", "no scheme", "http://localhost:4318"),
            ("ftp://host/x", "scheme ftp://", "http://localhost:4318"),
            ("http://", "no host", "http://localhost:4318"),
            ("http://:4318", "no host", "http://localhost:4318"),
            ("http://host:0", "port not in 1-65535", "http://localhost:4318"),
            ("http://host:65536", "port not in 1-65535", "http://localhost:4318"),
            ("http://host:43a8", "port not in 1-65535", "http://localhost:4318"),
            ("http://host:", "no port", "http://localhost:4318"),
            ("http://[::1", "not a URL", "http://localhost:4318"),
            ("http://local host", "whitespace in it", "http://localhost:4318"),
            ("", "not a URL", "http://localhost:4318"),
            (None, "not a URL", "http://localhost:4318"),
        ],
    )
    def test_bad_urls(self, value, why, example):
        from obsckpt.validators import validate_url

        message = (
            f"--x must be a URL (http:// or https://), got {value!r} ({why}); "
            f"give one like {example}"
        )
        with pytest.raises(ValueError) as info:
            validate_url(value, "--x", example="http://localhost:4318")
        assert str(info.value) == message

    def test_host_and_port_alone(self):
        from obsckpt.validators import validate_url

        assert validate_url("collector:4317", bare=True) == "collector:4317"
        with pytest.raises(
            ValueError, match=r"^must be .* or HOST:PORT, got 'collector' \(no port\)"
        ):
            validate_url("collector", bare=True)

    def usage_error(self, capsys, *argv: str) -> str:
        """The one error line of a refused command line, checked to follow its usage."""
        code, out, err = run(*argv)
        usage = capsys.readouterr().err
        assert (code, out, err) == (2, "", ""), usage
        *_, line = usage.rstrip("\n").splitlines()
        prog = line.partition(": error: ")[0]  # "obsckpt demo", "obsckpt dashboards export"
        assert usage.startswith(f"usage: {prog} "), usage
        return line

    def test_otlp_endpoint_without_a_scheme(self, tmp_path, capsys):
        root = tmp_path / "ckpt"
        line = self.usage_error(
            capsys, "demo", "--ckpt-dir", str(root), "--otlp-endpoint", "localhost:4318"
        )
        assert line == (
            "obsckpt demo: error: argument --otlp-endpoint: must be a URL (http:// or "
            "https://), got 'localhost:4318' (no scheme); give one like http://localhost:4318"
        )
        assert not root.exists()

    def test_otlp_endpoint_over_grpc_may_be_host_and_port(self, monkeypatch, capsys):
        from obsckpt.cli import build_parser

        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        args = build_parser().parse_args(["demo", "--otlp-endpoint", "localhost:4317"])
        assert args.otlp_endpoint == "localhost:4317"
        line = self.usage_error(capsys, "demo", "--otlp-endpoint", "localhost")
        assert "(no port); give one like http://localhost:4317" in line

    @pytest.mark.parametrize(
        "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    )
    def test_otlp_endpoint_variables(self, variable, tmp_path, capsys, monkeypatch):
        monkeypatch.setenv(variable, "localhost:4318")
        line = self.usage_error(capsys, "demo", "--ckpt-dir", str(tmp_path / "ckpt"))
        assert line == (
            f"obsckpt demo: error: {variable} must be a URL (http:// or https://), got "
            "'localhost:4318' (no scheme); give one like http://localhost:4318"
        )

    def test_the_flag_replaces_the_variable_it_sets(self, monkeypatch):
        from obsckpt.demo.endpoints import check_otel_environment

        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4318")
        check_otel_environment("http://localhost:4318")
        with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT must be a URL"):
            check_otel_environment()

    def test_the_python_api_refuses_it_before_ray_starts(self):
        from obsckpt.demo import DemoConfig
        from obsckpt.demo.endpoints import check_endpoints
        from obsckpt.errors import DemoError

        cfg = DemoConfig(metrics_port=None, otlp_endpoint="localhost:4318")
        with pytest.raises(DemoError, match=r"^--otlp-endpoint must be a URL .*'localhost:4318'"):
            check_endpoints(cfg)
        with pytest.raises(DemoError, match=r"^--address must be .*'10.0.0.1' \(no port\)"):
            check_endpoints(DemoConfig(metrics_port=None, address="10.0.0.1"))

    @pytest.mark.parametrize("value", ["auto", "10.0.0.1:6379", "ray://head:10001", "ray://head"])
    def test_good_ray_addresses(self, value):
        from obsckpt.cli import build_parser

        assert build_parser().parse_args(["demo", "--address", value]).address == value

    @pytest.mark.parametrize(
        "value, why",
        [
            ("10.0.0.1", "no port"),
            ("http://head:6379", "scheme http://"),
            ("head:99999", "port not in 1-65535"),
        ],
    )
    def test_bad_ray_addresses(self, value, why, capsys):
        line = self.usage_error(capsys, "demo", "--address", value)
        assert line == (
            "obsckpt demo: error: argument --address: must be a URL (ray://) or HOST:PORT, "
            f"got {value!r} ({why}); give one like 127.0.0.1:6379"
        )

    def test_runbook_url(self, tmp_path, capsys, monkeypatch):
        out = tmp_path / "out"
        line = self.usage_error(
            capsys, "dashboards", "export", str(out), "--runbook-url", "wiki:80"
        )
        assert line == (
            "obsckpt dashboards export: error: argument --runbook-url: must be a URL (http:// "
            "or https://), got 'wiki:80' (no scheme); give one like http://wiki:80"
        )
        monkeypatch.setenv("OBSCKPT_RUNBOOK_URL", "docs/runbook.md")
        line = self.usage_error(capsys, "dashboards", "export", str(out))
        assert line == (
            "obsckpt dashboards export: error: OBSCKPT_RUNBOOK_URL must be a URL (http:// or "
            "https://), got 'docs/runbook.md' (no scheme); give one like "
            "https://wiki.example.com/obsckpt/runbook.md"
        )
        assert not out.exists()
        # The flag wins over the variable, which is then not read.
        assert (
            run("dashboards", "export", str(out), "--runbook-url", "https://w.example/r.md")[0] == 0
        )

    def test_a_misspelled_flag_of_an_action_gets_its_usage(self, tmp_path, capsys):
        line = self.usage_error(capsys, "dashboards", "export", str(tmp_path), "--runbok-url", "x")
        assert line.endswith("--runbok-url (did you mean --runbook-url?) x")


class TestDemoOutputLines:
    def test_finish_line(self):
        from obsckpt.cli import finish_line
        from obsckpt.demo import DemoResult

        r = DemoResult(stop_reason="terminated", first_step=1, last_step=0, elapsed_s=3.0)
        r.committed = {"checkpoint": None, "state_dict": None}
        assert (
            finish_line(r) == "demo terminated: no step trained, committed checkpoint none, 3.0 s"
        )
        r = DemoResult(first_step=4, last_step=5, elapsed_s=1.25)
        r.committed = {"checkpoint": 5, "state_dict": 5}
        assert finish_line(r) == "demo completed: steps 4-5, committed checkpoint 5, 1.2 s"
        r.first_step = 5
        assert finish_line(r).startswith("demo completed: step 5,")

    def test_a_ray_task_error_is_one_line(self, ray_cluster):
        from obsckpt.cli import one_line

        @ray.remote
        def setup():
            raise ValueError("Overflow when unpacking\nlong long")

        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(setup.remote())
        assert "\n" in str(info.value)  # the remote traceback
        assert one_line(info.value) == "setup failed: ValueError: Overflow when unpacking long long"


def test_status_of_a_demo_root_before_its_first_save(tmp_path):
    """The demo points at `obsckpt status ROOT` from its start; before a save, that is a root."""
    from obsckpt.cli import DEMO_MARKER
    from obsckpt.demo.root import MARKER

    assert DEMO_MARKER == MARKER
    (tmp_path / MARKER).write_text("{}\n")
    code, out, err = run("status", str(tmp_path))
    assert code == 0, err
    assert "latest checkpoint: none" in out and "no step directories" in out


class TestDemoFailureExitCode:
    """A run that fails after it started exits 1 with one line; 2 is for bad usage only."""

    def test_rollout_weight_mismatch_is_a_failed_run(self, tmp_path, monkeypatch):
        import obsckpt.demo
        from obsckpt.demo.loop import check_rollout_weights

        def fails_mid_run(cfg, out, err):
            check_rollout_weights(1, 1, "00000000", "3e534a6a")

        monkeypatch.setattr(obsckpt.demo, "run_demo", fails_mid_run)
        code, _out, err = run("demo", "--ckpt-dir", str(tmp_path / "ckpt"))
        assert code == 1, err
        assert err.count("\n") == 1
        assert "the rollout's weights of version 1 differ from the trainer's step 1" in err


class TestDemoPlanLine:
    """The first line about the job says how many ranks, in the right number."""

    def test_plan_line_counts_ranks(self):
        from obsckpt.demo.config import DemoConfig
        from obsckpt.demo.plan import plan_line

        info = {"backend": "gloo", "device": "cpu", "parameters": 430_000}
        one = plan_line(DemoConfig(world_size=1, sync_method="broadcast", save_every=1), info)
        assert one.startswith("obsckpt demo: 1 FSDP2 rank (gloo, cpu), Qwen2 with 0.43 M")
        assert one.endswith("weight sync broadcast over gloo, full checkpoint every step")
        two = plan_line(DemoConfig(world_size=2, sync_method="memory", save_every=3), info)
        assert two.startswith("obsckpt demo: 2 FSDP2 ranks (gloo, cpu)")


def test_files_of_a_scratch_directory_count_as_temp_files(tmp_path):
    """An HF export built aside (huggingface.tmp.<pid>.<hex>/) when a job died is
    partly written, not files of the step."""
    from obsckpt.inspection import describe_step

    actor = layout.step_dir(tmp_path, 3) / "actor"
    actor.mkdir(parents=True)
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"m" * 10)
    scratch = Path(commit.scratch_dir(layout.step_dir(tmp_path, 3) / "huggingface"))
    (scratch / "config.json").write_text("{}")
    (scratch / "model.safetensors").write_bytes(b"s" * 5)
    info = describe_step(tmp_path, 3, {"checkpoint": None, "state_dict": None}, time.time())
    assert info["temp_files"] == 2, info
    assert "partly written" in info["note"], info


def test_the_command_line_and_the_demo_settings_import_without_torch():
    """`obsckpt --help`, `status` and `verify` and the demo's settings need no torch."""
    code = (
        "import sys\n"
        "import obsckpt.cli, obsckpt.demo.config\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


class TestUsageErrors:
    """A mistyped flag gets the subcommand's usage and the flag meant, exit code 2."""

    @pytest.mark.parametrize(
        ("argv", "usage", "hint"),
        [
            (["demo", "--stpes", "3"], "usage: obsckpt demo", "--stpes (did you mean --steps?)"),
            (["verify", "x", "--jsn"], "usage: obsckpt verify", "--jsn (did you mean --json?)"),
            (
                ["repair", "x", "--dryrun"],
                "usage: obsckpt repair",
                "--dryrun (did you mean --dry-run?)",
            ),
        ],
    )
    def test_misspelled_flag(self, argv, usage, hint, capsys):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert usage in err and f"unrecognized arguments: {hint}" in err

    def test_a_word_that_is_no_flag_gets_no_guess(self, capsys):
        assert main(["status", "x", "extra"]) == 2
        err = capsys.readouterr().err
        assert "usage: obsckpt status" in err and "unrecognized arguments: extra\n" in err
