"""Series over a long job: label values from callers stay bounded, the series of ranks
that are gone go away, and the duration buckets resolve the minutes a large checkpoint
takes. On a real monitor actor, real scrapes of /metrics, and a real Prometheus for the
quantiles."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import ray
from prometheus_client import CollectorRegistry
from reliability_helpers import Scrape, scrape, wait_for

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.monitor.labels import SlotLabels
from obsckpt.store import layout, reader
from obsckpt.telemetry.metrics import DURATION_BUCKETS, OVERFLOW_SLOT, Metrics

PER_RANK = (
    "obsckpt_rank_last_save_duration_seconds",
    "obsckpt_staging_bytes",
    "obsckpt_staging_pinned_bytes",
)


def make_monitor(namespace, root, **kw):
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace,
        default_local_dir=str(root),
        metrics_port=0,
        metrics_host="127.0.0.1",
        **kw,
    )
    address = ray.get(monitor.metrics_address.remote())
    return monitor, address


def label_values(s: Scrape, label: str, prefix: str = "obsckpt_") -> set[str]:
    return {lab[label] for name, lab, _ in s.samples if name.startswith(prefix) and label in lab}


def rank_series(s: Scrape, name: str) -> set[tuple[str, str]]:
    return {(lab["rank"], lab["slot"]) for n, lab, _ in s.samples if n == name}


def save(monitor, step, slot, rank, *, pid, parts=None, duration_s=1.0, lease=False):
    """One rank's save of ``slot`` as a coordinator reports it: admitted, then finished."""
    part = {"part": rank, "parts": parts} if parts is not None else {}
    reply = ray.get(
        monitor.notify_started.remote(
            step=step, slot=slot, kind="checkpoint", rank=rank, pid=pid, lease=lease, **part
        )
    )
    if lease:
        return reply  # left running: its heartbeats never come
    ray.get(
        monitor.notify_finished.remote(
            step,
            ticket=reply["ticket"],
            slot=slot,
            rank=rank,
            duration_s=duration_s,
            nbytes=1024,
            **part,
        )
    )
    return reply


def stage(monitor, rank, slot, *, pid=None, nbytes=1 << 20):
    ray.get(
        monitor.record_staging.remote(
            rank=rank, slot=slot, nbytes=nbytes, pinned_bytes=0, **({"pid": pid} if pid else {})
        )
    )


class TestSlotLabelsAreBounded:
    """A slot name that carries the step adds no series per step: past max_slot_labels
    distinct slots, saves are recorded under slot="_other" and counted, and every step
    still commits."""

    def test_per_step_slot_names_through_a_coordinator(self, namespace, tmp_path):
        root = tmp_path / "root"
        monitor, address = make_monitor(namespace, root, max_slot_labels=3)
        coord = CheckpointCoordinator(monitor, rank=0)
        sizes = {}
        for step in range(1, 11):
            asyncio.run(coord.register_and_monitor(step, checkpoint_thread_count=1))
            path = layout.step_dir(root, step) / "model.bin"

            def write(path=path):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"x" * 1024)

            coord.save_async(f"model_{step}", write, step, paths=[path])
            coord.wait_all(timeout=30)
            wait_for(
                lambda step=step: reader.read_iteration(root, "checkpoint") == step,
                30,
                f"step {step} to commit",
            )
            if step in (6, 10):
                sizes[step] = len(scrape(address).samples)
        s = scrape(address)
        assert label_values(s, "slot") == {"model_1", "model_2", "model_3", OVERFLOW_SLOT}
        assert s.value("obsckpt_saves_total", slot=OVERFLOW_SLOT, kind="checkpoint", result="ok")
        assert s.total("obsckpt_saves_total", slot=OVERFLOW_SLOT, result="ok") == 7
        assert s.value("obsckpt_slot_label_overflows_total") == 7
        assert s.total("obsckpt_save_duration_seconds_count") == 10
        assert sizes[6] == sizes[10], f"series grew with the steps: {sizes}"
        coord.close()
        ray.kill(monitor, no_restart=True)

    def test_first_fold_is_logged_once_by_name(self, caplog):
        metrics = Metrics(CollectorRegistry())
        slots = SlotLabels(2, metrics.slot_label_overflows)
        with caplog.at_level(logging.WARNING, logger="obsckpt.monitor.labels"):
            got = [slots.label(s, count=True) for s in ("a", "b", "c", "d", "c", "a")]
        assert got == ["a", "b", OVERFLOW_SLOT, OVERFLOW_SLOT, OVERFLOW_SLOT, "a"]
        (record,) = caplog.records
        assert "'c'" in record.getMessage() and "max_slot_labels" in record.getMessage()
        assert metrics.registry.get_sample_value("obsckpt_slot_label_overflows_total") == 3

    @pytest.mark.parametrize("bad", [0, -1, True, "8", 2.5])
    def test_bad_max_slot_labels_is_refused_by_name(self, tmp_path, bad):
        with pytest.raises(ValueError, match=rf"max_slot_labels must be a positive int.*{bad!r}"):
            CheckpointMonitor.get_actor(default_local_dir=str(tmp_path), max_slot_labels=bad)


class TestOtherCallerLabelsAreBounded:
    """rank, backend, method, reason and role take only known values (ranks: non-negative
    integers); anything else is refused by name and makes no series."""

    def test_unknown_values_are_refused(self, namespace, tmp_path):
        monitor, address = make_monitor(namespace, tmp_path / "root")
        bad_calls = [
            (monitor.record_broadcast.remote("NCCL", 1.0, 10), "'NCCL'"),
            (monitor.record_broadcast.remote("gloo", 1.0, 10, "ipc"), "'ipc' with backend 'gloo'"),
            (monitor.record_broadcast_failure.remote("nccl", "broadcast", "peer 3"), "'peer 3'"),
            (monitor.record_model_version.remote("learner", 3), "'learner'"),
            (monitor.notify_started.remote(step=1, slot="m", rank="0"), "got '0'"),
            (monitor.notify_started.remote(step=1, slot="m", rank=-1), "got -1"),
            (monitor.record_staging.remote(rank=1.5, slot="m", nbytes=1, pinned_bytes=0), "1.5"),
        ]
        for ref, named in bad_calls:
            with pytest.raises(ValueError, match=named):
                ray.get(ref)
        s = scrape(address)
        assert label_values(s, "backend") == {"nccl", "gloo", "cuda_ipc", "shm"}
        assert label_values(s, "role") == {"trainer", "rollout"}
        assert label_values(s, "reason") == {"timeout", "error"}
        assert label_values(s, "rank") == set()
        assert ray.get(monitor.status.remote())["in_flight"] == []
        ray.kill(monitor, no_restart=True)


class TestBadMeasurementsChangeNothing:
    """A measurement that a counter or histogram cannot take (negative bytes, a NaN or
    negative duration) is refused by name before the save is released: no series goes
    backwards or NaN, and the step commits once the save is reported properly."""

    def test_refused_then_committed(self, namespace, tmp_path):
        root = tmp_path / "root"
        monitor, address = make_monitor(namespace, root)
        ray.get(monitor.register_thread_count.remote(1, checkpoint_thread_count=1))
        ray.get(monitor.monitor_step.remote(1))
        reply = save(monitor, 1, "model", 0, pid=100, lease=True)
        finish = dict(ticket=reply["ticket"], slot="model", rank=0)
        for bad, named in (
            ({"nbytes": -1}, "nbytes must be a non-negative integer.*-1"),
            ({"duration_s": math.nan}, "duration_s must be finite.*nan"),
            ({"join_wait_s": -0.5}, "join_wait_s must be finite.*-0.5"),
        ):
            with pytest.raises(ValueError, match=named):
                ray.get(monitor.notify_finished.remote(1, **finish, **bad))
        for ref, named in (
            (monitor.record_upload.remote(math.inf), "seconds must be finite.*inf"),
            (monitor.record_broadcast.remote("gloo", 1.0, -8), "nbytes.*-8"),
        ):
            with pytest.raises(ValueError, match=named):
                ray.get(ref)
        assert [t["ticket"] for t in ray.get(monitor.status.remote())["in_flight"]] == [
            reply["ticket"]
        ]
        ray.get(monitor.notify_finished.remote(1, **finish, duration_s=2.0, nbytes=10))
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 1, 10, "step 1 to commit")
        s = scrape(address)
        assert s.value("obsckpt_save_duration_seconds_sum", slot="model", kind="checkpoint") == 2
        assert s.value("obsckpt_save_bytes_total", slot="model", kind="checkpoint") == 10
        assert s.value("obsckpt_state_dict_upload_duration_seconds_count") == 0
        ray.kill(monitor, no_restart=True)


class TestSeriesOfGoneRanks:
    """A rank's per-rank series (last save duration, staging bytes) go when the rank is
    known gone: its slot's world shrank below it, or its process died and no other
    process has reported as that rank since. Other ranks and slots keep theirs."""

    def test_world_shrinks(self, namespace, tmp_path):
        monitor, address = make_monitor(namespace, tmp_path / "root")
        for rank in range(4):
            stage(monitor, rank, "model")
            save(monitor, 1, "model", rank, pid=100 + rank, parts=4)
        save(monitor, 1, "extra", 3, pid=103)  # a slot not saved in parts
        s = scrape(address)
        assert rank_series(s, PER_RANK[0]) == {(str(r), "model") for r in range(4)} | {
            ("3", "extra")
        }
        # Resumed on two ranks: the first part of the smaller world tells it.
        save(monitor, 2, "model", 0, pid=200, parts=2)
        s = scrape(address)
        for name in PER_RANK:
            found = {key for key in rank_series(s, name) if key[1] == "model"}
            assert found == {("0", "model"), ("1", "model")}, (name, found)
        assert ("3", "extra") in rank_series(s, PER_RANK[0])
        assert s.total("obsckpt_saves_total", slot="model", result="ok") == 5  # counters stay
        ray.kill(monitor, no_restart=True)

    def test_process_gone(self, namespace, tmp_path):
        monitor, address = make_monitor(namespace, tmp_path / "root", lease_timeout_s=1.0)
        for rank in range(3):
            stage(monitor, rank, "model")
            save(monitor, 1, "model", rank, pid=100 + rank)
        # Step 2: ranks 1 and 2 die while saving. Rank 2's replacement (pid 202) is up
        # and has saved before the old lease runs out: rank 2's series are its.
        save(monitor, 2, "model", 0, pid=100)
        save(monitor, 2, "model", 1, pid=101, lease=True)
        save(monitor, 2, "model", 2, pid=102, lease=True)
        save(monitor, 3, "model", 2, pid=202, duration_s=5.0)
        wait_for(
            lambda: not ray.get(monitor.status.remote())["in_flight"],
            10,
            "the leases of ranks 1 and 2 to expire",
        )
        s = scrape(address)
        for name in PER_RANK:
            assert rank_series(s, name) == {("0", "model"), ("2", "model")}, name
        assert s.value(PER_RANK[0], rank="2", slot="model") == 5.0
        assert s.total("obsckpt_saves_total", slot="model", result="error") == 2
        ray.kill(monitor, no_restart=True)

    def test_replacement_known_by_its_staging_report(self, namespace, tmp_path):
        monitor, address = make_monitor(namespace, tmp_path / "root", lease_timeout_s=1.0)
        save(monitor, 1, "model", 0, pid=100)
        save(monitor, 2, "model", 0, pid=100, lease=True)  # dies while saving
        stage(monitor, 0, "model", pid=200, nbytes=2 << 20)  # its replacement prepares
        wait_for(
            lambda: not ray.get(monitor.status.remote())["in_flight"],
            10,
            "the lease of pid 100 to expire",
        )
        s = scrape(address)
        assert s.value("obsckpt_staging_bytes", rank="0", slot="model") == 2 << 20
        assert s.value(PER_RANK[0], rank="0", slot="model") == 1.0
        ray.kill(monitor, no_restart=True)


class TestBucketsResolveLongDurations:
    """A save of 40 minutes (a 70B shard on network storage; a step's commit lag or a
    save's admission wait runs longer still) and a 45-minute upload or broadcast get
    quantiles inside their own bucket, not the top finite bucket's bound: promtool
    evaluates histogram_quantile on the bucket series scraped from a real monitor."""

    @pytest.mark.needs_promtool
    def test_quantiles_of_long_durations(self, namespace, tmp_path):
        promtool = shutil.which("promtool") or "/usr/bin/promtool"
        if not Path(promtool).exists():
            pytest.fail("promtool not found: install Debian's `prometheus` package")
        monitor, address = make_monitor(namespace, tmp_path / "root")
        for rank in range(3):
            save(monitor, 1, "model", rank, pid=100 + rank, duration_s=2400.0)
        ray.get(monitor.record_upload.remote(2700.0))
        ray.get(monitor.record_broadcast.remote("gloo", 2700.0, 1 << 30))
        s = scrape(address)
        ray.kill(monitor, no_restart=True)
        series = [
            {
                "series": name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(lab.items())) + "}",
                "values": f"{value:g}",
            }
            for name, lab, value in s.samples
            if name.endswith("_bucket")
        ]
        checks = []
        for metric, observed in (
            ("obsckpt_save_duration_seconds", 2400.0),
            ("obsckpt_state_dict_upload_duration_seconds", 2700.0),
            ("obsckpt_broadcast_duration_seconds", 2700.0),
        ):
            low = max(b for b in DURATION_BUCKETS if b < observed)
            high = min((b for b in DURATION_BUCKETS if b >= observed), default=math.inf)
            for q in (0.5, 0.99):
                quantile = f"histogram_quantile({q}, sum by (le) ({metric}_bucket))"
                checks.append(
                    {
                        # One sample when the quantile falls in the observed value's bucket.
                        "expr": f"count({quantile} > {low:g} <= {high:g})".replace("inf", "Inf"),
                        "eval_time": "0m",
                        "exp_samples": [{"labels": "{}", "value": 1}],
                    }
                )
        test_file = tmp_path / "quantiles.test.yml"
        test_file.write_text(
            json.dumps(
                {
                    "rule_files": [],
                    "tests": [
                        {"interval": "1m", "input_series": series, "promql_expr_test": checks}
                    ],
                }
            )
        )
        result = subprocess.run(
            [promtool, "test", "rules", str(test_file)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
