"""The monitor's status(): its core's state as plain data, times as Unix timestamps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from obsckpt.monitor.core import MonitorCore
from obsckpt.telemetry import tracing
from obsckpt.telemetry.server import MetricsServer


def status_view(
    core: MonitorCore,
    root: Path | str,
    server: MetricsServer,
    *,
    leftovers_removed: int = 0,
    fenced: str | None = None,
    lock_recreated: int = 0,
    committing: dict[str, Any] | None = None,
    node_queries_failed: int = 0,
    iteration_repairs: list[str] | None = None,
    trainer_submits: bool = False,
) -> dict[str, Any]:
    """Latest committed steps, pending, failed and abandoned steps, saves in flight.

    ``leftovers_removed`` counts obsckpt's own temp files and scratch
    directories, left by writes cut short, that the monitor removed at start.
    ``fenced`` says why the monitor no longer owns its root (None while it
    does); ``lock_recreated`` counts the times its lock file was found deleted
    and locked anew; ``committing`` is the commit running now, with its phase and since
    when; ``node_queries_failed`` counts the times Ray could not be asked which
    nodes are dead; ``iteration_repairs`` says which iteration files the monitor
    pointed at the latest whole step at start (``on_bad_iteration="rewind"``).

    ``resaves`` counts every notification about a closed step that was
    accepted and changed nothing: re-saves proper, and registrations,
    submissions, starts and finishes for a step already committed (or below
    the committed one) that were ignored.
    """
    t = core.tracker
    unix = core.unix
    return {
        "root": str(root),
        "save_strategy": core.strategy.name,
        "latest": dict(t.latest),
        "last_commit_time": {k: unix(when) for k, when in core.last_commit.items()},
        "last_commit": {
            kind: {
                **detail,
                "whole_at": unix(detail["whole_at"]),
                "committed_at": unix(detail["committed_at"]),
            }
            for kind, detail in core.last_commit_detail.items()
        },
        "pending": [
            {
                "step": step,
                "kind": kind,
                "started": unix(p.started_at),
                "registered": p.registered,
                "finished": p.finished,
                "in_flight": p.in_flight,
                "submitted": p.submitted,
                "state": p.state,
                # Saves made of parts still missing some: slot -> parts finished / parts.
                "open_parts": {
                    str(slot): {
                        "parts": g.parts,
                        "finished": sorted(i for i, n in g.done.items() if n > g.counted),
                        "running": g.running,
                    }
                    for slot, g in p.groups.items()
                    if g.open
                },
            }
            for step, kind, p in t.pending()
        ],
        "failed": [
            {"step": step, "kind": kind, "error": p.error, "at": unix(p.resolved_at)}
            for step, kind, p in t.failed()
        ],
        "abandoned": [{"step": s, "reason": r} for s, r in sorted(t.abandoned.items())],
        "restarted": t.restarted,
        "resaves": t.resaves,
        "in_flight": [
            {
                "ticket": tk.ticket,
                "step": tk.step,
                "kind": tk.kind,
                "slot": tk.slot,
                "rank": tk.rank,
                "part": tk.part,
                "parts": tk.parts,
                "requested": unix(tk.requested),
                "admitted": unix(tk.admitted),
            }
            for tk in core.tickets
        ],
        "admission_waiting": core.admission.waiting,
        "metrics": {"address": server.address, "error": server.error},
        "span_export_failures": tracing.export_failures(),
        "leftovers_removed": leftovers_removed,
        "fenced": fenced,
        "lock_recreated": lock_recreated,
        "committing": committing,
        "node_queries_failed": node_queries_failed,
        "iteration_repairs": list(iteration_repairs or []),
        # A trainer submits the steps (verl's, Trinity's): managers leave it to it.
        "trainer_submits": trainer_submits,
    }
