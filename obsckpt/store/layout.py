"""The on-disk contract: every name obsckpt, verl and Trinity readers use in a root.

Pure: names, patterns and encodings, no I/O. Layout (compatible with verl and
Trinity readers)::

    <root>/latest_checkpointed_iteration.txt   one integer, written atomically at commit
    <root>/latest_state_dict_iteration.txt     one integer, written atomically at commit
    <root>/global_step_<N>/...                  the step's files
    <root>/global_step_<N>/manifest.json        files, sizes and CRC32s, written at commit
    <root>/global_step_<N>/data.pt              verl's dataloader state
    <root>/global_step_<N>/actor/               a role's model directory:
        model_world_size_<W>_rank_<R>.pt        its model shards (state dict)
        optim_world_size_<W>_rank_<R>.pt        optimizer shards (full checkpoint)
        extra_state_world_size_<W>_rank_<R>.pt  RNG and scheduler (full checkpoint)
        huggingface/                            the HF config, tokenizer and export
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from obsckpt.errors import IterationContentError
from obsckpt.validators import MAX_STEP, validate_step

ITERATION_FILES = {
    "checkpoint": "latest_checkpointed_iteration.txt",
    "state_dict": "latest_state_dict_iteration.txt",
}
KINDS = tuple(ITERATION_FILES)
MANIFEST_NAME = "manifest.json"
# The manifest format this obsckpt writes and reads. A later format may mean its
# entries differently, so a reader refuses it rather than guess.
MANIFEST_FORMAT = 1
STEP_DIR_PREFIX = "global_step_"
# The step as writers format it: ASCII digits without a leading zero. Another spelling
# (global_step_007, other scripts' digits) would name a directory that step_dir() never
# builds, so readers would look for, and retention delete, the wrong one.
STEP_DIR_RE = re.compile(r"^global_step_(0|[1-9][0-9]*)$", re.ASCII)
# Iteration files hold a step number; anything longer than this is not one.
MAX_ITERATION_BYTES = 64
# obsckpt's own temp names, as temp_name() makes them: ``<name>.tmp.<pid>.<8 hex>``.
# Only these are temp files: a file a save names ``optimizer.tmp`` or ``x.tmp.7`` is
# data, fsynced, listed in the manifest and checked like any other. Only these are
# ever swept as leftovers.
_OWN_TEMP_NAME_RE = re.compile(r"\.tmp\.\d+\.[0-9a-f]{8}$", re.ASCII)
_OWN_TEMP_SUFFIX_BYTES = len(".tmp.") + 10 + len(".") + 8  # pid up to 2**32 (10 digits)
# The longest file name a Linux filesystem takes (ext4, xfs, btrfs; NAME_MAX).
NAME_MAX = 255
_CRC_RE = re.compile(r"^[0-9a-fA-F]{8}$")

# verl's layout inside a step directory.
MODEL_SUBDIR = "actor"  # the actor role's directory (critic: "critic")
HF_SUBDIR = "huggingface"  # inside a role's directory
DATA_FILE = "data.pt"  # verl's dataloader state
SHARD_KINDS = ("model", "optim", "extra_state")
# Numbers as writers format them (ASCII, no leading zero): another spelling of a rank
# would be a second file for it.
SHARD_RE = re.compile(
    r"^(model|optim|extra_state)_world_size_(0|[1-9][0-9]*)_rank_(0|[1-9][0-9]*)\.pt$", re.ASCII
)
MODEL_SHARD_RE = re.compile(
    r"^model_world_size_(0|[1-9][0-9]*)_rank_(0|[1-9][0-9]*)\.pt$", re.ASCII
)


def model_shard_sets(names: Iterable[str]) -> dict[int, dict[int, str]]:
    """The model shard files among ``names`` (file names), by world size, then rank."""
    found: dict[int, dict[int, str]] = {}
    for name in names:
        m = MODEL_SHARD_RE.match(name)
        if m:
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = name
    return found


# The files a full checkpoint adds beside a state dict's model shards.
FULL_CHECKPOINT_PREFIXES = ("optim_", "extra_state_")


def shard_name(kind: str, world_size: int, rank: int) -> str:
    """verl's per-rank file name, e.g. ``model_world_size_2_rank_0.pt``."""
    if kind not in SHARD_KINDS:
        raise ValueError(f"shard kind must be one of {SHARD_KINDS}, got {kind!r}")
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def model_dir(root: str | os.PathLike, step: int, role: str = MODEL_SUBDIR) -> Path:
    """A role's model directory in a step: ``<root>/global_step_<N>/actor``."""
    return step_dir(root, step) / role


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temp file or scratch directory of an unfinished write.

    Only the names :func:`temp_name` makes count (``<name>.tmp.<pid>.<8 hex>``):
    ``optimizer.tmp``, ``w.safetensors.tmp.7`` or ``data.tmp.json`` are files of the step.
    """
    return _OWN_TEMP_NAME_RE.search(name) is not None


is_own_temp_name = is_temp_name  # the name the leftover sweep knows it by


def temp_name(path: str | os.PathLike) -> str:
    """The temp file to write ``path`` through: ``<path>.tmp.<pid>.<8 hex>``.

    Unique per write, so two writers of one path (two processes, or two saves
    in one process) never share it; :func:`is_temp_name` recognises it.

    Raises:
        ValueError: ``path``'s file name is so long that its temp name would pass the
            filesystem's limit of :data:`NAME_MAX` bytes (naming the name and the limit).
    """
    path = os.fspath(path)
    check_temp_room(path)
    return f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def check_temp_room(path: str | os.PathLike) -> None:
    """Refuse a file name too long for :func:`temp_name` to add its suffix.

    Raises:
        ValueError: naming the name, its length and the limit.
    """
    name = os.path.basename(os.fspath(path))
    room = NAME_MAX - _OWN_TEMP_SUFFIX_BYTES
    if len(os.fsencode(name)) > room:
        raise ValueError(
            f"file name {name[:60]!r}... is {len(os.fsencode(name))} bytes; obsckpt writes "
            f"a file through a temp file named beside it, so a name may have at most {room} "
            f"bytes (the filesystem's limit is {NAME_MAX}). Use a shorter name"
        )


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One file of a step, as a manifest records it."""

    path: str  # relative to the step directory
    size: int
    crc32: int
    # The object's ETag, for a file that is an object in an S3 root (None on a filesystem).
    etag: str | None = None

    def to_json(self) -> dict:
        out: dict = {"path": self.path, "size": self.size, "crc32": f"{self.crc32:08x}"}
        if self.etag is not None:
            out["etag"] = self.etag
        return out

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
        etag = obj.get("etag")
        if etag is not None and (not isinstance(etag, str) or not 0 < len(etag) <= 256):
            raise ValueError(f"{path!r} has etag {etag!r:.80}, not an object's ETag")
        return cls(path=path, size=size, crc32=int(crc, 16), etag=etag)


def kind_of(is_state_dict: bool) -> str:
    return "state_dict" if is_state_dict else "checkpoint"


def step_dir_name(step: int) -> str:
    """``global_step_<N>``: the one spelling of a step's directory name."""
    return f"{STEP_DIR_PREFIX}{validate_step(step)}"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """``<root>/global_step_<N>``."""
    return Path(root) / step_dir_name(step)


def step_location(root: str | os.PathLike, step: int, *parts: str) -> str:
    """``<root>/global_step_<N>/<parts...>`` as a string, for a local root or an ``s3://``
    one alike (a URL keeps its ``//``, which a :class:`~pathlib.Path` would collapse)."""
    text = os.fspath(root)
    if "://" in text:
        return "/".join([text.rstrip("/"), step_dir_name(step), *parts])
    return os.path.join(text, step_dir_name(step), *parts)


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


def step_of_path(path: str | os.PathLike) -> tuple[str, int] | None:
    """``(root, step)`` for a path at or inside ``<root>/global_step_<N>``, else None.

    The innermost step directory counts; ``path`` is made absolute first.
    """
    parts = os.path.abspath(path).split(os.sep)
    for i in range(len(parts) - 1, -1, -1):
        # Only the spelling step_dir() builds: a caller deletes or reads step_dir(root,
        # step), so another spelling (global_step_007) would name a different directory.
        step = step_of_dir_name(parts[i])
        if step is not None:
            return os.sep.join(parts[:i]) or os.sep, step
    return None


def repair_advice(path: str | os.PathLike) -> str:
    """What to do about the bad iteration file ``path`` (one deleting nothing)."""
    root = os.path.dirname(os.fspath(path)) or "."
    return (
        f"`obsckpt repair {root}` points it at the latest whole step on disk (it deletes "
        "nothing); or restore it from a backup"
    )


def parse_iteration(text: str, path: str | os.PathLike) -> int:
    stripped = text.strip()
    if not stripped.isdigit() or not stripped.isascii():
        raise IterationContentError(
            f"{path} holds {text[:40]!r}, not a step number; it must hold one non-negative "
            f"integer. {repair_advice(path)}"
        )
    value = int(stripped)
    if value > MAX_STEP:
        raise IterationContentError(
            f"{path} names step {stripped[:40]}..., beyond 2**63 - 1: not a step number. "
            f"{repair_advice(path)}"
        )
    return value


def manifest_bytes(records: list[FileRecord]) -> bytes:
    """The manifest's JSON, one file per line.

    Built line by line: ``json.dumps(..., indent=...)`` runs the pure-Python
    encoder, which took longer than the rest of a 1,024-file commit.
    """
    head = json.dumps({"version": MANIFEST_FORMAT, "created": time.time()})[:-1]
    lines = ",\n  ".join(json.dumps(r.to_json()) for r in records)
    return f'{head}, "files": [\n  {lines}\n]}}\n'.encode()


def parse_manifest(data: object) -> list[FileRecord]:
    """The records of a manifest's decoded JSON.

    Raises:
        ValueError: it is not a manifest obsckpt writes: another shape, a format other
            than :data:`MANIFEST_FORMAT` (a newer obsckpt wrote it), an entry that is not
            a file inside the step (named by its index), a file listed twice.
    """
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
