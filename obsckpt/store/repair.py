"""Whether a root's iteration files name whole steps, and the repair that rewinds them.

An iteration file that names a step that is not whole (its directory missing,
no manifest, a listed file gone or of another size) would have the monitor
treat every newer save as a re-save of an already committed step, and a
resume load a partial step. :func:`check_iterations` finds such a file;
:func:`rewind` points it at the latest whole step on disk, atomically, and
deletes nothing (with no whole step, the file is renamed aside).

The monitor's start-up check reads manifests and file sizes only (a root
holds hundreds of gigabytes); ``obsckpt repair`` and :func:`rewind` also
check every candidate's CRC32s before pointing a file at it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from obsckpt.errors import IterationContentError
from obsckpt.store import commit, layout, reader

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BadIteration:
    """An iteration file naming a step that is not whole."""

    kind: str  # "checkpoint" or "state_dict"
    path: Path  # the iteration file
    named: int | None  # the step it names (None: it holds no step number)
    problem: str  # why that step is not whole, or what the file holds
    latest_whole: int | None  # the step a rewind would name (None: none is whole)

    def describe(self) -> str:
        whole = "none" if self.latest_whole is None else f"step {self.latest_whole}"
        if self.named is None:
            return f"{self.path} {self.problem}; the latest whole step on disk is {whole}"
        return (
            f"{self.path} names step {self.named}, which is not whole ({self.problem}); "
            f"the latest whole step on disk is {whole}"
        )


def step_problem(root: str | os.PathLike, step: int, *, checksums: bool = False) -> str | None:
    """Why ``step`` of ``root`` is not whole, or None when it is.

    Whole: its directory and manifest are there, the manifest reads, and every
    file it lists is there with the listed size (and, with ``checksums``, CRC32).
    """
    sdir = layout.step_dir(root, step)
    if not sdir.is_dir():
        return f"{sdir} does not exist"
    if not (sdir / layout.MANIFEST_NAME).is_file():
        missing = reader.missing_shards(sdir)
        lacks = f"; {_listed(missing)} missing" if missing else ""
        return f"no manifest.json: never committed by obsckpt{lacks}"
    if checksums:
        problems = reader.verify_step(sdir, unlisted_files=False)
        if not problems:
            return None
        more = f"; and {len(problems) - 2} more" if len(problems) > 2 else ""
        return "; ".join(problems[:2]) + more
    try:
        records = reader.read_manifest(sdir)
    except FileNotFoundError:
        return "no manifest.json: never committed by obsckpt"
    except (ValueError, OSError) as exc:
        return f"unreadable manifest.json ({exc})"
    for rec in records:
        try:
            size = os.stat(sdir / rec.path).st_size
        except OSError:
            return f"{rec.path} is missing"
        if size != rec.size:
            return f"{rec.path} is {size} bytes, the manifest says {rec.size}"
    return None


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def foreign_problem(root: str | os.PathLike, step: int) -> str | None:
    """Why ``step`` of a root obsckpt never committed in (no manifest anywhere) is not
    whole: its directory is missing, or it lacks rank shards. None: nothing says so."""
    sdir = layout.step_dir(root, step)
    if not sdir.is_dir():
        return f"{sdir} does not exist"
    missing = reader.missing_shards(sdir)
    if missing:
        return f"no manifest.json (not written by obsckpt), and {_listed(missing)} missing"
    return None


def _is_full(root: str | os.PathLike, step: int, foreign: bool = False) -> bool:
    sdir = layout.step_dir(root, step)
    if foreign:
        names = [n for _d, ns in reader.walk_files(os.fspath(sdir)) for n in ns]
    else:
        try:
            names = [os.path.basename(r.path) for r in reader.read_manifest(sdir)]
        except (ValueError, OSError):
            return False
    return any(n.startswith(layout.FULL_CHECKPOINT_PREFIXES) for n in names)


def latest_whole_step(
    root: str | os.PathLike,
    kind: str,
    *,
    below: int | None = None,
    checksums: bool = False,
    foreign: bool = False,
) -> int | None:
    """The newest whole step (below ``below``) an iteration file of ``kind`` may name.

    A ``checkpoint`` file names a full checkpoint where the root has any (verl's
    optimizer and extra-state files); a ``state_dict`` file any whole step. In a
    ``foreign`` root (no manifest anywhere) whole means no rank shard missing.
    """
    steps = [s for s in reader.steps_on_disk(root) if below is None or s < below]
    full = {s: _is_full(root, s, foreign) for s in steps} if kind == "checkpoint" else {}
    need_full = any(full.values())
    for step in reversed(steps):
        if need_full and not full[step]:
            continue
        if foreign:
            problem = foreign_problem(root, step)
        else:
            problem = step_problem(root, step, checksums=checksums)
        if problem is None:
            return step
    return None


def check_iterations(root: str | os.PathLike, *, checksums: bool = False) -> list[BadIteration]:
    """The iteration files of ``root`` that name a step that is not whole.

    A root no step of which has a manifest was written before obsckpt committed
    there (verl's own checkpointing): only a missing step directory or a missing
    rank shard (by the world size the shards name) tells that a step is not whole.
    A file that holds no step number (empty, text) is reported too, with the
    latest whole step of all.

    Raises:
        IterationFileError: an iteration file cannot be read (a read error, a
            directory in its place): leave it, as the error says.
    """
    steps = reader.steps_on_disk(root)
    foreign = bool(steps) and not any(
        (layout.step_dir(root, s) / layout.MANIFEST_NAME).is_file() for s in steps
    )
    bad = []
    for kind in layout.KINDS:
        path = Path(root) / layout.ITERATION_FILES[kind]
        try:
            named = reader.read_iteration(root, kind)
        except IterationContentError:
            held = _held(path)
            whole = latest_whole_step(root, kind, checksums=checksums, foreign=foreign)
            bad.append(BadIteration(kind, path, None, f"holds {held}, not a step number", whole))
            continue
        if named is None:
            continue
        if foreign:
            problem = foreign_problem(root, named)
        else:
            problem = step_problem(root, named, checksums=checksums)
        if problem is not None:
            whole = latest_whole_step(root, kind, below=named, checksums=checksums, foreign=foreign)
            bad.append(BadIteration(kind, path, named, problem, whole))
    return bad


def _held(path: Path) -> str:
    """What a bad iteration file holds, shortly: ``nothing`` or ``'abc'``."""
    with open(path, "rb") as f:
        raw = f.read(41)
    if not raw.strip():
        return "nothing" if not raw else "only white space"
    text = raw[:40].decode("utf-8", errors="replace").strip()
    return repr(text) + ("..." if len(raw) > 40 else "")


def rewind(
    root: str | os.PathLike, found: list[BadIteration] | None = None, *, log: bool = True
) -> list[str]:
    """Point every iteration file naming a step that is not whole at the latest whole one.

    ``found`` is what ``check_iterations(root, checksums=True)`` returned (found
    again when None): the step each file is pointed at has been checked in full,
    CRC32s included. Each file is rewritten atomically (temp file, fsync, rename);
    one for which no whole step exists is renamed aside (``<name>.bad-<unix
    time>``), never deleted. Returns what was done, one line per file (also logged,
    unless ``log`` is False: ``obsckpt repair`` prints the lines itself).
    """
    done = []
    for bad in check_iterations(root, checksums=True) if found is None else found:
        whole = bad.latest_whole
        if whole is not None:
            # Backwards on purpose, so not write_iteration (which only moves forward).
            commit.atomic_write(bad.path, f"{whole}\n".encode())
            if bad.named is None:
                line = f"{bad.path}: {bad.problem}; it now names step {whole}"
            else:
                line = f"{bad.path}: step {bad.named} -> {whole} ({bad.problem})"
        else:
            aside = bad.path.with_name(f"{bad.path.name}.bad-{int(time.time())}")
            os.replace(bad.path, aside)
            commit.fsync_dir(bad.path.parent)
            line = f"{bad.path}: moved to {aside.name}, no whole step to name ({bad.problem})"
        if log:
            logger.warning("obsckpt repair: %s", line)
        done.append(line)
    return done
