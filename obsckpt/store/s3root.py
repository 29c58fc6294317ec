"""A checkpoint root in an S3 bucket: where its objects are, writing, checking and reading them.

:class:`S3Root` is what the rest of obsckpt holds for an ``s3://bucket/prefix``
root. The layout under the prefix is a local root's, as keys::

    <prefix>/obsckpt-pointer.json                    the commit pointer (see pointer)
    <prefix>/latest_checkpointed_iteration.txt       iteration objects, for verl and Trinity
    <prefix>/latest_state_dict_iteration.txt
    <prefix>/global_step_<N>/manifest.json           written create-only by the commit
    <prefix>/global_step_<N>/<path>                  the files the ranks wrote

Ranks write their files with :meth:`S3Root.writer` (multipart, parallel parts,
CRC32 on the way); the monitor checks them with HEAD (:meth:`S3Root.check_reported`)
and commits through :class:`~obsckpt.store.pointer.RootPointer`; readers go through
:meth:`S3Root.read_verified`, which checks size and CRC32 against the committed
manifest before a byte is handed over.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

from zlib_ng.zlib_ng import crc32_combine  # a dependency: zlib-ng's C version

from obsckpt.store.errors import PreconditionFailed, StoreError
from obsckpt.store.layout import (
    ITERATION_FILES,
    KINDS,
    MANIFEST_NAME,
    FileRecord,
    parse_manifest,
    step_dir_name,
    step_of_dir_name,
)
from obsckpt.store.pointer import POINTER_NAME, Pointer, RootPointer
from obsckpt.store.probe import PROBE_DIR
from obsckpt.store.reader import crc32
from obsckpt.store.stream import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, ObjectWriter
from obsckpt.store.transfer import run_parallel
from obsckpt.store.uri import Root, parse_root

__all__ = [
    "S3Root",
    "SweepReport",
    "locate_in_root",
    "open_s3_root",
    "shared_s3_root",
    "split_step_url",
]

# Reads of a verified file: ranges of this many bytes, this many at once.
READ_PART_SIZE = 16 * 1024 * 1024
READ_CONCURRENCY = 8
# HEADs of a commit's files at once.
HEAD_CONCURRENCY = 16
# A commit of more files than this checks them with one listing of the step's prefix.
LIST_ABOVE = 32


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What a start-up sweep removed."""

    aborted_uploads: list[str]
    removed_objects: list[str]


class S3Root:
    """The root ``root`` (an ``s3://`` :class:`~obsckpt.store.uri.Root`) through ``client``.

    Args:
        root: the parsed root.
        client: the bucket's client (:class:`~obsckpt.store.s3.S3Client`).
        part_size: bytes per part of the files ranks upload.
        concurrency: parts in flight per file.
    """

    def __init__(
        self,
        root: Root,
        client: Any,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        if not root.is_remote:
            raise ValueError(f"{root} is a local root, not an s3:// one")
        self.root = root
        self.client = client
        self.part_size = part_size
        self.concurrency = concurrency
        self.pointer = RootPointer(client, root.prefix)

    @property
    def url(self) -> str:
        return str(self.root)

    @property
    def endpoint(self) -> str:
        return str(self.client.endpoint)

    # --- names ---------------------------------------------------------------------

    def key(self, *parts: str) -> str:
        return self.root.key(*parts)

    def step_key(self, step: int, path: str = "") -> str:
        """The key of ``path`` in step ``step`` (the step's prefix with ``path`` empty)."""
        return self.key(step_dir_name(step), path)

    def url_of(self, key: str) -> str:
        return f"s3://{self.root.bucket}/{key}"

    def locate(self, url: str) -> tuple[int, str] | None:
        """(step, path in the step) of ``url`` when it names a file in a step of this root."""
        return locate_in_root(self.root, url)

    # --- writing -----------------------------------------------------------------

    def writer(self, step: int, path: str) -> ObjectWriter:
        """A file-like sink that becomes ``path`` in step ``step`` once finished."""
        return ObjectWriter(
            self.client,
            self.step_key(step, path),
            part_size=self.part_size,
            concurrency=self.concurrency,
        )

    def record(self, step: int, path: str, data: bytes) -> FileRecord:
        """Write a small file of step ``step`` in one PUT; its record."""
        etag = self.client.put(self.step_key(step, path), data)
        return FileRecord(path=path, size=len(data), crc32=crc32(data), etag=etag)

    # --- the commit's checks -------------------------------------------------------

    def check_reported(self, step: int, files: dict[str, FileRecord]) -> list[str]:
        """Problems with ``step``'s reported files as the store has them: missing, another
        size or another ETag than the rank reported. Empty when every object is as reported.

        A few files are checked with HEAD, one request each; more than
        :data:`LIST_ABOVE` with a listing of the step's prefix (a thousand objects per
        request, with the same size and ETag a HEAD gives), and HEAD for any the
        listing does not show.
        """
        listed: dict[str, tuple[int, str]] = {}
        if len(files) > LIST_ABOVE:
            base = self.step_key(step) + "/"
            listed = {o.key[len(base) :]: (o.size, o.etag) for o in self.client.list(base)}

        def check(rec: FileRecord) -> str | None:
            key = self.step_key(step, rec.path)
            where = self.url_of(key)
            found = listed.get(rec.path)
            if found is None:
                info = self.client.head(key)
                if info is None:
                    return f"{where}: missing (a rank reported it written)"
                found = (info.size, info.etag)
            size, etag = found
            if size != rec.size:
                return f"{where}: {size} bytes, the rank reported {rec.size}"
            if rec.etag is not None and etag != rec.etag:
                return f"{where}: ETag {etag}, the rank reported {rec.etag} (rewritten since)"
            return None

        pending = [rec for rec in files.values() if rec.path not in listed]
        found = (
            run_parallel(
                [partial(check, rec) for rec in pending], HEAD_CONCURRENCY, name="obsckpt-s3-head"
            )
            if pending
            else []
        )
        found += [check(rec) for rec in files.values() if rec.path in listed]
        return [p for p in found if p is not None]

    def has_objects(self, step: int) -> bool:
        return bool(self.client.list(self.step_key(step) + "/", max_keys=1))

    # --- reading -------------------------------------------------------------------

    def read_pointer(self) -> Pointer | None:
        return self.pointer.read()

    def committed(self, kind: str) -> int | None:
        """The committed step of ``kind``: the pointer's, else the iteration object's."""
        return self.committed_steps(kinds=(kind,))[kind]

    def committed_steps(self, kinds: tuple[str, ...] = KINDS) -> dict[str, int | None]:
        """The committed step of each kind, from one read of the pointer (else the
        iteration objects, for a root whose pointer is gone)."""
        pointer = self.pointer.read()
        if pointer is not None:
            return {kind: pointer.step(kind) for kind in kinds}
        out: dict[str, int | None] = {}
        for kind in kinds:
            blob = self.client.read(self.key(ITERATION_FILES[kind]))
            text = None if blob is None else blob.data.strip()
            out[kind] = int(text) if text and text.isdigit() else None
        return out

    def manifest(self, step: int) -> list[FileRecord] | None:
        """Step ``step``'s manifest records; None when it has no manifest.

        Raises:
            ValueError: the manifest is not one obsckpt writes (named in the message).
        """
        key = self.step_key(step, MANIFEST_NAME)
        blob = self.client.read(key)
        if blob is None:
            return None
        try:
            return parse_manifest(json.loads(blob.data))
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"{self.url_of(key)}: not an obsckpt manifest: {err}") from None

    def newest_committed(self) -> int | None:
        """The newest step the pointer names, of either kind (None before any commit)."""
        pointer = self.pointer.read()
        steps = (
            []
            if pointer is None
            else [s for s in (pointer.checkpoint_step, pointer.state_dict_step) if s is not None]
        )
        return max(steps, default=None)

    def committed_records(self, step: int) -> list[FileRecord]:
        """Committed step ``step``'s manifest records.

        A step is committed when its manifest exists and the pointer has reached it: a
        manifest above the pointer's steps was written by a commit that never moved the
        pointer (its monitor stopped between the two), and is not vouched for.

        Raises:
            ValueError: the step is not committed (named, with why).
        """
        records = self.manifest(step)
        where = self.url_of(self.step_key(step))
        if records is None:
            raise ValueError(f"{where}: step {step} has no manifest in {self.url}; not committed")
        newest = self.newest_committed()
        if newest is None or step > newest:
            raise ValueError(
                f"{where}: step {step} has a manifest but the root's pointer names "
                f"{'no step' if newest is None else f'step {newest}'}; its commit did not "
                "finish, so it is not committed"
            )
        return records

    def steps(self) -> list[int]:
        """The steps with any object under the root, in order.

        A prefix with no object left is not a step: some servers (SeaweedFS) keep
        listing a "directory" whose objects were all deleted.
        """
        found = set()
        for prefix in self.client.list_prefixes(self.key() + "/" if self.key() else ""):
            step = step_of_dir_name(prefix.rstrip("/").rsplit("/", 1)[-1])
            if step is not None and self.has_objects(step):
                found.add(step)
        return sorted(found)

    def verify_step(
        self, step: int, *, deep: bool = True, records: list[FileRecord] | None = None
    ) -> list[str]:
        """What is wrong with committed step ``step``: no manifest, a file missing, of another
        size, or (``deep``) whose CRC32 differs from the manifest's. Empty when whole.

        ``records``: the step's manifest records, read by a caller that has checked the
        step is committed (they are not read again)."""
        if records is None:
            try:
                records = self.committed_records(step)
            except ValueError as err:
                return [str(err)]
        problems = self.check_reported(step, {r.path: r for r in records})
        if problems or not deep:
            return problems

        def crc_problem(rec: FileRecord) -> str | None:
            try:
                self.read_verified(step, rec.path, records=records, concurrency=2)
            except (ValueError, StoreError) as err:
                return str(err)
            return None

        return [p for p in map(crc_problem, records) if p is not None]

    def read_verified(
        self,
        step: int,
        path: str,
        *,
        records: list[FileRecord] | None = None,
        part_size: int = READ_PART_SIZE,
        concurrency: int = READ_CONCURRENCY,
    ) -> bytearray:
        """File ``path`` of committed step ``step``, read with ranged, parallel GETs and
        checked against the manifest (size, ETag, CRC32) before it is returned.

        Raises:
            ValueError: the step is not committed (:meth:`committed_records`), its
                manifest does not list ``path``, or the bytes are not what it records
                (named, with both values).
            StoreError: the object could not be read.
        """
        rec, where = self._listed(step, path, records)
        try:
            data = self.client.get_ranged_parallel(
                self.step_key(step, path), rec.size, part_size, concurrency, etag=rec.etag
            )
        except PreconditionFailed:
            raise _replaced(where, rec) from None
        got = crc32(data)
        if got != rec.crc32:
            raise _corrupted(where, got, rec)
        return data

    def _listed(
        self, step: int, path: str, records: list[FileRecord] | None
    ) -> tuple[FileRecord, str]:
        """``path``'s record in committed step ``step``'s manifest, and the object's URL.

        Raises:
            ValueError: the step is not committed, or its manifest does not list ``path``.
        """
        records = records if records is not None else self.committed_records(step)
        where = self.url_of(self.step_key(step, path))
        rec = next((r for r in records if r.path == path), None)
        if rec is None:
            raise ValueError(f"{where}: not listed in the manifest of step {step}")
        return rec, where

    def download_verified(
        self,
        step: int,
        path: str,
        dest: str | os.PathLike[str],
        *,
        records: list[FileRecord] | None = None,
        part_size: int = READ_PART_SIZE,
        concurrency: int = READ_CONCURRENCY,
    ) -> None:
        """File ``path`` of committed step ``step`` written into the new local file ``dest``
        (fsynced): ranged, parallel GETs (If-Match on the manifest's ETag), each part
        written at its offset, and the whole checked against the manifest's size and CRC32.
        It holds ``concurrency`` parts in memory, whatever the file's size.

        Raises:
            ValueError: as :meth:`read_verified` (``dest`` may then hold the bytes read:
                the caller discards it).
            StoreError: the object could not be read.
        """
        rec, where = self._listed(step, path, records)
        key = self.step_key(step, path)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

        def part(start: int) -> tuple[int, int]:
            buf = bytearray(min(part_size, rec.size - start))
            self.client.read_range_into(key, memoryview(buf), start, rec.etag)
            view, at = memoryview(buf), start
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
            return crc32(buf), len(buf)

        try:
            parts = run_parallel(
                [partial(part, lo) for lo in range(0, rec.size, part_size)],
                concurrency,
                name="obsckpt-s3-download",
            )
            os.fsync(fd)
        except PreconditionFailed:
            raise _replaced(where, rec) from None
        finally:
            os.close(fd)
        got = 0
        for part_crc, length in parts:
            got = crc32_combine(got, part_crc, length)
        if got != rec.crc32:
            raise _corrupted(where, got, rec)

    # --- tidying -------------------------------------------------------------------

    def sweep(self, newest: int | None) -> SweepReport:
        """Abort obsckpt's dangling multipart uploads under the root and remove the objects
        of steps that never committed: any step above ``newest`` (the pointer's newest
        step; a manifest there is an unfinished commit's), and any step at or below it
        without a manifest. Only keys obsckpt writes (``global_step_<N>/`` and its probe
        directory) are touched. Run it at a monitor's start, before any save is admitted."""
        base = self.key() + "/" if self.key() else ""
        aborted = []
        for upload in self.client.list_multipart_uploads(base):
            if self._ours(upload.key, base):
                self.client.abort_multipart(upload.key, upload.upload_id)
                aborted.append(self.url_of(upload.key))
        orphans = []
        for step in self.steps():
            if newest is not None and step <= newest:
                try:
                    if self.manifest(step) is not None:
                        continue  # committed: retention's to remove, not the sweep's
                except ValueError:
                    continue  # a manifest obsckpt did not write: not ours to judge
            orphans.append(step)
        removed = self.remove_steps(orphans)
        probes = [o.key for o in self.client.list(self.key(PROBE_DIR) + "/")]
        self.client.delete(probes)
        return SweepReport(aborted_uploads=aborted, removed_objects=removed)

    def retain(self, keep: int, protected: set[int]) -> list[str]:
        """Remove the committed steps beyond the newest ``keep`` (never a ``protected`` one,
        nor one above the newest of them); the objects removed."""
        from obsckpt.store.commit import steps_beyond

        newest = max(protected, default=None)
        committed = []
        for step in self.steps():
            if newest is None or step > newest:
                continue
            try:
                if self.manifest(step) is not None:
                    committed.append(step)
            except ValueError:
                continue  # not a manifest obsckpt wrote: not ours to remove
        return self.remove_steps(steps_beyond(committed, keep, protected))

    def remove_steps(self, steps: list[int]) -> list[str]:
        """Delete every object of ``steps`` (retention, after the commit that made them
        unneeded): the manifest first, so a step half-removed is never taken as whole."""
        removed = []
        for step in steps:
            manifest = self.step_key(step, MANIFEST_NAME)
            if self.client.head(manifest) is not None:
                self.client.delete([manifest])
                removed.append(self.url_of(manifest))
            keys = [o.key for o in self.client.list(self.step_key(step) + "/")]
            self.client.delete(keys)
            removed += map(self.url_of, keys)
        return removed

    def names(self) -> list[str]:
        base = self.key() + "/" if self.key() else ""
        return sorted({o.key[len(base) :].split("/", 1)[0] for o in self.client.list(base)})

    def put_small(self, name: str, data: bytes) -> None:
        self.client.put(self.key(name), data)

    def clear_commit_state(self) -> None:
        self.client.delete([self.key(n) for n in (POINTER_NAME, *ITERATION_FILES.values())])

    def _ours(self, key: str, base: str) -> bool:
        rest = key[len(base) :]
        head = rest.split("/", 1)[0]
        return step_of_dir_name(head) is not None or head == PROBE_DIR or rest == POINTER_NAME


def _replaced(where: str, rec: FileRecord) -> ValueError:
    return ValueError(
        f"{where}: replaced since its commit (its ETag is not the manifest's "
        f"{rec.etag}); the step is damaged, resume from another step"
    )


def _corrupted(where: str, got: int, rec: FileRecord) -> ValueError:
    return ValueError(f"{where}: corrupted (crc32 {got:08x}, the manifest says {rec.crc32:08x})")


def locate_in_root(root: Root, url: str) -> tuple[int, str] | None:
    """(step, path in the step) of ``url`` when it names a file in a step of ``root``."""
    target = parse_root(url, what="path")
    if not target.is_remote or target.bucket != root.bucket:
        return None
    rest = target.prefix
    if root.prefix:
        if not rest.startswith(root.prefix + "/"):
            return None
        rest = rest[len(root.prefix) + 1 :]
    head, _, path = rest.partition("/")
    step = step_of_dir_name(head)
    if step is None or not path:
        return None
    return step, path


def split_step_url(url: str) -> tuple[str, int, str]:
    """(root URL, step, path in the step) of the object URL of a file in a step:
    ``s3://b/run/global_step_3/actor/m.pt`` is ``("s3://b/run", 3, "actor/m.pt")``.

    Raises:
        ValueError: ``url`` names no file inside a ``global_step_<N>`` prefix.
    """
    target = parse_root(url, what="path")
    parts = target.prefix.split("/") if target.is_remote else []
    for i, part in enumerate(parts[:-1]):
        step = step_of_dir_name(part)
        if step is not None:
            root = Root(scheme=target.scheme, bucket=target.bucket, prefix="/".join(parts[:i]))
            return str(root), step, "/".join(parts[i + 1 :])
    raise ValueError(f"{url!r} names no file in a global_step_<N> prefix of an s3:// root")


@functools.lru_cache(maxsize=8)
def shared_s3_root(url: str) -> S3Root:
    """This process's :class:`S3Root` for ``url`` (one client per root, shared by its saves)."""
    return open_s3_root(url)


def open_s3_root(value: str, what: str = "default_local_dir", **options: Any) -> S3Root:
    """The :class:`S3Root` that ``value`` (``s3://bucket/prefix``) names, with a client made
    from the standard AWS settings (the ``s3`` extra's boto3)."""
    root = parse_root(value, what=what)
    if not root.is_remote:
        raise ValueError(f"{what}={value!r} is a local path, not an s3:// root")
    from obsckpt.store import S3Client

    return S3Root(root, S3Client(root.bucket), **options)
