"""obsckpt as a user gets it: the sdist and the wheel `uv build` makes, and the wheel installed.

The wheel is installed without its dependencies into a fresh virtual
environment that sees this environment's packages only as plain import paths,
so the checkout beside it cannot be imported: what runs is what the wheel holds.
"""

from __future__ import annotations

import ast
import email
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

# `uv build` fetches the build backend (hatchling) from the package index.
pytestmark = pytest.mark.needs_index

ROOT = Path(__file__).resolve().parents[1]

# What a working tree holds besides the sources; none of it may reach a release.
NOT_SOURCES = {
    ".git",
    ".venv",
    ".uv-tools",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".hypothesis",
    "__pycache__",
    "dist",
    "build",
    "obsckpt-demo",
    "gpu-check-logs",
}
# Left in a copy of the tree before building: logs, another environment, run results.
JUNK = [
    "logs/suite.log",
    ".venv-py312/pyvenv.cfg",
    ".coverage",
    "out.json",
    "nohup.out",
    "wandb/run-1/files.txt",
]
# The sdist's top level: what builds the wheel and runs the suite (make test).
SDIST_TOP = {
    ".ci",
    ".dockerignore",
    ".gitignore",
    "Dockerfile",
    "LICENSE",
    "Makefile",
    "PKG-INFO",
    "README.md",
    "benchmarks",
    "constraints.txt",
    "dashboards",
    "deploy",
    "docker-compose.yml",
    "docs",
    "obsckpt",
    "pyproject.toml",
    "scripts",
    "tests",
}
# The observability files shipped as package data (obsckpt/_assets, make dashboards).
ASSET_NAMES = ("obsckpt-dashboard.json", "obsckpt-alerts.yml", "prometheus-scrape.yml")
# Standard-library and builtin names newer than some Python 3 release: (module or
# attribute name) -> the first version that has it.
NEWER_APIS = {
    "add_note": (3, 11),  # BaseException.add_note
    "ExceptionGroup": (3, 11),
    "BaseExceptionGroup": (3, 11),
    "StrEnum": (3, 11),
    "TaskGroup": (3, 11),
    "tomllib": (3, 11),
    "Self": (3, 11),
    "LiteralString": (3, 11),
    "assert_never": (3, 11),
    "batched": (3, 12),  # itertools.batched
}


def _uv() -> str:
    # uv from PATH, or the one the Makefile installs where PATH has none.
    uv = shutil.which("uv") or shutil.which("uv", path=str(ROOT / ".uv-tools" / "bin"))
    if uv is None:
        pytest.fail("uv is not installed: `python3 -m pip install uv` (the Makefile does this)")
    return uv


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("PYTEST")
    }
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _source_copy(dest: Path) -> Path:
    """The checkout's sources copied to ``dest``, with JUNK left beside them."""
    shutil.copytree(
        ROOT,
        dest,
        ignore=lambda _dir, names: [
            n for n in names if n in NOT_SOURCES or n.startswith(".venv") or n.endswith(".pyc")
        ],
    )
    for rel in JUNK:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text("left over\n")
    return dest


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel, as `uv build` makes them (the wheel from the sdist)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = _source_copy(tmp / "src")
    out = tmp / "dist"
    subprocess.run(
        [_uv(), "build", "--quiet", "--out-dir", str(out), str(src)],
        env=_env(),
        check=True,
        timeout=300,
    )
    [sdist] = out.glob("obsckpt-*.tar.gz")
    [wheel] = out.glob("obsckpt-*.whl")
    return {"sdist": sdist, "wheel": wheel}


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        [name] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(zf.read(name))


def _wheel_sources(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        return {n: zf.read(n).decode() for n in zf.namelist() if n.endswith(".py")}


def _oldest_python(requires_python: str) -> tuple[int, int]:
    spec = SpecifierSet(requires_python)
    return next((3, m) for m in range(0, 40) if f"3.{m}.99" in spec or f"3.{m}.0" in spec)


class TestSdist:
    """The sdist holds what builds the wheel and runs the tests, and nothing else of the tree."""

    def test_top_level_is_the_sources(self, dists):
        with tarfile.open(dists["sdist"]) as tf:
            names = [m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name]
        top = {n.split("/")[0] for n in names}
        assert top == SDIST_TOP, f"unexpected: {top - SDIST_TOP}, missing: {SDIST_TOP - top}"
        for rel in JUNK:
            assert rel not in names, f"the sdist ships {rel}, left in the working tree"
        junk = [n for n in names if set(n.split("/")) & NOT_SOURCES or n.endswith(".pyc")]
        assert not junk, f"the sdist ships caches or environments: {junk[:5]}"

    def test_holds_what_the_tests_read(self, dists):
        with tarfile.open(dists["sdist"]) as tf:
            names = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
        for rel in (
            "obsckpt/py.typed",
            "tests/conftest.py",
            "tests/data/compose-spec/compose-spec.json",
            "dashboards/obsckpt.json",
            "deploy/prometheus/rules/obsckpt-alerts.yml",
            "deploy/prometheus/tests/obsckpt-alerts.test.yml",
            "docs/metrics.md",
            "constraints.txt",
        ):
            assert rel in names, f"the sdist lacks {rel}"


class TestWheel:
    """The wheel is the package, its py.typed and its metadata; nothing else."""

    def test_files_are_the_package(self, dists):
        with zipfile.ZipFile(dists["wheel"]) as zf:
            names = zf.namelist()
        package = {n for n in names if not n.startswith("obsckpt-")}
        sources = {
            p.relative_to(ROOT).as_posix()
            for p in (ROOT / "obsckpt").rglob("*")
            if p.is_file() and p.suffix != ".pyc" and "__pycache__" not in p.parts
        }
        assert package == sources
        assert "obsckpt/py.typed" in package
        dist_info = {n.split("/", 1)[1] for n in names if n.startswith("obsckpt-")}
        assert dist_info == {"METADATA", "WHEEL", "RECORD", "entry_points.txt", "licenses/LICENSE"}
        with zipfile.ZipFile(dists["wheel"]) as zf:
            [license_file] = [n for n in names if n.endswith("licenses/LICENSE")]
            assert "Apache License" in zf.read(license_file).decode()

    def test_ships_the_dashboard_rules_and_scrape_snippet(self, dists):
        """The observability files of this version are package data, as make dashboards made them."""
        with zipfile.ZipFile(dists["wheel"]) as zf:
            shipped = {
                n.removeprefix("obsckpt/_assets/"): zf.read(n).decode()
                for n in zf.namelist()
                if n.startswith("obsckpt/_assets/")
            }
        assert set(shipped) == set(ASSET_NAMES)
        for name, text in shipped.items():
            assert text == (ROOT / "obsckpt" / "_assets" / name).read_text(), name
        assert json.loads(shipped["obsckpt-dashboard.json"])["uid"] == "obsckpt"

    def test_entry_point_and_version(self, dists):
        meta = _wheel_metadata(dists["wheel"])
        init = _wheel_sources(dists["wheel"])["obsckpt/__init__.py"]
        [version] = [
            node.value.value
            for node in ast.parse(init).body
            if isinstance(node, ast.Assign) and node.targets[0].id == "__version__"
        ]
        assert meta["Version"] == version
        with zipfile.ZipFile(dists["wheel"]) as zf:
            [ep] = [n for n in zf.namelist() if n.endswith("entry_points.txt")]
            assert "obsckpt = obsckpt.cli:main" in zf.read(ep).decode()

    def test_classifiers_match_requires_python(self, dists):
        meta = _wheel_metadata(dists["wheel"])
        spec = SpecifierSet(meta["Requires-Python"])
        minors = [
            c.rsplit(" ", 1)[1]
            for c in meta.get_all("Classifier") or []
            if c.startswith("Programming Language :: Python :: 3.")
        ]
        assert minors, "no Programming Language :: Python :: 3.X classifier"
        for minor in minors:
            assert f"{minor}.0" in spec, f"Python {minor} is classified but not admitted"
        oldest = ".".join(map(str, _oldest_python(meta["Requires-Python"])))
        assert oldest in minors, f"Python {oldest} is admitted but not classified"

    def test_requires_python_admits_only_pythons_the_code_runs_on(self, dists):
        """No standard-library API newer than the oldest Python that Requires-Python admits."""
        oldest = _oldest_python(_wheel_metadata(dists["wheel"])["Requires-Python"])
        too_new = []
        for name, text in _wheel_sources(dists["wheel"]).items():
            for node in ast.walk(ast.parse(text)):
                used = []
                if isinstance(node, ast.Attribute):
                    used = [node.attr]
                elif isinstance(node, ast.Name):
                    used = [node.id]
                elif isinstance(node, ast.Import):
                    used = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    used = [node.module or ""] + [a.name for a in node.names]
                for api in used:
                    if NEWER_APIS.get(api, (3, 0)) > oldest:
                        too_new.append(f"{name}:{node.lineno} {api} (Python {NEWER_APIS[api]})")
        assert not too_new, f"Requires-Python admits {oldest}, older than: {too_new}"

    def test_opentelemetry_lower_bounds(self, dists):
        """tracing.flush() reports spans left unsent only where force_flush waits (SDK 1.34+)."""
        requirements = [
            Requirement(r) for r in _wheel_metadata(dists["wheel"]).get_all("Requires-Dist")
        ]
        otel = [r for r in requirements if r.name.startswith("opentelemetry-")]
        assert {r.name for r in otel} >= {"opentelemetry-api", "opentelemetry-sdk"}
        for r in otel:
            assert not r.specifier.contains("1.33.0"), f"{r} admits an SDK older than 1.34"


@pytest.fixture(scope="module")
def installed(dists, tmp_path_factory) -> Path:
    """A fresh environment with the wheel; its dependencies come from this environment."""
    tmp = tmp_path_factory.mktemp("installed")
    venv = tmp / "venv"
    env = _env()
    subprocess.run(
        [_uv(), "venv", "--quiet", "--python", sys.executable, str(venv)], env=env, check=True
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [
            _uv(),
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--python",
            str(python),
            str(dists["wheel"]),
        ],
        env=env,
        check=True,
        timeout=120,
    )
    # This environment's packages as a plain path: its own .pth files (the editable
    # install of the checkout among them) are not read from there.
    target = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(target, "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def _wheel_metadata_version(bin_dir: Path) -> str:
    proc = subprocess.run(
        [str(bin_dir / "python"), "-c", "import obsckpt; print(obsckpt.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
    )
    return proc.stdout.strip()


def _run(bin_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


# Optional packages: the core must import without them (and without the checkout).
OPTIONAL = (
    "verl",
    "transformers",
    "accelerate",
    "opentelemetry.exporter",
    "grafana_foundation_sdk",
)
IMPORT_CHECK = """
import importlib.abc, json, sys, time

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in OPTIONAL):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
t0 = time.perf_counter()
import obsckpt
import_s = time.perf_counter() - t0
heavy = sorted(m for m in ("torch", "ray", *OPTIONAL) if m in sys.modules)
import obsckpt.cli, obsckpt.integrations, obsckpt.sync, obsckpt.telemetry
missing = [n for n in obsckpt.__all__ if not hasattr(obsckpt, n)]
try:
    obsckpt.integrations.FSDPCheckpointManager
    verl_error = None
except ModuleNotFoundError as exc:
    verl_error = str(exc)
print(json.dumps({"file": obsckpt.__file__, "heavy": heavy, "missing": missing,
                  "import_s": import_s, "verl_error": verl_error}))
"""


class TestInstalledWheel:
    """The installed wheel runs from an empty directory, with no checkout beside it."""

    def test_imports_without_extras_and_lazily(self, installed, tmp_path):
        code = f"OPTIONAL = {OPTIONAL!r}\n" + IMPORT_CHECK
        proc = _run(installed, tmp_path, "python", "-c", code)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert Path(result["file"]).is_relative_to(installed.parent), result["file"]
        assert result["heavy"] == [], f"import obsckpt loads {result['heavy']}"
        assert result["missing"] == []
        assert "pip install 'obsckpt[verl]'" in result["verl_error"]

    def test_cli_help_and_version(self, installed, dists, tmp_path):
        version = _wheel_metadata(dists["wheel"])
        for args in ([], ["demo"], ["status"], ["verify"], ["dashboards", "export"]):
            proc = _run(installed, tmp_path, "obsckpt", *args, "--help")
            assert proc.returncode == 0 and proc.stdout.startswith("usage: obsckpt"), proc.stderr
        proc = _run(installed, tmp_path, "obsckpt", "--version")
        assert proc.returncode == 0 and proc.stdout.strip() == f"obsckpt {version['Version']}"
        proc = _run(installed, tmp_path, "obsckpt", "status", str(tmp_path / "nope"))
        assert proc.returncode == 2 and "no such directory" in proc.stderr
        assert list(tmp_path.iterdir()) == []

    def test_dashboards_export(self, installed, tmp_path):
        """`obsckpt dashboards export DIR` writes the installed version's files, no checkout needed."""
        proc = _run(installed, tmp_path, "obsckpt", "dashboards", "export", "out")
        assert proc.returncode == 0, proc.stderr
        out = tmp_path / "out"
        assert sorted(p.name for p in out.iterdir()) == sorted(ASSET_NAMES)
        for name in ASSET_NAMES:
            assert (out / name).read_text() == (ROOT / "obsckpt" / "_assets" / name).read_text()
        version = _wheel_metadata_version(installed)
        assert f"obsckpt {version}:" in (out / "prometheus-scrape.yml").read_text()
