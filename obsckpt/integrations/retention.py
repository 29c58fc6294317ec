"""Which saved steps retention may delete: never the latest committed one, nor newer ones.

Shared by the FSDP and Megatron checkpoint managers; imports neither verl nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from obsckpt import layout, reader

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


def removable(saved: list[str], max_ckpt_to_keep: int | None) -> tuple[list[str], list[str]]:
    """``(paths, step_dirs)``: which of ``saved`` retention deletes now, and their step dirs.

    The whole ``global_step_<N>`` directory goes (manifest, ``huggingface/`` and
    all), not only a manager's own sub-directory: a step directory left with a
    manifest and no files would look like a damaged step. When an iteration
    file cannot be read nothing is deleted (logged): which step is committed
    is then unknown, and the save that just succeeded must not fail for it.
    """
    located = step_of(saved[-1]) if saved else None
    if located is None:
        return [], []
    try:
        latest = {kind: reader.read_iteration(located[0], kind) for kind in layout.KINDS}
    except ValueError as exc:
        logger.error("obsckpt: retention skipped, cannot read iteration files: %s", exc)
        return [], []
    doomed = select_for_removal(saved, max_ckpt_to_keep, latest)
    step_dirs = sorted({str(layout.step_dir(*step_of(path))) for path in doomed})
    return doomed, step_dirs
