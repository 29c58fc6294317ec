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

The lock is also a fence. ``flock`` belongs to the file's inode, so a lock
file deleted (or replaced) under a running monitor would let a second monitor
lock a new file at the same path while the first still commits. Each holder
therefore writes a random ``epoch`` into the file it locked, and
:meth:`RootLock.check`, called immediately before every iteration-file rename,
proves that the file at the path is still the one it holds (``os.stat`` of the
path against ``fstat`` of the held descriptor) and still names its epoch. A
monitor whose check fails is fenced for good: it commits nothing more, and the
monitor holding the file now at the path owns the root. A released lock (a
monitor shut down) fails the check the same way. A lock file found deleted
(with nothing at the path) is made and locked anew by the check: whichever
monitor locks a file at the path first owns the root.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from obsckpt.errors import CheckpointDirError, RootInUseError, RootLockLostError

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
# How often a watched lock checks its file between commits: a deleted lock file is
# made anew (or its holder fenced off) within this time, so a monitor starting on
# the root meanwhile is refused.
WATCH_INTERVAL_S = 2.0
_MAX_INFO_BYTES = 4096


class RootLock:
    """The held lock: :meth:`check` proves it still fences the root; :meth:`release` gives it up.

    Args:
        path: the lock file.
        fd: the open lock file (None: nothing held).
        epoch: the token this holder wrote into the file.
        locked: whether ``fd`` holds the ``flock`` (False on a filesystem without locks:
            the epoch alone then tells this holder from a later one).
        info: who holds it (host, pid, namespace, since), written again with the
            epoch into a lock file made anew.
    """

    def __init__(
        self,
        path: Path,
        fd: int | None,
        *,
        epoch: str = "",
        locked: bool = True,
        info: dict[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.epoch = epoch
        # Times the lock file was found deleted and locked anew by this holder.
        self.recreated = 0
        self._info = dict(info or {})
        self._fd = fd
        self._locked = locked and fd is not None
        self._inode = _identity(os.fstat(fd)) if fd is not None else None
        self._lost: str | None = None if fd is not None else "it was never taken"
        # The check runs in the commit's thread, status()'s and the watcher; release on
        # the event loop.
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Whether this process holds the ``flock`` on the lock file."""
        return self._fd is not None and self._locked

    @property
    def lost(self) -> str | None:
        """Why this lock no longer fences the root, as last checked (None: it does)."""
        return self._lost

    def check(self) -> None:
        """Prove that this holder still owns the root (see :meth:`fenced`).

        Raises:
            RootLockLostError: see :meth:`fenced`.
        """
        with self.fenced():
            pass

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """Prove that this holder still owns the root, and keep it until the block ends.

        Wrap a commit's renames in it: :meth:`release` (a shutdown) waits for the
        block, so a rename that passed the check never lands after the release.

        Raises:
            RootLockLostError: the lock was released, or the lock file at the path was
                replaced or rewritten by another holder, or deleted and locked anew by
                another monitor (for good: a lost lock is never found again), or the file
                cannot be read (or made again) to tell.
        """
        with self._guard:
            if self._lost is None:
                why, final = self._verify()
                if why is not None and final:
                    self._lost = why
                    logger.error(
                        "obsckpt: the monitor's lock on %s is lost: %s. This monitor commits "
                        "nothing more; the monitor holding the lock file now at that path (if "
                        "any) owns the root",
                        self.path.parent,
                        why,
                    )
            else:
                why = self._lost
            if why is not None:
                raise RootLockLostError(
                    f"this monitor no longer owns checkpoint root {str(self.path.parent)!r}: {why}"
                )
            yield

    def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Check the lock every ``interval_s`` in a thread until it is released or lost.

        Between commits nothing else looks at the lock file: a deleted one is made
        anew within ``interval_s`` (so a monitor starting on the root is refused),
        or this holder is found fenced off and says so (status, metric) before its
        next commit.
        """
        if self._watcher is not None or self._fd is None:
            return

        def run() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.check()
                except RootLockLostError:
                    if self._lost is not None:
                        return  # for good (logged by check)

        self._watcher = threading.Thread(target=run, name="obsckpt-root-fence", daemon=True)
        self._watcher.start()

    def _verify(self) -> tuple[str | None, bool]:
        """(why the fence fails or None, whether that is for good)."""
        fd = self._fd
        if fd is None:
            return "it was released (the monitor was shut down)", True
        try:
            now = os.lstat(self.path)
        except FileNotFoundError:
            return self._retake()
        except OSError as exc:
            return f"its lock file {str(self.path)!r} cannot be checked ({exc})", False
        if _identity(now) != self._inode:
            return f"its lock file {str(self.path)!r} was replaced by another file", True
        try:
            data = os.pread(fd, _MAX_INFO_BYTES, 0)
        except OSError as exc:
            return f"its lock file {str(self.path)!r} cannot be read ({exc})", False
        epoch = _parse(data).get("epoch")
        if epoch != self.epoch:
            return (
                f"its lock file {str(self.path)!r} names epoch {epoch!r}, not this "
                f"monitor's {self.epoch!r} (another monitor wrote it)",
                True,
            )
        return None, False

    def _retake(self) -> tuple[str | None, bool]:
        """The lock file is gone: lock a new one at the path, unless another monitor has.

        Whoever creates and locks the new file first owns the root: a monitor that
        started meanwhile has made this one's check find its file (replaced, for
        good); one that starts later is refused by the new lock.
        """
        gone = f"its lock file {str(self.path)!r} was deleted"
        try:
            fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644
            )
        except FileExistsError:
            return f"{gone} and another monitor has created one since", True
        except OSError as exc:
            # The root itself may be gone for now (moved away); a later check tries again.
            return f"{gone} and cannot be created again ({exc.strerror or exc})", False
        try:
            if self._locked and not _try_lock(fd):
                os.close(fd)
                return f"{gone} and another monitor has locked a new one since", True
            os.pwrite(fd, json.dumps({**self._info, "epoch": self.epoch}).encode(), 0)
        except OSError as exc:  # _NoLocks too: the filesystem changed under the root
            os.close(fd)
            return f"{gone} and cannot be locked again ({exc.strerror or exc})", False
        old, self._fd = self._fd, fd
        self._inode = _identity(os.fstat(fd))
        if old is not None:
            os.close(old)
        self.recreated += 1
        logger.warning(
            "obsckpt: the monitor's lock file %s was deleted while it ran; it locked a new "
            "one and still owns the root (a monitor that had started on the root meanwhile "
            "would have fenced it off instead)",
            self.path,
        )
        return None, False

    def release(self) -> None:
        """Unlock and close; the file stays (removing it would race a new holder's open)."""
        self._stop.set()
        with self._guard:
            fd, self._fd = self._fd, None
            if self._lost is None:
                self._lost = "it was released (the monitor was shut down)"
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file drops its flock
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=5.0)  # a check hung on the filesystem is left behind


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _parse(data: bytes) -> dict[str, Any]:
    try:
        info = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


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
    return _parse(data)


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
    ``nolock``) a warning is logged and the returned lock is not held; its
    epoch still fences it off once a later monitor has started on the root.

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
        locked = True
    except _NoLocks as exc:
        logger.warning(
            "obsckpt: cannot lock %s (%s): this filesystem does not support flock, so a "
            "second job on this checkpoint root would not be refused. Give every job a "
            "default_local_dir of its own",
            path,
            exc.strerror or exc,
        )
        # Kept open all the same: the epoch still fences this monitor off once a later
        # one has started on the root and written its own.
        locked = False
    except BaseException:
        _close(held, fd)
        raise
    # Who holds it is for the error a second monitor gives; the epoch is the fence.
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "namespace": namespace,
        "since": time.time(),
    }
    epoch = uuid.uuid4().hex
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({**info, "epoch": epoch}).encode(), 0)
    except BaseException:
        _close(held, fd)
        raise
    if held != fd:
        os.close(fd)  # another open file than the locked one: its flock stays
    return RootLock(path, held, epoch=epoch, locked=locked, info=info)


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
