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

from obsckpt import commit, layout, reader

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BadIteration:
    """An iteration file naming a step that is not whole."""

    kind: str  # "checkpoint" or "state_dict"
    path: Path  # the iteration file
    named: int  # the step it names
    problem: str  # why that step is not whole
    latest_whole: int | None  # the step a rewind would name (None: none is whole)

    def describe(self) -> str:
        whole = "none" if self.latest_whole is None else f"step {self.latest_whole}"
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


def _is_full(root: str | os.PathLike, step: int) -> bool:
    try:
        records = reader.read_manifest(layout.step_dir(root, step))
    except (ValueError, OSError):
        return False
    return any(
        os.path.basename(r.path).startswith(layout.FULL_CHECKPOINT_PREFIXES) for r in records
    )


def latest_whole_step(
    root: str | os.PathLike, kind: str, *, below: int | None = None, checksums: bool = False
) -> int | None:
    """The newest whole step (below ``below``) an iteration file of ``kind`` may name.

    A ``checkpoint`` file names a full checkpoint where the root has any (verl's
    optimizer and extra-state files); a ``state_dict`` file any whole step.
    """
    steps = [s for s in reader.steps_on_disk(root) if below is None or s < below]
    full = {s: _is_full(root, s) for s in steps} if kind == "checkpoint" else {}
    need_full = any(full.values())
    for step in reversed(steps):
        if need_full and not full[step]:
            continue
        if step_problem(root, step, checksums=checksums) is None:
            return step
    return None


def check_iterations(root: str | os.PathLike, *, checksums: bool = False) -> list[BadIteration]:
    """The iteration files of ``root`` that name a step that is not whole.

    A root no step of which has a manifest was written before obsckpt committed
    there (verl's own checkpointing): nothing says its steps are whole or not, so
    nothing is reported for it.

    Raises:
        IterationFileError: an iteration file does not hold a step number.
    """
    steps = reader.steps_on_disk(root)
    foreign = steps and not any(
        (layout.step_dir(root, s) / layout.MANIFEST_NAME).is_file() for s in steps
    )
    bad = []
    for kind in layout.KINDS:
        named = reader.read_iteration(root, kind)
        if named is None:
            continue
        if foreign and layout.step_dir(root, named).is_dir():
            continue
        problem = step_problem(root, named, checksums=checksums)
        if problem is not None:
            whole = latest_whole_step(root, kind, below=named, checksums=checksums)
            path = Path(root) / layout.ITERATION_FILES[kind]
            bad.append(BadIteration(kind, path, named, problem, whole))
    return bad


def rewind(root: str | os.PathLike, found: list[BadIteration] | None = None) -> list[str]:
    """Point every iteration file naming a step that is not whole at the latest whole one.

    ``found`` is what ``check_iterations(root, checksums=True)`` returned (found
    again when None): the step each file is pointed at has been checked in full,
    CRC32s included. Each file is rewritten atomically (temp file, fsync, rename);
    one for which no whole step exists is renamed aside (``<name>.bad-<unix
    time>``), never deleted. Returns what was done, one line per file (also logged).
    """
    done = []
    for bad in check_iterations(root, checksums=True) if found is None else found:
        whole = bad.latest_whole
        if whole is not None:
            # Backwards on purpose, so not write_iteration (which only moves forward).
            commit.atomic_write(bad.path, f"{whole}\n".encode())
            line = f"{bad.path}: step {bad.named} -> {whole} ({bad.problem})"
        else:
            aside = bad.path.with_name(f"{bad.path.name}.bad-{int(time.time())}")
            os.replace(bad.path, aside)
            commit.fsync_dir(bad.path.parent)
            line = f"{bad.path}: moved to {aside.name}, no whole step to name ({bad.problem})"
        logger.warning("obsckpt repair: %s", line)
        done.append(line)
    return done
