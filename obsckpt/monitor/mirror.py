"""A local root's committed steps kept on an ``s3://`` root too, and brought back from it.

Some hosts keep their checkpoint root on a local (shared) filesystem and read it
back by path; Trinity-RFT's trainer, explorer and resume all do. For them the
monitor takes a mirror (``mirror="s3://bucket/prefix"``, or ``OBSCKPT_MIRROR``):

- after each step it commits locally, a thread of the monitor copies the step's
  files, those its manifest lists, to the mirror, each checked against the
  manifest's size and CRC32 as it is read, and commits the step there as on an S3
  root (:class:`~obsckpt.monitor.s3_commit.S3StepWriter`: objects checked with HEAD,
  the manifest written create-only, the pointer moved by compare-and-swap under the
  monitor's own epoch on the mirror). The local commit never waits for it; when
  steps commit faster than they upload, the mirror goes to the newest of each kind.
- a monitor that starts on a root with no committed step restores the mirror's
  committed steps first (:func:`restore`), every file read through the verified
  path, so a job on a fresh machine resumes from the mirror through its host's own
  local reads.

The mirror is fenced like an S3 root: a monitor that another took the mirror from
copies nothing more (``status()["mirror"]["fenced"]``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from obsckpt.errors import FencedError, ManifestConflictError, MirrorError
from obsckpt.monitor.s3_commit import S3Ownership, S3StepWriter, read_s3_root
from obsckpt.store import commit, layout, reader
from obsckpt.store.layout import KINDS, FileRecord
from obsckpt.store.s3root import S3Root, open_s3_root
from obsckpt.store.scratch import upload_file
from obsckpt.store.transfer import run_parallel

__all__ = [
    "SettleRPC",
    "StepMirror",
    "TakenMirror",
    "restore",
    "start_mirror",
    "take_mirror",
]

logger = logging.getLogger("obsckpt.monitor")

# What one monitor uploads at once: files in parallel, parts of each in parallel. The
# monitor holds (parts + 1) part buffers per file: 2 x 5 x 16 MiB here.
FILES_AT_ONCE = 2
PART_SIZE = 16 << 20
PARTS_AT_ONCE = 4
# A step whose copy failed on the store is tried again after this long, doubling.
RETRY_FIRST_S = 2.0
RETRY_MAX_S = 60.0


class MirrorObserver(Protocol):
    """Told what the mirror does (the monitor's telemetry), from the mirror's thread."""

    def mirror_committed(self, kind: str, step: int) -> None: ...

    def mirror_step_copied(self, seconds: float, uploaded_bytes: int) -> None: ...

    def mirror_failed(self) -> None: ...

    def store_commit_fenced(self) -> None: ...

    def watch_store(self, store: S3Root) -> None: ...

    def leftovers_swept(self, root: str, removed: list[str]) -> None: ...


@dataclass(frozen=True, slots=True)
class TakenMirror:
    """A mirror a starting monitor took: the root, its epoch there, what it restored."""

    store: S3Root
    ownership: S3Ownership
    restored: dict[str, int]
    swept: list[str]


def take_mirror(
    url: str | None, root: str | os.PathLike[str], namespace: str | None, *, restarted: bool
) -> TakenMirror | None:
    """None without a mirror (``url`` None); else the mirror at ``url`` taken by a monitor
    starting on ``root``: the endpoint's conditional writes probed, the pointer moved to
    a new epoch, the mirror swept (the dangling uploads and the objects of uncommitted
    steps that a monitor stopped mid-copy left: only this monitor writes there now), and,
    unless Ray restarted the monitor, the mirror's steps restored into a root with none
    (:func:`restore`).

    Raises:
        ConditionalWritesUnsupportedError: the endpoint ignores them (one line).
        StoreError: the endpoint could not be reached (one line naming it).
        MirrorError: as :func:`restore`.
    """
    if url is None:
        return None
    store = open_s3_root(url, "mirror", part_size=PART_SIZE, concurrency=PARTS_AT_ONCE)
    ownership = S3Ownership(store, namespace)
    _, removed, aborted = read_s3_root(store, ownership, restarted=False)
    restored = {} if restarted else restore(root, store)
    return TakenMirror(store, ownership, restored, removed + aborted)


def restore(root: str | os.PathLike[str], store: S3Root) -> dict[str, int]:
    """The mirror's committed steps brought into ``root`` when no iteration file there
    names a step: what was restored (kind -> step); empty when nothing was to restore.

    Each file is read with ranged GETs into a temp directory (a few 16 MiB parts in
    memory at a time) and checked against the mirror's manifest (size, ETag, CRC32),
    fsynced, and the directory renamed into place; the step's manifest is written,
    and the iteration files last.

    Raises:
        MirrorError: a step directory of that number is already under ``root`` (not
            committed there: named, with what to do), or a step on the mirror is not
            whole (named).
        StoreError: the mirror could not be read.
    """
    root = Path(root)
    if any(reader.read_iteration(root, kind) is not None for kind in KINDS):
        return {}
    pointer = store.read_pointer()
    named = {} if pointer is None else {k: pointer.step(k) for k in KINDS}
    wanted = {k: s for k, s in named.items() if s is not None}
    if not wanted:
        return {}
    t0 = time.perf_counter()
    for step in sorted(set(wanted.values())):
        _restore_step(root, store, step)
    commit.write_iterations(root, wanted)
    logger.info(
        "obsckpt monitor: restored %s from the mirror %s into %s (%.1f s)",
        ", ".join(f"{k} step {s}" for k, s in sorted(wanted.items())),
        store.url,
        root,
        time.perf_counter() - t0,
    )
    return wanted


def _restore_step(root: Path, store: S3Root, step: int) -> None:
    sdir = layout.step_dir(root, step)
    if sdir.exists():
        raise MirrorError(
            f"{sdir} exists, but no iteration file under {root} names a step, so it was "
            f"never committed there; move it away to restore step {step} from the mirror "
            f"{store.url}, or unset the mirror to start from {root} as it is"
        )
    try:
        records = store.committed_records(step)
    except ValueError as err:
        raise MirrorError(f"the mirror's step {step} cannot be restored: {err}") from None
    tmp = Path(layout.temp_name(sdir))
    try:
        for rec in records:
            local = tmp.joinpath(*rec.path.split("/"))
            local.parent.mkdir(parents=True, exist_ok=True)
            try:  # a few parts in memory at a time, whatever the file's size
                store.download_verified(step, rec.path, local, records=records, concurrency=4)
            except ValueError as err:
                raise MirrorError(f"the mirror's step {step} cannot be restored: {err}") from None
        os.rename(tmp, sdir)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit.fsync_dir(root)
    reported = {r.path: FileRecord(path=r.path, size=r.size, crc32=r.crc32) for r in records}
    commit.finalize_step(sdir, reported)


def start_mirror(
    taken: TakenMirror | None,
    root: str | os.PathLike[str],
    observer: Any,
    keep_steps: int | None,
    latest: dict[str, int | None],
) -> StepMirror | None:
    """The monitor's mirror thread (None without a mirror), started on the steps of
    ``latest`` (the local root's committed ones) that the mirror lacks. ``observer``:
    the monitor's telemetry, which also counts the mirror's failed requests."""
    if taken is None:
        return None
    observer.watch_store(taken.store)
    observer.leftovers_swept(taken.store.url, taken.swept)
    mirror = StepMirror(root, taken, keep_steps=keep_steps, observer=observer)
    mirror.catch_up(latest)
    return mirror


class StepMirror:
    """Copies each step committed under ``root`` to ``store``, and commits it there.

    Args:
        root: the monitor's local root.
        taken: the mirror and this monitor's epoch on it (:func:`take_mirror`).
        keep_steps: the mirror's retention (as :class:`~obsckpt.options.MonitorOptions`').
        observer: told of each commit, copy and failure.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        taken: TakenMirror,
        *,
        keep_steps: int | None = None,
        observer: MirrorObserver | None = None,
    ) -> None:
        self.root = Path(root)
        self.store = store = taken.store
        self.ownership = ownership = taken.ownership
        self._observer = observer
        self._writer = S3StepWriter(store, ownership, self._fenced, keep_steps)
        self._cond = threading.Condition()
        self._wanted: dict[str, int] = {}
        self._copying: tuple[int, str] | None = None
        self._retry_at: float | None = None
        self._stopped = False
        self.committed: dict[str, int | None] = {k: ownership.lease.pointer.step(k) for k in KINDS}
        self.error: str | None = None
        self.failures = 0
        self.restored = dict(taken.restored)
        self.swept = len(taken.swept)
        if observer is not None:
            for kind, step in self.committed.items():
                observer.mirror_committed(kind, -1 if step is None else step)
        self._thread = threading.Thread(target=self._run, name="obsckpt-mirror", daemon=True)
        self._thread.start()

    # --- what the monitor tells it ------------------------------------------------

    def committed_locally(self, step: int, kind: str) -> None:
        """``step`` of ``kind`` was committed under the local root: copy it (thread-safe)."""
        with self._cond:
            mirrored = self.committed.get(kind)
            if (mirrored is None or step > mirrored) and step > self._wanted.get(kind, -1):
                self._wanted[kind] = step
                self._cond.notify_all()

    def catch_up(self, latest: dict[str, int | None]) -> None:
        """Copy the local root's committed steps the mirror lacks (at the monitor's start)."""
        for kind, step in latest.items():
            if step is not None:
                self.committed_locally(step, kind)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no copy runs or waits, the mirror stopped (fenced),
        or a copy failed and waits to be tried again; whether every copy asked for ended."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._wanted or self._copying) and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0 or (self._retry_at is not None and self._copying is None):
                    break
                self._cond.wait(left)
            return not self._wanted and self._copying is None

    def close(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the copies asked for (:meth:`wait_idle`), then stop;
        whether they all ended."""
        drained = self.wait_idle(wait_s)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if not drained:
            logger.warning(
                "obsckpt monitor: stopped with steps not yet on the mirror %s: %s (the next "
                "monitor on this root copies them)",
                self.store.url,
                self._wanted,
            )
        return drained

    def status(self) -> dict[str, Any]:
        with self._cond:
            copying = self._copying
            return {
                "url": self.store.url,
                "epoch": self.ownership.epoch,
                "committed": dict(self.committed),
                "copying": None if copying is None else {"step": copying[0], "kind": copying[1]},
                "waiting": dict(self._wanted),
                "error": self.error,
                "failures": self.failures,
                "fenced": self.ownership.lost,
                "restored": dict(self.restored),
                "swept": self.swept,
            }

    # --- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        delay = RETRY_FIRST_S
        while True:
            with self._cond:
                while not self._stopped and not self._ready():
                    wait = None if self._retry_at is None else self._retry_at - time.monotonic()
                    self._cond.wait(None if wait is None else max(wait, 0.0))
                if self._stopped:
                    return
                step, kind = min((s, KINDS.index(k), k) for k, s in self._wanted.items())[::2]
                self._copying = (step, kind)
            retry = False
            try:
                self._copy(step, kind)
                delay = RETRY_FIRST_S
            except FencedError as err:
                self._failed(step, kind, f"{err}", stop=True)
            except (MirrorError, ManifestConflictError, ValueError) as err:
                self._failed(step, kind, str(err))  # copying it again would not help
            except FileNotFoundError as err:
                if self._wanted.get(kind) == step:  # not a step left behind by a newer one
                    self._failed(step, kind, f"{err}")
            except Exception as err:  # noqa: BLE001 - the store failed: try again later
                retry = True
                self._failed(step, kind, f"{err}", retry_in=delay)
                delay = min(2 * delay, RETRY_MAX_S)
            with self._cond:
                self._copying = None
                if not retry and self._wanted.get(kind) == step:
                    del self._wanted[kind]
                self._cond.notify_all()

    def _ready(self) -> bool:
        if not self._wanted:
            return False
        return self._retry_at is None or time.monotonic() >= self._retry_at

    def _copy(self, step: int, kind: str) -> None:
        t0 = time.perf_counter()
        sdir = layout.step_dir(self.root, step)
        records = reader.read_manifest(sdir)
        there = {r.path: r for r in (self.store.manifest(step) or []) if r.etag is not None}

        def copy(rec: FileRecord) -> tuple[FileRecord, int]:
            old = there.get(rec.path)
            if old is not None and (old.size, old.crc32) == (rec.size, rec.crc32):
                return old, 0  # an earlier commit of the step sent it (HEAD checks it)
            return self._upload(sdir, step, rec), rec.size

        copied = run_parallel(
            [partial(copy, rec) for rec in records], FILES_AT_ONCE, name="obsckpt-mirror"
        )
        files = {rec.path: rec for rec, _ in copied}
        self._writer.write(step, kind, files, {})
        with self._cond:
            self._retry_at, self.error = None, None
            self.committed[kind] = max(step, self.committed[kind] or -1)
            if kind == "checkpoint":
                # The pointer's full checkpoint moves its state dict up to it too.
                self.committed["state_dict"] = max(step, self.committed["state_dict"] or -1)
                if self._wanted.get("state_dict", step + 1) <= step:
                    del self._wanted["state_dict"]
        if self._observer is not None:
            for k in (kind, "state_dict") if kind == "checkpoint" else (kind,):
                self._observer.mirror_committed(k, self.committed[k])  # type: ignore[arg-type]
            self._observer.mirror_step_copied(time.perf_counter() - t0, sum(n for _, n in copied))
        logger.info(
            "obsckpt monitor: %s step %d on the mirror %s (%d files, %.1f s)",
            kind,
            step,
            self.store.url,
            len(files),
            time.perf_counter() - t0,
        )

    def _upload(self, sdir: Path, step: int, rec: FileRecord) -> FileRecord:
        path = sdir.joinpath(*rec.path.split("/"))
        up = upload_file(self.store, str(path), step, rec.path)
        if (up.size, up.crc32) != (rec.size, rec.crc32):
            raise MirrorError(
                f"{path} holds {up.size} bytes with crc32 {up.crc32:08x}, but its step's "
                f"manifest records {rec.size} bytes with crc32 {rec.crc32:08x}: it changed "
                f"after its commit, so step {step} is not copied to the mirror (check it with "
                f"obsckpt verify {self.root})"
            )
        return up

    def _failed(
        self, step: int, kind: str, error: str, *, stop: bool = False, retry_in: float | None = None
    ) -> None:
        message = f"{kind} step {step} not copied to the mirror {self.store.url}: {error}"
        with self._cond:
            self.error = message
            self.failures += 1
            if stop:
                self._stopped = True
            self._retry_at = None if retry_in is None else time.monotonic() + retry_in
        if self._observer is not None:
            self._observer.mirror_failed()
        logger.error(
            "obsckpt monitor: %s%s",
            message,
            "; it copies nothing more"
            if stop
            else (f"; trying again in {retry_in:.0f} s" if retry_in else ""),
        )

    def _fenced(self) -> None:
        if self._observer is not None:
            self._observer.store_commit_fenced()


# The longest the end of a job waits for its last commit and the mirror's copy of it.
SETTLE_WAIT_S = 600.0


class SettleRPC:
    """The monitor's ``settle`` RPC (part of :class:`~obsckpt.monitor.CheckpointMonitor`)."""

    mirror: StepMirror | None
    _committer: Any

    async def settle(self, timeout_s: float = SETTLE_WAIT_S) -> dict[str, Any]:
        """Wait up to ``timeout_s`` for the commit under way, then for the mirror's copies of
        the steps committed so far (each on the mirror, or failed and waiting to be tried
        again). Trinity's trainer calls it, through the Synchronizer, as it stops, so that
        a job does not end before its last step is committed and on the mirror.

        Returns:
            ``committed`` and ``mirrored`` (whether each ended in time) and the mirror's
            ``status`` (None without a mirror).
        """
        deadline = time.monotonic() + timeout_s
        committed = await self._committer.wait_idle(timeout_s)
        mirror = self.mirror
        mirrored = mirror is None or await asyncio.to_thread(
            mirror.wait_idle, max(0.0, deadline - time.monotonic())
        )
        return {
            "committed": committed,
            "mirrored": mirrored,
            "mirror": None if mirror is None else mirror.status(),
        }
