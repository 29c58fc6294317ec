"""Durable writes and the commit procedure.

Every write that a commit depends on goes through :func:`atomic_write`: temp
file, fsync, rename over the target, fsync of the directory. The names written
are :mod:`obsckpt.layout`'s; reading them back is :mod:`obsckpt.reader`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

from obsckpt.errors import CheckpointDirError, FsyncTimeoutError
from obsckpt.store.layout import (
    ITERATION_FILES,
    MANIFEST_NAME,
    FileRecord,
    is_own_temp_name,
    manifest_bytes,
    step_dir,
    step_of_dir_name,
    temp_name,
)
from obsckpt.store.reader import (
    iteration_mtime,
    read_iteration,
    read_manifest,
    record_file,
    steps_on_disk,
    unlisted,
    walk_files,
)
from obsckpt.validators import validate_step

# How long one round of fsyncs may take before FsyncTimeoutError: generous, since a
# large checkpoint's files on a busy network filesystem take minutes; past it, the
# storage is taken to be hung (an fsync stuck on an NFS server never returns).
FSYNC_TIMEOUT_S = 1800.0

# A commit's phases, in order (finalize_step's ``on_phase``; the ``phase`` label of
# obsckpt_commit_phase_seconds):
PHASE_SCAN = "scan"  # listing the step, checking files, writing the temp files
PHASE_FSYNC_FILES = "fsync_files"  # fsync of files, directories and temp files
PHASE_MANIFEST = "manifest"  # the manifest renamed in, the step and root fsynced
PHASE_RENAME_ITERATION = "rename_iteration"  # fence, iteration files renamed, root fsynced
COMMIT_PHASES = (PHASE_SCAN, PHASE_FSYNC_FILES, PHASE_MANIFEST, PHASE_RENAME_ITERATION)


def raise_named(exc: OSError, path: str | os.PathLike) -> NoReturn:
    """Raise ``exc``, naming ``path`` when it names no file (an error on a file descriptor).

    ``os.write`` and ``os.fsync`` report only the cause ("No space left on
    device"); a commit's error must also say which file of which step it hit.
    """
    if exc.filename is not None:
        raise exc
    raise OSError(exc.errno, exc.strerror or str(exc), os.fspath(path)) from exc


def scratch_dir(path: str | os.PathLike) -> str:
    """A new, empty directory beside ``path`` to build it in: ``<path>.tmp.<pid>.<8 hex>``.

    Named as a temp file of ``path``, so a commit's manifest and ``obsckpt
    verify`` leave it and everything in it out: a step committed while files
    are still being built in it (or after a crash left it) does not list them.
    """
    name = temp_name(path)
    os.mkdir(name)
    return name


def _fsync_path(path: str | os.PathLike, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise_named(exc, path)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    _fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_file(path: str | os.PathLike) -> None:
    _fsync_path(path, os.O_RDONLY)


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new content."""
    path = Path(path)
    pending = [_write_temp(path, data)]
    try:
        fsync_many([(pending[0][0], False)], phase=f"writing {str(path)!r}")
    except BaseException:
        _discard(pending)
        raise
    _publish(path.parent, pending)


def write_iteration(root: str | os.PathLike, kind: str, step: int) -> None:
    """Atomically make ``kind``'s iteration file name ``step``; it never goes backwards.

    Raises:
        ValueError: the file already names a later step.
    """
    write_iterations(root, {kind: step})


def write_iterations(root: str | os.PathLike, steps: dict[str, int]) -> None:
    """Atomically move several iteration files forward, with one directory fsync.

    Each new content is written to a temp file and fsynced, then every temp
    file is renamed into place (in the order given) and the directory is
    fsynced once. A file that already names the same step is left alone.

    Raises:
        ValueError: a file already names a later step than asked for.
    """
    pending = _stage_iterations(Path(root), steps)
    try:
        fsync_many([(tmp, False) for tmp, _ in pending])
    except BaseException:
        _discard(pending)
        raise
    _publish(Path(root), pending)


def _stage_iterations(root: Path, steps: dict[str, int]) -> list[tuple[Path, Path]]:
    """Temp files holding the new iteration contents (not yet fsynced)."""
    pending: list[tuple[Path, Path]] = []
    try:
        for kind, step in steps.items():
            validate_step(step)
            current = read_iteration(root, kind)
            if current is not None and current > step:
                raise ValueError(
                    f"{ITERATION_FILES[kind]} names step {current}; refusing to move it back "
                    f"to {step}"
                )
            if current == step:
                continue
            pending.append(_write_temp(root / ITERATION_FILES[kind], f"{step}\n".encode()))
    except BaseException:
        _discard(pending)
        raise
    return pending


def _publish(
    root: Path,
    pending: list[tuple[Path, Path]],
    *,
    phase: str = "publish",
    timeout_s: float | None = None,
    fence: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
) -> None:
    try:
        with fence():
            for tmp, path in pending:
                os.replace(tmp, path)
    except BaseException:
        _discard(pending)
        raise
    if pending:
        fsync_many([(root, True)], phase=phase, timeout_s=timeout_s)


def _write_temp(path: Path, data: bytes) -> tuple[Path, Path]:
    tmp = Path(temp_name(path))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException as exc:
        os.close(fd)
        # Not handed to the caller's clean-up yet: a full disk would keep it for good.
        _discard([(tmp, path)])
        if isinstance(exc, OSError):
            raise_named(exc, tmp)
        raise
    os.close(fd)
    return tmp, path


def _discard(pending: list[tuple[Path, Path]]) -> None:
    for tmp, _ in pending:
        # Best effort: on a filesystem turned read-only the unlink fails too, and its
        # error must not replace the one that ended the write.
        with contextlib.suppress(OSError):
            os.unlink(tmp)


# Made on first use; a forked child (a DataLoader worker, a multiprocessing rank) gets a
# new one, since the parent's worker threads do not exist in it.
_fsync_pool: ThreadPoolExecutor | None = None
_fsync_pool_lock = threading.Lock()


def _reset_fsync_pool_in_child() -> None:
    global _fsync_pool, _fsync_pool_lock
    _fsync_pool = None
    _fsync_pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_fsync_pool_in_child)


def fsync_many(
    targets: Sequence[tuple[str | os.PathLike[str], bool]],
    *,
    phase: str = "fsync",
    timeout_s: float | None = None,
) -> None:
    """fsync files (False) and directories (True) concurrently, within ``timeout_s``.

    On a journaling filesystem concurrent fsyncs share one journal commit
    instead of waiting for one each, which is most of a commit's latency.

    Args:
        targets: (path, is_dir) pairs.
        phase: what the fsyncs are for, named in the timeout's error.
        timeout_s: the longest wait for all of them (default :data:`FSYNC_TIMEOUT_S`,
            read at the call). An fsync that is still running then keeps its pool
            thread; the storage is hung, and later fsyncs will time out too.

    Raises:
        FsyncTimeoutError: they did not all finish in time; it names the phase, the
            files still waited for and how long it waited.
        OSError: an fsync failed (the first, in ``targets``' order).
    """
    global _fsync_pool
    if not targets:
        return
    timeout = FSYNC_TIMEOUT_S if timeout_s is None else timeout_s
    sync = [fsync_dir if is_dir else fsync_file for _, is_dir in targets]
    with _fsync_pool_lock:
        if _fsync_pool is None:
            _fsync_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="obsckpt-fsync")
    started = time.monotonic()
    try:
        # Through the pool even for one target: a wait on it can be bounded.
        futures = [
            _fsync_pool.submit(fn, path) for fn, (path, _) in zip(sync, targets, strict=True)
        ]
    except RuntimeError:
        # The interpreter is shutting down (pools take no new work): a save that is
        # still running then, past the exit wait, fsyncs its files one by one.
        for fn, (path, _) in zip(sync, targets, strict=True):
            fn(path)
        return
    _, not_done = concurrent.futures.wait(futures, timeout=timeout)
    if not_done:
        waiting = [
            os.fspath(p) for f, (p, _) in zip(futures, targets, strict=True) if f in not_done
        ]
        shown = ", ".join(repr(p) for p in waiting[:5])
        more = f" and {len(waiting) - 5} more" if len(waiting) > 5 else ""
        raise FsyncTimeoutError(
            f"{phase}: {len(waiting)} of {len(targets)} fsyncs had not finished after "
            f"{time.monotonic() - started:.1f} s (timeout {timeout:g} s): still waiting for "
            f"{shown}{more}. The storage is not answering (a hung network filesystem "
            "server?); check it, e.g. whether `ls` or `sync` in that directory returns"
        )
    for future in futures:
        future.result()


def ensure_root(root: str | os.PathLike) -> Path:
    """Create ``root`` if needed and prove it is writable, or raise CheckpointDirError."""
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise CheckpointDirError(
            f"checkpoint directory {str(path)!r} is a file, not a directory; "
            "pass default_local_dir pointing at a directory"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".obsckpt-write-probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise CheckpointDirError(
            f"checkpoint directory {str(path)!r} is not writable ({exc.strerror or exc}); "
            "pass a default_local_dir this process can create files in"
        ) from exc
    return path


def finalize_step(
    sdir: str | os.PathLike,
    reported: dict[str, FileRecord] | None = None,
    *,
    iterations: dict[str, int] | None = None,
    timings: dict[str, float] | None = None,
    on_phase: Callable[[str], None] | None = None,
    fence: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
    fsync_timeout_s: float | None = None,
) -> list[FileRecord]:
    """Make every file of a step durable, write its manifest, then move iteration files.

    Files that workers reported (fsynced, with size and CRC) are only checked
    for size; any other file under the step directory is checksummed and
    fsynced here. The durable writes run in three rounds, each a set of
    concurrent fsyncs:

    1. every unreported file, every directory of the step, the manifest's temp
       file and the iteration files' temp files (``iterations``: kind → step);
    2. the manifest is renamed into place (inside ``fence()``); the step
       directory and the root (``sdir``'s parent, which holds the step
       directory) are fsynced;
    3. the iteration files are renamed into place (inside ``fence()``) and the
       root is fsynced.

    So an iteration file never names a step whose files, directories or
    manifest could be lost in a crash. Returns the manifest's records.

    Args:
        sdir: the step directory.
        reported: the files workers reported, by path relative to ``sdir``.
        iterations: kind → step, the iteration files to move.
        timings: if given, the seconds of each part are stored in it: ``scan``
            (listing and checking the files, the manifest and temp files written),
            ``round1``, ``round2`` and ``publish`` (the three rounds of fsyncs).
        on_phase: called with each of :data:`COMMIT_PHASES` as it begins (in the
            calling thread), so a caller can show which one a hung commit is in.
        fence: makes a context held around each rename (the manifest's, then the
            iteration files'); entering it raises (and nothing more is renamed)
            when the caller may no longer commit.
        fsync_timeout_s: the longest wait for each round of fsyncs (default
            :data:`FSYNC_TIMEOUT_S`).

    Raises:
        FsyncTimeoutError: a round of fsyncs did not finish in time (named in it).
        OSError: a file could not be read, written or fsynced.
    """
    clock = time.perf_counter
    begin = on_phase if on_phase is not None else (lambda _phase: None)
    fence = fence if fence is not None else contextlib.nullcontext
    begin(PHASE_SCAN)
    t0 = clock()
    sdir = Path(sdir)
    root = sdir.parent
    reported = reported or {}
    records: dict[str, FileRecord] = {}
    targets: list[tuple[str | os.PathLike, bool]] = []
    exists = sdir.is_dir()
    if exists:
        top = os.fspath(sdir)
        for dirpath, names in walk_files(top):
            # Relative names by prefix, not os.path.relpath: a step can hold thousands.
            prefix = "" if dirpath == top else os.path.relpath(dirpath, top) + os.sep
            for name in names:
                rel = prefix + name
                if rel == MANIFEST_NAME:
                    continue
                full = os.path.join(dirpath, name)
                known = reported.get(rel)
                if known is not None and known.size == os.stat(full).st_size:
                    records[rel] = known
                else:
                    records[rel] = record_file(full, sdir)
                    targets.append((full, False))
            targets.append((dirpath, True))
    # A worker on another node may have reported files this process cannot see.
    for rel, rec in reported.items():
        records.setdefault(rel, rec)
    ordered = [records[k] for k in sorted(records)]
    manifest: list[tuple[Path, Path]] = []
    pending: list[tuple[Path, Path]] = []
    try:
        if exists:
            manifest.append(_write_temp(sdir / MANIFEST_NAME, manifest_bytes(ordered)))
        pending = _stage_iterations(root, iterations or {})
        begin(PHASE_FSYNC_FILES)
        t1 = clock()
        fsync_many(
            targets + [(tmp, False) for tmp, _ in manifest + pending],
            phase=f"commit of {sdir.name}: {PHASE_FSYNC_FILES}",
            timeout_s=fsync_timeout_s,
        )
        begin(PHASE_MANIFEST)
        t2 = clock()
        if exists:
            with fence():
                os.replace(*manifest[0])
            manifest = []
            fsync_many(
                [(sdir, True), (root, True)],
                phase=f"commit of {sdir.name}: {PHASE_MANIFEST}",
                timeout_s=fsync_timeout_s,
            )
        begin(PHASE_RENAME_ITERATION)
        t3 = clock()
    except BaseException:
        _discard(manifest + pending)
        raise
    _publish(
        root,
        pending,
        fence=fence,
        phase=f"commit of {sdir.name}: {PHASE_RENAME_ITERATION} (the iteration files are "
        "renamed; whether they are durable is unknown)",
        timeout_s=fsync_timeout_s,
    )
    if timings is not None:
        timings.update(scan=t1 - t0, round1=t2 - t1, round2=t3 - t2, publish=clock() - t3)
    return ordered


def sweep_leftovers(root: str | os.PathLike) -> list[str]:
    """Remove obsckpt's own leftovers that no writer can still be using; returns them.

    A write cut short (a killed rank, a monitor killed inside its commit) leaves
    its temp file or scratch directory behind: ``<name>.tmp.<pid>.<8 hex>``
    (:func:`obsckpt.store.layout.is_own_temp_name`) in the root or under a step
    directory. Only those names are removed, and only when older than the last
    commit (the newest iteration file): the caller runs this when a job starts,
    holding the root's lock, before any save of the job is admitted. Nothing
    else is touched; a leftover that cannot be removed is skipped.
    """
    root = Path(root)
    commits = [t for kind in ITERATION_FILES if (t := iteration_mtime(root, kind)) is not None]
    if not commits:
        return []
    before = max(commits)
    removed: list[str] = []

    def sweep(path: str, is_dir: bool) -> None:
        try:
            if os.lstat(path).st_mtime >= before:
                return
            if is_dir:
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            return
        removed.append(path)

    for entry in os.scandir(root):
        if is_own_temp_name(entry.name) and entry.is_file(follow_symlinks=False):
            sweep(entry.path, False)
        elif step_of_dir_name(entry.name) is not None and entry.is_dir(follow_symlinks=False):
            for dirpath, dirnames, filenames in os.walk(entry.path):
                for name in [d for d in dirnames if is_own_temp_name(d)]:
                    dirnames.remove(name)
                    sweep(os.path.join(dirpath, name), True)
                for name in filenames:
                    if is_own_temp_name(name):
                        sweep(os.path.join(dirpath, name), False)
    return sorted(removed)


def remove_strays(sdir: str | os.PathLike) -> list[str]:
    """Remove the files a committed step's manifest does not list; returns them (relative).

    A save of a committed step is not written (its commit stands), but a host's
    saving code may write before it hands the save to obsckpt: Trinity-RFT's
    ``save_state_dict`` streams ``model.safetensors.tmp`` on the training thread
    and only renames it in the background save. Such a file lies in a step its
    manifest vouches for without being listed, so ``verify`` would fail the step.
    The caller removes them only when the monitor says no other save of the step
    is on its way (:meth:`obsckpt.monitor.core.MonitorCore.settled`). A step with
    no readable manifest is not committed: nothing is touched. The listed files,
    the manifest and obsckpt's own temp files are never touched.
    """
    sdir = Path(sdir)
    try:
        records = read_manifest(sdir)
    except (OSError, ValueError):
        return []
    removed = []
    for rel in unlisted(sdir, records):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sdir / rel)
            removed.append(rel)
    if removed:
        fsync_many([(d, True) for d in sorted({os.path.dirname(sdir / r) for r in removed})])
    return removed


def steps_beyond(committed: list[int], keep: int, protected: set[int]) -> list[int]:
    """Which of the ``committed`` steps retention removes: those older than the newest
    ``keep`` of them, less the ``protected`` ones (steps an iteration file or pointer names)."""
    ordered = sorted(set(committed))
    return [s for s in ordered[: max(0, len(ordered) - keep)] if s not in protected]


def remove_old_steps(root: str | os.PathLike, keep: int, protected: set[int]) -> list[str]:
    """Remove the committed step directories of ``root`` beyond the newest ``keep`` (see
    :func:`steps_beyond`); the removed directories. Each step's manifest goes first (and
    the step directory is fsynced), so a step cut short by a crash reads as not whole,
    never as committed with files missing. Only steps with a manifest count: a step
    being written, or one that never committed, is left alone."""
    root = Path(root)
    committed = [s for s in steps_on_disk(root) if (step_dir(root, s) / MANIFEST_NAME).is_file()]
    newest = max(protected, default=None)
    removed = []
    for step in steps_beyond(committed, keep, protected):
        if newest is not None and step > newest:
            continue
        sdir = step_dir(root, step)
        try:
            os.unlink(sdir / MANIFEST_NAME)
        except FileNotFoundError:
            pass
        fsync_dir(sdir)
        shutil.rmtree(sdir)
        removed.append(str(sdir))
    if removed:
        fsync_dir(root)
    return removed
