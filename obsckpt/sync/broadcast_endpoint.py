"""One member's end of a weight broadcast: what the sending and the receiving side share.

:class:`BroadcastEndpoint` holds a :class:`~obsckpt.sync.broadcast.WeightBroadcaster`'s
settings and state, and the rules every broadcast keeps on either side: each
collective is issued and waited for within the broadcast's deadline, a
failure once the first collective was issued breaks the group (the peers are
out of step), and failures are counted. The sending side is in
:mod:`~obsckpt.sync.broadcast`, the receiving side in
:mod:`~obsckpt.sync.broadcast_recv`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from obsckpt.errors import BroadcastError
from obsckpt.sync.buckets import DEFAULT_BUCKET_BYTES, TensorMeta
from obsckpt.sync.group import WeightSyncGroup
from obsckpt.sync.telemetry import WeightSyncTelemetry

MODES = ("bucketed", "per_tensor")


class BroadcastEndpoint:
    """Settings, version and validity state, and the collectives of one broadcast, on either side.

    The arguments are :class:`~obsckpt.sync.broadcast.WeightBroadcaster`'s.
    """

    def __init__(
        self,
        group: WeightSyncGroup,
        *,
        src: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        mode: str = "bucketed",
        timeout_s: float | None = None,
        metrics: Any = None,
        monitor: Any = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds or None, got {timeout_s!r}")
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < group.world_size:
            raise ValueError(
                f"src must be a rank of the group, in [0, {group.world_size}), got {src!r}; "
                "pass the sending member's rank (trainer rank 0 is usually 0)"
            )
        self.group = group
        self.src = src
        self.bucket_bytes = int(bucket_bytes)
        self.mode = mode
        self.timeout_s = timeout_s
        self.telemetry = WeightSyncTelemetry(metrics=metrics, monitor=monitor)
        self._pool: list[torch.Tensor] = []  # raw byte buffers, one bucket each
        self.last_step: int | None = None
        self.last_seconds: float | None = None
        # False while the receive area or into='s tensors hold bytes of a broadcast
        # that failed or was refused midway (not a known version); True again
        # after the next broadcast received into them.
        self.weights_valid = True
        self._issued = False  # a collective of the current broadcast was issued
        self._writing = False  # the current broadcast writes into the held weights

    @property
    def is_sender(self) -> bool:
        """Whether this member sends (its rank is ``src``)."""
        return self.group.rank == self.src

    @contextlib.contextmanager
    def _failing(self, role: str) -> Iterator[None]:
        """A broadcast that fails once its first collective was issued breaks the group.

        The peers are then somewhere inside the broadcast's sequence of
        collectives; the next call would pair with what is left of it (a
        receiver taking the wrong bytes as weights, or gloo ending the
        process), so the group is aborted as for a timeout. The failure is
        counted, and anything but a :class:`BroadcastError` is raised as one,
        chained to the original. KeyboardInterrupt and SystemExit break the
        group too, and are raised as they are.
        """
        self._issued = False
        try:
            yield
        except BaseException as exc:
            err: BaseException = exc
            if self._issued:
                if self._writing:
                    self.weights_valid = False
                self._pool = []  # the aborted collectives may still hold these buffers
                self.group.mark_broken(f"{role} failed midway: {type(exc).__name__}: {exc}")
                if isinstance(exc, Exception) and not isinstance(exc, BroadcastError):
                    err = BroadcastError(
                        f"weight broadcast ({role}, {self.group.backend}) on {self.group.host}:"
                        f"{self.group.port} failed after it began: {type(exc).__name__}: {exc}; "
                        "the peers are out of step, so the group is now broken: close it and "
                        "form a new group on a fresh port"
                    )
            if self._issued or isinstance(exc, BroadcastError):
                self._count(err)
            if err is exc:
                raise
            raise err from exc
        finally:
            self._issued = self._writing = False

    def _count(self, exc: BaseException) -> None:
        if self.telemetry:
            self.telemetry.failure(self.group.backend, "broadcast", exc)

    def _refuse(self, exc: BroadcastError) -> None:
        """Raise an error that leaves the group in step (counted; the span records it)."""
        self._count(exc)
        raise exc

    def _issue(self, t: torch.Tensor, deadline: float) -> Any:
        """Start one collective of the current broadcast (from here on, a failure breaks the group)."""
        self._issued = True
        return self.group.broadcast_async(t, self.src, deadline)

    def _broadcast_now(self, t: torch.Tensor, deadline: float, what: str) -> None:
        work = self._issue(t, deadline)
        self.group.wait(work, deadline, lambda t: self._progress(what, 0, 1, None, t))

    def _progress(
        self,
        unit: str,
        at: int,
        total: int,
        meta: list[TensorMeta] | None,
        timed_out: bool = True,
    ) -> str:
        budget = self.timeout_s if self.timeout_s is not None else self.group.timeout_s
        role = "sending" if self.is_sender else "receiving"
        if meta is None:
            what = f"{role}, {self.group.backend}"
            done = f"the {unit} was not {'taken' if self.is_sender else 'sent'} by the peers"
        else:
            mib = sum(m.nbytes for m in meta) / 2**20
            what = f"{role}, {len(meta)} tensors, {mib:.1f} MiB, {self.group.backend}"
            done = f"{at} of {total} {unit}s completed"
        where = f"weight broadcast ({what}) on {self.group.host}:{self.group.port}"
        if timed_out:
            return f"{where} did not finish within {budget:.1f} s: {done}; the group is now broken"
        done = f"on the {unit}" if meta is None else f"after {done}"
        return (
            f"{where} failed {done} (a peer gone, or the backend refused the collective); "
            "the group is now broken: close it and form a new group on a fresh port"
        )

    def release_buffers(self) -> None:
        """Drop the reusable buffers (allocated again when needed)."""
        self._pool.clear()
