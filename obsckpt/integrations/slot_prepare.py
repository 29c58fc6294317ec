"""Preparing a checkpoint manager's save slots ahead of its first save.

A trainer that never calls ``CheckpointCoordinator.prepare`` (verl's and
Trinity's do not) would pay the staging's allocation and page faults in its
first save's stall. The FSDP manager prepares its model and extra-state
slots when it is built, and its optimizer slot after the optimizer's first
step (when the optimizer's state exists), with the hook here.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def prepare_slots(manager: Any, model_slot: str) -> None:
    """Make ``manager``'s save slots' staging in the background ahead of the first save, so
    that it stalls no longer than a later one: the model's (``model_slot``) and the extra
    state's now, the optimizer's after its first step (when its state exists). A slot
    whose first save comes first waits for its prepare, no longer than a cold save takes."""
    try:
        if manager.model is not None and manager.should_save_model:
            state = manager._model_state_dict(lora_only=manager.saves_lora_only)
            manager.coordinator.prepare(model_slot, state, background=True)
        if manager.should_save_extra:
            manager.coordinator.prepare("extra_state", manager._extra_state(), background=True)
        if manager.optimizer is not None and manager.should_save_optimizer:
            manager.optimizer.register_step_post_hook(prepare_after_first_step(manager))
    except Exception as exc:  # noqa: BLE001 - a first save then allocates, as without
        logger.warning("obsckpt: the save slots were not prepared ahead of the first save: %s", exc)


def prepare_after_first_step(manager: Any) -> Callable[..., None]:
    """An optimizer step hook that prepares ``manager``'s optimizer slot once, after the
    first step (the state exists then); a no-op afterwards (a hook cannot remove itself
    while the optimizer runs its hooks). It holds the manager weakly."""
    ref = weakref.ref(manager)
    done = False

    def hook(*_: Any) -> None:
        nonlocal done
        m = ref()
        if done or m is None:
            return
        done = True
        try:
            state = m._sharded(m.optimizer.state_dict)
            m.coordinator.prepare("optim", state, background=True)
        except Exception as exc:  # noqa: BLE001 - never fails the training step
            logger.warning("obsckpt: the optimizer's save slot was not prepared: %s", exc)

    return hook
