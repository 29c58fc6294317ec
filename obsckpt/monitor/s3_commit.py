"""The monitor's commits into an ``s3://`` root: ownership by epoch, checks by HEAD, a pointer swap.

An object store has no lock file and no rename. The monitor owns an S3 root by
moving its pointer to a new epoch at start (:class:`S3Ownership`, after checking
that the endpoint enforces conditional writes), and commits a whole step with
:class:`S3StepWriter`: every object the ranks reported is checked with HEAD
(size and ETag), the manifest is written create-only, and the pointer is moved
by compare-and-swap (:class:`~obsckpt.store.pointer.RootPointer`). A monitor
that another took the root from is fenced: its next commit is refused before it
writes anything, and ``status()`` and ``obsckpt_monitor_fenced`` say so.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator

from obsckpt.errors import FencedError, StoreCheckError
from obsckpt.monitor.commit_io import retain
from obsckpt.store.layout import KINDS, FileRecord, manifest_bytes
from obsckpt.store.pointer import PHASE_HEAD_CHECK, Lease
from obsckpt.store.probe import probe_conditional_writes
from obsckpt.store.s3root import S3Root

__all__ = ["S3Ownership", "S3StepWriter", "read_s3_root"]


class S3Ownership:
    """This monitor's hold on an S3 root: the pointer's epoch it moved to at start.

    The part of :class:`obsckpt.store.rootlock.RootLock` a monitor uses, for an S3 root.

    Args:
        store: the root.
        namespace: the job's Ray namespace, for the owner's name.
        probe: check first that the endpoint enforces conditional writes.

    Raises:
        ConditionalWritesUnsupportedError: the endpoint ignores If-None-Match or If-Match.
        StoreError: the endpoint could not be reached, or the pointer not taken.
    """

    def __init__(self, store: S3Root, namespace: str | None, *, probe: bool = True) -> None:
        self.store = store
        if probe:
            probe_conditional_writes(store.client, store.root.prefix)
        owner = f"{namespace or 'obsckpt'}@{socket.gethostname()}:{os.getpid()}"
        self.lease: Lease = store.pointer.take_ownership(owner)
        self.recreated = 0  # no lock file to make anew on an object store

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    @property
    def lost(self) -> str | None:
        """Why this monitor no longer owns the root, or None while it does."""
        if self.lease.fenced_by is None:
            return None
        return (
            f"{self.store.url}: epoch {self.lease.fenced_by} took the root from this monitor's "
            f"epoch {self.lease.epoch}"
        )

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """Raise :class:`FencedError` once fenced (the commit itself checks the pointer too)."""
        if self.lease.fenced_by is not None:
            raise FencedError(
                f"{self.lost}; it commits nothing more",
                root=self.store.url,
                epoch=self.lease.epoch,
                new_epoch=self.lease.fenced_by,
            )
        yield

    def check(self) -> None:
        """Read the pointer: a higher epoch fences this monitor (raises FencedError)."""
        self.store.pointer.check(self.lease)

    def watch(self) -> None:
        """Nothing to watch between commits: each commit reads the pointer first."""

    def release(self) -> None:
        """Nothing to release: the next monitor takes the root by moving its epoch up."""


class S3StepWriter:
    """Commits steps under an S3 root (the monitor's :class:`~obsckpt.monitor.commit_io.StepWriter`
    for ``s3://``).

    Args:
        store: the root.
        ownership: this monitor's epoch on it.
    """

    sees_step_dirs = False

    def __init__(
        self,
        store: S3Root,
        ownership: S3Ownership,
        on_fenced: Callable[[], None] | None = None,
        keep_steps: int | None = None,
    ) -> None:
        self.store = store
        self.ownership = ownership
        self.root = store.url
        self._on_fenced = on_fenced
        self.keep_steps = keep_steps

    def has_step_dir(self, step: int) -> bool:
        return self.store.has_objects(step)

    def write(
        self,
        step: int,
        kind: str,
        files: dict[str, FileRecord],
        phases: dict[str, float],
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        """Check ``step``'s reported objects with HEAD, write its manifest, move the pointer.

        Raises:
            FencedError: another monitor took the root; nothing was written.
            StoreCheckError: a reported object is missing or differs (named).
            StoreError: the store failed (the pointer unchanged, or the outcome named).
        """
        try:
            self._write(step, kind, files, on_phase)
        except FencedError:
            if self._on_fenced is not None:
                self._on_fenced()
            raise

    def _write(
        self,
        step: int,
        kind: str,
        files: dict[str, FileRecord],
        on_phase: Callable[[str], None] | None,
    ) -> None:
        begin = on_phase if on_phase is not None else (lambda _phase: None)
        with self.ownership.fenced():
            pass
        begin(PHASE_HEAD_CHECK)
        problems = self.store.check_reported(step, files)
        if problems:
            raise StoreCheckError(
                f"{len(problems)} of {len(files)} reported objects are not as reported: "
                + "; ".join(problems[:3])
                + ("; ..." if len(problems) > 3 else ""),
                operation="head",
                key=self.store.step_key(step),
                status="mismatch",
            )
        records = [files[path] for path in sorted(files)]
        pointer = self.store.pointer.commit(
            self.ownership.lease, kind, step, manifest_bytes(records), on_phase=begin
        )
        if self.keep_steps is not None:
            keep = self.keep_steps
            named = {s for s in (pointer.checkpoint_step, pointer.state_dict_step) if s is not None}
            retain(lambda: self.store.retain(keep, named), self.root)


def read_s3_root(
    store: S3Root, ownership: S3Ownership, restarted: bool
) -> tuple[dict[str, int | None], list[str], list[str]]:
    """A monitor's start on ``store``: the committed steps (the pointer's: taking the root
    brought the iteration objects up to it), and, unless Ray restarted the monitor within
    its job (whose saves may be uploading), the start's sweep before any save is admitted:
    the objects of steps that never committed removed, obsckpt's dangling uploads aborted."""
    latest = {k: ownership.lease.pointer.step(k) for k in KINDS}
    if restarted:
        return latest, [], []
    swept = store.sweep(max((s for s in latest.values() if s is not None), default=None))
    return latest, swept.removed_objects, swept.aborted_uploads
