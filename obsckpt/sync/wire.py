"""What both weight-sync methods share: the broadcast's wire header, the result, the version rule.

The broadcast (:mod:`~obsckpt.sync.broadcast`) opens each transfer with a
header in two collectives: a preamble of three int64 (:data:`MAGIC`, the
body's length, the step or -1) and a body, the pickled
``{version, mode, bucket_bytes, meta}``. A receiver checks the magic and the
version before it trusts the rest; the step travels in the preamble, so an
unchanged model sends the same body bytes at every step (receivers parse it
once). The ipc sync (:mod:`~obsckpt.sync.ipc`) sends an
:class:`~obsckpt.sync.ipc.IpcPayload` instead, and keeps the same version
rule and returns the same :class:`BroadcastResult`.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass

from obsckpt.errors import BroadcastError
from obsckpt.sync.buckets import TensorMeta

MAGIC = 0x0B5C_5EED
HEADER_VERSION = 1


@dataclass(frozen=True, slots=True)
class BroadcastResult:
    """What one weight sync moved and how long it took (on this side).

    ``collectives`` counts the broadcast's collectives, or the handles an ipc
    sync handed out; ``mode`` is the broadcast's mode (``bucketed``,
    ``per_tensor``) or ``ipc``.
    """

    seconds: float
    nbytes: int
    tensors: int
    collectives: int
    backend: str
    mode: str


# ----------------------------------------------------------------------
# The version rule
# ----------------------------------------------------------------------


def validate_newer_step(step: object, last_step: int | None, *, none_ok: bool = False) -> None:
    """The version rule every weight sync keeps: ``step`` is a step newer than ``last_step``.

    ``none_ok`` only says, in the error, that the caller also accepts None (no version).

    Raises:
        ValueError: ``step`` is not a non-negative integer, or not newer than ``last_step``.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        also = " or None" if none_ok else ""
        raise ValueError(f"step must be a non-negative integer{also}, got {step!r}")
    if last_step is not None and step <= last_step:
        raise ValueError(
            f"step {step} is not newer than step {last_step}, the last one sent; "
            "weight versions never go backwards: send a newer step"
        )


def is_stale_step(step: int | None, held: int | None) -> bool:
    """The receiving side of the rule: ``step`` is not newer than the ``held`` one (refuse it).

    A sync without a version (None), or a receiver holding none, refuses nothing.
    """
    return step is not None and held is not None and step <= held


# ----------------------------------------------------------------------
# The broadcast's header
# ----------------------------------------------------------------------


def encode_header(mode: str, bucket_bytes: int, meta: Sequence[TensorMeta]) -> bytes:
    """The header's body: how the tensors that follow travel (without the step)."""
    header = {
        "version": HEADER_VERSION,
        "mode": mode,
        "bucket_bytes": bucket_bytes,
        "meta": [m.to_wire() for m in meta],
    }
    return pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)


def encode_preamble(length: int, step: int | None) -> list[int]:
    """The header's first collective (three int64): magic, body length, step (-1: none)."""
    return [MAGIC, length, -1 if step is None else step]


def decode_preamble(values: Sequence[int]) -> tuple[int, int | None]:
    """``(body length, step)`` of a received preamble.

    Raises:
        BroadcastError: it is not obsckpt's (the peers disagree on the protocol).
    """
    magic, length, step = (int(x) for x in values)
    if magic != MAGIC:
        raise BroadcastError(
            f"the first message was not a weight-sync header (magic {magic:#x}); sender and "
            "receivers disagree on the protocol, the group is now broken"
        )
    return length, (None if step < 0 else step)


def decode_header(raw: bytes) -> tuple[str, int, list[TensorMeta]]:
    """``(mode, bucket_bytes, meta)`` of a received header body.

    Raises:
        BroadcastError: the header is of another version of obsckpt.
    """
    header = pickle.loads(raw)
    if header.get("version") != HEADER_VERSION:
        raise BroadcastError(
            f"unsupported weight-sync header version {header.get('version')}; "
            "run the same obsckpt version on both sides"
        )
    meta = [TensorMeta.from_wire(m) for m in header["meta"]]
    return header["mode"], int(header["bucket_bytes"]), meta
