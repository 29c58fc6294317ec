"""The label values obsckpt's metrics take, and the checks on what callers send.

Every label whose values are fixed is listed here (``slot`` and ``rank`` are the
callers', bounded by the monitor); a value outside these would be a new series.
The ``validate_*`` functions refuse label values and measurements that a metric
cannot record. :mod:`obsckpt.telemetry.metrics` re-exports every name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from obsckpt.admission import STRATEGIES
from obsckpt.store.commit import COMMIT_PHASES
from obsckpt.store.layout import KINDS
from obsckpt.store.pointer import STORE_COMMIT_PHASES
from obsckpt.validators import non_negative_int

RESULTS = ("ok", "error")
# Weight-sync backends: torch.distributed's for a broadcast; CUDA IPC, or shared
# memory files on CPU, for the colocated sync.
NCCL, GLOO, CUDA_IPC, SHM = "nccl", "gloo", "cuda_ipc", "shm"
BACKENDS = (NCCL, GLOO, CUDA_IPC, SHM)
# Weight-sync methods and the backends each runs on.
BROADCAST_BACKENDS = (NCCL, GLOO)
IPC_BACKENDS = (CUDA_IPC, SHM)
SYNC_METHODS = {"broadcast": BROADCAST_BACKENDS, "ipc": IPC_BACKENDS}
FAILURE_REASONS = ("timeout", "error")
# A delta-capable sync: how the weights went, its phases, the integrity checks that can fail.
SYNC_ENCODINGS = ("full", "delta")
SYNC_PHASES = ("snapshot", "encode", "wire", "apply", "verify")
SYNC_CHECKS = ("checksum", "digest")
DELTA_METHODS = ("broadcast", "memory")
# Who holds a model version: the trainer, or the rollout side it syncs to.
TRAINER, ROLLOUT = "trainer", "rollout"
ROLES = (TRAINER, ROLLOUT)

# Requests to an object store, as obsckpt.store.s3 names them (the ``operation`` label);
# a request error's ``code`` is its HTTP status, or one of STORE_ERROR_WORDS when no
# status came. Anything else is recorded as "other".
STORE_OPERATIONS = (
    "put", "put_create_only", "put_if_match", "get", "head", "list", "delete",
    "create_multipart", "upload_part", "complete_multipart", "abort_multipart",
    "list_multipart",
)  # fmt: skip
STORE_ERROR_WORDS = ("timeout", "connection", "credentials", "client")


def store_error_labels(operation: str, code: str) -> tuple[str, str]:
    """The (operation, code) labels of a failed store request, each from a bounded set."""
    op = operation.split(" ", 1)[0]
    op = op if op in STORE_OPERATIONS else "other"
    ok_code = (code.isdigit() and len(code) == 3) or code in STORE_ERROR_WORDS
    return op, code if ok_code else "other"


# Distinct slot label values a monitor keeps by default; later new slots share OVERFLOW_SLOT.
DEFAULT_MAX_SLOT_LABELS = 32
# Not a valid slot name (those start with a letter or digit), so it never collides with one.
OVERFLOW_SLOT = "_other"

# Label values known up front, so the series exist (at zero) from the first scrape.
KNOWN_LABELS: dict[str, tuple[str, ...]] = {
    "kind": KINDS,
    "strategy": STRATEGIES,
    "backend": BACKENDS,
    "role": ROLES,
    # A local root's commit phases, then an s3:// root's.
    "phase": COMMIT_PHASES + STORE_COMMIT_PHASES,
}


def validate_max_slot_labels(value: object) -> int:
    """``value`` if it is a positive int, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            "max_slot_labels must be a positive int (the distinct slot names kept as "
            f'metric labels; later new slots are recorded as slot="{OVERFLOW_SLOT}"), '
            f"got {value!r}"
        )
    return value


def validate_sync_labels(backend: object, method: object, reason: object = None) -> None:
    """Refuse weight-sync label values outside the known ones: each would be a new series.

    Raises:
        ValueError: ``backend`` is not one of ``method``'s, or ``reason`` is not known.
    """
    if method not in SYNC_METHODS or backend not in SYNC_METHODS[method]:
        known = "; ".join(
            f"{m!r} with {', '.join(map(repr, bs))}" for m, bs in SYNC_METHODS.items()
        )
        raise ValueError(
            f"weight-sync method {method!r} with backend {backend!r} is not one obsckpt "
            f"records; pass one of: {known}"
        )
    if reason is not None and reason not in FAILURE_REASONS:
        raise ValueError(
            f"weight-sync failure reason {reason!r} is not one of {FAILURE_REASONS}; pass "
            "'timeout' for a sync that stalled past its timeout, else 'error'"
        )


def validate_weight_sync(report: Mapping[str, Any]) -> None:
    """Refuse a delta-capable sync's report whose labels or measurements a metric cannot take.

    Raises:
        ValueError: naming the field and the value.
    """
    if report.get("method") not in DELTA_METHODS:
        raise ValueError(
            f"weight-sync report method {report.get('method')!r}: pass one of {DELTA_METHODS}"
        )
    if report.get("encoding") not in SYNC_ENCODINGS:
        raise ValueError(
            f"weight-sync report encoding {report.get('encoding')!r}: pass one of {SYNC_ENCODINGS}"
        )
    for phase, seconds in dict(report.get("phases") or {}).items():
        if phase not in SYNC_PHASES:
            raise ValueError(f"weight-sync phase {phase!r} is not one of {SYNC_PHASES}")
        validate_seconds(f"phases[{phase!r}]", seconds)
    validate_seconds("pause_s", report.get("pause_s"))
    validate_bytes("sent_bytes", report.get("sent_bytes"))
    validate_bytes("state_bytes", report.get("state_bytes"))
    corrupt = report.get("corrupt")
    if corrupt is not None and corrupt not in SYNC_CHECKS:
        raise ValueError(f"weight-sync check {corrupt!r} is not one of {SYNC_CHECKS}")
    fraction = report.get("changed_fraction")
    if fraction is not None and not (isinstance(fraction, (int, float)) and 0 <= fraction <= 1):
        raise ValueError(f"changed_fraction must be in [0, 1] or None, got {fraction!r}")


def validate_seconds(name: str, value: object) -> None:
    """Refuse a duration that is not finite, non-negative seconds (None passes).

    A negative one would make a histogram's ``_sum`` go backwards (read as a
    reset by rate()), a NaN would make it NaN for the rest of the monitor's life.
    """
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"{name} must be finite, non-negative seconds or None, got {value!r}; "
            "pass the measured duration (e.g. from time.monotonic()) or None"
        )


def validate_bytes(name: str, value: object) -> None:
    """Refuse a byte count that is not a non-negative integer (None passes)."""
    if value is None:
        return
    if non_negative_int(value) is None:
        raise ValueError(
            f"{name} must be a non-negative integer number of bytes or None, got {value!r}"
        )


def validate_role(role: object) -> None:
    """Refuse a ``role`` label value other than ``trainer`` or ``rollout``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
