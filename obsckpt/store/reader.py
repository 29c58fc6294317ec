"""Reading what a root holds: iteration files, manifests, checksums, verification.

Every read opens a regular file only (:func:`open_regular`): a FIFO or a device
left in a file's place on a shared filesystem must not block a reader.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from obsckpt.errors import IterationContentError, IterationFileError
from obsckpt.store.layout import (
    ITERATION_FILES,
    MANIFEST_NAME,
    MAX_ITERATION_BYTES,
    SHARD_RE,
    FileRecord,
    is_temp_name,
    parse_iteration,
    parse_manifest,
    repair_advice,
    shard_name,
    step_of_dir_name,
)

try:  # zlib-ng's CRC-32 (same polynomial and values as zlib's) is several times faster
    from zlib_ng.zlib_ng import crc32 as crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency, but stay usable without it
    from zlib import crc32 as crc32

_CHUNK = 8 << 20


def open_regular(path: str | os.PathLike) -> int:
    """A descriptor open for reading on ``path``, which must be a regular file.

    Opened without blocking and checked before any read: a FIFO left in a
    file's place (by another tool on a shared filesystem) would otherwise block
    its reader, a monitor's commit or a CLI command, forever.

    Raises:
        OSError: ``path`` cannot be opened, or is not a regular file (naming what it is).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise OSError(
                errno.EINVAL, f"not a regular file (a {_file_type(mode)})", os.fspath(path)
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


# Errors of the moment, not of the file: the same read can succeed later, so the
# advice is to fix the cause, never to remove or replace the file.
_TRANSIENT = (
    "EMFILE ENFILE EIO EAGAIN EINTR ENOMEM ETIMEDOUT ESTALE EBUSY ENOLCK ECONNRESET "
    "ECONNREFUSED EHOSTUNREACH ENETDOWN ENETUNREACH EREMOTEIO ENOBUFS"
)
TRANSIENT_ERRNOS = frozenset(getattr(errno, n) for n in _TRANSIENT.split() if hasattr(errno, n))
_CHECKS = {
    errno.EMFILE: "this process has too many open files: raise its limit (ulimit -n)",
    errno.ENFILE: "the system has too many open files: raise fs.file-max or close some",
    errno.ENOMEM: "the host is out of memory",
    errno.EACCES: "give this process read permission on it",
    errno.EPERM: "give this process read permission on it",
}


def read_error_advice(
    exc: OSError, must: str | None = "a regular file holding one non-negative integer"
) -> str:
    """What a failed read of a root's file means and what to do, by its errno.

    A transient error (too many open files, an I/O error, a stale NFS handle) says
    it is transient and what to check; only an error that cannot pass by itself
    gets advice about the file: what it ``must`` be, where given.
    """
    code = exc.errno
    name = errno.errorcode.get(code, str(code)) if code is not None else "no errno"
    what = f"{exc.strerror or exc} ({name})"
    check = _CHECKS.get(code)
    if code in TRANSIENT_ERRNOS:
        hint = check or "check the filesystem (dmesg, the mount's health) and retry"
        return f"{what}; a transient error, not a bad file: {hint}. Leave the file as it is"
    if check:
        return f"{what}; {check}"
    return f"{what}; it must be {must}" if must else what


def read_iteration(root: str | os.PathLike, kind: str) -> int | None:
    """The step an iteration file names, None when there is no file.

    Raises:
        IterationFileError: the file exists but does not hold a step number.
    """
    path = Path(root) / ITERATION_FILES[kind]
    try:
        with open(open_regular(path), "rb") as f:
            raw = f.read(MAX_ITERATION_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise IterationFileError(
                f"{path} is a directory, not an iteration file; remove it (a file naming "
                "the committed step is written at the next commit)"
            ) from None
        raise IterationFileError(f"cannot read {path}: {read_error_advice(exc)}") from exc
    if len(raw) > MAX_ITERATION_BYTES:
        raise IterationContentError(
            f"{path} is {os.path.getsize(path)} bytes long, not a step number; "
            f"it must hold one non-negative integer. {repair_advice(path)}"
        )
    return parse_iteration(raw.decode("utf-8", errors="replace"), path)


def iteration_mtime(root: str | os.PathLike, kind: str) -> float | None:
    """When ``kind``'s iteration file was last written (None: no such file)."""
    try:
        return os.stat(Path(root) / ITERATION_FILES[kind]).st_mtime
    except OSError:
        return None


def step_files(sdir: str | os.PathLike) -> list[tuple[str, int, float]]:
    """``(path in the step, size, mtime)`` of every file under ``sdir``, temp files
    included (:func:`walk_files` leaves them out)."""
    files = []
    for dirpath, _dirs, names in os.walk(sdir):
        for name in names:
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            files.append((os.path.relpath(full, sdir), st.st_size, st.st_mtime))
    return files


def walk_files(top: str) -> Iterator[tuple[str, list[str]]]:
    """``(directory, file names)`` under ``top``, in sorted order, temp files left out.

    A directory named as a temp file (:func:`scratch_dir`) is left out whole.
    """
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if not is_temp_name(d))
        yield dirpath, [name for name in sorted(filenames) if not is_temp_name(name)]


def names_in(directory: str | os.PathLike) -> list[str]:
    """The names of the entries of ``directory`` (a step's model directory, say).

    Raises:
        FileNotFoundError, NotADirectoryError, OSError: as listing it does.
    """
    return os.listdir(directory)


def exists(path: str | os.PathLike) -> bool:
    """Whether anything is at ``path``."""
    return os.path.exists(path)


def steps_on_disk(root: str | os.PathLike) -> list[int]:
    """Step numbers of the ``global_step_<N>`` directories under ``root``, ascending."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for entry in entries:
        step = step_of_dir_name(entry)
        if step is not None and os.path.isdir(os.path.join(root, entry)):
            steps.append(step)
    return sorted(steps)


def file_crc32(path: str | os.PathLike) -> tuple[int, int]:
    """(size, crc32) of a file, read in chunks."""
    crc = 0
    size = 0
    with open(open_regular(path), "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def record_file(path: str | os.PathLike, base: str | os.PathLike) -> FileRecord:
    size, crc = file_crc32(path)
    return FileRecord(path=os.path.relpath(path, base), size=size, crc32=crc)


def read_manifest(sdir: str | os.PathLike) -> list[FileRecord]:
    """The records of a step's manifest.

    Raises:
        FileNotFoundError: the step has no manifest.
        OSError: it cannot be read, or is not a regular file.
        ValueError: it is not JSON, or not a manifest obsckpt writes (see
            :func:`obsckpt.store.layout.parse_manifest`).
    """
    with open(open_regular(Path(sdir) / MANIFEST_NAME), encoding="utf-8") as f:
        try:
            data = json.load(f)
        except RecursionError:  # nesting no manifest has, deeper than the parser goes
            raise ValueError("not a manifest: JSON nested too deeply") from None
    return parse_manifest(data)


def verify_step(sdir: str | os.PathLike, *, unlisted_files: bool = True) -> list[str]:
    """Problems found checking a step against its manifest; empty when it is whole.

    With ``unlisted_files=False`` a file the manifest does not list is not a
    problem (it does not make the committed files less whole).
    """
    sdir = Path(sdir)
    try:
        records = read_manifest(sdir)
    except FileNotFoundError:
        return [f"{sdir / MANIFEST_NAME}: missing manifest"]
    except ValueError as exc:
        return [f"{sdir / MANIFEST_NAME}: unreadable manifest ({exc})"]
    except OSError as exc:  # a directory in its place, a read error
        return [f"{sdir / MANIFEST_NAME}: unreadable manifest ({exc.strerror or exc})"]
    problems = []
    missing = 0
    for rec in records:
        full = sdir / rec.path
        if not full.is_file():
            problems.append(f"{full}: missing")
            missing += 1
            continue
        try:
            size, crc = file_crc32(full)
        except OSError as exc:  # a read error is what a check is for: name it, go on
            problems.append(f"{full}: unreadable ({exc.strerror or exc})")
            continue
        if size != rec.size:
            what = "truncated" if size < rec.size else "grown"
            problems.append(f"{full}: {what} ({size} bytes, manifest says {rec.size})")
        elif crc != rec.crc32:
            problems.append(f"{full}: corrupted (crc32 {crc:08x}, manifest says {rec.crc32:08x})")
    if records and missing == len(records):
        problems.insert(
            0,
            f"{sdir}: all {missing} file(s) the manifest lists are gone (obsckpt's retention "
            "removes a step's whole directory; these were removed by something else)",
        )
    if unlisted_files:
        problems.extend(
            f"{sdir / rel}: not listed in the manifest" for rel in unlisted(sdir, records)
        )
    return problems


def unlisted(sdir: str | os.PathLike, records: list[FileRecord]) -> list[str]:
    """Files under the step directory ``sdir`` its manifest does not list (relative paths).

    A commit lists every file of the step, so one not listed was added after it;
    loaders refuse such a file. obsckpt's own temp files and scratch directories
    (of a write cut short) are not counted.
    """
    listed = {rec.path for rec in records} | {MANIFEST_NAME}
    top = os.fspath(sdir)
    extra = []
    for dirpath, names in walk_files(top):
        prefix = "" if dirpath == top else os.path.relpath(dirpath, top) + os.sep
        extra.extend(prefix + name for name in names if prefix + name not in listed)
    return extra


def missing_shards(sdir: str | os.PathLike) -> list[str]:
    """The rank shards a step directory lacks (relative paths), by the world size its
    shards name: ``model_world_size_2_rank_0.pt`` alone lacks ``..._rank_1.pt``.

    What tells a step written without a manifest (verl's own checkpointing) is not
    whole; a step with a manifest is checked against it instead.
    """
    top = os.fspath(sdir)
    missing = []
    for dirpath, names in walk_files(top):
        ranks: dict[tuple[str, int], set[int]] = {}
        for name in names:
            m = SHARD_RE.match(name)
            if m is not None:
                ranks.setdefault((m.group(1), int(m.group(2))), set()).add(int(m.group(3)))
        prefix = "" if dirpath == top else os.path.relpath(dirpath, top) + os.sep
        for (kind, world), seen in sorted(ranks.items()):
            missing += [prefix + shard_name(kind, world, r) for r in range(world) if r not in seen]
    return missing
