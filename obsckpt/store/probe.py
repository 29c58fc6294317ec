"""Whether an endpoint enforces the conditional writes the commit protocol relies on.

A commit on an object store is safe only if a create-only PUT (If-None-Match: *)
over an existing object and a PUT with a stale ETag (If-Match) are both refused.
Some S3-compatible servers ignore one header or the other and overwrite
silently; on those two monitors could both believe they moved the pointer.
:func:`probe_conditional_writes` tries both on a scratch object before anything
is committed, and refuses the endpoint if either write goes through.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable

from obsckpt.store.client import ObjectClient
from obsckpt.store.errors import (
    ConditionalConflict,
    ConditionalWritesUnsupportedError,
    PreconditionFailed,
    StoreError,
    StoreUnavailableError,
)
from obsckpt.store.uri import join_key

__all__ = ["PROBE_DIR", "probe_conditional_writes"]

PROBE_DIR = ".obsckpt"
# A refused write answered 409 (a concurrent write raced it) proves nothing either way;
# it is tried again this many times.
_CONFLICT_TRIES = 3


def probe_conditional_writes(client: ObjectClient, prefix: str) -> None:
    """Check that ``client``'s endpoint refuses a create-only PUT over an object and a stale If-Match.

    Writes ``<prefix>/.obsckpt/probe-<uuid>``, checks that a create-only PUT over
    it fails with 412 and leaves it unchanged, that a PUT with its current ETag
    succeeds and one with the old ETag then fails with 412, and deletes it.

    Raises:
        ConditionalWritesUnsupportedError: a check failed (one line naming the
            endpoint and the check).
        StoreError: the endpoint could not be asked (unreachable, no access).
    """
    key = join_key(prefix, PROBE_DIR, f"probe-{uuid.uuid4().hex}")
    where = f"s3://{client.bucket}/{key}"

    def refuse(check: str, what: str) -> ConditionalWritesUnsupportedError:
        return ConditionalWritesUnsupportedError(
            f"S3 endpoint {client.endpoint} does not enforce conditional writes: {what} "
            f"(probe object {where}); obsckpt commits only where both If-None-Match: * and "
            "If-Match are enforced, as AWS S3 does",
            endpoint=client.endpoint,
            check=check,
        )

    created = False
    try:
        first = _must_take(
            lambda: client.put_create_only(key, b"obsckpt probe 1"), "if_none_match", refuse
        )
        created = True
        if not _refused(lambda: client.put_create_only(key, b"obsckpt probe 2")):
            raise refuse(
                "if_none_match",
                "a create-only PUT (If-None-Match: *) over an existing object succeeded",
            )
        if _content(client, key) != b"obsckpt probe 1":
            raise refuse("if_none_match", "a refused create-only PUT replaced the object anyway")
        _must_take(lambda: client.put_if_match(key, b"obsckpt probe 3", first), "if_match", refuse)
        if not _refused(lambda: client.put_if_match(key, b"obsckpt probe 4", first)):
            raise refuse("if_match", "a PUT with a stale ETag (If-Match) succeeded")
        if _content(client, key) != b"obsckpt probe 3":
            raise refuse("if_match", "a refused PUT with a stale ETag replaced the object anyway")
    finally:
        if created:
            # The probe's own verdict matters more than its cleanup failing.
            with contextlib.suppress(StoreError):
                client.delete([key])


def _must_take(
    put: Callable[[], str],
    check: str,
    refuse: Callable[[str, str], ConditionalWritesUnsupportedError],
) -> str:
    """A conditional PUT whose condition holds; an error answer means the header is not taken."""
    try:
        return put()
    except StoreUnavailableError:
        raise
    except StoreError as err:
        header = "If-None-Match: *" if check == "if_none_match" else "If-Match"
        raise refuse(
            check, f"a PUT with {header} whose condition held was answered {err.code} ({err})"
        ) from err


def _refused(put: Callable[[], object]) -> bool:
    """Whether a PUT whose condition fails was refused (False: it went through).

    A 409 (a concurrent write raced it) is asked again; the caller reads the object
    back in any case, so a write applied despite the answer is caught there.
    """
    for _ in range(_CONFLICT_TRIES):
        try:
            put()
        except PreconditionFailed:
            return True
        except ConditionalConflict:
            continue
        return False
    return True


def _content(client: ObjectClient, key: str) -> bytes | None:
    blob = client.read(key)
    return None if blob is None else blob.data
