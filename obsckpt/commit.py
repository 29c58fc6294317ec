"""The on-disk contract: step directories, iteration files, manifests, durable writes.

Layout (compatible with verl and Trinity readers)::

    <root>/latest_checkpointed_iteration.txt   one integer, written atomically at commit
    <root>/latest_state_dict_iteration.txt     one integer, written atomically at commit
    <root>/global_step_<N>/...                  the step's files
    <root>/global_step_<N>/manifest.json        files, sizes and CRC32s, written at commit

Every write that a commit depends on goes through :func:`atomic_write`:
temp file, fsync, rename over the target, fsync of the directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import operator
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from obsckpt.errors import CheckpointDirError, IterationFileError

try:  # zlib-ng's CRC-32 (same polynomial and values as zlib's) is several times faster
    from zlib_ng.zlib_ng import crc32 as crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency, but stay usable without it
    from zlib import crc32 as crc32

ITERATION_FILES = {
    "checkpoint": "latest_checkpointed_iteration.txt",
    "state_dict": "latest_state_dict_iteration.txt",
}
KINDS = tuple(ITERATION_FILES)
MANIFEST_NAME = "manifest.json"
# The manifest format this obsckpt writes and reads. A later format may mean its
# entries differently, so a reader refuses it rather than guess.
MANIFEST_FORMAT = 1
# The step as writers format it: ASCII digits without a leading zero. Another spelling
# (global_step_007, other scripts' digits) would name a directory that step_dir() never
# builds, so readers would look for, and retention delete, the wrong one.
STEP_DIR_RE = re.compile(r"^global_step_(0|[1-9][0-9]*)$", re.ASCII)
# A temp file of a write not yet renamed into place: ``<name>.tmp`` or
# ``<name>.tmp.<pid>[.<hex>]`` (obsckpt's own). Not part of a step's files.
_TEMP_NAME_RE = re.compile(r"\.tmp(\.\d+(\.[0-9a-f]+)?)?$")
_SLOT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CRC_RE = re.compile(r"^[0-9a-fA-F]{8}$")
_CHUNK = 8 << 20
# Iteration files hold a step number; anything longer than this is not one.
_MAX_ITERATION_BYTES = 64
# Readers hold steps in an int64; a larger number in an iteration file is not a step.
MAX_STEP = 2**63 - 1


def is_temp_name(name: str) -> bool:
    """Whether the file ``name`` is a temp file of an unfinished write (see ``_TEMP_NAME_RE``).

    Only a suffix counts: ``chat_template.tmpl`` or ``data.tmp.json`` are files of the step.
    """
    return _TEMP_NAME_RE.search(name) is not None


def temp_name(path: str | os.PathLike) -> str:
    """The temp file to write ``path`` through: ``<path>.tmp.<pid>.<8 hex>``.

    Unique per write, so two writers of one path (two processes, or two saves
    in one process) never share it; :func:`is_temp_name` recognises it.
    """
    return f"{os.fspath(path)}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One file of a step, as a manifest records it."""

    path: str  # relative to the step directory
    size: int
    crc32: int

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "crc32": f"{self.crc32:08x}"}

    @classmethod
    def from_json(cls, obj: dict) -> FileRecord:
        """The record of a manifest entry; ValueError when it is not one obsckpt writes.

        The path must stay inside the step directory: a reader joins it to that
        directory, and an absolute path or a ``..`` would check, or load, a file
        elsewhere in the step's place.
        """
        if not isinstance(obj, dict):
            raise ValueError(f"{obj!r} is not an object with path, size and crc32")
        missing = [key for key in ("path", "size", "crc32") if key not in obj]
        if missing:
            raise ValueError(f"{obj!r} has no {' and no '.join(missing)}")
        path, size, crc = obj["path"], obj["size"], obj["crc32"]
        if not isinstance(path, str) or not path or "\0" in path:
            raise ValueError(f"path {path!r} is not a file name")
        if os.path.isabs(path) or ".." in Path(path).parts:
            raise ValueError(f"path {path!r} points outside the step directory")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{path!r} has size {size!r}, not a non-negative integer")
        if not isinstance(crc, str) or not _CRC_RE.match(crc):
            raise ValueError(f"{path!r} has crc32 {crc!r}, not 8 hexadecimal digits")
        return cls(path=path, size=size, crc32=int(crc, 16))


def kind_of(is_state_dict: bool) -> str:
    return "state_dict" if is_state_dict else "checkpoint"


def non_negative_int(value: object) -> int | None:
    """``value`` as an int if it is a non-negative integer (numpy's too), else None.

    bool is refused: ``True`` is not a rank, a step or a byte count.
    """
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if number >= 0 else None


def positive_seconds(value: object) -> bool:
    """Whether ``value`` is a positive number of seconds (an int or float, not a bool)."""
    # bool is an int subclass; NaN fails every comparison, so "> 0" refuses it.
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def scratch_dir(path: str | os.PathLike) -> str:
    """A new, empty directory beside ``path`` to build it in: ``<path>.tmp.<pid>.<8 hex>``.

    Named as a temp file of ``path``, so a commit's manifest and ``obsckpt
    verify`` leave it and everything in it out: a step committed while files
    are still being built in it (or after a crash left it) does not list them.
    """
    name = temp_name(path)
    os.mkdir(name)
    return name


def walk_files(top: str) -> Iterator[tuple[str, list[str]]]:
    """``(directory, file names)`` under ``top``, in sorted order, temp files left out.

    A directory named as a temp file (:func:`scratch_dir`) is left out whole.
    """
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if not is_temp_name(d))
        yield dirpath, [name for name in sorted(filenames) if not is_temp_name(name)]


def validate_step(step: object, what: str = "global_step") -> int:
    """Return ``step`` if it is a non-negative integer, else raise a ValueError naming it."""
    # bool is an int subclass; True is not a step.
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(
            f"{what} must be a non-negative integer, got {step!r} ({type(step).__name__}); "
            "pass the training step as an int"
        )
    if step < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {step}")
    if step > MAX_STEP:
        raise ValueError(f"{what} must be at most 2**63 - 1, got {step}")
    return step


def validate_slot(name: object) -> str:
    """Return ``name`` if it is safe as a file-name component, else raise a ValueError."""
    if not isinstance(name, str) or not _SLOT_RE.match(name) or name in (".", ".."):
        raise ValueError(
            f"slot name {name!r} is not safe in file and thread names; use 1-128 characters "
            "from letters, digits, '.', '_' and '-', starting with a letter or digit"
        )
    return name


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"global_step_{validate_step(step)}"


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


def step_of_dir_name(name: str) -> int | None:
    """The step a ``global_step_<N>`` directory name holds, None for any other name.

    Only the spelling :func:`step_dir` builds counts, and only a step a reader can
    hold (at most ``MAX_STEP``).
    """
    m = STEP_DIR_RE.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP else None


def raise_named(exc: OSError, path: str | os.PathLike) -> NoReturn:
    """Raise ``exc``, naming ``path`` when it names no file (an error on a file descriptor).

    ``os.write`` and ``os.fsync`` report only the cause ("No space left on
    device"); a commit's error must also say which file of which step it hit.
    """
    if exc.filename is not None:
        raise exc
    raise OSError(exc.errno, exc.strerror or str(exc), os.fspath(path)) from exc


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
        fsync_file(pending[0][0])
    except BaseException:
        _discard(pending)
        raise
    _publish(path.parent, pending)


def parse_iteration(text: str, path: str | os.PathLike) -> int:
    stripped = text.strip()
    if not stripped.isdigit() or not stripped.isascii():
        raise IterationFileError(
            f"{path} holds {text[:40]!r}, not a step number; it must hold one non-negative "
            "integer. Restore it from a backup or remove it to start from no committed step"
        )
    value = int(stripped)
    if value > MAX_STEP:
        raise IterationFileError(
            f"{path} names step {stripped[:40]}..., beyond 2**63 - 1: not a step number. "
            "Restore it from a backup or remove it to start from no committed step"
        )
    return value


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


def read_iteration(root: str | os.PathLike, kind: str) -> int | None:
    """The step an iteration file names, None when there is no file.

    Raises:
        IterationFileError: the file exists but does not hold a step number.
    """
    path = Path(root) / ITERATION_FILES[kind]
    try:
        with open(open_regular(path), "rb") as f:
            raw = f.read(_MAX_ITERATION_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise IterationFileError(
                f"{path} is a directory, not an iteration file; remove it (a file naming "
                "the committed step is written at the next commit)"
            ) from None
        raise IterationFileError(
            f"cannot read {path}: {exc.strerror or exc}; it must be a regular file holding "
            "one non-negative integer. Restore it from a backup or remove it to start from "
            "no committed step"
        ) from exc
    if len(raw) > _MAX_ITERATION_BYTES:
        raise IterationFileError(
            f"{path} is {os.path.getsize(path)} bytes long, not a step number; "
            "it must hold one non-negative integer"
        )
    return parse_iteration(raw.decode("utf-8", errors="replace"), path)


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


def _publish(root: Path, pending: list[tuple[Path, Path]]) -> None:
    try:
        for tmp, path in pending:
            os.replace(tmp, path)
    except BaseException:
        _discard(pending)
        raise
    if pending:
        fsync_dir(root)


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


_fsync_pool: ThreadPoolExecutor | None = None
_fsync_pool_lock = threading.Lock()


def fsync_many(targets: Sequence[tuple[str | os.PathLike[str], bool]]) -> None:
    """fsync files (False) and directories (True) concurrently.

    On a journaling filesystem concurrent fsyncs share one journal commit
    instead of waiting for one each, which is most of a commit's latency.
    """
    global _fsync_pool
    sync = [fsync_dir if is_dir else fsync_file for _, is_dir in targets]
    if len(targets) <= 1:
        for fn, (path, _) in zip(sync, targets, strict=True):
            fn(path)
        return
    with _fsync_pool_lock:
        if _fsync_pool is None:
            _fsync_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="obsckpt-fsync")
    try:
        futures = [
            _fsync_pool.submit(fn, path) for fn, (path, _) in zip(sync, targets, strict=True)
        ]
    except RuntimeError:
        # The interpreter is shutting down (pools take no new work): a save that is
        # still running then, past the exit wait, fsyncs its files one by one.
        for fn, (path, _) in zip(sync, targets, strict=True):
            fn(path)
        return
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


def finalize_step(
    sdir: str | os.PathLike,
    reported: dict[str, FileRecord] | None = None,
    *,
    iterations: dict[str, int] | None = None,
    timings: dict[str, float] | None = None,
) -> list[FileRecord]:
    """Make every file of a step durable, write its manifest, then move iteration files.

    Files that workers reported (fsynced, with size and CRC) are only checked
    for size; any other file under the step directory is checksummed and
    fsynced here. The durable writes run in three rounds, each a set of
    concurrent fsyncs:

    1. every unreported file, every directory of the step, the manifest's temp
       file and the iteration files' temp files (``iterations``: kind → step);
    2. the manifest is renamed into place; the step directory and the root
       (``sdir``'s parent, which holds the step directory) are fsynced;
    3. the iteration files are renamed into place and the root is fsynced.

    So an iteration file never names a step whose files, directories or
    manifest could be lost in a crash. Returns the manifest's records. If
    ``timings`` is given, the seconds of each phase are stored in it: ``scan``
    (listing and checking the files, the manifest and temp files written),
    ``round1``, ``round2`` and ``publish`` (the three rounds of fsyncs).
    """
    clock = time.perf_counter
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
            manifest.append(_write_temp(sdir / MANIFEST_NAME, _manifest_bytes(ordered)))
        pending = _stage_iterations(root, iterations or {})
        t1 = clock()
        fsync_many(targets + [(tmp, False) for tmp, _ in manifest + pending])
        t2 = clock()
        if exists:
            os.replace(*manifest[0])
            manifest = []
            fsync_many([(sdir, True), (root, True)])
        t3 = clock()
    except BaseException:
        _discard(manifest + pending)
        raise
    _publish(root, pending)
    if timings is not None:
        timings.update(scan=t1 - t0, round1=t2 - t1, round2=t3 - t2, publish=clock() - t3)
    return ordered


def _manifest_bytes(records: list[FileRecord]) -> bytes:
    """The manifest's JSON, one file per line.

    Built line by line: ``json.dumps(..., indent=...)`` runs the pure-Python
    encoder, which took longer than the rest of a 1,024-file commit.
    """
    head = json.dumps({"version": MANIFEST_FORMAT, "created": time.time()})[:-1]
    lines = ",\n  ".join(json.dumps(r.to_json()) for r in records)
    return f'{head}, "files": [\n  {lines}\n]}}\n'.encode()


def read_manifest(sdir: str | os.PathLike) -> list[FileRecord]:
    """The records of a step's manifest.

    Raises:
        FileNotFoundError: the step has no manifest.
        OSError: it cannot be read, or is not a regular file.
        ValueError: it is not a manifest obsckpt writes: not JSON, another shape, a
            format other than :data:`MANIFEST_FORMAT` (a newer obsckpt wrote it), an
            entry that is not a file inside the step (named by its index), a file
            listed twice.
    """
    with open(open_regular(Path(sdir) / MANIFEST_NAME), encoding="utf-8") as f:
        try:
            data = json.load(f)
        except RecursionError:  # nesting no manifest has, deeper than the parser goes
            raise ValueError("not a manifest: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object but {type(data).__name__}")
    files = data.get("files")
    if not isinstance(files, list):
        raise ValueError(f'no "files" list (it holds {files!r:.60})')
    fmt = data.get("version", MANIFEST_FORMAT)
    if fmt != MANIFEST_FORMAT or type(fmt) is not int:
        if type(fmt) is int and fmt > MANIFEST_FORMAT:
            raise ValueError(
                f"manifest format {fmt}, written by a newer obsckpt; this one reads format "
                f"{MANIFEST_FORMAT}. Upgrade obsckpt (pip install -U obsckpt) to read or "
                "verify this step"
            )
        raise ValueError(
            f'"version" is {fmt!r:.60}, not a manifest format (obsckpt writes {MANIFEST_FORMAT})'
        )
    records = []
    seen = set()
    for i, obj in enumerate(files):
        try:
            rec = FileRecord.from_json(obj)
        except ValueError as exc:
            raise ValueError(f"entry {i}: {exc}") from None
        if rec.path in seen:
            raise ValueError(f"entry {i}: lists {rec.path!r} twice")
        seen.add(rec.path)
        records.append(rec)
    return records


def verify_step(sdir: str | os.PathLike) -> list[str]:
    """Problems found checking a step against its manifest; empty when it is whole."""
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
    for rec in records:
        full = sdir / rec.path
        if not full.is_file():
            problems.append(f"{full}: missing")
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
    return problems
