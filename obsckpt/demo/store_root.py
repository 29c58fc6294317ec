"""The demo's checkpoint root on S3 (``--ckpt-dir s3://bucket/prefix``).

The same rules as a local root (:mod:`obsckpt.demo.root`): the demo uses an
empty prefix or one holding its marker object, starts over without --resume
(removing the objects an earlier demo run left: its steps, the pointer and the
iteration objects), resumes only from a committed step saved by as many ranks
and whole against its manifest, and removes uncommitted steps before a resumed
run saves them again. Endpoint and credentials come from the standard AWS
settings, which the demo passes on to its Ray workers.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from typing import Any

from obsckpt import layout
from obsckpt.demo.config import MARKER, DemoConfig, ModelSpec
from obsckpt.errors import DemoError
from obsckpt.store.pointer import POINTER_NAME

# What the demo removes when it starts over: besides the step prefixes, the root's
# commit state (the pointer, the iteration objects) and its marker.
_ROOT_OBJECTS = (POINTER_NAME, *layout.ITERATION_FILES.values())


def open_root(url: str) -> Any:
    """The :class:`~obsckpt.store.s3root.S3Root` of ``url``, or a :class:`DemoError`."""
    from obsckpt.store import StoreError
    from obsckpt.store.s3root import open_s3_root

    try:
        store = open_s3_root(url, "--ckpt-dir")
        store.client.list(store.key() + "/", max_keys=1)
    except (StoreError, ValueError, ImportError) as exc:
        raise DemoError(f"--ckpt-dir {url} cannot be used: {exc}") from None
    return store


def prepare_store_root(
    cfg: DemoConfig, say: Any, *, dry_run: bool = False
) -> tuple[str, int, int | None]:
    """:func:`obsckpt.demo.root.prepare_root` for an ``s3://`` root."""
    store = open_root(cfg.ckpt_dir)
    url = store.url
    base = store.key() + "/"
    names = {o.key[len(base) :].split("/", 1)[0] for o in store.client.list(base, max_keys=1000)}
    if MARKER not in names and names:
        shown = ", ".join(sorted(names)[:3]) + (
            f" and {len(names) - 3} more" if len(names) > 3 else ""
        )
        raise DemoError(
            f"{url} holds objects the demo did not write ({shown}) and no {MARKER}; the demo "
            "removes old checkpoints under its prefix as it runs (--keep), so it only uses an "
            "empty prefix or one it created. Pass --ckpt-dir with a new prefix"
        )
    latest = committed_in_store(url, store)
    ck, sd = latest["checkpoint"], latest["state_dict"]
    if cfg.resume and ck is not None:
        _check_step(store, ck, cfg.world_size)
    if dry_run:
        return url, ck if cfg.resume and ck is not None else 0, sd if cfg.resume else None
    steps = store.steps()
    if not cfg.resume:
        if steps or ck is not None or sd is not None:
            say(
                f"starting over in {url}: removing {len(steps)} steps of an earlier demo run "
                "(pass --resume to continue from it instead)"
            )
            # The commit state first: a stop partway never leaves a pointer naming a
            # step that is already gone.
            store.client.delete([store.key(name) for name in _ROOT_OBJECTS])
            store.remove_steps(steps)
        resumed, sd = 0, None
    else:
        if ck is None:
            say(f"--resume: {url} holds no committed checkpoint; starting at step 1")
        resumed = ck or 0
        committed = max((s for s in (ck, sd) if s is not None), default=-1)
        stale = [s for s in steps if s > committed]
        if stale:
            say(f"--resume: removing uncommitted steps {stale} (left by an earlier run)")
            store.remove_steps(stale)
    marker = {"world_size": cfg.world_size, "model": asdict(ModelSpec())}
    store.client.put(store.key(MARKER), (json.dumps(marker) + "\n").encode())
    return url, resumed, sd


def _check_step(store: Any, step: int, world_size: int | None) -> None:
    """Refuse to resume from ``step`` saved by another number of ranks, or not whole."""
    from obsckpt.store import StoreError

    assert world_size is not None, "the plan is resolved before the root is prepared"
    where = shlex.quote(store.url)
    try:
        records = store.committed_records(step)
    except ValueError as exc:
        raise DemoError(f"--resume: {exc} (see `obsckpt status {where}`)") from None
    want = f"{layout.MODEL_SUBDIR}/{layout.shard_name('model', world_size, 0)}"
    if want not in {r.path for r in records}:
        shards = (layout.MODEL_SHARD_RE.match(r.path.rsplit("/", 1)[-1]) for r in records)
        sizes = sorted({m.group(1) for m in shards if m and m.group(2) == "0"})
        raise DemoError(
            f"step {step} in {store.url} was not saved by {world_size} ranks "
            f"(found world sizes {sizes or 'none'}); pass --world-size to match it"
        )
    try:
        problems = store.verify_step(step, deep=False)
    except StoreError as exc:
        raise DemoError(f"--resume: {exc}") from None
    if problems:
        raise DemoError(
            f"--resume: committed step {step} in {store.url} does not match its manifest "
            f"({'; '.join(problems[:3])}); see `obsckpt verify {where}`, or start over "
            "without --resume (which removes it)"
        )


def committed_in_store(url: str, store: Any = None) -> dict[str, int | None]:
    """The steps the root's pointer names (None each when it cannot be read)."""
    from obsckpt.store import StoreError

    try:
        store = store or open_root(url)
        pointer = store.read_pointer()
    except (StoreError, DemoError, ValueError):
        return {kind: None for kind in layout.KINDS}
    return {kind: None if pointer is None else pointer.step(kind) for kind in layout.KINDS}


def rotate_store_state_dicts(
    url: str, full_steps: list[int], latest: dict[str, int | None]
) -> None:
    """:func:`obsckpt.demo.root.rotate_state_dicts` for an ``s3://`` root."""
    if any(s is None for s in latest.values()):
        return
    from obsckpt.store.s3root import shared_s3_root

    store = shared_s3_root(url)
    floor = min(s for s in latest.values() if s is not None)
    full = set(full_steps)
    doomed = []
    for step in store.steps():
        if step >= floor or step in full:
            continue
        records = store.manifest(step) or []
        if not any(
            r.path.split("/")[-1].startswith(layout.FULL_CHECKPOINT_PREFIXES) for r in records
        ):
            doomed.append(step)
    store.remove_steps(doomed)
