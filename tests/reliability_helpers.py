"""Shared pieces of the reliability tests: scraping /metrics, checking a root, worker actors.

``OBSCKPT_RELIABILITY_TRIALS`` raises the number of randomised trials (the
suite runs a few; docs/reliability.md reports runs with many more), and
``OBSCKPT_RELIABILITY_REPORT`` names a JSON-lines file each trial appends its
outcome to, so the figures in the docs can be recomputed.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from obsckpt.store import layout, reader

TRIALS_ENV = "OBSCKPT_RELIABILITY_TRIALS"
REPORT_ENV = "OBSCKPT_RELIABILITY_REPORT"


def trials(default: int) -> int:
    """How many randomised trials to run: ``default`` unless the environment asks for more."""
    value = os.environ.get(TRIALS_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


def report(test: str, **fields) -> None:
    """Append one trial's outcome to the report file, when one is configured."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"test": test, **fields}, sort_keys=True) + "\n")


# ----------------------------------------------------------------------
# /metrics
# ----------------------------------------------------------------------


class Scrape:
    """One scrape of a /metrics endpoint, queried by name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.append((s.name, dict(s.labels), s.value))

    def value(self, name: str, **labels: str) -> float | None:
        """The one sample with this name and exactly these labels, None if absent."""
        for n, lab, v in self.samples:
            if n == name and lab == labels:
                return v
        return None

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples with this name whose labels include ``labels``."""
        return sum(
            v
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == val for k, val in labels.items())
        )


def scrape(address: str, timeout: float = 10.0) -> Scrape:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as resp:
        return Scrape(resp.read().decode())


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


# ----------------------------------------------------------------------
# The on-disk invariant
# ----------------------------------------------------------------------


def monitor_status(monitor, timeout: float = 60.0) -> dict:
    """The monitor's status(), retried while Ray restarts it."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(monitor.status.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the actor is restarting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def assert_root_consistent(root: str | os.PathLike) -> dict[str, int | None]:
    """Every iteration file names a whole step: manifest verifies, every .pt loads.

    Returns the step each iteration file names (None where there is none).
    """
    root = Path(root)
    latest = {}
    for kind in layout.KINDS:
        step = reader.read_iteration(root, kind)
        latest[kind] = step
        if step is None:
            continue
        sdir = layout.step_dir(root, step)
        assert sdir.is_dir(), (
            f"{layout.ITERATION_FILES[kind]} names step {step} but {sdir} is missing"
        )
        problems = reader.verify_step(sdir)
        assert not problems, f"step {step} named by {kind} does not verify: {problems}"
        for rec in reader.read_manifest(sdir):
            if rec.path.endswith(".pt"):
                torch.load(sdir / rec.path, weights_only=True)
    leftovers = [
        p.name for p in root.iterdir() if p.name.startswith("latest_") and ".tmp" in p.name
    ]
    assert not leftovers, f"temporary iteration files left behind: {leftovers}"
    return latest


def rank_state(step: int, rank: int, numel: int) -> dict[str, torch.Tensor]:
    """A deterministic state dict for ``rank`` at ``step``: resumption can check its values."""
    return {
        "w": torch.full((numel,), float(step * 1000 + rank), dtype=torch.float32),
        "step": torch.tensor(step),
    }


def rank_path(root: str | os.PathLike, step: int, rank: int, world: int) -> Path:
    return layout.step_dir(root, step) / "actor" / f"model_world_size_{world}_rank_{rank}.pt"


# ----------------------------------------------------------------------
# A trainer rank as a Ray actor
# ----------------------------------------------------------------------


class RankWorker:
    """One trainer rank: saves its shard of a step with CheckpointCoordinator.

    Decorated with ``ray.remote`` by :func:`rank_worker_class`, so this module
    imports without Ray.
    """

    def __init__(
        self,
        monitor,
        root: str,
        rank: int,
        world: int,
        numel: int,
        trace: bool = False,
        **coord_kwargs,
    ):
        import obsckpt.staging  # noqa: F401 - import torch's distributed parts now, not mid-save
        from obsckpt import CheckpointCoordinator
        from obsckpt.telemetry import tracing

        if trace:  # configured by this process's OTEL_* variables
            tracing.setup_tracing("obsckpt-rank")

        self.root, self.rank, self.world, self.numel = root, rank, world, numel
        self.coord_kwargs = coord_kwargs
        self.coord = CheckpointCoordinator(monitor, rank=rank, **coord_kwargs)

    def pid(self) -> int:
        return os.getpid()

    def attach(self, monitor) -> None:
        """Report to another monitor from now on (the job was restarted around this rank)."""
        from obsckpt import CheckpointCoordinator

        self.coord = CheckpointCoordinator(monitor, rank=self.rank, **self.coord_kwargs)

    def save(self, step: int) -> float:
        """Snapshot this rank's state for ``step`` and write it in the background."""
        t0 = time.monotonic()
        path = rank_path(self.root, step, self.rank, self.world)
        self.coord.save_state_dict_async(
            "model", rank_state(step, self.rank, self.numel), path, step
        )
        return time.monotonic() - t0

    def wait(self, timeout: float = 60.0) -> str | None:
        """Join the saves; the error text, or None when every save succeeded."""
        try:
            self.coord.wait_all(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - returned to the test as text
            return f"{type(exc).__name__}: {exc}"
        return None

    def resume(self) -> int | None:
        """Load this rank's file from the newest committed step; returns that step."""
        step = reader.read_iteration(self.root, "checkpoint")
        if step is None:
            return None
        state = torch.load(rank_path(self.root, step, self.rank, self.world), weights_only=True)
        expected = rank_state(step, self.rank, self.numel)
        assert torch.equal(state["w"], expected["w"]) and int(state["step"]) == step
        return step


def by_value() -> None:
    """Ship this module's classes to Ray workers by value: tests/ is not on their path."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rank_worker_class():
    import ray

    by_value()
    return ray.remote(num_cpus=0, max_restarts=0)(RankWorker)


class RunsCode:
    """Unpickling this runs code: it creates the file named in its argument."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def rewrite_manifest(sdir) -> None:
    """The manifest of ``sdir`` rewritten to match whatever its files hold now."""
    from obsckpt.store import commit as disk

    records = [
        reader.record_file(os.path.join(d, n), sdir)
        for d, names in reader.walk_files(str(sdir))
        for n in names
        if n != layout.MANIFEST_NAME
    ]
    disk.atomic_write(sdir / layout.MANIFEST_NAME, layout.manifest_bytes(records))
