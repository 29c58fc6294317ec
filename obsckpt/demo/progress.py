"""Live progress of the demo: one redrawn line on a terminal, periodic lines elsewhere.

On a terminal the line is redrawn in place (``\\r``); when output goes to a
file or a container log, a full line is printed every few seconds and after
every commit, so the log stays readable.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

_BAR = 24


class Progress:
    """Renders ``step, loss, last committed step, saves in flight`` as the job runs.

    Args:
        total: number of steps, or None when the job runs until stopped.
        stream: where to write (default stderr).
        interactive: redraw in place (default: ``stream.isatty()``).
        interval: seconds between lines when not interactive.
    """

    def __init__(
        self,
        total: int | None,
        *,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        interval: float = 5.0,
        enabled: bool = True,
    ) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.interactive = isatty() if interactive is None else interactive
        self.interval = interval
        self.enabled = enabled
        self.t0 = time.monotonic()
        self._last_print = 0.0
        self._last_committed: int | None = None
        self._drawn = False
        self._first_step: int | None = None
        self._first_at: float | None = None
        self._start = 0  # the step this run goes on from (the resumed step)
        self._duration: tuple[float, float] | None = None  # (training start, --duration)

    def set_range(self, start: int, last: int | None) -> None:
        """Steps ``start + 1`` to ``last`` (None: until stopped); a resumed run starts above 0."""
        self._start = start
        self.total = last

    def set_duration(self, seconds: float, started_at: float) -> None:
        """Training stops after ``seconds`` from ``started_at`` (monotonic), or at its last step."""
        self._duration = (started_at, seconds)

    def update(
        self,
        step: int,
        *,
        loss: float | None,
        committed: int | None,
        in_flight: int,
        pending: int,
        rollout_version: int | None,
    ) -> None:
        if not self.enabled:
            return
        if self._first_step is None:
            self._first_step = step
            self._first_at = time.monotonic()
        text = self.render(step, loss, committed, in_flight, pending, rollout_version)
        now = time.monotonic()
        if self.interactive:
            cols = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + text[: cols - 1].ljust(cols - 1))
            self.stream.flush()
            self._drawn = True
        elif (
            now - self._last_print >= self.interval
            or committed != self._last_committed
            or (self.total is not None and step >= self.total)
        ):
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_print = now
        self._last_committed = committed

    def render(self, step, loss, committed, in_flight, pending, rollout_version) -> str:
        now = time.monotonic()
        elapsed = now - self.t0
        # The rate counts from the first step, not from the (slow) start-up.
        since = now - (self._first_at or now)
        done = step - (self._first_step or step)
        rate = done / since if since > 0 else 0.0
        fracs = []
        head = f"step {step}"
        if self.total:
            span = self.total - self._start
            fracs.append(min(1.0, (step - self._start) / span) if span > 0 else 1.0)
            head = f"step {step}/{self.total}"
        if self._duration is not None:
            # Whichever ends the run first (--duration or the last step) fills the bar.
            started, seconds = self._duration
            fracs.append(min(1.0, max(0.0, now - started) / seconds))
            head += f" ({min(now - started, seconds):.0f}/{seconds:.0f}s)"
        if fracs:
            filled = int(round(max(fracs) * _BAR))
            head = "[" + "#" * filled + "." * (_BAR - filled) + "] " + head
        parts = [
            head,
            f"loss {loss:.3f}" if loss is not None else "loss -",
            f"committed {committed if committed is not None else '-'}",
            f"saves in flight {in_flight}",
        ]
        if pending:
            parts.append(f"pending steps {pending}")
        parts.append(f"rollout v{rollout_version if rollout_version is not None else '-'}")
        parts.append(f"{rate:.1f} step/s")
        parts.append(f"{elapsed:.0f}s")
        return "  ".join(parts)

    def note(self, message: str) -> None:
        """Print a message on its own line without garbling the bar."""
        if self.interactive and self._drawn:
            self.stream.write("\n")
            self._drawn = False
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
