"""The one read path for loading a checkpoint: verified against its commit, no code from disk.

Every loader in obsckpt (the FSDP and Megatron managers, the Synchronizer's
checkpoint sync, the demo's resume) reads through :class:`CommittedStep`:

1. the file must lie in a ``global_step_<N>`` directory whose step is
   committed: its ``manifest.json`` present, parseable and of a known format,
   and an iteration file naming that step or a later one;
2. the file must be listed in that manifest (a file added after the commit is
   refused by name), and its bytes must match the listed size and CRC32;
3. only then is it deserialised, with ``torch.load(weights_only=True)`` and the
   few globals of :data:`ALLOWED_GLOBALS`; a file naming any other global is
   refused with its path and the global.

A ``torch.save`` file is read once, into memory of the process's own, with
its CRC32 computed chunk by chunk right behind the reads (a second thread);
only when the whole file matches is it deserialised, from that memory and
without a second copy (:mod:`obsckpt.checked_read`). A file changed while it
was read (its size or times moved) fails the load. The tensors are ordinary
memory, not a mapping of the file: nothing written to the file later reaches
them. Other files (safetensors, JSON) are checked through the open descriptor
and then read from the page cache (:meth:`CommittedStep.open_verified`).

Code that calls ``torch.load`` itself (verl's checkpoint managers) is run
inside :func:`verified_torch_load`, which sends this thread's ``torch.load``
calls through the same path.
"""

from __future__ import annotations

import contextlib
import enum
import io
import mmap
import os
import pickle
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from obsckpt.errors import UnsafeCheckpointError, UnverifiedCheckpointError
from obsckpt.store import checked_read, layout, reader

# What torch.load(weights_only=True) says when it refuses a global: "Unsupported global:
# GLOBAL x.y" (torch <= 2.12) or "unsupported GLOBAL x.y" (later wordings).
_REFUSED_GLOBAL = re.compile(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)")


def _enum_member(cls: Any, name: str) -> Any:
    """``getattr`` as pickles of enum members use it, for the allowed enums only."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls in _ALLOWED_ENUMS):
        # Worded as torch words a refused global, so the error names it the same way.
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL builtins.getattr ({cls!r:.60})")
    if name not in cls.__members__:
        raise pickle.UnpicklingError(f"{cls.__name__} has no member {name!r}")
    return cls.__members__[name]


def _sharded_tensor_globals() -> list[tuple[Any, str]]:
    """FSDP1's ShardedTensor (verl's FSDP1 manager saves model and optimizer shards as them)."""
    try:
        from torch.distributed import remote_device
        from torch.distributed._shard import metadata as shard_metadata
        from torch.distributed._shard.sharded_tensor import api, shard
        from torch.distributed._shard.sharded_tensor import metadata as st_metadata
        from torch.distributed._shard.sharding_spec import chunk_sharding_spec
    except ImportError:  # pragma: no cover - a torch built without distributed
        return []
    _ALLOWED_ENUMS.add(st_metadata.MEM_FORMAT_ENCODING)
    why = "FSDP1's sharded state dicts (ShardedTensor), as verl's FSDP1 manager saves them"
    return [
        (api.ShardedTensor, why),
        (shard.Shard, why),
        (st_metadata.ShardedTensorMetadata, why),
        (st_metadata.TensorProperties, why),
        (st_metadata.MEM_FORMAT_ENCODING, why),
        (shard_metadata.ShardMetadata, why),
        (chunk_sharding_spec.ChunkShardingSpec, why),
        (remote_device._remote_device, why),
        # Pickles of enum members call getattr(EnumClass, "NAME"): only that is allowed.
        ((_enum_member, "builtins.getattr"), "enum members in ShardedTensor's metadata"),
    ]


def _numpy_globals() -> list[tuple[Any, str]]:
    """NumPy arrays: verl's extra_state holds ``np.random.get_state()`` (a uint32 array)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # NumPy 2
    except ImportError:  # pragma: no cover - NumPy 1
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    why = "NumPy's RNG state (np.random.get_state()) in verl's extra_state RNG record"
    allowed: list[tuple[Any, str]] = [(_reconstruct, why), (np.ndarray, why), (np.dtype, why)]
    dtypes = getattr(np, "dtypes", None)  # NumPy >= 1.25 pickles dtypes by their class
    if dtypes is not None:
        for name in ("UInt32DType", "Int64DType", "Float64DType", "UInt8DType"):
            if hasattr(dtypes, name):
                allowed.append((getattr(dtypes, name), why))
    return allowed


_ALLOWED_ENUMS: set[type] = set()
# Every global a checkpoint may name besides torch's own weights_only set (tensors,
# storages, dtypes, plain containers), each with why it is needed. Nothing here can run
# code of the file's choosing: classes rebuilt from plain fields, and one getattr that
# only looks up enum members.
ALLOWED_GLOBALS: list[tuple[Any, str]] = [*_numpy_globals(), *_sharded_tensor_globals()]


def _import_tensor_subclasses() -> None:
    # DTensor (FSDP2's shards) unpickles under weights_only once its module is imported.
    with contextlib.suppress(ImportError):
        import torch.distributed.tensor  # noqa: F401


class CommittedStep:
    """A committed step, opened to read its files: each checked against the manifest first.

    Use :meth:`of` to open the step holding a path.
    """

    def __init__(self, sdir: Path, records: dict[str, layout.FileRecord]) -> None:
        self.dir = sdir
        self.records = records

    @classmethod
    def of(cls, path: str | os.PathLike) -> CommittedStep:
        """The committed step ``path`` (the step directory or a path inside it) belongs to.

        Raises:
            UnverifiedCheckpointError: ``path`` is not inside a ``global_step_<N>``
                directory, or that step has no manifest, an unreadable one, or is
                not committed (no iteration file names it or a later step).
        """
        path = os.fspath(path)
        if "://" in path:
            raise UnverifiedCheckpointError(
                f"{path} is remote: obsckpt verifies a step on a local filesystem. Copy the "
                "whole global_step_<N> directory (with its manifest.json) to local disk first"
            )
        located = layout.step_of_path(path)
        if located is None:
            raise UnverifiedCheckpointError(
                f"{path} is not inside a {layout.STEP_DIR_PREFIX}<N> directory: obsckpt loads "
                "only files of a committed step, checked against its manifest"
            )
        root, step = located
        sdir = layout.step_dir(root, step)
        manifest = sdir / layout.MANIFEST_NAME
        try:
            records = {r.path: r for r in reader.read_manifest(sdir)}
        except FileNotFoundError:
            raise UnverifiedCheckpointError(
                f"{manifest} is missing: step {step} was never committed by obsckpt (its "
                "commit did not finish, or another tool wrote it), so nothing says its files "
                "are whole. Resume from a committed step (`obsckpt status "
                f"{root}` lists them)"
            ) from None
        except ValueError as exc:
            raise UnverifiedCheckpointError(f"{manifest} is unreadable: {exc}") from exc
        except OSError as exc:
            raise UnverifiedCheckpointError(
                f"{manifest} is unreadable: {reader.read_error_advice(exc, must=None)}"
            ) from exc
        latest = cls._latest(root)
        if latest is None or step > latest:
            raise UnverifiedCheckpointError(
                f"step {step} in {root} is not committed: its manifest was written but no "
                f"iteration file names it or a later step (latest committed: "
                f"{'none' if latest is None else latest}); its commit did not finish"
            )
        return cls(sdir, records)

    @staticmethod
    def _latest(root: str) -> int | None:
        steps = []
        for kind in layout.KINDS:
            try:
                named = reader.read_iteration(root, kind)
            except ValueError as exc:
                raise UnverifiedCheckpointError(str(exc)) from exc
            if named is not None:
                steps.append(named)
        return max(steps, default=None)

    def record(self, path: str | os.PathLike) -> layout.FileRecord:
        """The manifest's record of ``path``; refused by name when it lists none."""
        rel = os.path.relpath(os.path.abspath(path), self.dir)
        rec = self.records.get(rel)
        if rec is None:
            raise UnverifiedCheckpointError(
                f"{path} is not listed in {self.dir / layout.MANIFEST_NAME}, so it is not part "
                "of the committed step (a commit lists every file of its step): it was added "
                "afterwards and is not loaded. Remove it, or resume from another step"
            )
        return rec

    @contextlib.contextmanager
    def open_verified(self, path: str | os.PathLike) -> Iterator[str]:
        """``path`` checked against the manifest, as a path to load from inside the ``with``.

        The file is opened once; its size and CRC32 are checked through that
        descriptor (which brings it into the page cache: the load that follows
        reads it from there, not from disk again), and the path yielded names
        the same open file (``/proc/self/fd/<n>``), so a file renamed into its
        place meanwhile is not what is loaded. When the ``with`` ends, the file
        must not have changed (size, modification and change times): a write
        into it during the load fails the load.

        Raises:
            UnverifiedCheckpointError: not listed, unreadable, its size or CRC32
                differs from the manifest's, or it changed while it was loaded.
        """
        with self._opened(path) as (fd, before, rec):
            try:
                crc = _crc_of(fd, before.st_size)
            except OSError as exc:
                raise UnverifiedCheckpointError(
                    f"cannot read {path}: {reader.read_error_advice(exc, must=None)}"
                ) from exc
            self._check_crc(path, crc, rec)
            yield f"/proc/self/fd/{fd}" if _PROC_FD else os.fspath(path)
            self._check_unchanged(path, fd, before)

    @contextlib.contextmanager
    def _opened(self, path: Any) -> Iterator[tuple[int, os.stat_result, layout.FileRecord]]:
        """``path`` listed, opened and of the listed size: (descriptor, its stat, the record)."""
        rec = self.record(path)
        fd = self._open(path)
        try:
            before = os.fstat(fd)
            self._check_size(path, before.st_size, rec)
            yield fd, before, rec
        finally:
            os.close(fd)

    def _open(self, path: Any) -> int:
        try:
            return reader.open_regular(path)
        except FileNotFoundError:
            raise UnverifiedCheckpointError(
                f"{path} is missing, but {self.dir / layout.MANIFEST_NAME} lists it: the "
                "step is damaged; resume from another step"
            ) from None
        except OSError as exc:
            raise UnverifiedCheckpointError(
                f"cannot read {path}: {reader.read_error_advice(exc, must=None)}"
            ) from exc

    @staticmethod
    def _check_unchanged(path: Any, fd: int, before: os.stat_result) -> None:
        after = os.fstat(fd)
        if _stamp(after) != _stamp(before):
            raise UnverifiedCheckpointError(
                f"{path} changed while it was loaded (size {before.st_size} -> "
                f"{after.st_size}): something is writing into a committed step; what was "
                "read is dropped"
            )

    def _check_size(self, path: Any, size: int, rec: layout.FileRecord) -> None:
        if size != rec.size:
            what = "truncated" if size < rec.size else "grown"
            raise UnverifiedCheckpointError(
                f"{path} is {what}: {size} bytes, the step's manifest says {rec.size}; the "
                "step is damaged (see `obsckpt verify`), resume from another step"
            )

    def _check_crc(self, path: Any, crc: int, rec: layout.FileRecord) -> None:
        if crc != rec.crc32:
            raise UnverifiedCheckpointError(
                f"{path} is corrupted: crc32 {crc:08x}, the step's manifest says "
                f"{rec.crc32:08x}. The step is damaged (see `obsckpt verify`); resume from "
                "another step"
            )

    def read_bytes(self, path: str | os.PathLike) -> bytes:
        """``path``'s bytes, checked against the manifest (for safetensors and JSON)."""
        with self.open_verified(path) as source, open(source, "rb") as f:
            return f.read()

    def torch_load(self, path: str | os.PathLike, map_location: Any = None) -> Any:
        """``torch.load`` of ``path`` after its check, with ``weights_only=True`` always.

        The file is read once, into memory of its own, with its CRC32 computed
        on the way (:func:`obsckpt.store.checked_read.read_checked`); only once the
        whole file matches the manifest is it deserialised, from that memory
        and without a second copy. The tensors of one file share that memory.

        Raises:
            UnverifiedCheckpointError: see :meth:`open_verified`.
            UnsafeCheckpointError: the file names a global outside :data:`ALLOWED_GLOBALS`.
        """
        with self._opened(path) as (fd, before, rec):
            try:
                buffer, crc = checked_read.read_checked(fd, before.st_size)
            except EOFError as exc:
                self._check_unchanged(path, fd, before)
                raise UnverifiedCheckpointError(f"{path} shrank while it was read: {exc}") from exc
            except OSError as exc:
                raise UnverifiedCheckpointError(
                    f"cannot read {path}: {reader.read_error_advice(exc, must=None)}"
                ) from exc
            self._check_unchanged(path, fd, before)
            self._check_crc(path, crc, rec)
        if not checked_read.is_torch_zip(buffer):  # torch's legacy format: load from a copy
            legacy = io.BytesIO(bytes(checked_read.memory_of(buffer)))
            return safe_torch_load(legacy, path, map_location=map_location)
        return _safely(path, lambda: checked_read.torch_load_buffer(buffer, map_location))

    def verify_all(self, under: str | os.PathLike | None = None) -> int:
        """Check every file under ``under`` (default: the whole step); the number checked.

        For loaders that read files themselves (Megatron's distributed checkpoint):
        every file must be listed and match, and every listed file must be there.
        """
        top = Path(under) if under is not None else self.dir
        checked = 0
        for dirpath, names in reader.walk_files(os.fspath(top)):
            for name in names:
                full = Path(dirpath) / name
                if full == self.dir / layout.MANIFEST_NAME:
                    continue
                with self.open_verified(full):
                    checked += 1
        prefix = os.path.relpath(top, self.dir)
        for rel in self.records:
            inside = prefix == "." or rel.startswith(prefix + os.sep)
            if inside and not (self.dir / rel).is_file():
                raise UnverifiedCheckpointError(
                    f"{self.dir / rel} is missing, but {self.dir / layout.MANIFEST_NAME} lists "
                    "it: the step is damaged; resume from another step"
                )
        return checked


_PROC_FD = os.path.isdir("/proc/self/fd")


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _crc_of(fd: int, size: int) -> int:
    """CRC32 of the open file ``fd`` (``size`` bytes), through a read-only mapping."""
    if size == 0:
        return 0
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
        return reader.crc32(mm)


def safe_torch_load(source: Any, shown: Any, *, map_location: Any = None) -> Any:
    """``torch.load(source, weights_only=True)`` with :data:`ALLOWED_GLOBALS`, errors named.

    ``shown`` is the path errors name (``source`` may be a buffer or a memory file).

    Raises:
        UnsafeCheckpointError: the file names a global outside the allowlist.
        UnverifiedCheckpointError: it is not a file ``torch.save`` wrote.
    """
    return _safely(
        shown, lambda: _ORIGINAL_LOAD(source, map_location=map_location, weights_only=True)
    )


def _safely(shown: Any, load_weights_only: Callable[[], Any]) -> Any:
    """Run a weights-only load with :data:`ALLOWED_GLOBALS` allowed; its errors named."""
    _import_tensor_subclasses()
    allowed = [entry for entry, _why in ALLOWED_GLOBALS]
    try:
        with torch.serialization.safe_globals(allowed):
            return load_weights_only()
    except pickle.UnpicklingError as exc:
        refused = _REFUSED_GLOBAL.search(str(exc))
        if refused is None:
            raise UnverifiedCheckpointError(
                f"{shown} cannot be loaded: it is not a file torch.save wrote ({_first_line(exc)})"
            ) from exc
        raise UnsafeCheckpointError(
            f"{shown} refers to the global {refused.group(1)}, which obsckpt does not load: "
            "unpickling it could run code from the file. obsckpt loads tensors, plain "
            "containers and the globals in obsckpt.store.loading.ALLOWED_GLOBALS only; save "
            "such state as tensors and plain values"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - torch's readers fail in many ways
        raise UnverifiedCheckpointError(
            f"{shown} cannot be loaded: it is not a file torch.save wrote ({_first_line(exc)})"
        ) from exc


def _first_line(exc: BaseException) -> str:
    """``Type: the line that says what failed``: torch's errors run to several lines."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    for line in lines:
        if "GLOBAL" in line or "error" in line.lower():
            return f"{type(exc).__name__}: {line[:300]}"
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def load(path: str | os.PathLike, map_location: Any = None) -> Any:
    """Load one file of a committed step: checked against its manifest, weights only.

    ``path`` may be an object of an ``s3://`` root (see :func:`load_object`).
    """
    if isinstance(path, str) and path.startswith("s3://"):
        return load_object(path, map_location)
    return CommittedStep.of(path).torch_load(path, map_location=map_location)


def load_object(url: str, map_location: Any = None) -> Any:
    """Load one file of a committed step of an ``s3://`` root, weights only.

    Its bytes are read with ranged, parallel GETs straight into one buffer and
    checked against the step's manifest (size, the object's ETag, CRC32) before
    anything is deserialised; tensors on the CPU are views into that buffer.

    Raises:
        UnverifiedCheckpointError: the step is not committed (no manifest, or its
            commit never moved the root's pointer), the manifest does not list the
            file, or its bytes differ from what it records.
        StoreError: the object could not be read.
    """
    return CommittedObjects.of(url).torch_load(url, map_location)


class CommittedObjects:
    """A committed step of an ``s3://`` root, opened to read its objects: its manifest
    and the root's pointer are read once, then each object is checked against the
    manifest before it is deserialised. Use :meth:`of` to open the step holding a URL."""

    def __init__(self, store: Any, step: int, records: list[layout.FileRecord]) -> None:
        self.store = store
        self.step = step
        self.records = records
        self.url = store.url_of(store.step_key(step))

    @classmethod
    def of(cls, url: str) -> CommittedObjects:
        """The committed step that ``url`` (the step's prefix or an object in it) belongs to.

        Raises:
            UnverifiedCheckpointError: ``url`` is in no ``global_step_<N>`` prefix, or that
                step is not committed.
        """
        from obsckpt.store.s3root import shared_s3_root, split_step_url

        try:
            root, step, _ = split_step_url(url.rstrip("/") + "/-")
            store = shared_s3_root(root)
            return cls(store, step, store.committed_records(step))
        except ValueError as exc:
            raise UnverifiedCheckpointError(f"{url} cannot be loaded: {exc}") from None

    def path_of(self, url: str) -> str:
        """``url``'s path in the step; refused when it lies outside the step."""
        if not url.startswith(self.url + "/"):
            raise UnverifiedCheckpointError(
                f"a checkpoint loader read {url}, outside the step {self.url} being loaded: "
                "obsckpt verifies files of a committed step only"
            )
        return url[len(self.url) + 1 :]

    def paths(self) -> set[str]:
        """The paths, in the step, that its manifest lists."""
        return {r.path for r in self.records}

    def read_bytes(self, url: str) -> bytearray:
        """The object's bytes, checked against the manifest (size, ETag, CRC32)."""
        try:
            return self.store.read_verified(self.step, self.path_of(url), records=self.records)
        except ValueError as exc:
            raise UnverifiedCheckpointError(f"{url} cannot be loaded: {exc}") from None

    def torch_load(self, url: str, map_location: Any = None) -> Any:
        """``torch.load`` of the object after its check, with ``weights_only=True`` always."""
        data = self.read_bytes(url)
        if not data:
            raise UnverifiedCheckpointError(f"{url} cannot be loaded: it is empty")
        storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
        return _safely(url, lambda: checked_read.torch_load_buffer(storage, map_location))


_ORIGINAL_LOAD = torch.load
_scope = threading.local()


# The scope of a verified_torch_load that checks each file against its own step.
_ANY_STEP = object()


def _verified_load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    step: CommittedStep | CommittedObjects | object | None = getattr(_scope, "step", None)
    if step is None:  # another thread's call, outside any verified_torch_load
        return _ORIGINAL_LOAD(f, map_location, *args, **kwargs)
    if not isinstance(f, (str, os.PathLike)):
        raise UnverifiedCheckpointError(
            f"a checkpoint loader read {type(f).__name__} {f!r:.80}, not a file of a "
            "committed step: obsckpt verifies files of a committed step only"
        )
    if step is _ANY_STEP:
        return load(f, map_location=map_location)
    if not isinstance(step, CommittedStep):  # CommittedObjects, or a verified local copy
        return step.torch_load(os.fspath(f), map_location)  # type: ignore[attr-defined]
    inside = os.path.abspath(f).startswith(os.fspath(step.dir) + os.sep)
    if not inside:
        raise UnverifiedCheckpointError(
            f"a checkpoint loader read {f}, outside the step {step.dir} being loaded: "
            "obsckpt verifies files of a committed step only"
        )
    return step.torch_load(f, map_location=map_location)


@contextlib.contextmanager
def verified_torch_load(
    path: str | os.PathLike | None = None,
    *,
    step: Any = None,
) -> Iterator[Any]:
    """Send this thread's ``torch.load`` calls through :meth:`CommittedStep.torch_load`.

    For code that calls ``torch.load`` itself (verl's managers and trainer, with
    ``weights_only=False``): inside the ``with``, each of this thread's loads must
    name a file of the committed step holding ``path`` (with ``path`` None: of
    whichever committed step holds the file, for a loader that picks its step
    itself), is checked against the manifest and is loaded with
    ``weights_only=True``. ``path`` may be in a step of an ``s3://`` root: the
    loads then name its objects' URLs. ``step`` instead of ``path``: an object
    with a ``torch_load(path, map_location)`` that checks and loads (a verified
    local copy of a step, see :mod:`obsckpt.integrations.object_steps`). Other
    threads' loads are untouched.
    """
    global _patch_users
    if step is None and path is not None:
        if isinstance(path, str) and path.startswith("s3://"):
            step = CommittedObjects.of(path)
        else:
            step = CommittedStep.of(path)
    previous = getattr(_scope, "step", None)
    _scope.step = step if step is not None else _ANY_STEP
    with _patch_lock:  # torch.load is replaced while any thread is inside
        _patch_users += 1
        torch.load = _verified_load  # type: ignore[assignment]
    try:
        yield step
    finally:
        _scope.step = previous
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                torch.load = _ORIGINAL_LOAD


_patch_lock = threading.Lock()
_patch_users = 0
