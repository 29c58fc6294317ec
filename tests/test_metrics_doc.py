"""docs/metrics.md is generated from the one place metrics are defined, and is current."""

from __future__ import annotations

from pathlib import Path

from obsckpt.telemetry.metrics import METRICS, SPANS
from obsckpt.telemetry.reference import reference_markdown

REPO = Path(__file__).resolve().parents[1]
DESIGN_METRICS = {
    "obsckpt_save_duration_seconds": ("histogram", ("slot", "kind")),
    "obsckpt_saves_total": ("counter", ("slot", "kind", "result")),
    "obsckpt_save_bytes_total": ("counter", ("slot", "kind")),
    "obsckpt_saves_in_flight": ("gauge", ("kind",)),
    "obsckpt_thread_join_wait_seconds": ("histogram", ("slot",)),
    "obsckpt_save_admission_wait_seconds": ("histogram", ("strategy",)),
    "obsckpt_commit_lag_seconds": ("histogram", ("kind",)),
    "obsckpt_latest_step": ("gauge", ("kind",)),
    "obsckpt_last_commit_timestamp_seconds": ("gauge", ("kind",)),
    "obsckpt_pending_steps": ("gauge", ("kind",)),
    "obsckpt_oldest_pending_step_start_timestamp_seconds": ("gauge", ("kind",)),
    "obsckpt_step_failures_total": ("counter", ("kind",)),
    "obsckpt_rank_last_save_duration_seconds": ("gauge", ("rank", "slot")),
    "obsckpt_broadcast_duration_seconds": ("histogram", ("backend", "method")),
    "obsckpt_broadcast_bytes_total": ("counter", ("backend", "method")),
    "obsckpt_state_dict_upload_duration_seconds": ("histogram", ()),
    "obsckpt_model_version": ("gauge", ("role",)),
    "obsckpt_slot_label_overflows_total": ("counter", ()),
    "obsckpt_last_thread_join_wait_seconds": ("gauge", ("slot",)),
    "obsckpt_last_save_admission_wait_seconds": ("gauge", ("strategy",)),
    "obsckpt_last_commit_lag_seconds": ("gauge", ("kind",)),
    "obsckpt_last_commit_phase_seconds": ("gauge", ("phase",)),
    "obsckpt_last_broadcast_duration_seconds": ("gauge", ("backend", "method")),
    "obsckpt_last_broadcast_bytes": ("gauge", ("backend", "method")),
    "obsckpt_last_state_dict_upload_duration_seconds": ("gauge", ()),
    "obsckpt_leftovers_removed_total": ("counter", ()),
}
# Labels whose values are fixed in telemetry/vocabulary.py, and the two that callers fill in,
# which the monitor bounds (slot: max_slot_labels; rank: the world size).
BOUNDED_LABELS = {"kind", "result", "strategy", "backend", "method", "reason", "role", "phase"}
# A store request's operation (vocabulary.STORE_OPERATIONS) and its HTTP status or error
# word, each mapped to "other" outside those (vocabulary.store_error_labels).
BOUNDED_LABELS |= {"operation", "code"}
# A delta-capable weight sync's phase, encoding and failed check (vocabulary.validate_weight_sync).
BOUNDED_LABELS |= {"sync_phase", "encoding", "check"}
CALLER_LABELS = {"slot", "rank"}


def test_docs_page_is_current():
    page = (REPO / "docs" / "metrics.md").read_text()
    assert page == reference_markdown(), "docs/metrics.md is stale: run `make metrics-doc`"


def test_every_contract_metric_is_defined_with_its_type_and_labels():
    defined = {m.name: (m.type, m.labels) for m in METRICS}
    for name, spec in DESIGN_METRICS.items():
        assert defined.get(name) == spec, name


def test_histograms_carry_no_rank_or_step_label():
    for m in METRICS:
        if m.type == "histogram":
            assert "rank" not in m.labels and "step" not in m.labels, m.name


def test_every_label_is_bounded():
    for m in METRICS:
        unbounded = set(m.labels) - BOUNDED_LABELS - CALLER_LABELS
        assert not unbounded, f"{m.name}: label(s) {unbounded} have no bound"


def test_every_contract_span_is_defined():
    names = {s.name for s in SPANS}
    assert names >= {
        "obsckpt.checkpoint",
        "obsckpt.save",
        "obsckpt.commit",
        "obsckpt.join_wait",
        "obsckpt.admission_wait",
        "obsckpt.broadcast",
        "obsckpt.upload",
    }
