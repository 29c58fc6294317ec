"""Which saved steps retention may delete: never the latest committed one, nor newer ones.

Shared by the FSDP and Megatron checkpoint managers, on a local root and an ``s3://``
one alike (through the root's :class:`~obsckpt.store.roots.StepStore`); imports
neither verl nor torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from obsckpt.store import layout

logger = logging.getLogger(__name__)

step_of = layout.step_of_path  # the name this module's callers know


def select_for_removal(
    saved: list[str],
    max_ckpt_to_keep: int | None,
    latest: dict[str, int | None],
    step_of: Callable[[str], tuple[Any, int] | None] = layout.step_of_path,
) -> list[str]:
    """Which of ``saved`` (oldest first) retention may delete now.

    Keeps the newest ``max_ckpt_to_keep`` paths and, beyond those, anything
    that is not provably superseded: a path outside a ``global_step_<N>``
    directory, the latest committed step of either kind, and every step newer
    than the latest committed checkpoint (in flight, or not yet known failed).
    """
    if not (isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0):
        return []
    committed = latest.get("checkpoint")
    if committed is None:
        return []
    protected = {s for s in latest.values() if s is not None}
    removable = []
    for path in saved[: max(0, len(saved) - max_ckpt_to_keep)]:
        located = step_of(path)
        if located is None:
            continue
        step = located[1]
        if step in protected or step > committed:
            continue
        removable.append(path)
    return removable


def locate(path: str) -> tuple[str, int] | None:
    """(root, step) of a path or object URL inside a ``global_step_<N>`` directory."""
    if "://" in path:
        from obsckpt.integrations.object_steps import step_of as step_of_url

        return step_of_url(path)
    located = step_of(os.path.abspath(path))
    return None if located is None else (str(located[0]), located[1])


def prune(saved: list[str], max_ckpt_to_keep: int | None) -> list[str]:
    """Remove the steps of ``saved`` (oldest first) that retention may delete now
    (:func:`select_for_removal`); returns the paths of ``saved`` that went.

    Whole steps go, the manifest first (``huggingface/`` and all, not only a
    manager's own sub-directory: a step left with a manifest and no files would
    look damaged), through the root's :class:`~obsckpt.store.roots.StepStore`.
    When the committed steps cannot be read nothing is removed (logged): which
    step is committed is then unknown, and the save that just succeeded must not
    fail for it.
    """
    from obsckpt.store import StoreError
    from obsckpt.store.roots import open_step_store

    located = locate(saved[-1]) if saved else None
    if located is None:
        return []
    store = open_step_store(located[0])
    try:
        latest = store.committed_steps()
    except (ValueError, StoreError) as exc:
        logger.error("obsckpt: retention skipped, cannot read the committed steps: %s", exc)
        return []
    doomed = select_for_removal(saved, max_ckpt_to_keep, latest, step_of=locate)
    store.remove_steps(sorted({step for path in doomed if (step := _step(path)) is not None}))
    return doomed


def _step(path: str) -> int | None:
    located = locate(path)
    return None if located is None else located[1]
