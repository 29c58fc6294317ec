"""The checkpoint managers' steps on an ``s3://`` root: the files verl writes beside its
shards and the names a world-size check reads, each on objects instead of a directory
(retention is :func:`obsckpt.integrations.retention.prune`'s, on either; a verified
local copy of a step's files is :class:`obsckpt.store.verified_copy.VerifiedCopy`).

The shards themselves need nothing here: the coordinator streams each into its
object (:meth:`~obsckpt.CheckpointCoordinator.save_state_dict_async`). Imports
neither verl nor boto3 at module level.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from obsckpt.store import layout
from obsckpt.store.scratch import prune, scratch_path


def is_url(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is an object URL (``s3://...``), not a local path."""
    return isinstance(path, str) and "://" in path


def join(base: str, *names: str) -> str:
    """``base/names...``: a URL joined with ``/``, a local path with :func:`os.path.join`."""
    return "/".join([base.rstrip("/"), *names]) if is_url(base) else os.path.join(base, *names)


def save_metadata(
    coordinator: Any,
    url: str,
    step: int,
    write: Callable[[str], Any],
) -> bool:
    """Write a step's small files (HF config, tokenizer, ``fsdp_config.json``) to ``url``.

    ``write(directory)`` writes them into a local scratch directory; each file
    or directory it wrote is then uploaded as one state-dict save of the step
    (slot ``hf_metadata``, registered here, so the step's model commits only
    with them, as on a local root), unless the step is committed already.
    Returns whether anything was saved.
    """
    local = scratch_path(url, coordinator.rank)
    os.makedirs(local, exist_ok=True)
    write(local)
    names = sorted(os.listdir(local))
    if not names:
        prune(local)
        return False
    coordinator.link.register_thread_count(step, state_dict_thread_count=1)
    coordinator.save_sync(
        lambda: None,
        step,
        True,
        name="hf_metadata",
        paths=[f"{url}/{name}" for name in names],
        unless_committed=True,
    )
    prune(local)
    return True


def step_of(url: str) -> tuple[str, int] | None:
    """(root URL, step) of an object URL inside a ``global_step_<N>`` prefix, else None."""
    from obsckpt.store.s3root import split_step_url

    try:
        root, step, _ = split_step_url(url.rstrip("/") + "/-")
    except ValueError:
        return None
    return root, step


def names_under(url: str, listed: set[str]) -> set[str]:
    """The names, relative to ``url`` (a prefix in a step), of the step's manifest
    paths ``listed`` under it."""
    located = step_of(url)
    if located is None:
        return set()
    sub = url.rstrip("/")[len(layout.step_location(*located)) + 1 :]
    return {p[len(sub) + 1 :] for p in listed if p.startswith(sub + "/")} if sub else listed


def written_at(url: str, rank: int | None) -> tuple[str, list[str] | None]:
    """Where a save function that writes files itself writes ``url``, and the ``paths=``
    of its save: for a URL, its scratch path (uploaded after the save), else the path
    itself, written in place (None: the files are found by the commit)."""
    if is_url(url):
        return scratch_path(url, rank), [url]
    return url, None
