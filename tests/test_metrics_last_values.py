"""Last-value gauges: each latency histogram's last observation, and the weight syncs'
bytes counter's last increment (the bytes of the last sync), kept until the next.

Set with the histogram or counter, under its labels, by the monitor's telemetry and
by the weight-sync telemetry's local metrics; absent (not 0) until the first
observation. On real registries, a real monitor actor and its /metrics.
"""

from __future__ import annotations

import math

import pytest
import ray
from prometheus_client import CollectorRegistry, generate_latest
from reliability_helpers import Scrape, scrape, wait_for

from obsckpt import CheckpointMonitor
from obsckpt.monitor.events import CommitRecord
from obsckpt.monitor.telemetry import MonitorTelemetry
from obsckpt.sync.telemetry import WeightSyncTelemetry
from obsckpt.telemetry.metrics import METRICS, SYNC_PHASES, Metrics

SPECS = {spec.attr: spec for spec in METRICS}
# Histogram name -> the name of the gauge holding its last observation.
LAST = {
    SPECS[spec.last_of].name: spec.name
    for spec in METRICS
    if spec.last_of and SPECS[spec.last_of].type == "histogram"
}
# Counter name -> the name of the gauge holding its last increment.
LAST_ADDED = {
    SPECS[spec.last_of].name: spec.name
    for spec in METRICS
    if spec.last_of and SPECS[spec.last_of].type == "counter"
}
BYTES = "obsckpt_last_broadcast_bytes"


def sample_names(registry: CollectorRegistry) -> set[str]:
    """The names of every sample ``registry`` holds, without the ``*_created`` ones
    (which only obsckpt's own processes switch off)."""
    return {
        s.name
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of ``name`` in ``registry``, by their sorted label items."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == name
    }


class TestDefinitions:
    def test_every_latency_histogram_has_a_last_value_gauge(self):
        """The save duration's last value is the per-rank gauge; every other histogram has
        ``obsckpt_last_<stem>`` with the histogram's labels."""
        histograms = {spec.name: spec for spec in METRICS if spec.type == "histogram"}
        assert set(LAST) == set(histograms) - {"obsckpt_save_duration_seconds"}
        for histogram, gauge in LAST.items():
            spec = next(s for s in METRICS if s.name == gauge)
            assert spec.type == "gauge"
            assert gauge == histogram.replace("obsckpt_", "obsckpt_last_", 1)
            assert spec.labels == histograms[histogram].labels, gauge

    def test_the_weight_sync_bytes_have_a_last_value_gauge(self):
        """The bytes of the last sync (its bandwidth is last bytes / last duration), and a
        delta-capable sync's bytes sent and state size: the counters with a last-value
        gauge, the first under the last duration's labels."""
        assert LAST_ADDED == {
            "obsckpt_broadcast_bytes_total": BYTES,
            "obsckpt_weight_sync_sent_bytes_total": "obsckpt_last_weight_sync_sent_bytes",
            "obsckpt_weight_sync_state_bytes_total": "obsckpt_last_weight_sync_state_bytes",
        }
        assert len(LAST) + len(LAST_ADDED) == len([s for s in METRICS if s.last_of])
        spec = next(s for s in METRICS if s.name == BYTES)
        duration = next(s for s in METRICS if s.name == LAST["obsckpt_broadcast_duration_seconds"])
        assert spec.type == "gauge"
        assert spec.labels == duration.labels == SPECS["broadcast_bytes"].labels


class TestMetricsObserve:
    def test_no_series_before_the_first_observation(self):
        metrics = Metrics(CollectorRegistry())
        for gauge in (*LAST.values(), *LAST_ADDED.values()):
            assert samples(metrics.registry, gauge) == {}, gauge
        # The histograms' and counters' own known series are there at zero, as before.
        text = generate_latest(metrics.registry).decode()
        assert 'obsckpt_broadcast_bytes_total{backend="shm",method="ipc"} 0.0' in text
        assert 'obsckpt_commit_lag_seconds_count{kind="checkpoint"} 0.0' in text
        assert "obsckpt_state_dict_upload_duration_seconds_count 0.0" in text
        assert "\nobsckpt_last_state_dict_upload_duration_seconds " not in text

    @pytest.mark.parametrize(
        ("histogram", "labels"),
        [
            ("join_wait", ("model",)),
            ("admission_wait", ("single_node",)),
            ("commit_lag", ("state_dict",)),
            ("broadcast_duration", ("shm", "ipc")),
            ("upload_duration", ()),
            ("commit_phase", ("fsync_files",)),
        ],
    )
    def test_each_observation_sets_the_gauge(self, histogram, labels):
        metrics = Metrics(CollectorRegistry())
        spec = SPECS[histogram]
        gauge = LAST[spec.name]
        key = tuple(sorted(zip(spec.labels, labels, strict=True)))
        for seconds in (42.5, 0.125, 7.0):
            metrics.observe(histogram, seconds, *labels)
            assert samples(metrics.registry, gauge) == {key: seconds}
        assert samples(metrics.registry, spec.name + "_count")[key] == 3
        assert samples(metrics.registry, spec.name + "_sum")[key] == 42.5 + 0.125 + 7.0

    def test_save_duration_has_no_gauge_of_its_own(self):
        """Its last value is the per-rank gauge, which the monitor sets per rank."""
        metrics = Metrics(CollectorRegistry())

        def names() -> set[str]:
            return sample_names(metrics.registry)

        before = names()
        metrics.observe("save_duration", 3.0, "model", "checkpoint")
        stem = "obsckpt_save_duration_seconds"
        assert names() - before == {f"{stem}_bucket", f"{stem}_sum", f"{stem}_count"}
        assert samples(metrics.registry, f"{stem}_sum") == {
            (("kind", "checkpoint"), ("slot", "model")): 3.0
        }


class TestMetricsAdd:
    @pytest.mark.parametrize(
        "labels",
        [("nccl", "broadcast"), ("gloo", "broadcast"), ("cuda_ipc", "ipc"), ("shm", "ipc")],
    )
    def test_each_increment_sets_the_gauge(self, labels):
        metrics = Metrics(CollectorRegistry())
        key = tuple(sorted(zip(("backend", "method"), labels, strict=True)))
        for nbytes in (3 << 30, 1 << 20, 0, 5 << 30):
            metrics.add("broadcast_bytes", nbytes, *labels)
            assert samples(metrics.registry, BYTES) == {key: nbytes}
        total = samples(metrics.registry, "obsckpt_broadcast_bytes_total")
        assert total[key] == (8 << 30) + (1 << 20)
        assert sum(total.values()) == total[key]  # the other backends' series stay at 0

    def test_a_counter_without_a_gauge_is_only_counted(self):
        metrics = Metrics(CollectorRegistry())

        def names() -> set[str]:
            return sample_names(metrics.registry)

        before = names()
        metrics.add("save_bytes", 10, "model", "checkpoint")
        assert names() - before == {"obsckpt_save_bytes_total"}
        assert samples(metrics.registry, "obsckpt_save_bytes_total") == {
            (("kind", "checkpoint"), ("slot", "model")): 10
        }


class TestMonitorTelemetry:
    """The monitor's observer sets each gauge where it observes the histogram."""

    @pytest.fixture
    def telemetry(self) -> MonitorTelemetry:
        return MonitorTelemetry("unrestricted", CollectorRegistry(), max_slot_labels=2)

    def last(self, telemetry: MonitorTelemetry, histogram: str):
        return samples(telemetry.metrics.registry, LAST[histogram])

    def test_commit_lag_of_each_moved_kind(self, telemetry):
        telemetry.step_committed(
            CommitRecord(
                step=4,
                kind="checkpoint",
                whole_at=110.0,
                committed_at=112.5,
                started_at=100.0,
                moved=("checkpoint", "state_dict"),
            )
        )
        assert self.last(telemetry, "obsckpt_commit_lag_seconds") == {
            (("kind", "checkpoint"),): 12.5,
            (("kind", "state_dict"),): 12.5,
        }
        telemetry.step_committed(
            CommitRecord(
                step=5,
                kind="checkpoint",
                whole_at=3601.0,
                committed_at=3603.0,
                started_at=3600.0,
                moved=("checkpoint",),
            )
        )
        assert self.last(telemetry, "obsckpt_commit_lag_seconds") == {
            (("kind", "checkpoint"),): 3.0,
            (("kind", "state_dict"),): 12.5,
        }

    def test_commit_phases(self, telemetry):
        telemetry.commit_phase_ended("scan", 0.5)
        telemetry.commit_phase_ended("manifest", 0.25)
        telemetry.commit_phase_ended("scan", 2.0)
        assert self.last(telemetry, "obsckpt_commit_phase_seconds") == {
            (("phase", "scan"),): 2.0,
            (("phase", "manifest"),): 0.25,
        }

    def test_join_wait_under_the_bounded_slot_label(self, telemetry):
        for slot, wait in (("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0), ("a", 0.5)):
            telemetry.save_finished(
                "checkpoint",
                slot,
                0,
                ok=True,
                error=None,
                step=1,
                duration_s=1.0,
                nbytes=1,
                join_wait_s=wait,
            )
        # max_slot_labels=2: c and d share "_other", as their histogram series do.
        assert self.last(telemetry, "obsckpt_thread_join_wait_seconds") == {
            (("slot", "a"),): 0.5,
            (("slot", "b"),): 2.0,
            (("slot", "_other"),): 4.0,
        }

    def test_weight_sync_and_upload(self, telemetry):
        telemetry.record_broadcast("nccl", 30.0, 1 << 30, "broadcast")
        telemetry.record_broadcast("nccl", 20.0, 2 << 30, "broadcast")
        telemetry.record_broadcast("cuda_ipc", 0.5, 3 << 30, "ipc")
        telemetry.record_upload(9.0)
        assert self.last(telemetry, "obsckpt_broadcast_duration_seconds") == {
            (("backend", "nccl"), ("method", "broadcast")): 20.0,
            (("backend", "cuda_ipc"), ("method", "ipc")): 0.5,
        }
        assert samples(telemetry.metrics.registry, BYTES) == {
            (("backend", "nccl"), ("method", "broadcast")): 2 << 30,
            (("backend", "cuda_ipc"), ("method", "ipc")): 3 << 30,
        }
        assert self.last(telemetry, "obsckpt_state_dict_upload_duration_seconds") == {(): 9.0}

    def test_a_refused_measurement_leaves_the_last_value(self, telemetry):
        telemetry.record_upload(9.0)
        telemetry.record_broadcast("gloo", 1.5, 10, "broadcast")
        with pytest.raises(ValueError, match="seconds must be finite"):
            telemetry.record_upload(math.nan)
        with pytest.raises(ValueError, match="seconds must be finite"):
            telemetry.record_broadcast("gloo", -1.0, 20, "broadcast")
        with pytest.raises(ValueError, match="nbytes must be a non-negative integer"):
            telemetry.record_broadcast("gloo", 2.0, -1, "broadcast")
        assert self.last(telemetry, "obsckpt_state_dict_upload_duration_seconds") == {(): 9.0}
        assert self.last(telemetry, "obsckpt_broadcast_duration_seconds") == {
            (("backend", "gloo"), ("method", "broadcast")): 1.5
        }
        assert samples(telemetry.metrics.registry, BYTES) == {
            (("backend", "gloo"), ("method", "broadcast")): 10
        }


def test_weight_sync_telemetry_sets_the_local_gauges():
    """The broadcaster's and the Synchronizer's local metrics (no monitor in the job)."""
    telemetry = WeightSyncTelemetry(metrics=Metrics(CollectorRegistry()))
    telemetry.broadcast("gloo", 4.0, 100)
    telemetry.broadcast("shm", 0.75, 300, "ipc")
    telemetry.broadcast("shm", 0.5, 200, "ipc")
    telemetry.upload(2.0)
    telemetry.upload(3.5)
    registry = telemetry.metrics.registry
    assert samples(registry, "obsckpt_last_broadcast_duration_seconds") == {
        (("backend", "gloo"), ("method", "broadcast")): 4.0,
        (("backend", "shm"), ("method", "ipc")): 0.5,
    }
    assert samples(registry, BYTES) == {
        (("backend", "gloo"), ("method", "broadcast")): 100,
        (("backend", "shm"), ("method", "ipc")): 200,
    }
    assert samples(registry, "obsckpt_last_state_dict_upload_duration_seconds") == {(): 3.5}
    assert samples(registry, "obsckpt_state_dict_upload_duration_seconds_count") == {(): 2}


STORE_UPLOAD = "obsckpt_last_store_upload_seconds"
MIRROR_COPY = "obsckpt_last_mirror_copy_seconds"


def _check_against_histograms(before: Scrape, after: Scrape) -> set[tuple[str, tuple]]:
    """Every last-value sample of ``after`` is its histogram's one observation since
    ``before`` (the growth of its _sum), or unchanged when there was none; returns the
    (gauge, labels) that took a new observation."""
    new = set()
    for name, labels, value in after.samples:
        histogram = next((h for h, g in LAST.items() if g == name), None)
        if histogram is None:
            continue
        count = after.value(histogram + "_count", **labels) - (
            before.value(histogram + "_count", **labels) or 0
        )
        assert count in (0, 1), (name, labels, count)
        if count:
            grown = after.value(histogram + "_sum", **labels) - (
                before.value(histogram + "_sum", **labels) or 0
            )
            assert value == pytest.approx(grown, rel=1e-9, abs=1e-12), (name, labels)
            new.add((name, tuple(sorted(labels.items()))))
        else:
            assert before.value(name, **labels) == value, (name, labels)
    return new


def test_a_real_monitor_serves_each_last_observation(ray_cluster, namespace, tmp_path):
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace,
        default_local_dir=str(tmp_path / "root"),
        metrics_port=0,
        metrics_host="127.0.0.1",
    )
    try:
        address = ray.get(monitor.metrics_address.remote(), timeout=60)
        previous = scrape(address)
        assert not [s for s in previous.samples if s[0] in (*LAST.values(), BYTES)]
        for step, join_wait, broadcast, nbytes, upload in (
            (1, 0.25, 0.2, 1 << 20, 0.1),
            (2, 0.5, 0.7, 3 << 20, 0.3),
        ):
            ray.get(monitor.register_thread_count.remote(step, checkpoint_thread_count=1))
            ray.get(monitor.monitor_step.remote(step))
            reply = ray.get(
                monitor.notify_started.remote(step=step, slot="model", kind="checkpoint", rank=0)
            )
            ray.get(
                monitor.notify_finished.remote(
                    step,
                    ticket=reply["ticket"],
                    slot="model",
                    rank=0,
                    duration_s=1.0,
                    nbytes=10,
                    join_wait_s=join_wait,
                )
            )
            ray.get(monitor.record_broadcast.remote("gloo", broadcast, nbytes))
            ray.get(monitor.record_upload.remote(upload))
            phases = dict(
                zip(SYNC_PHASES, (0.01 * step, 0.02, 0.03, 0.04 * step, 0.05), strict=True)
            )
            report = {
                "method": "broadcast",
                "step": step,
                "encoding": "delta",
                "phases": phases,
                "sent_bytes": nbytes // 20,
                "state_bytes": nbytes,
                "changed_fraction": 0.02,
                "pause_s": 0.1 * step,
                "rollout_version": step,
                "corrupt": None,
            }
            ray.get(monitor.record_weight_sync.remote(report))
            current = wait_for(
                lambda step=step: (
                    s
                    if (s := scrape(address)).value(
                        "obsckpt_commit_lag_seconds_count", kind="checkpoint"
                    )
                    == step
                    else None
                ),
                30,
                f"step {step}'s commit",
            )
            new = {name for name, _ in _check_against_histograms(previous, current)}
            # An upload to an s3:// root is observed only there (tests/test_store_commit.py),
            # a copy to a mirror only with one (tests/test_store_mirror.py).
            assert new == set(LAST.values()) - {STORE_UPLOAD, MIRROR_COPY}, set(LAST.values()) - new
            assert current.value("obsckpt_last_thread_join_wait_seconds", slot="model") == join_wait
            assert (
                current.value(
                    "obsckpt_last_broadcast_duration_seconds", backend="gloo", method="broadcast"
                )
                == broadcast
            )
            # The last sync's bytes: the counter's growth since the previous scrape.
            gloo = {"backend": "gloo", "method": "broadcast"}
            grown = current.value("obsckpt_broadcast_bytes_total", **gloo) - previous.value(
                "obsckpt_broadcast_bytes_total", **gloo
            )
            assert current.value(BYTES, **gloo) == grown == nbytes
            assert current.value("obsckpt_last_state_dict_upload_duration_seconds") == upload
            # Only observed series exist: no nccl broadcast was made.
            assert (
                current.value(
                    "obsckpt_last_broadcast_duration_seconds", backend="nccl", method="broadcast"
                )
                is None
            )
            assert current.value(BYTES, backend="nccl", method="broadcast") is None
            previous = current
    finally:
        ray.kill(monitor, no_restart=True)
