"""One committer per checkpoint root: the monitor's lock on ``<root>/.obsckpt-monitor.lock``.

Two jobs pointed at one root (a relaunch while the old job still runs, two
experiments with the same ``default_local_dir``) would each write the iteration
files, and each one's monitor would take the other's half-written steps for
abandoned ones and its retention would delete them. The monitor therefore holds
an exclusive ``flock`` on a file in the root for as long as its process lives;
a second monitor refuses the root, naming the holder.

The kernel drops the lock when the holding process ends, however it ends, so a
crashed monitor never leaves the root locked. On NFS, Linux carries ``flock``
as a whole-file POSIX lock to the server, which frees a lost client's locks
when its lease runs out (90 s by default): a monitor that Ray restarts on
another node waits that long for it (:data:`RESTART_WAIT_S`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from obsckpt.errors import CheckpointDirError, RootInUseError

logger = logging.getLogger(__name__)

LOCK_NAME = ".obsckpt-monitor.lock"
# How long a new monitor waits for a holder to go: ray.kill returns before the
# killed monitor's process has ended, so a job that kills its monitor and starts
# another would otherwise race its own lock.
START_WAIT_S = 5.0
# How long a monitor that Ray restarted waits for its predecessor's lock: an NFS
# server keeps a lost client's locks until its lease ends (90 s by default).
RESTART_WAIT_S = 120.0
_POLL_S = 0.25
_MAX_INFO_BYTES = 4096


class RootLock:
    """The held lock; :meth:`release` gives it up (so does the process's end)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd  # None: not held (released, or a filesystem without locks)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock and close; the file stays (removing it would race a new holder's open)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file drops its flock


def lock_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / LOCK_NAME


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise CheckpointDirError(
            f"cannot open the monitor's lock file {str(path)!r} ({exc.strerror or exc}); "
            "the checkpoint root must let this process create and write files"
        ) from exc


class _NoLocks(OSError):
    """flock failed for another reason than a holder (a filesystem without locks, EBADF)."""


def _try_lock(fd: int) -> bool:
    """Whether ``fd`` took the lock (False: another open file holds it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise _NoLocks(exc.errno, exc.strerror) from exc
    return True


def _poll(done: Callable[[], bool], wait_s: float) -> bool:
    """Call ``done`` every _POLL_S until it is true (True) or ``wait_s`` has passed (False)."""
    deadline = time.monotonic() + wait_s
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(_POLL_S, left))
    return True


def read_holder(root: str | os.PathLike[str]) -> dict[str, Any]:
    """What the lock file says of its last holder ({} when missing or unreadable)."""
    try:
        fd = os.open(lock_path(root), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        data = os.read(fd, _MAX_INFO_BYTES)
    except OSError:
        return {}
    finally:
        os.close(fd)
    try:
        info = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def describe_holder(info: dict[str, Any]) -> str:
    """``info`` in a few words: host, pid, namespace, since when."""
    parts = []
    if isinstance(info.get("host"), str):
        parts.append(f"host {info['host']}")
    if isinstance(info.get("pid"), int):
        parts.append(f"pid {info['pid']}")
    if isinstance(info.get("namespace"), str):
        parts.append(f"Ray namespace {info['namespace']!r}")
    since = info.get("since")
    if isinstance(since, int | float) and not isinstance(since, bool):
        try:
            parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(since)))
        except (OverflowError, OSError, ValueError):
            pass
    return ", ".join(parts) if parts else "a holder that left no details"


def _in_use(root: Path, info: dict[str, Any], waited: float) -> RootInUseError:
    after = f" after waiting {waited:.0f} s" if waited >= 1 else ""
    return RootInUseError(
        f"checkpoint root {str(root)!r} is in use by another obsckpt monitor "
        f"({describe_holder(info)}){after}. Two jobs committing into one root would "
        "overwrite each other's iteration files and delete each other's steps. Give "
        "this job a default_local_dir of its own, or stop the other job first (its "
        f"lock, {LOCK_NAME}, is released when its monitor's process ends)",
        holder=info,
    )


def acquire(
    root: str | os.PathLike[str], *, namespace: str | None = None, wait_s: float = 0.0
) -> RootLock:
    """Lock ``root`` for this process's monitor, waiting up to ``wait_s`` for a holder to go.

    On a filesystem that cannot lock (some FUSE mounts, NFS mounted with
    ``nolock``) a warning is logged and the returned lock is not held.

    Raises:
        RootInUseError: another process (or another monitor in this one) holds it.
        CheckpointDirError: the lock file cannot be created.
    """
    root = Path(root)
    path = lock_path(root)
    fd = _open(path)
    # Held through a read-only descriptor where the filesystem allows: a file open
    # for writing keeps an administrator from remounting the root read-only.
    held = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        try:
            got = _try_lock(held)
        except _NoLocks as exc:
            if exc.errno != errno.EBADF:
                raise
            # NFS carries flock as a POSIX write lock, which needs the read-write one.
            os.close(held)
            held = fd
            got = _try_lock(held)
        if not (got or _poll(lambda: _try_lock(held), wait_s)):
            raise _in_use(root, read_holder(root), wait_s)
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "namespace": namespace,
            "since": time.time(),
        }
        # Who holds it, for the error a second monitor gives; not needed for the lock.
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    except _NoLocks as exc:
        _close(held, fd)
        logger.warning(
            "obsckpt: cannot lock %s (%s): this filesystem does not support flock, so a "
            "second job on this checkpoint root would not be refused. Give every job a "
            "default_local_dir of its own",
            path,
            exc.strerror or exc,
        )
        return RootLock(path, None)
    except BaseException:
        _close(held, fd)
        raise
    if held != fd:
        os.close(fd)  # another open file than the locked one: its flock stays
    return RootLock(path, held)


def _close(*fds: int) -> None:
    for fd in set(fds):
        os.close(fd)


def locked_by(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Who holds ``root``'s lock now (their details, perhaps {}), or None if no one does.

    Tries the lock and lets it go at once, so it never keeps a monitor out.
    """
    path = lock_path(root)
    fd = None
    # Read-write where possible: over NFS an exclusive lock needs a writable descriptor.
    for flags in (os.O_RDWR, os.O_RDONLY):
        try:
            fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            break
        except OSError:
            continue
    if fd is None:
        return None  # no lock file (or one this process cannot open): no monitor to name
    try:
        if _try_lock(fd):
            return None
    except _NoLocks:
        return None
    finally:
        os.close(fd)  # also drops the lock this probe may have taken
    return read_holder(root)


def check_free(root: str | os.PathLike[str], *, wait_s: float = 0.0) -> None:
    """Raise :class:`RootInUseError` if a monitor holds ``root`` for ``wait_s`` more seconds.

    For a caller about to start a monitor or to clear a root: it fails there
    rather than in a remote actor or after removing another job's files.
    """
    if not _poll(lambda: locked_by(root) is None, wait_s):
        raise _in_use(Path(root), read_holder(root), wait_s)
