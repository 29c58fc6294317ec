"""The CPU fallback's shared-memory files: made and locked by the sender, orphans removed.

On the CPU the ipc sync's buckets are files in shared memory (``/dev/shm``)
that both processes map. Each is named ``obsckpt-ipc-<pid>-<uuid hex>`` and
share-locked by the sender that made it for as long as it holds it, so the
files of a sender that is gone (a killed trainer) can be told apart and
removed by the next sender that allocates.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
import uuid

logger = logging.getLogger(__name__)

PREFIX = "obsckpt-ipc-"
# Owner read/write only, whatever the umask (a umask can only take bits away).
MODE = 0o600
_NAME = re.compile(r"^obsckpt-ipc-(\d+)-[0-9a-f]{32}$")


def default_dir() -> str:
    """``/dev/shm`` where there is one, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def create(shm_dir: str, size: int) -> tuple[str, int]:
    """A new file of ``size`` bytes in ``shm_dir``: its path, and a descriptor holding its lock.

    The file is made with mode 0600: other users of the host cannot read the weights.

    The pages are reserved now: a sparse file on a full tmpfs (Docker's 64 MiB
    ``/dev/shm``) would kill the process with SIGBUS at the first write.

    Raises:
        OSError: the file could not be made or reserved (it is removed then;
            ``ENOSPC`` or ``EFBIG`` when there is no room).
    """
    path = os.path.join(shm_dir, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    # The model's weights: readable by this user only (the receiver is the same job's).
    # /dev/shm is shared by every user of the host, and a umask of 022 would leave a
    # file made 0o666 readable by all of them.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return path, fd


def remove(paths: list[str], fds: list[int]) -> None:
    """Delete files made by :func:`create` and close (unlock) their descriptors."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    for fd in fds:
        os.close(fd)


def remove_orphaned_shm(shm_dir: str) -> list[str]:
    """Remove the shared-memory files of senders whose process is gone (a killed trainer).

    A file is removed only when no process of its PID runs on this host and
    no process holds its lock (a live sender keeps one on each of its files,
    which also covers a sender in another PID namespace sharing the directory).
    Returns the paths removed.
    """
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _NAME.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone already, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue  # locked: its sender is alive
        finally:
            os.close(fd)
    if removed:
        logger.info(
            "obsckpt: removed %d shared-memory files of ipc senders that are gone: %s",
            len(removed),
            removed,
        )
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True
