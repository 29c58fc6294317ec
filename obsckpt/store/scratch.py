"""Files a save function writes, for a step of an ``s3://`` root.

Some saves are functions that write files themselves: ``save_pretrained`` of an
HF model, a Megatron distributed checkpoint, verl's ``data.pt``. An object store
takes objects, so for a save of an ``s3://`` root each URL named in ``paths=``
stands for a local scratch path (:func:`scratch_path`): the function writes
there, then every file under it is uploaded to the URL (its path below the
scratch path becoming its key below the URL), checksummed from the bytes sent,
and the scratch is removed. State dicts given to ``save_state_dict_async`` do
not pass through here: they stream straight into their object.

The scratch lies under ``OBSCKPT_SCRATCH_DIR`` (default: the system's temp
directory), on the node that saves.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from obsckpt.store import reader
from obsckpt.store.layout import FileRecord
from obsckpt.store.uri import parse_root

SCRATCH_ENV = "OBSCKPT_SCRATCH_DIR"
_READ_SIZE = 4 << 20
_UPLOADS_AT_ONCE = 4


def scratch_base() -> str:
    """The directory scratch paths lie under (``OBSCKPT_SCRATCH_DIR`` or the temp dir)."""
    return os.environ.get(SCRATCH_ENV) or os.path.join(tempfile.gettempdir(), "obsckpt-scratch")


def scratch_path(url: str, rank: int | None = None) -> str:
    """The local path a save function of ``rank`` (its coordinator's rank; None for a
    process without one) writes for the object (or prefix) ``url``.

    The same URL and rank always map to the same path on a node, so a save
    function can be built before the save runs; ranks on one node get paths of
    their own (several ranks write files under one prefix, as Megatron's
    distributed checkpoint does). A local path is returned as it is.
    """
    target = parse_root(url, what="path")
    if not target.is_remote:
        return os.fspath(url)
    owner = "driver" if rank is None else f"rank-{rank}"
    return os.path.join(scratch_base(), owner, target.bucket, *target.prefix.split("/"))


def run_and_upload(
    save_fn: Callable[[], Any], urls: list[str] | None, store: Any, rank: int | None = None
) -> list[FileRecord]:
    """Run ``save_fn``, then upload what it wrote at each URL's scratch path (of ``rank``).

    ``store`` is the root's :class:`~obsckpt.store.s3root.S3Root`; each URL is in
    one of its steps (checked before the save started). Returns the records of
    the objects written (path in the step, size, CRC32, ETag). The scratch paths
    are removed, whether the save or the upload failed or not.

    Raises:
        FileNotFoundError: ``save_fn`` wrote nothing at a URL's scratch path.
        StoreError: an upload failed (its object is not left half-written).
    """
    scratches = [scratch_path(u, rank) for u in urls or []]
    try:
        save_fn()
        jobs: list[tuple[str, int, str]] = []
        for url, local in zip(urls or [], scratches, strict=True):
            located = store.locate(url)
            if located is None:  # pragma: no cover - refused before the save ran
                raise ValueError(f"{url} is not in a step of {store.url}")
            step, rel = located
            if os.path.isdir(local):
                for dirpath, names in reader.walk_files(local):
                    for name in names:
                        path = os.path.join(dirpath, name)
                        sub = os.path.relpath(path, local).replace(os.sep, "/")
                        jobs.append((path, step, f"{rel}/{sub}"))
            elif os.path.isfile(local):
                jobs.append((local, step, rel))
            else:
                raise FileNotFoundError(
                    f"{url} is named in paths= but the save function wrote nothing at its "
                    f"local scratch path {local} (an s3:// root's saves write there, see "
                    "obsckpt.scratch_path(url, coordinator.rank)); name only what the save writes"
                )
        if not jobs:
            return []
        with ThreadPoolExecutor(min(_UPLOADS_AT_ONCE, len(jobs))) as pool:
            return list(pool.map(lambda job: upload_file(store, *job), jobs))
    finally:
        for local in scratches:
            if os.path.isdir(local):
                shutil.rmtree(local, ignore_errors=True)
            elif os.path.lexists(local):
                os.unlink(local)
            prune(os.path.dirname(local))


def prune(directory: str) -> None:
    """Remove ``directory`` and its parents below :func:`scratch_base` while they are empty."""
    base = os.path.abspath(scratch_base())
    directory = os.path.abspath(directory)
    while directory.startswith(base + os.sep):
        try:
            os.rmdir(directory)
        except OSError:  # not empty (another save's scratch), or gone
            return
        directory = os.path.dirname(directory)


def upload_file(store: Any, local: str, step: int, path: str) -> FileRecord:
    """Upload the file ``local`` as ``path`` in step ``step`` of ``store``; its record."""
    writer = store.writer(step, path)
    try:
        with open(local, "rb") as f:
            while chunk := f.read(_READ_SIZE):
                writer.write(chunk)
        done = writer.finish()
    except BaseException as exc:
        writer.abort(exc)
        raise
    return FileRecord(path=path, size=done.size, crc32=done.crc32, etag=done.etag)
