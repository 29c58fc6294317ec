"""The end-of-run summary, computed from one scrape of the job's own /metrics endpoint.

Nothing is tallied on the side: every figure comes from the monitor's
Prometheus series. Quantiles are estimated from histogram buckets the way
PromQL's ``histogram_quantile`` does (linear within the bucket), so they
agree with what a dashboard shows for the same run; ``max`` is the upper
bound of the highest non-empty bucket (histograms keep no exact maximum),
and ``mean`` is exact (``_sum / _count``).
"""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from obsckpt.telemetry.metrics import IPC_BACKENDS, ROLES


@dataclass(slots=True)
class Histogram:
    """One histogram series: cumulative bucket counts, count and sum."""

    buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative count)
    count: float = 0.0
    sum: float = 0.0

    def quantile(self, q: float) -> float | None:
        """``histogram_quantile(q, ...)`` of this series; None when it is empty."""
        if self.count <= 0 or not self.buckets:
            return None
        ordered = sorted(self.buckets)
        rank = q * self.count
        prev_le, prev_count = 0.0, 0.0
        for le, cum in ordered:
            if cum >= rank:
                if math.isinf(le):
                    return prev_le  # PromQL answers with the highest finite bound
                width = cum - prev_count
                if width <= 0:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_count) / width
            prev_le, prev_count = le, cum
        return ordered[-1][0]

    def max_bound(self) -> float | None:
        """Upper bound of the highest non-empty bucket (the largest observation is at most this)."""
        if self.count <= 0:
            return None
        prev = 0.0
        best = None
        for le, cum in sorted(self.buckets):
            if cum > prev:
                best = le
            prev = cum
        return best

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


class Scrape:
    """Parsed samples of one /metrics text, queried by metric and labels."""

    def __init__(self, text: str) -> None:
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.append((s.name, dict(s.labels), float(s.value)))

    @classmethod
    def fetch(cls, address: str, timeout: float = 10.0) -> Scrape:
        url = address if "://" in address else f"http://{address}/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return cls(resp.read().decode())

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels`` (0 when none)."""
        return sum(
            v
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == val for k, val in labels.items())
        )

    def histograms(self, name: str, by: str | None = None) -> dict[str, Histogram]:
        """Histograms of ``name`` grouped by the label ``by`` (one group ``""`` when None)."""
        out: dict[str, Histogram] = defaultdict(Histogram)
        merged: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        for n, lab, v in self.samples:
            key = lab.get(by, "") if by else ""
            if n == f"{name}_bucket":
                merged[key][float(lab["le"])] += v
            elif n == f"{name}_count":
                out[key].count += v
            elif n == f"{name}_sum":
                out[key].sum += v
        for key, buckets in merged.items():
            out[key].buckets = sorted(buckets.items())
        return dict(out)


@dataclass(slots=True)
class Row:
    what: str
    count: str
    p50: str = ""
    p95: str = ""
    max: str = ""
    mean: str = ""
    note: str = ""


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1.0:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds:.2f} s"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _hist_row(what: str, h: Histogram, note: str = "") -> Row:
    bound = h.max_bound()
    return Row(
        what=what,
        count=f"{h.count:.0f}",
        p50=_s(h.quantile(0.5)),
        p95=_s(h.quantile(0.95)),
        max=f"<= {_s(bound)}" if bound is not None else "-",
        mean=_s(h.mean),
        note=note,
    )


def summarize(scrape: Scrape, committed: dict[str, int | None] | None = None) -> dict:
    """The summary as plain data: rows of the table and the headline counts.

    ``committed`` (the monitor's ``status()["latest"]``) tells "no commit yet"
    apart from step 0, which the ``obsckpt_latest_step`` gauge cannot.
    """
    rows: list[Row] = []
    durations = scrape.histograms("obsckpt_save_duration_seconds", by="slot")
    for slot in sorted(durations):
        h = durations[slot]
        saved = scrape.value("obsckpt_save_bytes_total", slot=slot)
        errors = scrape.value("obsckpt_saves_total", slot=slot, result="error")
        note = _bytes(saved) + " written"
        if errors:
            note += f", {errors:.0f} failed"
        rows.append(_hist_row(f"save {slot}", h, note))
    for slot, h in sorted(scrape.histograms("obsckpt_thread_join_wait_seconds", by="slot").items()):
        if h.count <= 0:
            continue
        rows.append(_hist_row(f"join wait {slot}", h))
    for strategy, h in sorted(
        scrape.histograms("obsckpt_save_admission_wait_seconds", by="strategy").items()
    ):
        if h.count <= 0:
            continue
        rows.append(_hist_row(f"admission wait ({strategy})", h))
    for backend, h in sorted(
        scrape.histograms("obsckpt_broadcast_duration_seconds", by="backend").items()
    ):
        if h.count <= 0:
            continue
        nbytes = scrape.value("obsckpt_broadcast_bytes_total", backend=backend)
        rate = nbytes / h.sum if h.sum > 0 else 0.0
        note = f"{_bytes(nbytes)} sent, {_bytes(rate)}/s"
        # The backend names the method: cuda_ipc and shm are colocated handovers.
        what = "ipc sync" if backend in IPC_BACKENDS else "broadcast"
        rows.append(_hist_row(f"{what} ({backend})", h, note))
    for method, h in sorted(
        scrape.histograms("obsckpt_rollout_pause_seconds", by="method").items()
    ):
        if h.count <= 0:
            continue
        sent = scrape.value("obsckpt_weight_sync_sent_bytes_total", method=method)
        full = scrape.value("obsckpt_weight_sync_state_bytes_total", method=method)
        delta_full = scrape.value(
            "obsckpt_weight_sync_state_bytes_total", method=method, encoding="delta"
        )
        delta_sent = scrape.value(
            "obsckpt_weight_sync_sent_bytes_total", method=method, encoding="delta"
        )
        share = f" ({sent / full:.0%})" if full > 0 else ""
        note = f"{_bytes(sent)} sent of {_bytes(full)} whole{share}"
        if delta_full > 0:
            note += f"; deltas {delta_sent / delta_full:.0%} of the state they replaced"
        rows.append(_hist_row(f"rollout pause ({method})", h, note))
    failures = scrape.value("obsckpt_broadcast_failures_total")
    if failures:
        rows.append(
            Row(
                "weight-sync failures",
                f"{failures:.0f}",
            )
        )
    upload = scrape.histograms("obsckpt_state_dict_upload_duration_seconds").get("")
    if upload is not None and upload.count > 0:
        rows.append(_hist_row("state-dict upload", upload))
    for kind, h in sorted(scrape.histograms("obsckpt_commit_lag_seconds", by="kind").items()):
        if h.count > 0:
            rows.append(_hist_row(f"commit lag ({kind})", h))
    saves_ok = scrape.value("obsckpt_saves_total", result="ok")
    saves_failed = scrape.value("obsckpt_saves_total", result="error")
    step_failures = {
        kind: scrape.value("obsckpt_step_failures_total", kind=kind)
        for kind in ("checkpoint", "state_dict")
    }
    latest = {}
    for kind in ("checkpoint", "state_dict"):
        present = [
            v
            for n, lab, v in scrape.samples
            if n == "obsckpt_latest_step" and lab.get("kind") == kind
        ]
        latest[kind] = int(present[0]) if present else None
        if committed is not None:
            latest[kind] = committed.get(kind)
    versions = {}
    for role in ROLES:
        present = [
            v
            for n, lab, v in scrape.samples
            if n == "obsckpt_model_version" and lab.get("role") == role
        ]
        # The series exists at 0 from the first scrape, before anything is reported, and
        # the demo's versions are training steps, which start at 1: 0 means "none yet".
        versions[role] = int(present[0]) if present and present[0] > 0 else None
    return {
        "rows": rows,
        "saves_ok": int(saves_ok),
        "saves_failed": int(saves_failed),
        "step_failures": {k: int(v) for k, v in step_failures.items()},
        "latest": latest,
        "model_version": versions,
    }


def format_table(summary: dict) -> str:
    """The summary as an aligned text table with a headline underneath."""
    header = Row("", "count", "p50", "p95", "max", "mean", "")
    rows = [header, *summary["rows"]]
    cols = ("what", "count", "p50", "p95", "max", "mean", "note")
    widths = {c: max(len(getattr(r, c)) for r in rows) for c in cols}
    right = {"count", "p50", "p95", "max", "mean"}

    def line(r: Row) -> str:
        cells = []
        for c in cols:
            v = getattr(r, c)
            cells.append(v.rjust(widths[c]) if c in right else v.ljust(widths[c]))
        return "  ".join(cells).rstrip()

    width = max(len(line(r)) for r in rows)
    out = [line(header), "-" * width]
    out += [line(r) for r in summary["rows"]] or ["(no measurements)"]
    out.append("-" * width)
    fails = summary["step_failures"]
    latest = summary["latest"]
    versions = summary["model_version"]
    out.append(
        f"committed: checkpoint {_opt(latest['checkpoint'])}, state dict "
        f"{_opt(latest['state_dict'])}   saves: {summary['saves_ok']} ok, "
        f"{summary['saves_failed']} failed   failed steps: {fails['checkpoint']} checkpoint, "
        f"{fails['state_dict']} state dict"
    )
    out.append(
        f"model version: trainer {_opt(versions['trainer'])}, rollout {_opt(versions['rollout'])}"
    )
    out.append("(p50/p95 from histogram buckets as histogram_quantile; max is a bucket bound)")
    return "\n".join(out)


def _opt(v) -> str:
    return "-" if v is None else str(v)
