"""A checkpoint root's committed steps, the same small interface on a POSIX directory
and on an ``s3://`` prefix.

:class:`StepStore` is what code that reads, checks or prunes committed steps
needs of a root, whichever the backend: which steps are committed, which steps
hold anything, a step's manifest, a verified read of one of its files, a check
of the whole step, the removal of whole steps (manifest first), and what a tool
that owns a root (the demo) needs besides: the names under it, a small file of
its own, and clearing what names committed steps. Writing and
committing stay with each backend's own writer (``commit.finalize_step`` for a
directory, :class:`~obsckpt.monitor.s3_commit.S3StepWriter` for a bucket).

- :class:`PosixRoot`: a directory every node shares (iteration files, step
  directories; reads checked with :mod:`obsckpt.reader`).
- :class:`~obsckpt.store.s3root.S3Root`: an ``s3://`` prefix (the pointer object,
  step prefixes; ranged reads checked against the manifest).

:func:`open_step_store` gives the one a root names.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Protocol, runtime_checkable

from obsckpt.store import commit, layout, reader
from obsckpt.store.layout import FileRecord
from obsckpt.store.rootlock import LOCK_NAME
from obsckpt.store.uri import is_remote


@runtime_checkable
class StepStore(Protocol):
    """A root's committed steps (see the module's docstring)."""

    @property
    def url(self) -> str:
        """The root as users write it: an absolute directory or ``s3://bucket/prefix``."""
        ...

    def committed_steps(self, kinds: tuple[str, ...] = layout.KINDS) -> dict[str, int | None]:
        """The committed step of each kind (None: none yet)."""
        ...

    def steps(self) -> list[int]:
        """The steps holding anything under the root, committed or not, in order."""
        ...

    def manifest(self, step: int) -> list[FileRecord] | None:
        """Step ``step``'s manifest records; None when it has none. ValueError: unreadable."""
        ...

    def committed_records(self, step: int) -> list[FileRecord]:
        """A committed step's manifest records; ValueError when it is not committed."""
        ...

    def read_verified(self, step: int, path: str) -> bytes | bytearray:
        """File ``path`` of committed step ``step``, checked against the manifest."""
        ...

    def verify_step(self, step: int, *, deep: bool = True) -> list[str]:
        """What is wrong with committed step ``step`` (empty: whole)."""
        ...

    def remove_steps(self, steps: list[int]) -> list[str]:
        """Remove whole steps, the manifest first; what was removed."""
        ...

    def names(self) -> list[str]:
        """The names directly under the root (a step's, a file's), obsckpt's lock aside."""
        ...

    def put_small(self, name: str, data: bytes) -> None:
        """Write a small file at the root, durably and whole (a reader sees the old
        content or the new)."""
        ...

    def clear_commit_state(self) -> None:
        """Remove what names committed steps (iteration files, an S3 root's pointer), so
        that no step is taken as committed; the steps themselves stay."""
        ...


class PosixRoot:
    """A checkpoint root in a directory (:class:`StepStore`)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))

    @property
    def url(self) -> str:
        return str(self.root)

    def committed_steps(self, kinds: tuple[str, ...] = layout.KINDS) -> dict[str, int | None]:
        """The iteration files' steps (ValueError: one cannot be read)."""
        return {kind: reader.read_iteration(self.root, kind) for kind in kinds}

    def steps(self) -> list[int]:
        return reader.steps_on_disk(self.root)

    def manifest(self, step: int) -> list[FileRecord] | None:
        try:
            return reader.read_manifest(layout.step_dir(self.root, step))
        except FileNotFoundError:
            return None

    def committed_records(self, step: int) -> list[FileRecord]:
        records = self.manifest(step)
        where = layout.step_dir(self.root, step)
        if records is None:
            raise ValueError(f"{where}: step {step} has no manifest; not committed")
        newest = max((s for s in self.committed_steps().values() if s is not None), default=None)
        if newest is None or step > newest:
            raise ValueError(
                f"{where}: step {step} has a manifest but no iteration file names it or a "
                "later step; its commit did not finish, so it is not committed"
            )
        return records

    def read_verified(self, step: int, path: str) -> bytes:
        from obsckpt.store.loading import CommittedStep

        self.committed_records(step)
        return CommittedStep.of(layout.step_dir(self.root, step) / path).read_bytes(
            layout.step_dir(self.root, step) / path
        )

    def verify_step(self, step: int, *, deep: bool = True) -> list[str]:
        try:
            self.committed_records(step)
        except ValueError as err:
            return [str(err)]
        sdir = layout.step_dir(self.root, step)
        if deep:
            return reader.verify_step(sdir)
        problems = []
        for rec in reader.read_manifest(sdir):
            try:
                size = (sdir / rec.path).stat().st_size
            except OSError as err:
                problems.append(f"{sdir / rec.path}: {err.strerror or err}")
                continue
            if size != rec.size:
                problems.append(f"{sdir / rec.path}: {size} bytes, the manifest says {rec.size}")
        return problems

    def remove_steps(self, steps: list[int]) -> list[str]:
        removed = []
        for step in steps:
            sdir = layout.step_dir(self.root, step)
            manifest = sdir / layout.MANIFEST_NAME
            if manifest.exists():
                manifest.unlink()
                removed.append(str(manifest))
            if sdir.is_dir():
                shutil.rmtree(sdir, ignore_errors=True)
                removed.append(str(sdir))
        return removed

    def names(self) -> list[str]:
        return sorted(e for e in os.listdir(self.root) if e != LOCK_NAME)

    def put_small(self, name: str, data: bytes) -> None:
        commit.atomic_write(self.root / name, data)

    def clear_commit_state(self) -> None:
        # Made durable before a step goes: a crash partway never leaves an iteration
        # file naming a step directory that is already gone.
        for name in layout.ITERATION_FILES.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / name)
        commit.fsync_dir(self.root)


def open_step_store(root: str | os.PathLike) -> StepStore:
    """The :class:`StepStore` of ``root``: :class:`PosixRoot` for a directory, the shared
    :class:`~obsckpt.store.s3root.S3Root` for an ``s3://`` URL."""
    if is_remote(root):
        from obsckpt.store.s3root import shared_s3_root

        return shared_s3_root(os.fspath(root))
    return PosixRoot(root)
