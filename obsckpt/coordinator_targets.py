"""Refusing a save's targets outside its step, before anything is written (mixed into
:class:`~obsckpt.coordinator.CheckpointCoordinator`)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from obsckpt.errors import SavePathError
from obsckpt.monitor_link import MonitorLink
from obsckpt.store.file_records import check_targets, path_list
from obsckpt.validators import validate_parts, validate_slot, validate_step

if TYPE_CHECKING:
    from obsckpt.save_job import SaveJob


class TargetChecks:
    """:meth:`check_targets`, and the check every save makes of its own targets."""

    _link: MonitorLink

    if TYPE_CHECKING:

        def _require_monitor(self) -> None: ...

        def _job(self, *args: Any, **kwargs: Any) -> SaveJob: ...  # the coordinator's

    def check_targets(
        self,
        paths: Iterable[str | os.PathLike],
        global_step: int,
        is_state_dict: bool = False,
        *,
        name: str = "sync",
        part: int | None = None,
        parts: int | None = None,
    ) -> None:
        """Refuse, before anything is written, a target outside ``global_step``'s directory.

        For what a save writes before it reaches :meth:`save_sync` or
        :meth:`save_state_dict_async`, or into a directory other ranks' saves
        share (not ``paths=``); ``name``, ``is_state_dict`` and ``part``/``parts``
        as the save will have them. A refused target fails that save and its step.

        Raises:
            SavePathError: a path lies (or resolves) outside this step's directory.
        """
        validate_slot(name)
        validate_step(global_step)
        validate_parts(part, parts)
        self._require_monitor()
        self._check_targets(path_list(paths), name, global_step, is_state_dict, part, parts)

    def _check_targets(
        self,
        paths: list[str] | None,
        name: str,
        step: int,
        is_state_dict: bool,
        part: int | None,
        parts: int | None,
        *,
        through_temp: bool = False,
    ) -> None:
        """Refuse a target outside ``step``'s directory before anything is written.

        The refused save is reported failed before admission, so a step that
        registered it fails now instead of waiting for it.

        Raises:
            SavePathError: see :func:`obsckpt.store.file_records.check_targets`.
        """
        if not paths:
            return
        try:
            root = self._link.checkpoint_root()
            check_targets(paths, root=root, step=step, slot=name, through_temp=through_temp)
        except SavePathError as exc:
            self._job(name, step, is_state_dict, part, parts).fail_unstarted(exc)
            raise
