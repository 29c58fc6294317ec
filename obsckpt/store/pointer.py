"""The commit protocol on an object store: a create-only manifest and a fenced pointer.

An object store has no rename and no lock, so a step is committed by moving one
small object, the pointer, by compare-and-swap::

    <prefix>/obsckpt-pointer.json                 {"epoch", "owner", "commit_id",
                                                   "checkpoint_step", "state_dict_step"}
    <prefix>/global_step_<N>/manifest.json        written create-only before the pointer moves
    <prefix>/latest_checkpointed_iteration.txt    copies of the pointer's steps, for
    <prefix>/latest_state_dict_iteration.txt      verl and Trinity readers (one integer)

The pointer is the truth; the iteration objects follow it (they are written after
it moves, never backwards, and brought up to it when an owner takes the root).

Ownership. :meth:`RootPointer.take_ownership` moves the pointer to ``epoch + 1``
with the new owner's name: from then on every pointer write of an older owner
fails its If-Match, and finding a higher epoch in the pointer tells that owner
it was fenced (:class:`FencedError`); it commits nothing more. A commit reads the
pointer first, so an owner already fenced writes not even its manifest.

Ambiguous outcomes. A conditional PUT answered 409 ConditionalRequestConflict,
or whose answer was lost (a timeout, a reset), may or may not have been applied.
Each pointer write carries a fresh ``commit_id``; the outcome is settled by
reading the pointer back: our ``commit_id`` means it landed; another commit id
under our epoch means it did not, and the swap is tried again against the ETag
just read; a higher epoch means we were fenced. A read that fails too leaves
the outcome unknown, and the error says so; the next commit or takeover settles
it the same way.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from obsckpt.store.client import ObjectClient
from obsckpt.store.errors import (
    ConditionalConflict,
    FencedError,
    ManifestConflictError,
    ObjectNotFoundError,
    PointerFormatError,
    PreconditionFailed,
    StoreError,
    StoreUnavailableError,
)
from obsckpt.store.layout import (
    ITERATION_FILES,
    KINDS,
    MANIFEST_NAME,
    parse_manifest,
    step_dir_name,
)
from obsckpt.store.uri import join_key
from obsckpt.validators import MAX_STEP, validate_step

__all__ = [
    "POINTER_NAME",
    "STORE_COMMIT_PHASES",
    "Lease",
    "Pointer",
    "RootPointer",
    "read_pointer",
]

POINTER_NAME = "obsckpt-pointer.json"
# A commit's phases on an object store, as it tells them (the commit's metrics).
PHASE_HEAD_CHECK = "head_check"  # the reported objects checked with HEAD (the caller's)
PHASE_MANIFEST_PUT = "manifest_put"  # the manifest written create-only
PHASE_POINTER_CAS = "pointer_cas"  # the pointer swapped, the iteration objects moved
STORE_COMMIT_PHASES = (PHASE_HEAD_CHECK, PHASE_MANIFEST_PUT, PHASE_POINTER_CAS)
# The pointer format this obsckpt writes and reads; a reader refuses another.
POINTER_FORMAT = 1
# The most bytes a pointer can take; anything longer is not one.
_MAX_POINTER_BYTES = 4096
# Swaps tried before giving up while others keep moving the pointer.
DEFAULT_MAX_TRIES = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Pointer:
    """What the root's pointer object says: who owns the root, and what is committed."""

    epoch: int
    owner: str
    commit_id: str
    checkpoint_step: int | None = None
    state_dict_step: int | None = None

    def step(self, kind: str) -> int | None:
        """The committed step of ``kind`` (``checkpoint`` or ``state_dict``), None if none."""
        return self.checkpoint_step if kind == "checkpoint" else self.state_dict_step

    def with_step(self, kind: str, step: int, commit_id: str) -> Pointer:
        """This pointer with ``kind`` at ``step``; a full checkpoint also commits its state
        dict (the state-dict step moves up to it, never down)."""
        if kind == "checkpoint":
            sd = self.state_dict_step
            return dataclasses.replace(
                self,
                commit_id=commit_id,
                checkpoint_step=step,
                state_dict_step=step if sd is None or sd < step else sd,
            )
        return dataclasses.replace(self, commit_id=commit_id, state_dict_step=step)

    def to_bytes(self) -> bytes:
        return (json.dumps({"version": POINTER_FORMAT, **dataclasses.asdict(self)}) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Pointer:
        """The pointer ``data`` holds; ``where`` names the object in errors.

        Raises:
            PointerFormatError: ``data`` is not a pointer this obsckpt writes.
        """

        def bad(why: str) -> PointerFormatError:
            return PointerFormatError(
                f"{where} is not an obsckpt pointer ({why}); it was written by something "
                "else, or by another obsckpt version"
            )

        if len(data) > _MAX_POINTER_BYTES:
            raise bad(f"{len(data)} bytes")
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise bad(f"not JSON: {err}") from None
        if not isinstance(obj, dict):
            raise bad(f"a JSON {type(obj).__name__}, not an object")
        if obj.get("version") != POINTER_FORMAT:
            raise bad(f"format {obj.get('version')!r}, this obsckpt reads {POINTER_FORMAT}")
        epoch, owner, commit_id = obj.get("epoch"), obj.get("owner"), obj.get("commit_id")
        if not _is_count(epoch) or epoch < 1:  # type: ignore[operator]
            raise bad(f"epoch {epoch!r}")
        if not isinstance(owner, str) or not isinstance(commit_id, str):
            raise bad(f"owner {owner!r}, commit_id {commit_id!r}")
        steps = {}
        for kind in KINDS:
            value = obj.get(f"{kind}_step")
            if value is not None and not _is_count(value):
                raise bad(f"{kind}_step {value!r}")
            steps[f"{kind}_step"] = value
        return cls(epoch=epoch, owner=owner, commit_id=commit_id, **steps)  # type: ignore[arg-type]


@dataclass(slots=True, kw_only=True)
class Lease:
    """One owner's hold on a root, from :meth:`RootPointer.take_ownership`.

    ``pointer`` and ``etag`` are the pointer as this owner last read or wrote it;
    ``fenced_by`` is the epoch that fenced it, once one has. Used by one thread at a
    time.
    """

    root: str
    owner: str
    epoch: int
    pointer: Pointer
    etag: str
    fenced_by: int | None = None


def read_pointer(client: ObjectClient, prefix: str) -> Pointer | None:
    """The pointer of the root at ``prefix`` in ``client``'s bucket; None before any owner.

    Raises:
        PointerFormatError: the object is not a pointer this obsckpt writes.
    """
    return RootPointer(client, prefix).read()


class RootPointer:
    """The commit protocol on one root (``prefix`` in ``client``'s bucket).

    Args:
        client: the bucket's objects (an :class:`~obsckpt.store.s3.S3Client`).
        prefix: the root's key prefix ("" for the whole bucket).
        max_tries: swaps tried while other writers keep moving the pointer.
    """

    def __init__(
        self, client: ObjectClient, prefix: str, *, max_tries: int = DEFAULT_MAX_TRIES
    ) -> None:
        self._client = client
        self._prefix = prefix.strip("/")
        self._max_tries = max_tries
        self._key = join_key(self._prefix, POINTER_NAME)
        # Told each time a conditional write of the pointer lost a race or met a 409.
        self.on_conflict: Callable[[], None] | None = None

    @property
    def root(self) -> str:
        """The root as a URL, for messages: ``s3://bucket/prefix``."""
        return f"s3://{join_key(self._client.bucket, self._prefix)}"

    def read(self) -> Pointer | None:
        """The pointer now; None before any owner took the root."""
        found = self._read()
        return None if found is None else found[0]

    def take_ownership(self, owner: str) -> Lease:
        """Make ``owner`` the root's owner, fencing the one before; its :class:`Lease`.

        The pointer's epoch goes up by one (1 on a root without a pointer); steps
        are kept. The root is taken from whoever holds it, running or not: deciding
        that this owner should have it is the caller's part. The iteration objects
        are then brought up to the pointer's steps (a previous owner may have
        stopped between the two).

        Raises:
            StoreError: the pointer could not be swapped in ``max_tries`` tries (others
                kept taking the root), or the store failed.
        """
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner must be a non-empty string, got {owner!r}")
        for _ in range(self._max_tries):
            commit_id = uuid.uuid4().hex
            found = self._read()
            if found is None:
                new = Pointer(epoch=1, owner=owner, commit_id=commit_id)
                put = partial(self._client.put_create_only, self._key, new.to_bytes())
            else:
                old, old_etag = found
                new = dataclasses.replace(
                    old, epoch=old.epoch + 1, owner=owner, commit_id=commit_id
                )
                put = partial(self._client.put_if_match, self._key, new.to_bytes(), old_etag)
            etag = self._swap(put, commit_id)
            if etag is not None:
                lease = Lease(root=self.root, owner=owner, epoch=new.epoch, pointer=new, etag=etag)
                try:
                    for kind in KINDS:
                        step = new.step(kind)
                        if step is not None:
                            self._advance_iteration(kind, step)
                except StoreError as err:
                    err.add_note(
                        f"{owner!r} took {self.root} (epoch {new.epoch}), but its iteration "
                        "objects could not be brought up to the pointer"
                    )
                    raise
                return lease
        raise self._gave_up("take_ownership", f"{self._max_tries} other owners took it meanwhile")

    def check(self, lease: Lease) -> Pointer:
        """The pointer, read now, if ``lease`` still owns the root.

        Raises:
            FencedError: another owner took the root.
        """
        return self._owned(lease)[0]

    def commit(
        self,
        lease: Lease,
        kind: str,
        step: int,
        manifest: bytes,
        *,
        on_phase: Callable[[str], None] | None = None,
    ) -> Pointer:
        """Commit ``step`` of ``kind``: its manifest, then the pointer, then the iteration object.

        The manifest goes to ``global_step_<N>/manifest.json`` create-only (the same
        bytes already there are a retry of this commit, and fine); the pointer
        moves by If-Match on the ETag just read, with this lease's epoch and a new
        commit id. Committing the step the pointer already names again is a no-op
        (its manifest checked). A full checkpoint also moves the state-dict step up
        to it. ``on_phase`` is told ``manifest_put`` and ``pointer_cas`` as each
        begins. Returns the pointer as written.

        Raises:
            FencedError: another owner took the root (now or before); nothing more of
                this commit is written, and every later commit of ``lease`` raises too.
            ValueError: ``step`` is below the pointer's step of ``kind`` (steps never
                go backwards), or ``kind`` is not one of ``checkpoint``/``state_dict``.
            ManifestConflictError: the step's manifest exists with other bytes.
            StoreError: the store failed; where the pointer write's outcome could not
                be settled, the message says so (the next commit settles it).
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        step = validate_step(step)
        pointer, etag = self._owned(lease)
        committed = pointer.step(kind)
        if committed is not None and step < committed:
            raise ValueError(
                f"{self.root}: {kind} step {step} is below the committed step {committed}; "
                "steps must not go backwards"
            )
        begin = on_phase if on_phase is not None else (lambda _phase: None)
        begin(PHASE_MANIFEST_PUT)
        self._write_manifest(step, manifest)
        begin(PHASE_POINTER_CAS)
        for _ in range(self._max_tries):
            current = pointer.step(kind)
            if current is not None and current >= step:
                if current > step:
                    raise ValueError(
                        f"{self.root}: {kind} step {current} was committed while step {step} "
                        "was being committed; steps must not go backwards"
                    )
                break  # this step is committed already (by an earlier try of this lease)
            commit_id = uuid.uuid4().hex
            new = pointer.with_step(kind, step, commit_id)
            put = partial(self._client.put_if_match, self._key, new.to_bytes(), etag)
            written = self._swap(put, commit_id)
            if written is not None:
                lease.pointer, lease.etag = new, written
                break
            pointer, etag = self._owned(lease)  # lost the swap: fenced, or try again
        else:
            raise self._gave_up(f"commit of {kind} step {step}", "the pointer kept moving")
        try:
            for moved in KINDS:
                committed_step = lease.pointer.step(moved)
                if committed_step is not None and (moved == kind or committed_step == step):
                    self._advance_iteration(moved, committed_step)
        except StoreError as err:
            err.add_note(
                f"{kind} step {step} is committed (the pointer names it); its iteration object "
                "lags and is brought up by the next commit or takeover"
            )
            raise
        return lease.pointer

    # --- internals --------------------------------------------------------------

    def _read(self) -> tuple[Pointer, str] | None:
        blob = self._client.read(self._key)
        if blob is None:
            return None
        return Pointer.from_bytes(
            blob.data, f"s3://{self._client.bucket}/{self._key}"
        ), blob.info.etag

    def _owned(self, lease: Lease) -> tuple[Pointer, str]:
        """The pointer and its ETag, read now; FencedError if ``lease`` no longer owns the root."""
        if lease.fenced_by is not None:
            raise self._fenced(lease, lease.fenced_by, None)
        found = self._read()
        if found is None:
            raise PointerFormatError(
                f"{self.root}: the pointer {POINTER_NAME} is gone while {lease.owner!r} (epoch "
                f"{lease.epoch}) owns the root; something other than obsckpt deleted it"
            )
        pointer, etag = found
        if pointer.epoch > lease.epoch:
            lease.fenced_by = pointer.epoch
            raise self._fenced(lease, pointer.epoch, pointer.owner)
        if pointer.epoch < lease.epoch:
            raise PointerFormatError(
                f"{self.root}: the pointer's epoch {pointer.epoch} is below this owner's "
                f"{lease.epoch}; something other than obsckpt rewrote it"
            )
        lease.pointer, lease.etag = pointer, etag
        return pointer, etag

    def _swap(self, put: Callable[[], str], commit_id: str) -> str | None:
        """Run a conditional pointer write; its ETag if it landed, None if it lost.

        An ambiguous answer is settled by reading the pointer: it landed if the
        pointer now carries ``commit_id``.
        """
        try:
            return put()
        except PreconditionFailed:
            self._conflicted()
            return None
        except (ConditionalConflict, StoreUnavailableError) as err:
            if isinstance(err, StoreUnavailableError) and not err.maybe_applied:
                raise  # never sent: nothing to settle
            if isinstance(err, ConditionalConflict):
                self._conflicted()
            try:
                found = self._read()
            except StoreError as read_err:
                read_err.add_note(
                    f"the outcome of a pointer write at {self.root} is unknown ({err}); the next "
                    "commit or takeover settles it by reading the pointer"
                )
                raise
            if found is not None and found[0].commit_id == commit_id:
                return found[1]
            return None

    def _conflicted(self) -> None:
        if self.on_conflict is not None:
            self.on_conflict()

    def _write_manifest(self, step: int, data: bytes) -> None:
        key = join_key(self._prefix, step_dir_name(step), MANIFEST_NAME)
        for _ in range(self._max_tries):
            try:
                self._client.put_create_only(key, data)
                return
            except PreconditionFailed:
                pass
            except (ConditionalConflict, StoreUnavailableError) as err:
                if isinstance(err, StoreUnavailableError) and not err.maybe_applied:
                    raise
            existing = self._client.read(key)
            if existing is None:
                continue  # the ambiguous write did not land: write it again
            if existing.data == data:
                return  # ours, from an earlier try; or the same manifest committed before
            if _extends(existing.data, data):
                # A later commit of the step (its full checkpoint after its state dict)
                # lists more files and keeps every record of the first: replace it.
                try:
                    self._client.put_if_match(key, data, existing.info.etag)
                    return
                except (PreconditionFailed, ConditionalConflict):
                    continue  # moved meanwhile (or the outcome is unknown): read it again
            raise ManifestConflictError(
                f"s3://{self._client.bucket}/{key} already holds another manifest "
                f"({len(existing.data)} bytes, {len(data)} given): step {step} was committed "
                "before, or an owner that was fenced wrote it; not committing it again"
            )
        raise self._gave_up(f"the manifest of step {step}", "its writes kept conflicting")

    def _advance_iteration(self, kind: str, step: int) -> None:
        """Move ``kind``'s iteration object up to ``step``; never down (a compare-and-swap)."""
        key = join_key(self._prefix, ITERATION_FILES[kind])
        data = f"{step}\n".encode()
        for _ in range(self._max_tries):
            blob = self._client.read(key)
            try:
                if blob is None:
                    self._client.put_create_only(key, data)
                    return
                current = _iteration_value(blob.data)
                if current is not None and current >= step:
                    return
                self._client.put_if_match(key, data, blob.info.etag)
                return
            except (PreconditionFailed, ConditionalConflict, ObjectNotFoundError):
                continue  # another writer moved (or removed) it: read it again
            except StoreUnavailableError as err:
                if not err.maybe_applied:
                    raise
        raise self._gave_up(f"the {ITERATION_FILES[kind]} object", "other writers kept moving it")

    def _fenced(self, lease: Lease, new_epoch: int, new_owner: str | None) -> FencedError:
        by = f" (owner {new_owner!r})" if new_owner is not None else ""
        return FencedError(
            f"{self.root}: owner {lease.owner!r} (epoch {lease.epoch}) was fenced by epoch "
            f"{new_epoch}{by}, which took the root over; it commits nothing more",
            root=self.root,
            epoch=lease.epoch,
            new_epoch=new_epoch,
        )

    def _gave_up(self, what: str, why: str) -> StoreError:
        return StoreError(
            f"{self.root}: gave up on {what} after {self._max_tries} tries: {why}",
            operation="commit",
            key=self._key,
            status="contention",
        )


def _extends(old: bytes, new: bytes) -> bool:
    """Whether manifest ``new`` lists every record of ``old`` unchanged (and maybe more)."""
    try:
        before = {r.path: r for r in parse_manifest(json.loads(old))}
        after = {r.path: r for r in parse_manifest(json.loads(new))}
    except (ValueError, UnicodeDecodeError):
        return False
    return all(after.get(path) == rec for path, rec in before.items())


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_STEP  # type: ignore[operator]


def _iteration_value(data: bytes) -> int | None:
    """The step an iteration object names; None for anything else (it is then replaced)."""
    text = data.strip()
    return int(text) if text.isdigit() and len(text) <= 20 else None
