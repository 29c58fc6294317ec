"""The demo's checkpoint root: which directories it may use, what a resume keeps, rotation.

The demo removes checkpoints as it runs (it starts over without --resume,
rotates old ones with --keep), so it only uses an empty directory or one
holding its marker file :data:`MARKER`, which it writes there.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import asdict
from pathlib import Path

from obsckpt import commit, layout, reader, rootlock
from obsckpt.demo.config import MARKER, DemoConfig, ModelSpec
from obsckpt.demo.store_root import (
    committed_in_store,
    prepare_store_root,
    rotate_store_state_dicts,
)
from obsckpt.errors import CheckpointDirError, DemoError, IterationFileError, RootInUseError
from obsckpt.store.uri import is_remote

__all__ = ["MARKER", "committed_on_disk", "demo_root", "prepare_root", "rotate_state_dicts"]


def prepare_root(
    cfg: DemoConfig, say, *, dry_run: bool = False
) -> tuple[Path | str, int, int | None]:
    """Create or check the checkpoint root.

    The demo removes checkpoints as it runs (it starts over without --resume,
    rotates old ones with --keep), so it only uses an empty directory or one
    holding its marker file, which it writes there; anything else is refused,
    with --resume too. Resuming removes only steps above both iteration files
    (saves an earlier run never committed): a committed step is never removed.

    With ``dry_run`` it only checks (creating the directory if missing): nothing
    is removed or written and nothing is said, so a run can refuse a root before
    it starts anything.

    Returns:
        The root, the committed checkpoint to resume after (0: none) and, with
        --resume, the committed state-dict step (None: none).
    """
    if is_remote(cfg.ckpt_dir):
        return prepare_store_root(cfg, say, dry_run=dry_run)
    root = Path(cfg.ckpt_dir).expanduser().resolve()
    _ensure_root(root)
    # Before anything is removed: a running job's steps are not this demo's to clear
    # (an earlier demo's monitor that is still ending gets a few seconds).
    try:
        rootlock.check_free(root, wait_s=rootlock.START_WAIT_S)
    except RootInUseError as exc:
        raise DemoError(
            f"--ckpt-dir {root} is in use by a running obsckpt monitor "
            f"({rootlock.describe_holder(exc.holder)}); wait for that job to end or pass "
            "--ckpt-dir with another directory"
        ) from None
    marker = root / MARKER
    if not marker.is_file():
        # A lock file left by a monitor that has ended holds nothing of a job's.
        entries = sorted(e for e in os.listdir(root) if e != rootlock.LOCK_NAME)
        if entries:
            raise DemoError(_foreign_root_message(root, entries))
    try:
        latest = {kind: reader.read_iteration(root, kind) for kind in layout.KINDS}
    except IterationFileError as exc:
        raise DemoError(str(exc)) from exc
    on_disk = reader.steps_on_disk(root)
    ck, sd = latest["checkpoint"], latest["state_dict"]
    if cfg.resume and ck is not None:
        _check_world_size(root, ck, cfg.world_size)
        _check_whole(root, ck)
    if dry_run:
        return root, ck if cfg.resume and ck is not None else 0, sd if cfg.resume else None
    if not cfg.resume:
        if on_disk or ck is not None or sd is not None:
            say(
                f"starting over in {root}: removing {len(on_disk)} step directories of an "
                "earlier demo run (pass --resume to continue from it instead)"
            )
            _clear(root, on_disk)
        resumed, sd = 0, None
    else:
        if ck is None:
            say(f"--resume: {root} holds no committed checkpoint; starting at step 1")
            resumed = 0
        else:
            resumed = ck
        committed = max((s for s in (ck, sd) if s is not None), default=-1)
        # Above both iteration files: saves of an earlier run that never committed,
        # which the resumed run's saves of the same steps would mix with.
        stale = [s for s in on_disk if s > committed]
        if stale:
            say(f"--resume: removing uncommitted steps {stale} (left by an earlier run)")
            _clear(root, stale, iteration_files=False)
    commit.atomic_write(
        marker,
        (json.dumps({"world_size": cfg.world_size, "model": asdict(ModelSpec())}) + "\n").encode(),
    )
    return root, resumed, sd


def _ensure_root(root: Path) -> None:
    """ensure_root, its errors worded for the --ckpt-dir flag."""
    try:
        commit.ensure_root(root)
    except CheckpointDirError as exc:
        if root.exists() and not root.is_dir():
            raise DemoError(
                f"--ckpt-dir {root} is a file, not a directory; pass --ckpt-dir with a "
                "directory (it is created if missing)"
            ) from exc
        cause = exc.__cause__
        why = getattr(cause, "strerror", None) or cause or exc
        raise DemoError(
            f"--ckpt-dir {root} cannot be created or written ({why}); pass --ckpt-dir with "
            "a directory this user can create files in"
        ) from exc


def _foreign_root_message(root: Path, entries: list[str]) -> str:
    ckpt = [
        e for e in entries if layout.STEP_DIR_RE.match(e) or e in layout.ITERATION_FILES.values()
    ]
    shown = ckpt or entries
    names = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    what = "checkpoints the demo did not write" if ckpt else "files the demo did not write"
    return (
        f"{root} holds {what} ({names}) and no {MARKER}; the demo removes old checkpoints "
        "in its directory as it runs (--keep), so it only uses an empty directory or one it "
        "created. Pass --ckpt-dir with a new or empty directory"
    )


def _check_world_size(root: Path, step: int, world_size: int | None) -> None:
    if not layout.step_dir(root, step).is_dir():
        raise DemoError(
            f"{layout.ITERATION_FILES['checkpoint']} in {root} names step {step}, which is not "
            f"on disk, so there is nothing to resume from (see `obsckpt status {root}`)"
        )
    model = layout.model_dir(root, step)
    want = model / layout.shard_name("model", world_size, 0)
    if not want.is_file():
        shards = (layout.MODEL_SHARD_RE.match(p.name) for p in model.glob("*.pt"))
        sizes = sorted({m.group(1) for m in shards if m and m.group(2) == "0"})
        raise DemoError(
            f"step {step} in {root} was not saved by {world_size} ranks "
            f"(found world sizes {sizes or 'none'}); pass --world-size to match it"
        )


def _check_whole(root: Path, step: int) -> None:
    """Refuse to resume from a step whose files do not match its manifest.

    Loading it would fail deep in a trainer rank (or, worse, load damaged state).
    """
    problems = reader.verify_step(layout.step_dir(root, step))
    if problems:
        shown = "; ".join(problems[:3]) + (
            f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        )
        raise DemoError(
            f"--resume: committed step {step} in {root} does not match its manifest ({shown}); "
            f"see `obsckpt verify {shlex.quote(str(root))}`. Restore the step's files, or "
            "start over without --resume (which removes them)"
        )


def _clear(root: Path, steps: list[int], *, iteration_files: bool = True) -> None:
    # Iteration files first, made durable: a crash partway never leaves one naming a
    # step directory that is already gone.
    if iteration_files:
        for name in layout.ITERATION_FILES.values():
            try:
                os.unlink(root / name)
            except FileNotFoundError:
                pass
        commit.fsync_dir(root)
    for step in steps:
        shutil.rmtree(layout.step_dir(root, step), ignore_errors=True)


def rotate_state_dicts(
    root: Path | str, full_steps: list[int], latest: dict[str, int | None]
) -> None:
    """Remove state-dict-only steps below both committed steps (checkpoint sync leaves one a step).

    Full checkpoints are the manager's to keep or remove (``max_ckpt_to_keep``):
    this run's (``full_steps``) and, after --resume, an earlier run's, told by
    their optimizer files.
    """
    if is_remote(root):
        return rotate_store_state_dicts(os.fspath(root), full_steps, latest)
    root = Path(root)
    committed = [s for s in latest.values() if s is not None]
    if len(committed) < len(latest):
        return
    floor = min(committed)
    full = set(full_steps)
    for step in reader.steps_on_disk(root):
        if step < floor and step not in full and not _is_full_checkpoint(root, step):
            shutil.rmtree(layout.step_dir(root, step), ignore_errors=True)


def _is_full_checkpoint(root: Path, step: int) -> bool:
    model = layout.model_dir(root, step)
    return any(any(model.glob(prefix + "*")) for prefix in layout.FULL_CHECKPOINT_PREFIXES)


def demo_root(text: str) -> Path | str:
    """``--ckpt-dir`` as the demo keeps it: a local path (``~`` expanded) or an ``s3://`` URL."""
    return text if is_remote(text) else Path(text).expanduser()


def committed_on_disk(root: Path | str) -> dict[str, int | None]:
    """The steps the iteration files name (None: no file, or one that cannot be read);
    for an ``s3://`` root, the steps its pointer names."""
    if is_remote(root):
        return committed_in_store(os.fspath(root))
    latest: dict[str, int | None] = {}
    for kind in layout.KINDS:
        try:
            latest[kind] = reader.read_iteration(root, kind)
        except IterationFileError:
            latest[kind] = None
    return latest
