"""The staging of a coordinator's slots: one arena per slot, prepared, reused, handed over.

A state-dict save copies into its slot's :class:`~obsckpt.staging.StagingBuffers`
(made on first use, or ahead of it by :meth:`SlotStaging.prepare`). A slot
with none takes over the arena of an idle slot of the same shapes last saved
at an earlier step, so slot names that change every step hold one arena, not
one per step. Every change of a slot's bytes is reported to the monitor.

torch is imported on first use, not at module load: the monitor actor never needs it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

from obsckpt.errors import SaveTimeoutError, WaitTimeoutError
from obsckpt.monitor_link import MonitorLink
from obsckpt.save_threads import STALL_TIMEOUT_S, STALL_WARNING_S, THREADS, wait_watched
from obsckpt.validators import validate_slot

if TYPE_CHECKING:
    from obsckpt.staging import StagingBuffers, StagingCopy


class StagedSave:
    """What :meth:`~obsckpt.coordinator.CheckpointCoordinator.save_state_dict_async` returns.

    Call :meth:`wait_staged` before changing the saved tensors in place (the
    optimizer step). Without ``overlap`` the state is staged before the save
    call returns, and it returns at once. :meth:`hold` lends the snapshot
    itself, to publish the same state (weight sync) without a second copy.
    """

    __slots__ = ("slot", "step", "_copy", "_snapshot", "_staging", "_generation")

    def __init__(
        self,
        slot: str,
        step: int,
        copy: StagingCopy | None = None,
        snapshot: Any = None,
        staging: SlotStaging | None = None,
        generation: int = 0,
    ) -> None:
        self.slot = slot
        self.step = step
        self._copy = copy  # an overlapped save's copy; None: staged before the call returned
        self._snapshot = snapshot
        self._staging = staging
        self._generation = generation

    @property
    def staged(self) -> bool:
        """Whether every copy has finished (a failed copy counts as finished)."""
        return self._copy is None or self._copy.finished()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Until the snapshot's copies are done, then the caller may change its tensors.

        CUDA sources: the caller's current stream waits for the side stream's
        copies (an event; the host does not block). CPU sources: blocks until
        the copy thread has finished. ``timeout`` None waits at most
        :data:`obsckpt.staging.STAGING_TIMEOUT_S`.

        Raises:
            SaveTimeoutError: the copies did not finish within ``timeout`` seconds.
            TensorMutatedError: a tensor was changed in place before its copy
                finished; this save fails (its step never commits).
        """
        if self._copy is None:
            return
        if timeout is None:
            from obsckpt.staging import STAGING_TIMEOUT_S  # loaded already: the copy is its

            timeout = STAGING_TIMEOUT_S
        if not self._copy.wait(timeout):
            raise SaveTimeoutError(
                f"staging of slot {self.slot!r} step {self.step} did not finish within "
                f"{timeout} s ({len(self._copy.copies)} tensors)",
                slot=self.slot,
                step=self.step,
            )

    @contextlib.contextmanager
    def hold(self, timeout: float | None = None) -> Iterator[Any]:
        """The snapshot this save writes (host tensors in the slot's staging), lent for the block.

        Publish the step's weights from it (memory sync, a broadcast, a delta)
        and the state leaves the device once for both the durable write and the
        publish: no second copy, no second stall. Read it only: the background
        write reads it too. While the block runs, the slot's next save waits
        before it stages (so a publish never reads a half-overwritten snapshot);
        the block should end before then, as a training loop's publish does.

        Raises:
            SaveTimeoutError: the staging copies did not finish within ``timeout``.
            TensorMutatedError: a tensor changed before its copy finished (the save fails too).
            ValueError: the slot's next save already staged over this snapshot.
        """
        self.wait_staged(timeout)
        if self._copy is not None:
            self._copy.finish()  # in host memory, not only ordered on the device
        if self._staging is None:
            raise ValueError(f"the save of slot {self.slot!r} step {self.step} kept no snapshot")
        with self._staging.holding(self.slot, self._generation, self.step):
            yield self._snapshot


class SlotStaging:
    """Each slot's staging buffers, and the prepare() calls that make them ahead of a save.

    Args:
        link: where each slot's staging bytes are reported.
        save_running: whether a slot has a save running (its staging is in use).
        logger: where cold saves and take-overs are logged.
        stall_warning_s: while a save or a prepare waits for the slot's prepare,
            a warning naming the slot is logged every this many seconds.
        stall_timeout_s: such a wait raises :class:`WaitTimeoutError` after this
            many seconds (None: it never does).
    """

    def __init__(
        self,
        link: MonitorLink,
        *,
        save_running: Callable[[str], bool],
        logger: logging.Logger,
        stall_warning_s: float = STALL_WARNING_S,
        stall_timeout_s: float | None = STALL_TIMEOUT_S,
    ) -> None:
        self.logger = logger
        self.stall_warning_s = stall_warning_s
        self.stall_timeout_s = stall_timeout_s
        self._link = link
        self._save_running = save_running
        # Guards the four fields below. Taken before the coordinator's slot-table lock
        # (through ``save_running``), never after it.
        self._lock = threading.Lock()
        self._buffers: dict[str, StagingBuffers] = {}
        self._staged_at: dict[str, int] = {}  # slot -> step of its last save's snapshot
        self._preparing: dict[str, Future] = {}  # slot -> prepare() running or failed
        self._took_over = False  # whether a slot took over another's staging (logged once)
        # Snapshots lent to publishers (StagedSave.hold): slot -> holders; a save of the
        # slot waits before staging over its snapshot, counted in generations.
        self._holds: dict[str, int] = {}
        self._generations: dict[str, int] = {}
        self._released = threading.Condition(self._lock)

    def __getitem__(self, slot: str) -> StagingBuffers:
        """Slot ``slot``'s staging buffers (KeyError if it has none)."""
        with self._lock:
            return self._buffers[slot]

    def nbytes(self, slot: str | None = None) -> tuple[int, int]:
        """(staging bytes, of which pinned) held for slot ``slot`` (or all slots)."""
        with self._lock:
            held = [s for n, s in self._buffers.items() if slot is None or n == slot]
        return sum(s.bytes_allocated for s in held), sum(s.pinned_bytes for s in held)

    def prepare(self, slot: str, state_dict: Any, *, background: bool = False) -> Future:
        """Allocate, pin and pre-fault ``slot``'s staging for ``state_dict``'s shapes.

        Returns:
            A future, done when the slot is prepared; its result is the bytes staged.
        """
        import obsckpt.staging  # noqa: F401 - the import (torch, the writer) is part of what is prepared

        validate_slot(slot)
        future: Future = Future()

        def run() -> None:
            try:
                THREADS.warm(2)  # a save and an overlapped copy start no thread
                staging = self._buffers_for(slot, wait_prepare=False)
                staging.prepare(state_dict)
                self._report(slot, staging)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)
            else:
                future.set_result(staging.bytes_allocated)

        with self._lock:
            previous = self._preparing.get(slot)
            self._preparing[slot] = future
        if previous is not None:
            try:
                self._wait_prepare(slot, previous)  # one prepare of a slot at a time
            except BaseException as exc:
                future.set_exception(exc)  # settled: a later prepare does not wait for it
                raise
        if background:
            threading.Thread(target=run, name=f"obsckpt-prepare-{slot}", daemon=True).start()
        else:
            run()
            future.result()
        return future

    def snapshot(
        self, slot: str, state_dict: Any, step: int, *, overlap: bool
    ) -> tuple[Any, StagingCopy | None]:
        """Copy ``state_dict`` into ``slot``'s staging for a save of ``step``.

        Returns:
            (the snapshot, its copy running in the background when ``overlap``,
            else None: the copy is done).
        """
        from obsckpt.staging import StagingCopy

        self._wait_holds(slot)
        staging = self._buffers_for(slot, state=state_dict, step=step)
        with self._lock:
            self._generations[slot] = self._generations.get(slot, 0) + 1
        allocations = staging.allocations
        copier = None
        if overlap:
            snapshot, copies = staging.plan(state_dict)
            copier = StagingCopy(staging, copies)
        else:
            snapshot = staging.stage(state_dict)
        if staging.allocations != allocations:
            self._cold_save(slot, step, staging)
        if copier is not None:
            # Kept threads: the copy thread costs a queue put, not a thread start.
            copier.start(lambda run: THREADS.submit(run, f"obsckpt-stage-{slot}-step{step}"))
        return snapshot, copier

    def stage_ahead(self, slot: str, state_dict: Any, step: int) -> StagedSave:
        """:meth:`snapshot` of ``state_dict`` that no save writes yet (see
        :meth:`~obsckpt.coordinator.CheckpointCoordinator.stage`)."""
        snapshot, _ = self.snapshot(slot, state_dict, step, overlap=False)
        return StagedSave(slot, step, None, snapshot, self, self.generation(slot))

    def reusable(self, staged: StagedSave | None, slot: str, step: int) -> Any:
        """``staged``'s snapshot if a save of ``slot`` at ``step`` may write it as it is
        (taken for that slot and step here, not staged over since), else None."""
        if staged is None or staged._staging is not self or staged._snapshot is None:
            return None
        if (staged.slot, staged.step) != (slot, step) or staged._copy is not None:
            return None
        with self._lock:
            return (
                staged._snapshot if self._generations.get(slot, 0) == staged._generation else None
            )

    def generation(self, slot: str) -> int:
        """How many snapshots ``slot`` has taken (a lent snapshot is valid while it is the last)."""
        with self._lock:
            return self._generations.get(slot, 0)

    @contextlib.contextmanager
    def holding(self, slot: str, generation: int, step: int) -> Iterator[None]:
        """Keep ``slot``'s snapshot ``generation`` from being staged over while the block runs.

        Raises:
            ValueError: a later save of the slot already staged over it.
        """
        with self._lock:
            now = self._generations.get(slot, 0)
            if now != generation:
                raise ValueError(
                    f"the snapshot of slot {slot!r} step {step} was already overwritten by a "
                    "later save of the slot; publish from a save's snapshot (StagedSave.hold) "
                    "before the slot's next save"
                )
            self._holds[slot] = self._holds.get(slot, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._holds[slot] -= 1
                if not self._holds[slot]:
                    del self._holds[slot]
                self._released.notify_all()

    def _wait_holds(self, slot: str) -> None:
        """Wait until no publisher holds ``slot``'s snapshot: watched, bounded by ``stall_timeout_s``."""

        def released(timeout: float | None) -> bool:
            with self._lock:
                return self._released.wait_for(lambda: slot not in self._holds, timeout)

        if slot in self._holds:
            self._wait_bounded(
                released,
                f"the publish holding the snapshot of slot {slot!r} (StagedSave.hold)",
                f"the snapshot of slot {slot!r} was still held by a publish after {{s}} "
                "(stall_timeout_s); the slot's next save waits for it. End the "
                "StagedSave.hold() block before the slot's next save",
            )

    def wait_prepared(self, deadline: float | None) -> None:
        """Wait for every prepare() running, until ``deadline`` (``time.monotonic()``; None: no limit)."""
        with self._lock:
            preparing = list(self._preparing.values())
        for future in preparing:
            try:
                future.exception(
                    None if deadline is None else max(0.0, deadline - time.monotonic())
                )
            except FutureTimeoutError:
                pass  # its slot is still being prepared; it keeps its staging

    def _wait_prepare(self, slot: str, future: Future) -> None:
        """Wait for ``future``, a prepare of ``slot``: watched, and bounded by ``stall_timeout_s``.

        Raises:
            WaitTimeoutError: the prepare still runs after ``stall_timeout_s``.
        """
        self._wait_bounded(
            lambda t: not wait_futures([future], t).not_done,
            f"the prepare() of slot {slot!r}",
            f"the prepare() of slot {slot!r} was still running after {{s}} (stall_timeout_s); "
            "a save or prepare of the slot waits for it. Check the stuck prepare (py-spy dump)",
        )

    def _wait_bounded(self, wait: Callable[[float | None], bool], what: str, late: str) -> None:
        """``wait`` watched (a warning naming ``what`` every ``stall_warning_s``) and bounded
        by ``stall_timeout_s``.

        Raises:
            WaitTimeoutError: ``late``, its ``{s}`` the bound in seconds.
        """
        if not wait_watched(
            wait,
            self.stall_timeout_s,
            lambda: what,
            warn_every=self.stall_warning_s,
            log=self.logger,
        ):
            raise WaitTimeoutError(late.format(s=f"{self.stall_timeout_s:.1f} s"))

    def release(self, *, keep: set[str]) -> None:
        """Release the staging of every slot not in ``keep`` nor being prepared."""
        with self._lock:
            busy = keep | {n for n, f in self._preparing.items() if not f.done()} | set(self._holds)
            names = [n for n in self._buffers if n not in busy]
            released = [(n, self._buffers.pop(n)) for n in names]
        for slot, staging in released:
            staging.release()
            self._report(slot, staging)

    def _buffers_for(
        self,
        slot: str,
        *,
        wait_prepare: bool = True,
        state: Any = None,
        step: int | None = None,
    ) -> StagingBuffers:
        """Slot ``slot``'s staging. A save (``state`` of ``step``) of a slot that has none
        takes over the staging of an idle slot of the same layout last saved at an
        earlier step (see :meth:`_take_over`)."""
        from obsckpt.staging import StagingBuffers

        if wait_prepare:
            with self._lock:
                future = self._preparing.pop(slot, None)
            if future is not None:
                self._wait_prepare(slot, future)
            if future is not None and future.exception() is not None:
                self.logger.warning(
                    "obsckpt: prepare() of slot %r failed (%s); the save allocates its staging",
                    slot,
                    future.exception(),
                )
        with self._lock:
            staging = self._buffers.get(slot)
            if step is not None:
                self._staged_at[slot] = step
        if staging is None:
            staging = StagingBuffers()
            if state is not None and step is not None:
                staging = self._take_over(slot, staging, staging.layout_of(state), step)
            with self._lock:
                staging = self._buffers.setdefault(slot, staging)
        return staging

    def _take_over(
        self, slot: str, fresh: StagingBuffers, layout: Any, step: int
    ) -> StagingBuffers:
        """The staging of an idle slot that fits ``layout``, moved to ``slot``; else ``fresh``.

        Only a slot whose last save is finished and was a snapshot of an earlier
        step is taken over: a slot prepared and not saved yet, or one saved in
        this step, keeps its staging.
        """
        with self._lock:
            for old, staging in self._buffers.items():
                if self._staged_at.get(old, step) >= step or self._busy(old):
                    continue
                if staging.fits(layout):
                    del self._buffers[old]
                    self._staged_at.pop(old, None)
                    self._buffers[slot] = staging
                    break
            else:
                return fresh
            first = not self._took_over
            self._took_over = True
        (self.logger.warning if first else self.logger.debug)(
            "obsckpt: slot %r takes over the staging of slot %r (%.1f MiB, same shapes, idle "
            "since an earlier step) instead of allocating its own. Slot names that change "
            "every step would otherwise hold one staging arena per step; name slots by what "
            'they hold ("model", "optimizer")',
            slot,
            old,
            staging.bytes_allocated / (1 << 20),
        )
        self._report(old, fresh)  # the old slot holds nothing now
        self._report(slot, staging)
        return staging

    def _busy(self, slot: str) -> bool:
        """Whether ``slot`` has a save, a prepare() or a publish holding it (caller holds the lock)."""
        if slot in self._holds:
            return True
        preparing = self._preparing.get(slot)
        if preparing is not None and not preparing.done():
            return True
        return self._save_running(slot)

    def _cold_save(self, slot: str, step: int, staging: StagingBuffers) -> None:
        self.logger.info(
            "obsckpt: save of slot %r step %d allocated its staging (%.1f MiB in %.3f s) on the "
            "caller's path; call prepare() at start-up to take this out of the first save",
            slot,
            step,
            staging.bytes_allocated / (1 << 20),
            staging.last_allocation_s,
        )
        self._report(slot, staging, cold=True)

    def _report(self, slot: str, staging: StagingBuffers, *, cold: bool = False) -> None:
        # Sent only when a slot's staging changes (prepare, a cold save, close), not per save.
        self._link.record_staging(
            slot, nbytes=staging.bytes_allocated, pinned_bytes=staging.pinned_bytes, cold=cold
        )
