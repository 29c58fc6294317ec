"""The demo's checkpoint root: which roots it may use, what a resume keeps, rotation.

The demo removes checkpoints as it runs (it starts over without --resume,
rotates old ones with --keep), so it only uses an empty root (a directory, or
an ``s3://`` prefix) or one holding its marker :data:`MARKER`, which it writes
there. Both kinds of root are reached through the storage layer's
:class:`~obsckpt.store.roots.StepStore`; only making a directory and checking
that no monitor holds it are a directory's own.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict
from pathlib import Path

from obsckpt.demo.config import MARKER, DemoConfig, ModelSpec
from obsckpt.errors import (
    CheckpointDirError,
    DemoError,
    ObsckptError,
    RootInUseError,
    StoreError,
)
from obsckpt.store import commit, layout, rootlock
from obsckpt.store.pointer import POINTER_NAME
from obsckpt.store.roots import StepStore, open_step_store
from obsckpt.store.uri import is_remote

__all__ = ["MARKER", "committed_on_disk", "demo_root", "prepare_root", "rotate_state_dicts"]


def prepare_root(
    cfg: DemoConfig, say, *, dry_run: bool = False
) -> tuple[Path | str, int, int | None]:
    """Create or check the checkpoint root.

    The demo removes checkpoints as it runs (it starts over without --resume,
    rotates old ones with --keep), so it only uses an empty root or one holding
    its marker, which it writes there; anything else is refused, with --resume
    too. Resuming removes only steps above both committed steps (saves an
    earlier run never committed): a committed step is never removed.

    With ``dry_run`` it only checks (creating a directory if missing): nothing
    is removed or written and nothing is said, so a run can refuse a root before
    it starts anything.

    Returns:
        The root (a resolved directory, or the ``s3://`` URL), the committed
        checkpoint to resume after (0: none) and, with --resume, the committed
        state-dict step (None: none).
    """
    store = _open(cfg.ckpt_dir)
    try:
        names = store.names()
    except StoreError as exc:  # the endpoint, the bucket or the credentials
        raise DemoError(f"--ckpt-dir {store.url} cannot be used: {exc}") from None
    if MARKER not in names and names:
        raise DemoError(_foreign_root_message(store, names))
    try:
        latest = store.committed_steps()
    except ValueError as exc:  # an iteration file that cannot be read
        raise DemoError(str(exc)) from exc
    ck, sd = latest["checkpoint"], latest["state_dict"]
    if cfg.resume and ck is not None:
        _check_step(store, ck, cfg.world_size)
    root: Path | str = store.url if is_remote(store.url) else Path(store.url)
    if dry_run:
        return root, ck if cfg.resume and ck is not None else 0, sd if cfg.resume else None
    steps = store.steps()
    if not cfg.resume:
        if steps or ck is not None or sd is not None:
            say(
                f"starting over in {store.url}: removing {len(steps)} steps of an earlier "
                "demo run (pass --resume to continue from it instead)"
            )
            # What names committed steps first: a stop partway never leaves it naming
            # a step that is already gone.
            store.clear_commit_state()
            store.remove_steps(steps)
        resumed, sd = 0, None
    else:
        if ck is None:
            say(f"--resume: {store.url} holds no committed checkpoint; starting at step 1")
        resumed = ck or 0
        committed = max((s for s in (ck, sd) if s is not None), default=-1)
        # Above both committed steps: saves of an earlier run that never committed,
        # which the resumed run's saves of the same steps would mix with.
        stale = [s for s in steps if s > committed]
        if stale:
            say(f"--resume: removing uncommitted steps {stale} (left by an earlier run)")
            store.remove_steps(stale)
    marker = {"world_size": cfg.world_size, "model": asdict(ModelSpec())}
    store.put_small(MARKER, (json.dumps(marker) + "\n").encode())
    return root, resumed, sd


def _open(ckpt_dir: str) -> StepStore:
    """The root's store (a directory: made, and checked free of a running monitor); errors
    worded for --ckpt-dir."""
    if is_remote(ckpt_dir):
        from obsckpt.store.s3root import open_s3_root

        try:
            return open_s3_root(ckpt_dir, "--ckpt-dir")
        except (StoreError, ValueError, ImportError) as exc:
            raise DemoError(f"--ckpt-dir {ckpt_dir} cannot be used: {exc}") from None
    root = Path(ckpt_dir).expanduser().resolve()
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
    return open_step_store(root)


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


def _foreign_root_message(store: StepStore, names: list[str]) -> str:
    commit_state = {POINTER_NAME, *layout.ITERATION_FILES.values()}
    ckpt = [n for n in names if layout.STEP_DIR_RE.match(n) or n in commit_state]
    shown = ckpt or names
    listed = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    remote = is_remote(store.url)
    what = "checkpoints" if ckpt else "objects" if remote else "files"
    where = "prefix" if remote else "directory"
    return (
        f"{store.url} holds {what} the demo did not write ({listed}) and no {MARKER}; the "
        f"demo removes old checkpoints in its {where} as it runs (--keep), so it only uses "
        f"an empty {where} or one it created. Pass --ckpt-dir with a new or empty {where}"
    )


def _check_step(store: StepStore, step: int, world_size: int | None) -> None:
    """Refuse to resume from ``step`` when it was saved by another number of ranks, or
    does not match its manifest (loading it would fail deep in a trainer rank or, worse,
    load damaged state)."""
    assert world_size is not None, "the plan is resolved before the root is prepared"
    where = shlex.quote(store.url)
    try:
        records = store.committed_records(step)
    except ValueError as exc:
        raise DemoError(
            f"--resume: step {step} is committed in {store.url} but cannot be resumed from "
            f"({exc}); see `obsckpt status {where}`"
        ) from None
    want = f"{layout.MODEL_SUBDIR}/{layout.shard_name('model', world_size, 0)}"
    if want not in {r.path for r in records}:
        shards = (layout.MODEL_SHARD_RE.match(r.path.rsplit("/", 1)[-1]) for r in records)
        sizes = sorted({m.group(1) for m in shards if m and m.group(2) == "0"})
        raise DemoError(
            f"step {step} in {store.url} was not saved by {world_size} ranks "
            f"(found world sizes {sizes or 'none'}); pass --world-size to match it"
        )
    try:
        problems = store.verify_step(step)
    except StoreError as exc:
        raise DemoError(f"--resume: {exc}") from None
    if problems:
        shown = "; ".join(problems[:3]) + (
            f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        )
        raise DemoError(
            f"--resume: committed step {step} in {store.url} does not match its manifest "
            f"({shown}); see `obsckpt verify {where}`. Restore the step's files, or start "
            "over without --resume (which removes them)"
        )


def rotate_state_dicts(
    root: Path | str, full_steps: list[int], latest: dict[str, int | None]
) -> None:
    """Remove state-dict-only steps below both committed steps (checkpoint sync leaves one a step).

    Full checkpoints are the manager's to keep or remove (``max_ckpt_to_keep``):
    this run's (``full_steps``) and, after --resume, an earlier run's, told by
    their optimizer files in the step's manifest.
    """
    if any(s is None for s in latest.values()):
        return
    store = open_step_store(root)
    floor = min(s for s in latest.values() if s is not None)
    full = set(full_steps)
    doomed = []
    for step in store.steps():
        if step >= floor or step in full:
            continue
        try:
            records = store.manifest(step) or []
        except ValueError:
            continue  # not a manifest obsckpt can read: not the demo's to remove
        names = (r.path.rsplit("/", 1)[-1] for r in records)
        if not any(n.startswith(layout.FULL_CHECKPOINT_PREFIXES) for n in names):
            doomed.append(step)
    store.remove_steps(doomed)


def demo_root(text: str) -> Path | str:
    """``--ckpt-dir`` as the demo keeps it: a local path (``~`` expanded) or an ``s3://`` URL."""
    return text if is_remote(text) else Path(text).expanduser()


def committed_on_disk(root: Path | str) -> dict[str, int | None]:
    """The committed step of each kind (None: none, or what names it cannot be read)."""
    try:
        return open_step_store(os.fspath(root)).committed_steps()
    except (ObsckptError, ValueError, OSError, ImportError):
        return {kind: None for kind in layout.KINDS}
