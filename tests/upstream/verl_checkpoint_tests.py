"""verl 0.9.1's own checkpoint tests, run from its sdist with obsckpt's managers in place.

    python tests/upstream/verl_checkpoint_tests.py [--python PY] [--sdist FILE]
        [--mode all|baseline|obsckpt|obsckpt-step-dirs] [--workdir DIR]

Downloads verl 0.9.1's sdist from the package index (``UV_DEFAULT_INDEX``,
``UV_INDEX_URL`` or ``PIP_INDEX_URL``, else PyPI), checks its SHA-256, unpacks
its ``tests/`` into ``build/verl-upstream/`` and runs the checkpoint tests that
run on a CPU with ``PY`` (default: this interpreter), which must have verl
0.9.1 and obsckpt installed, in three modes (``all``, the default, runs each):

* ``baseline``: as verl ships them, with verl's own ``FSDPCheckpointManager``;
  every selected test must pass;
* ``obsckpt``: with ``obsckpt.integrations.verl_install.install()`` called
  before any test module is imported (so ``verl.utils.checkpoint.
  fsdp_checkpoint_manager.FSDPCheckpointManager`` is obsckpt's), a local Ray
  cluster and a ``checkpoint_monitor`` whose root is pytest's base temp
  directory (where the tests save), as a job running obsckpt has. Every
  selected test must pass, except those in :data:`DIFFERENCES`, which must
  fail with the error named there (docs/integrations.md, "verl 0.9.1's own
  checkpoint tests", gives each reason);
* ``obsckpt-step-dirs``: verl's FSDP LoRA checkpoint tests, rewritten as
  :data:`STEP_DIRS_REWRITES` says (save into a step directory, nothing else)
  with ``OBSCKPT_SYNC_SAVE=1``, against obsckpt's manager used alone (no
  trainer: it commits the steps it saves, and a load waits for that commit):
  verl's own assertions, all of which must pass.

Exits non-zero on any unexpected outcome: a test that fails (or passes where a
documented difference is expected), a skipped test, a selected file or test
that is missing, an sdist whose checksum does not match, or a verl other than
0.9.1. This module is also the pytest plugin (``-p verl_checkpoint_tests``)
that applies these rules inside each run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

VERL_VERSION = "0.9.1"
SDIST = f"verl-{VERL_VERSION}.tar.gz"
SDIST_SHA256 = "3e03d8816b2546b2c5580705671b8d0bb3f79b8364e7b5c56dbfc1245536ba22"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_WORKDIR = REPO / "build" / "verl-upstream"
MODULE = Path(__file__).stem
NAMESPACE = "verl-upstream"

# The sdist ships part of verl's test tree; its checkpoint tests are those of
# tests/checkpoint_engine/ (the agent-loop tests that also drive a checkpoint engine need
# a rollout server on GPUs). Those that run on a CPU, with the number of tests each holds:
SELECTED: dict[str, int] = {
    # verl's FSDPCheckpointManager and BaseCheckpointManager: checkpoint.save_lora_only
    "tests/checkpoint_engine/test_fsdp_lora_only_checkpoint_on_cpu.py": 16,
    # the global step handed to verl's checkpoint engines (weight sync to the rollout)
    "tests/checkpoint_engine/test_global_steps_on_cpu.py": 2,
    # verl's checkpoint engines' weight-sync helpers (delta sync, bucketing, placement)
    "tests/checkpoint_engine/test_sglang_fusion_bucketing_on_cpu.py": 12,
    "tests/checkpoint_engine/test_sglang_loader.py": 6,
    "tests/checkpoint_engine/test_sharded_delta.py": 11,
    "tests/checkpoint_engine/test_block_placement.py": 15,
}
# The rest of tests/checkpoint_engine/, not run: why.
EXCLUDED: dict[str, str] = {
    "tests/checkpoint_engine/test_correctness_on_gpu.py": "NCCL checkpoint engine: CUDA GPUs",
    "tests/checkpoint_engine/test_correctness_on_npu.py": "HCCL checkpoint engine: Ascend NPUs",
    "tests/checkpoint_engine/test_utils.py": "helpers of the GPU tests; holds no tests",
    "tests/checkpoint_engine/test_special_server_adapter.py": (
        "a vLLM/SGLang rollout server on GPUs, a model from the hub and verl's source tree's "
        "Hydra configs"
    ),
}


@dataclass(frozen=True)
class Difference:
    """A test that fails with obsckpt in place, deliberately: how, and why."""

    error: str  # the exception's class name (or a base class's)
    match: str  # a regular expression its message must contain
    reason: str


_LORA = "tests/checkpoint_engine/test_fsdp_lora_only_checkpoint_on_cpu.py::TestFSDPCheckpointManagerLoraOnly::"
_PLAIN_DIR = Difference(
    "SavePathError",
    r"refused before writing .*: it lies in no global_step_<N> directory",
    "saves to a plain directory (tmp_path/ckpt, lora_only, full_ckpt), not a "
    "global_step_<N> directory: obsckpt commits only step directories and refuses any "
    "other save path before writing",
)
_PLAIN_DIR_THEN_LOAD = Difference(
    _PLAIN_DIR.error,
    _PLAIN_DIR.match,
    _PLAIN_DIR.reason + "; the test then loads that checkpoint, which no trainer committed, "
    "and obsckpt loads only a committed step's files, checked against its manifest",
)
# Every test that fails with obsckpt in place, and only those. Each passes in the
# obsckpt-step-dirs mode, saving into a step directory (which the manager then commits).
DIFFERENCES: dict[str, Difference] = {
    _LORA + "test_save_lora_only_filters_state_dict": _PLAIN_DIR,
    _LORA + "test_save_lora_only_no_lora_saves_full": _PLAIN_DIR,
    _LORA + "test_save_lora_only_disabled_saves_full": _PLAIN_DIR,
    _LORA + "test_load_lora_only_checkpoint_merges": _PLAIN_DIR_THEN_LOAD,
    _LORA + "test_load_full_checkpoint_still_works": _PLAIN_DIR_THEN_LOAD,
}


# The same LoRA tests once more, rewritten (in build/, from the sdist's file) to save into
# a step directory, which is all obsckpt asks of a save; OBSCKPT_SYNC_SAVE=1 as the tests
# read the files right after save_checkpoint returns. With no trainer in these tests, the
# manager submits each step it saves and a second manager's load waits for the commit.
# verl's assertions are unchanged and must all pass.
LORA_FILE = "tests/checkpoint_engine/test_fsdp_lora_only_checkpoint_on_cpu.py"
STEP_DIRS_FILE = "tests/checkpoint_engine/test_fsdp_lora_only_checkpoint_in_step_dirs.py"
STEP_DIRS_TESTS = STEP_DIRS_FILE + "::TestFSDPCheckpointManagerLoraOnly"
STEP_DIRS_COUNT = 7
_STEP_DIR = 'tmp_path / "global_step_1" / "actor"'
STEP_DIRS_REWRITES: list[tuple[str, str, int]] = [  # (old, new, occurrences)
    ('tmp_path / "ckpt"', _STEP_DIR, 3),
    ('tmp_path / "lora_only"', _STEP_DIR, 1),
    ('tmp_path / "full_ckpt"', _STEP_DIR, 1),
]
MODES: dict[str, tuple[list[str], dict[str, int]]] = {  # mode -> (pytest args, tests per file)
    "baseline": (list(SELECTED), SELECTED),
    "obsckpt": (list(SELECTED), SELECTED),
    "obsckpt-step-dirs": ([STEP_DIRS_TESTS], {STEP_DIRS_FILE: STEP_DIRS_COUNT}),
}


# ----------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------


class RunnerError(Exception):
    """A required part is missing or does not match; the message says what to do."""


def index_url() -> str:
    for name in ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_INDEX_URL"):
        if os.environ.get(name):
            return os.environ[name]
    return "https://pypi.org/simple"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_sdist(target: Path) -> None:
    """Fetch verl's sdist from the index's simple page into ``target``, checksum-verified."""
    page = index_url().rstrip("/") + "/verl/"
    request = urllib.request.Request(
        page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            body = response.read().decode("utf-8", "replace")
            base = response.geturl()
            kind = response.headers.get("Content-Type", "")
        if "json" in kind:  # PEP 691
            links = [f["url"] for f in json.loads(body)["files"] if f["filename"] == SDIST]
        else:  # PEP 503: <a href="...">
            links = re.findall(
                r"""href=["']([^"']*/?""" + re.escape(SDIST) + r"""(?:#[^"']*)?)""", body
            )
        urls = [urllib.parse.urljoin(base, link.split("#")[0]) for link in links]
        if not urls:
            raise RunnerError(f"{page} lists no {SDIST}: check the index (PIP_INDEX_URL)")
        partial = target.with_suffix(".part")
        with urllib.request.urlopen(urls[0], timeout=300) as response, partial.open("wb") as f:
            shutil.copyfileobj(response, f)
    except OSError as exc:  # URLError, timeouts, refused connections
        raise RunnerError(
            f"cannot download {SDIST} from {page}: {exc}; check the network or pass --sdist FILE"
        ) from exc
    os.replace(partial, target)


def sdist(given: Path | None, cache: Path) -> Path:
    """The verified sdist: ``given``, else the cached copy, else a fresh download."""
    path = given or cache / SDIST
    if given is None and not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"verl-upstream: downloading {SDIST} from {index_url()}", flush=True)
        download_sdist(path)
    if not path.is_file():
        raise RunnerError(f"--sdist {path} is not a file: pass the path of {SDIST}")
    digest = sha256(path)
    if digest != SDIST_SHA256:
        raise RunnerError(
            f"{path} has SHA-256 {digest}, not {SDIST}'s {SDIST_SHA256}: delete it and run again "
            "(a partial or different download)"
        )
    return path


def unpack_tests(archive: Path, workdir: Path) -> Path:
    """Unpack only the sdist's ``tests/`` into a fresh ``workdir/verl-<version>``.

    Only ``tests/``: with verl's sources beside them, ``import verl`` would
    load those instead of the installed verl that obsckpt patches.
    """
    root = workdir / f"verl-{VERL_VERSION}"
    shutil.rmtree(root, ignore_errors=True)
    prefix = f"verl-{VERL_VERSION}/tests/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise RunnerError(f"{archive} holds no {prefix}: not verl's sdist")
        for member in members:  # a checksum-verified archive, checked all the same
            if not (member.isfile() or member.isdir()) or ".." in Path(member.name).parts:
                raise RunnerError(f"{archive}: unexpected member {member.name!r}")
        # Python's "data" filter where it has one (3.11.4+); the check above otherwise.
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(workdir, members=members, **safe)  # noqa: S202
    text = (root / LORA_FILE).read_text()
    for before, after, count in STEP_DIRS_REWRITES:
        if text.count(before) != count:
            raise RunnerError(
                f"{LORA_FILE} holds {before!r} {text.count(before)} times, not {count}: "
                f"update STEP_DIRS_REWRITES in {MODULE}.py"
            )
        text = text.replace(before, after)
    header = (
        f"# Written by obsckpt's {MODULE}.py from verl's {LORA_FILE}: see STEP_DIRS_REWRITES.\n"
    )
    (root / STEP_DIRS_FILE).write_text(header + text)
    (root / "pytest.ini").write_text(
        "[pytest]\n"
        "# verl's tests, run by obsckpt's tests/upstream/verl_checkpoint_tests.py\n"
        "markers =\n    asyncio: pytest-asyncio (not installed; the selected tests need none)\n"
    )
    return root


def check_files(root: Path) -> None:
    """Every checkpoint test file of the sdist is selected or excluded by name; none is missing."""
    present = {
        str(p.relative_to(root)) for p in (root / "tests/checkpoint_engine").glob("test_*.py")
    }
    present.discard(STEP_DIRS_FILE)  # written by unpack_tests
    known = set(SELECTED) | set(EXCLUDED)
    if missing := sorted(known - present):
        raise RunnerError(f"the sdist lacks {missing}: update SELECTED / EXCLUDED in {MODULE}.py")
    if unknown := sorted(present - known):
        raise RunnerError(
            f"the sdist holds {unknown}, which {MODULE}.py neither selects nor excludes: "
            "add each to SELECTED or, with its reason, to EXCLUDED"
        )


def run_mode(python: str, root: Path, mode: str) -> int:
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OBSCKPT_EXIT_WAIT_S", "5")
    command = [
        python, "-m", "pytest", "-c", str(root / "pytest.ini"), "--rootdir", str(root),
        "-p", MODULE, f"--verl-upstream={mode}", "-p", "no:cacheprovider",
        "--basetemp", str(root / f"tmp-{mode}"), "-q", "-rfEsx", "--timeout=300",
        *MODES[mode][0],
    ]  # fmt: skip
    if mode == "obsckpt-step-dirs":
        env["OBSCKPT_SYNC_SAVE"] = "1"
    print(f"verl-upstream: {mode}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    rc = subprocess.call(command, cwd=root, env=env)
    print(f"verl-upstream: {mode}: exit {rc} in {time.monotonic() - started:.0f} s", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="runs the tests (default: this)")
    parser.add_argument("--sdist", type=Path, help=f"a downloaded {SDIST} (checksum-verified)")
    parser.add_argument("--mode", choices=["all", *MODES], default="all")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    args = parser.parse_args(argv)
    # The tests run in the work directory: a relative path (.venv/bin/python) is made
    # absolute, not resolved (a virtual environment's python is a link to the base one).
    python = shutil.which(args.python) if os.sep not in args.python else args.python
    if python is None or not os.access(python, os.X_OK):
        print(f"verl-upstream: --python {args.python}: no such interpreter", file=sys.stderr)
        return 2
    python = os.path.abspath(python)
    started = time.monotonic()
    try:
        archive = sdist(args.sdist, args.workdir)
        root = unpack_tests(archive, args.workdir)
        check_files(root)
    except RunnerError as exc:
        print(f"verl-upstream: {exc}", file=sys.stderr)
        return 2
    for path, reason in EXCLUDED.items():
        print(f"verl-upstream: not run: {path} ({reason})")
    for test, diff in DIFFERENCES.items():
        print(f"verl-upstream: documented difference: {test}: {diff.error} ({diff.reason})")
    modes = list(MODES) if args.mode == "all" else [args.mode]
    failed = [mode for mode in modes if run_mode(python, root, mode) != 0]
    took = time.monotonic() - started
    if failed:
        print(f"verl-upstream: FAILED ({', '.join(failed)}) in {took:.0f} s", file=sys.stderr)
        return 1
    print(f"verl-upstream: OK ({', '.join(modes)}) in {took:.0f} s")
    return 0


# ----------------------------------------------------------------------
# The pytest plugin (-p verl_checkpoint_tests --verl-upstream=MODE)
# ----------------------------------------------------------------------


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--verl-upstream",
        choices=list(MODES),
        help="run verl's tests with verl's own checkpoint manager or with obsckpt's",
    )


def _mode(config: Any) -> str | None:
    return config.getoption("--verl-upstream")


def pytest_configure(config: Any) -> None:
    mode = _mode(config)
    if mode is None:
        return
    import verl

    if verl.__version__ != VERL_VERSION:
        raise _usage(
            f"verl {verl.__version__} is installed, not {VERL_VERSION}: install verl=={VERL_VERSION}"
        )
    if Path(verl.__file__).resolve().is_relative_to(Path(config.rootpath).resolve()):
        raise _usage(f"verl is imported from {verl.__file__}, not the installed package")
    if mode != "baseline":
        from obsckpt.integrations import verl_install

        # Before any test module imports verl's managers, as a job calls it before ray.init.
        verl_install.install()


def _usage(message: str) -> Exception:
    return pytest.UsageError(f"verl-upstream: {message}")


def pytest_collection_finish(session: Any) -> None:
    if _mode(session.config) is None:
        return
    counts: dict[str, int] = {}
    for item in session.items:
        counts[item.nodeid.split("::")[0]] = counts.get(item.nodeid.split("::")[0], 0) + 1
    expected = MODES[_mode(session.config)][1]
    wrong = {f: (counts.get(f, 0), n) for f, n in expected.items() if counts.get(f, 0) != n}
    if wrong:
        raise _usage(
            "collected (found, expected) tests per file differ: "
            f"{wrong}; every selected test must run"
        )
    ids = {item.nodeid for item in session.items}
    missing = sorted(set(DIFFERENCES) - ids) if _mode(session.config) == "obsckpt" else []
    if missing:
        raise _usage(f"documented differences not collected: {missing}")


_monitor: list[Any] = []  # the running checkpoint monitor


@pytest.fixture(scope="session", autouse=True)
def _obsckpt_job(request: Any, tmp_path_factory: Any) -> Any:
    """With obsckpt: a local Ray cluster and the job's checkpoint monitor, as a job has."""
    mode = _mode(request.config)
    if mode in (None, "baseline"):
        yield
        return
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=NAMESPACE)
    if mode == "obsckpt":
        # verl's tests save under their tmp_path: the monitor's root is the base of those.
        _start_monitor(tmp_path_factory.getbasetemp())
    yield
    if _monitor:
        _stop_monitor()
    ray.shutdown()


@pytest.fixture(autouse=True)
def _step_dirs_job(request: Any) -> Any:
    """obsckpt-step-dirs: a monitor per test whose root is its tmp_path (a job per test)."""
    if _mode(request.config) != "obsckpt-step-dirs":
        yield
        return
    _start_monitor(request.getfixturevalue("tmp_path"))
    yield
    _stop_monitor()


def _start_monitor(root: Path) -> None:
    import ray

    from obsckpt import CheckpointMonitor

    monitor = CheckpointMonitor.get_actor(
        namespace=NAMESPACE, default_local_dir=str(root), metrics_port=None
    )
    ray.get(monitor.status.remote())
    _monitor.append(monitor)


def _stop_monitor() -> None:
    import ray

    from obsckpt.options import MONITOR_ACTOR_NAME

    monitor = _monitor.pop()
    ray.get(monitor.shutdown.remote())
    ray.kill(monitor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the name is free once the actor is gone
        try:
            ray.get_actor(MONITOR_ACTOR_NAME, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the checkpoint monitor in namespace {NAMESPACE!r} did not end in 30 s")


def _manager_check(mode: str) -> tuple[str | None, list[str]]:
    """Why a manager name in verl's modules is not the one ``mode`` runs (or None), and
    the modules checked.

    Every module where ``verl_install`` rebinds a manager name that the tests
    imported is checked; verl's ``fsdp_checkpoint_manager`` must be one of them.
    """
    from obsckpt.integrations.verl_install import MANAGER_SITES

    wanted = "verl." if mode == "baseline" else "obsckpt."
    if "verl.utils.checkpoint.fsdp_checkpoint_manager" not in sys.modules:
        return "no test imported verl.utils.checkpoint.fsdp_checkpoint_manager", []
    checked = []
    for name, (attr, _, _) in MANAGER_SITES.items():
        module = sys.modules.get(name)
        owner = getattr(getattr(module, attr, None), "__module__", None)
        if owner is None:
            continue
        if not owner.startswith(wanted):
            return f"{name}.{attr} is {owner}'s, not {wanted.rstrip('.')}'s", checked
        checked.append(name)
    return None, checked


def judge(mode: str, nodeid: str, error: BaseException | None) -> tuple[str, str] | None:
    """What a test's outcome becomes in ``mode``, given the error it raised (None: passed).

    Returns None (its outcome stands), ``("xfailed", why)`` (a documented
    difference, failing as documented) or ``("failed", why)`` (a documented
    difference that passed, or failed another way).
    """
    diff = DIFFERENCES.get(nodeid) if mode == "obsckpt" else None
    if diff is None:
        return None
    if error is None:
        return (
            "failed",
            f"passed with obsckpt in place, but {MODULE}.DIFFERENCES expects {diff.error} "
            f"({diff.reason}): remove it there and in docs/integrations.md",
        )
    names = {cls.__name__ for cls in type(error).__mro__}
    if diff.error in names and re.search(diff.match, str(error)) is not None:
        return "xfailed", f"documented difference: {diff.error}: {diff.reason}"
    return (
        "failed",
        f"a documented difference failed another way: expected {diff.error} matching "
        f"{diff.match!r}, got {type(error).__name__}",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    report = yield
    mode = _mode(item.config)
    if mode is None:
        return report
    verdict = None
    if report.when == "call":
        verdict = judge(mode, item.nodeid, call.excinfo.value if call.excinfo else None)
    if verdict is not None:
        outcome, why = verdict
        if outcome == "xfailed":
            report.outcome = "skipped"
            report.wasxfail = why
        elif call.excinfo is None:
            report.outcome = "failed"
            report.longrepr = why
        else:  # keep the traceback
            report.sections.append(("verl-upstream", why))
    elif report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped ({reason}): every selected test must run"
    return report


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    mode = _mode(session.config)
    if mode is None or exitstatus not in (0, 1):
        return
    why, checked = _manager_check(mode)
    if why is not None:
        print(f"\nverl-upstream: {mode}: {why}", file=sys.stderr)
        session.exitstatus = 1
    else:
        owner = "verl" if mode == "baseline" else "obsckpt"
        print(f"\nverl-upstream: {mode}: the managers are {owner}'s in {checked}")


if __name__ == "__main__":
    sys.exit(main())
