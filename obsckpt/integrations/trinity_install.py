"""Switch a stock Trinity-RFT job to obsckpt without editing Trinity: a Trinity plugin.

Trinity-RFT loads every ``*.py`` of its plugin directories (``trinity run
--plugin-dir DIR`` or ``TRINITY_PLUGIN_DIRS``) in its launcher, and again in
its trainer and explorer actors, before they build anything. obsckpt ships
such a plugin (:data:`PLUGIN_DIR`); ``python -m obsckpt.trinity`` runs
Trinity's own CLI with it added. The plugin calls :func:`install`, which

* rebinds, in every Trinity module that binds them (:data:`SITES`), the names
  ``Synchronizer``, ``CheckpointCoordinator`` and ``CheckpointMonitor`` to
  obsckpt's: now for the modules already imported, and right after each of
  the others is imported, so the import order does not matter;
* in the launcher (before Ray starts), adds a Ray ``worker_process_setup_hook``
  to the job's ``runtime_env``, so every process of the job (the trainer's
  verl workers and the rollout models, which load no plugins) does the same,
  and passes the launcher's ``OBSCKPT_*`` variables on to them: the monitor
  is created in the trainer's process and takes its options from there;
* keeps ``torch.save`` off the files a committed step's manifest lists
  (:func:`guard_committed_files`): Trinity's workers save a full checkpoint
  on every rank, and save the last step again at the end of training.

Trinity's named actors (``checkpoint_monitor``, ``synchronizer``) are found
by name with ``get_if_exists``: whichever process creates one first decides
its class, so the hook matters for the processes that create them and the
rest find obsckpt's.

The monitor's options: Trinity's own config gives the root
(``checkpoint_job_dir``) and ``trainer.save_strategy``; every other option
comes from the ``OBSCKPT_*`` variables (:data:`obsckpt.options.SETTINGS`),
which win over the config (see docs/integrations.md).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path
from typing import Any

from obsckpt.errors import UnsupportedStoreError, UnverifiedCheckpointError
from obsckpt.integrations._rebind import Rebinder, with_setup_hook, wrap_ray_init
from obsckpt.integrations._rebind import original as _original
from obsckpt.monitor import CheckpointMonitor
from obsckpt.monitor.lifecycle import start_actor
from obsckpt.options import OBSCKPT_MIRROR, MonitorOptions
from obsckpt.store import layout
from obsckpt.store.loading import CommittedStep
from obsckpt.store.uri import is_remote, joined_url_scheme, local_root

__all__ = [
    "HOOK",
    "PLUGIN_DIR",
    "SITES",
    "TrinityCheckpointMonitor",
    "guard_committed_files",
    "install",
    "is_patched",
    "original",
    "patch",
    "runtime_env",
    "worker_setup",
]

HOOK = "obsckpt.integrations.trinity_install.worker_setup"
# The directory to give Trinity as a plugin directory: it holds obsckpt's plugin only.
PLUGIN_DIR = str(Path(__file__).with_name("trinity_plugin"))

_SYNC = "obsckpt.sync.synchronizer:Synchronizer"
_COORDINATOR = "obsckpt.coordinator:CheckpointCoordinator"
_MONITOR = "obsckpt.integrations.trinity_install:TrinityCheckpointMonitor"

# Trinity-RFT 0.6.0 module -> {name bound there: obsckpt's object}. The verl
# trainer (``trinity.trainer.verl``, verl >= 0.8) and the legacy one
# (``trinity.trainer.verl_legacy``, verl < 0.8) are both covered.
SITES: dict[str, dict[str, str]] = {
    "trinity.manager.synchronizer": {"Synchronizer": _SYNC},
    "trinity.manager": {"Synchronizer": _SYNC},
    "trinity.trainer.trainer": {"Synchronizer": _SYNC},
    "trinity.explorer.explorer": {"Synchronizer": _SYNC},
    "trinity.trainer.tinker.tinker_trainer": {"Synchronizer": _SYNC},
    "trinity.common.models.sglang_model": {"Synchronizer": _SYNC},
    "trinity.common.models.tinker_model": {"Synchronizer": _SYNC},
    "trinity.trainer.verl.checkpoint": {"CheckpointCoordinator": _COORDINATOR},
    "trinity.trainer.verl.trainer": {
        "CheckpointCoordinator": _COORDINATOR,
        "CheckpointMonitor": _MONITOR,
    },
    "trinity.trainer.verl.workers": {"Synchronizer": _SYNC, "CheckpointCoordinator": _COORDINATOR},
    "trinity.trainer.verl.fsdp_engine": {"CheckpointCoordinator": _COORDINATOR},
    "trinity.trainer.verl.megatron_engine": {"CheckpointCoordinator": _COORDINATOR},
    "trinity.trainer.verl_legacy.verl_trainer": {"CheckpointMonitor": _MONITOR},
    "trinity.trainer.verl_legacy.fsdp_checkpoint_manager": {
        "Synchronizer": _SYNC,
        "CheckpointMonitor": _MONITOR,
    },
    "trinity.trainer.verl_legacy.megatron_checkpoint_manager": {
        "Synchronizer": _SYNC,
        "CheckpointMonitor": _MONITOR,
    },
    "trinity.trainer.verl_legacy.megatron_workers": {"Synchronizer": _SYNC},
}

logger = logging.getLogger(__name__)
_rebinder = Rebinder(SITES)
_lock = threading.RLock()


class TrinityCheckpointMonitor(CheckpointMonitor):
    """obsckpt's monitor as Trinity's trainer asks for it: ``get_actor`` takes its options
    from Trinity's arguments and the ``OBSCKPT_*`` variables (which win)."""

    @classmethod
    def get_actor(  # type: ignore[override]
        cls,
        namespace: str | None = None,
        save_strategy: Any = None,
        default_local_dir: str | os.PathLike[str] | None = None,
        default_hdfs_dir: str | None = None,
    ) -> Any:
        """The job's ``checkpoint_monitor`` (created from obsckpt's class if absent).

        Without ``default_local_dir`` (Trinity's workers) the running one is returned.

        Raises:
            ValueError: as :meth:`CheckpointMonitor.get_actor`, or an ``OBSCKPT_*``
                variable an option refuses (named).
        """
        if default_local_dir is None:
            return CheckpointMonitor.get_actor(namespace)
        # Trinity's trainer submits each step (register_and_monitor).
        trinity_given: dict[str, Any] = {"namespace": namespace, "trainer_submits": True}
        if save_strategy is not None:
            trinity_given["save_strategy"] = save_strategy
        if default_hdfs_dir is not None:
            trinity_given["default_hdfs_dir"] = default_hdfs_dir
        given = os.fspath(default_local_dir)
        if joined_url_scheme(given) is not None or is_remote(given):
            # Trinity's config check makes a relative checkpoint_root_dir absolute, so
            # s3://b/run reaches here as <cwd>/s3:/b/run.
            raise UnsupportedStoreError(
                f"checkpoint_job_dir={given!r} (from checkpoint_root_dir): Trinity-RFT keeps "
                "its job directory on a local filesystem (its state files, logs, experience "
                "buffer, and the checkpoints its explorer and trainer read back by path), so "
                "obsckpt's Trinity switch takes a local (shared) directory; to keep its "
                "checkpoints on S3 as well, set OBSCKPT_MIRROR=s3://bucket/prefix: each "
                "committed step is copied and committed there, and a job started on an "
                "empty directory resumes from it (docs/storage.md)"
            )
        # Checked here: from_settings names a refused value among the job's settings.
        root = local_root(default_local_dir)
        options = MonitorOptions.from_settings(root, None, **trinity_given)
        return start_actor(CheckpointMonitor, options)


def install() -> None:
    """Switch this process, and the Ray job it starts next, to obsckpt (idempotent).

    In Trinity's launcher (Ray not started yet) the job's ``runtime_env`` gets
    the worker hook and the ``OBSCKPT_*`` variables; in a process of a running
    job (Trinity's trainer and explorer actors) only this process is patched.
    """
    patch()
    import ray

    if not ray.is_initialized():
        wrap_ray_init(ray, HOOK, runtime_env)


def patch() -> None:
    """Rebind Trinity's names in this process, now and as its modules are imported, and
    keep ``torch.save`` off the files of committed steps (:func:`guard_committed_files`)."""
    _rebinder.patch()
    guard_committed_files()


def guard_committed_files() -> None:
    """Make ``torch.save`` leave a file that a committed step's manifest lists as it is.

    Trinity's workers save a full checkpoint with ``torch.save`` on every rank,
    outside any obsckpt call on all ranks but the first; at the end of training
    they save the last step again, which may be committed already. Rewriting
    its files in place would change what the manifest vouches for (and a crash
    would leave them torn), so such a write is skipped and logged: the step
    keeps the files it was committed with. Files the manifest does not list
    (a full checkpoint of a step whose state dict alone was committed) are
    written as usual.
    """
    import torch

    with _lock:
        save = torch.save
        if getattr(save, "obsckpt_guard", False):
            return

        @functools.wraps(save)
        def guarded_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, os.PathLike)) and _committed_file(f):
                logger.warning(
                    "obsckpt: %s not written again: its step is committed and its manifest "
                    "lists this file; the step keeps the file it was committed with",
                    os.fspath(f),
                )
                return None
            return save(obj, f, *args, **kwargs)

        guarded_save.obsckpt_guard = True  # type: ignore[attr-defined]
        torch.save = guarded_save


def _committed_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is listed in the manifest of a committed step."""
    if layout.step_of_path(os.fspath(path)) is None:
        return False
    try:
        step = CommittedStep.of(path)
    except UnverifiedCheckpointError:
        return False
    return os.path.relpath(os.path.abspath(path), step.dir) in step.records


def worker_setup() -> None:
    """Ray's per-worker setup hook: :func:`patch` in this worker process."""
    patch()


def is_patched(module_name: str) -> bool:
    """Whether Trinity's ``module_name`` has been rebound in this process."""
    return _rebinder.is_patched(module_name)


def original(module_name: str, attr: str) -> Any:
    """Trinity's own ``attr`` of ``module_name`` (e.g. its ``Synchronizer``), rebound or not."""
    return _original(module_name, attr)


def runtime_env(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (a Ray ``runtime_env``) with obsckpt's worker hook and ``OBSCKPT_*`` variables.

    Variables ``base`` sets itself are kept.

    Raises:
        ValueError: ``base`` already names another ``worker_process_setup_hook``.
    """
    env = with_setup_hook(base, HOOK)
    # With a mirror, the monitor reaches S3 through the standard AWS variables of the
    # launcher's environment (nodes with their own credentials need none of them).
    prefixes = ("OBSCKPT_", "AWS_") if os.environ.get(OBSCKPT_MIRROR) else ("OBSCKPT_",)
    forwarded = {
        name: os.environ[name]
        for name in sorted(os.environ)
        if name.startswith(prefixes) and os.environ[name]
    }
    env["env_vars"] = {**forwarded, **dict(env.get("env_vars") or {})}
    return env
