"""The monitor's label policy: bounded ``slot`` values, and per-rank series removed when gone.

Callers send slot names and ranks; each distinct value would be a new series
for the life of the monitor. :class:`SlotLabels` keeps the first
``max_slot_labels`` slot names and folds later new ones into one value;
:class:`RankSeries` remembers the per-rank gauges' series so those of a rank
that is gone can be removed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from obsckpt.telemetry.metrics import OVERFLOW_SLOT, validate_max_slot_labels

logger = logging.getLogger(__name__)


class SlotLabels:
    """The ``slot`` label value of each slot name, bounded.

    A slot keeps its own name while it is among the first ``max_labels``
    distinct slots; any later new one is recorded as ``"_other"``, so a slot
    name that carries the step adds no series per step. The first slot folded
    so is logged by name, with what to do.

    Args:
        max_labels: distinct slot names kept (``max_slot_labels``).
        overflows: the counter of folded reports (``obsckpt_slot_label_overflows_total``).
    """

    def __init__(self, max_labels: int, overflows: Counter) -> None:
        self.max_labels = validate_max_slot_labels(max_labels)
        self._overflows = overflows
        self._kept: set[str] = set()
        self._logged = False

    def label(self, slot: str | None, *, count: bool = False) -> str:
        """The label value for ``slot`` (None: a caller that names none, ``"unknown"``).

        Args:
            count: count a fold in ``obsckpt_slot_label_overflows_total`` (once per
                finished save or staging report, not per lookup).
        """
        if slot is None:
            return "unknown"
        name = str(slot)
        if name in self._kept:
            return name
        if len(self._kept) < self.max_labels:
            self._kept.add(name)
            return name
        if not self._logged:
            self._logged = True
            logger.warning(
                "obsckpt: slot %r is a new slot past the %d distinct slots this monitor keeps "
                "as metric labels (max_slot_labels); its measurements, and those of every later "
                'new slot, are recorded under slot="%s" and counted in '
                "obsckpt_slot_label_overflows_total. Name slots by what they hold "
                '("model", "optimizer"), not with a step or a time in them; a job that '
                "really has more slots can raise max_slot_labels in "
                "CheckpointMonitor.get_actor",
                name,
                self.max_labels,
                OVERFLOW_SLOT,
            )
        if count:
            self._overflows.inc()
        return OVERFLOW_SLOT


class RankSeries:
    """The (rank, slot) series of the per-rank gauges, so those of ranks that are gone
    can be removed.

    Only gauges are removed: a counter that vanished and came back would read
    as a reset.

    Args:
        gauges: the gauges labelled (rank, slot).
    """

    def __init__(self, *gauges: Gauge) -> None:
        self._gauges = gauges
        self._pairs: set[tuple[str, str]] = set()

    def set(self, gauge: Gauge, rank: str, slot: str, value: float) -> None:
        """Set ``gauge``'s series of ``rank`` and ``slot`` to ``value``."""
        gauge.labels(rank, slot).set(value)
        self._pairs.add((rank, slot))

    def remove(self, gone: Callable[[str, str], bool]) -> list[tuple[str, str]]:
        """Remove every series whose (rank, slot) ``gone`` holds for; returns those pairs."""
        removed = sorted(pair for pair in self._pairs if gone(*pair))
        for pair in removed:
            for gauge in self._gauges:
                with contextlib.suppress(KeyError):  # a gauge this pair never set
                    gauge.remove(*pair)
            self._pairs.discard(pair)
        return removed
