"""Switch a stock verl job to obsckpt in one step: :func:`install` in the driver.

verl has no setting that chooses its checkpoint manager: every worker builds
``FSDPCheckpointManager`` (or ``MegatronCheckpointManager``) from the name its
module imported, and the trainer's ``_save_checkpoint`` writes
``latest_checkpointed_iteration.txt`` itself as soon as the workers return.
Two trainers are covered: verl 0.9's default, the V1 ``PPOTrainer``
(``verl.trainer.ppo.v1``, ``trainer.use_v1=true``), and ``RayPPOTrainer``
(``trainer.use_v1=false``, and verl 0.7).
:func:`install` therefore

* registers a Ray ``worker_process_setup_hook`` (merged into the
  ``runtime_env`` of the next ``ray.init``, the one verl's ``run_ppo`` makes),
  so every Ray worker process of the job runs :func:`patch`, as does the
  driver itself;
* :func:`patch` rebinds the manager names in verl's worker and engine modules
  to obsckpt's managers, now if they are imported, else the moment they are
  (an import hook: a worker that never imports verl pays nothing);
* wraps the trainer: the method that builds the workers (``init_workers``;
  the V1 trainer's ``init``) first creates the ``checkpoint_monitor`` (root
  ``trainer.default_local_dir``), so every worker's manager finds it;
  ``_save_checkpoint`` runs verl's own code with its write of the iteration
  file diverted (the monitor writes it, atomically, when every rank's files
  are durable) and its ``torch.save`` of ``data.pt`` (the dataloader state)
  written atomically, and not at all into a step whose checkpoint is
  committed; it fsyncs what the trainer wrote itself (``data.pt``, the V1
  asynchronous modes' ``transfer_queue/``) and submits the step; a V1
  ``checkpoint_callback`` hears of the save only once it is committed; ``fit``
  waits, before returning, until the last submitted step is committed (verl
  would exit and kill the save threads). Subclasses' overrides of these
  methods (recipes, verl's experimental trainers) are wrapped the same way.

What the wrapped trainer methods do is :mod:`obsckpt.integrations.verl_trainer`'s;
this module installs them.

Resume is verl's own ``_load_checkpoint``: it reads the iteration file, which
names only committed steps, and each manager waits for its saves in flight
before loading.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from obsckpt.integrations._rebind import (
    ORIGINALS,
    AfterImport,
    with_setup_hook,
    wrap_ray_init,
)
from obsckpt.integrations._rebind import original as _original
from obsckpt.integrations.verl_trainer import (
    COMMIT_TIMEOUT_ENV,
    DEFAULT_COMMIT_TIMEOUT_S,
    checkpoint_root,
    diverting_open,
    fit_wrapper,
    link_for,
    load_wrapper,
    monitor_for,
    save_and_submit,
    save_wrapper,
    setup_wrapper,
    tracking_log_wrapper,
    wait_for_commit,
    wrap_torch_save,
)

logger = logging.getLogger(__name__)

__all__ = [
    "COMMIT_TIMEOUT_ENV",
    "DEFAULT_COMMIT_TIMEOUT_S",
    "HOOK",
    "checkpoint_root",
    "install",
    "is_patched",
    "original",
    "link_for",
    "monitor_for",
    "patch",
    "runtime_env",
    "save_and_submit",
    "wait_for_commit",
    "worker_setup",
]

HOOK = "obsckpt.integrations.verl_install.worker_setup"

# verl module -> (name bound there, obsckpt module, obsckpt name). verl 0.9 builds
# managers in its engines; verl 0.7 also in fsdp_workers / megatron_workers.
MANAGER_SITES: dict[str, tuple[str, str, str]] = {
    "verl.workers.engine.fsdp.transformer_impl": (
        "FSDPCheckpointManager",
        "obsckpt.integrations.fsdp_checkpoint_manager",
        "FSDPCheckpointManager",
    ),
    "verl.workers.engine.veomni.transformer_impl": (
        "FSDPCheckpointManager",
        "obsckpt.integrations.fsdp_checkpoint_manager",
        "FSDPCheckpointManager",
    ),
    "verl.workers.fsdp_workers": (
        "FSDPCheckpointManager",
        "obsckpt.integrations.fsdp_checkpoint_manager",
        "FSDPCheckpointManager",
    ),
    "verl.workers.engine.megatron.transformer_impl": (
        "MegatronCheckpointManager",
        "obsckpt.integrations.verl_megatron",
        "MegatronCheckpointManager",
    ),
    "verl.workers.megatron_workers": (
        "MegatronCheckpointManager",
        "obsckpt.integrations.verl_megatron",
        "MegatronCheckpointManager",
    ),
    # Where verl defines them: code that imports a manager from there (verl's own tests,
    # users' scripts) gets obsckpt's too. verl's class stays reachable (see ORIGINALS).
    "verl.utils.checkpoint.fsdp_checkpoint_manager": (
        "FSDPCheckpointManager",
        "obsckpt.integrations.fsdp_checkpoint_manager",
        "FSDPCheckpointManager",
    ),
    "verl.utils.checkpoint.megatron_checkpoint_manager": (
        "MegatronCheckpointManager",
        "obsckpt.integrations.verl_megatron",
        "MegatronCheckpointManager",
    ),
}
# verl module -> (trainer class, the method that builds the workers). verl 0.9 runs the
# V1 trainer unless trainer.use_v1=false; verl 0.7 has only RayPPOTrainer.
TRAINER_SITES: dict[str, tuple[str, str]] = {
    "verl.trainer.ppo.v1.trainer_base": ("PPOTrainer", "init"),
    "verl.trainer.ppo.ray_trainer": ("RayPPOTrainer", "init_workers"),
}

# verl module -> (class, method) whose calls obsckpt wraps: the driver's metrics logger.
LOGGER_SITES: dict[str, tuple[str, str]] = {"verl.utils.tracking": ("Tracking", "log")}

# Every module name above; the import hook asks it of every module imported.
_SITE_NAMES = frozenset((*MANAGER_SITES, *TRAINER_SITES, *LOGGER_SITES))
_lock = threading.RLock()
_patched: set[str] = set()
_pending: set[str] = set()
_finder: AfterImport | None = None


# ----------------------------------------------------------------------
# The one step
# ----------------------------------------------------------------------


def install() -> None:
    """Make this verl job checkpoint through obsckpt; call in the driver before ``ray.init``.

    Call it before verl starts Ray (before ``verl.trainer.main_ppo.run_ppo`` or
    ``main``). If your code calls ``ray.init`` itself, call :func:`install`
    before that, or pass ``runtime_env=runtime_env(...)`` to it.

    Raises:
        RuntimeError: Ray is already initialised in this process (the hook can
            no longer reach the job's workers).
    """
    import ray

    if ray.is_initialized():
        raise RuntimeError(
            "obsckpt.integrations.verl_install.install() must run before ray.init(): Ray is "
            "already initialised, so its workers would keep verl's checkpoint manager. Call "
            "install() first, or pass runtime_env=verl_install.runtime_env(<yours>) to ray.init"
        )
    patch()
    wrap_ray_init(ray, HOOK, runtime_env)


def runtime_env(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (a Ray ``runtime_env``) with obsckpt's worker setup hook added.

    Raises:
        ValueError: ``base`` already names another ``worker_process_setup_hook``.
    """
    return with_setup_hook(base, HOOK)


def worker_setup() -> None:
    """Ray's per-worker setup hook: :func:`patch` in this worker process."""
    patch()


# ----------------------------------------------------------------------
# Patching verl's modules, now or when they are imported
# ----------------------------------------------------------------------


def patch() -> None:
    """Rebind verl's manager names and wrap its trainer, in this process (idempotent)."""
    global _finder
    with _lock:
        for name in [*MANAGER_SITES, *TRAINER_SITES, *LOGGER_SITES]:
            module = sys.modules.get(name)
            if module is not None:
                _apply(name, module)
        if _finder is None:
            _finder = AfterImport(_patches_on_import, _apply)
            sys.meta_path.insert(0, _finder)


def _patches_on_import(name: str) -> bool:
    return name in _SITE_NAMES and name not in _patched


def is_patched(module_name: str) -> bool:
    """Whether :func:`patch` has been applied to ``module_name`` in this process."""
    return module_name in _patched


def original(module_name: str, attr: str) -> Any:
    """verl's own ``attr`` of ``module_name``, whether or not :func:`patch` rebound it.

    obsckpt's managers build on verl's classes through this, so the import order
    of verl's modules, obsckpt's and :func:`install` does not matter.
    """
    return _original(module_name, attr)


def _replacement(source: str, source_attr: str) -> Any:
    """obsckpt's object, or None while its module is still being imported."""
    import importlib

    loading = sys.modules.get(source)
    if loading is not None and not hasattr(loading, source_attr):
        # obsckpt's module imported verl's, whose import brought us here: its class does
        # not exist yet. bind_pending() binds it once that module has run.
        return None
    return getattr(importlib.import_module(source), source_attr)


def _apply(name: str, module: Any) -> None:
    with _lock:
        if name in _patched:
            return
        if name in TRAINER_SITES:
            _patch_trainer(module, *TRAINER_SITES[name])
        elif name in LOGGER_SITES:
            cls_name, method = LOGGER_SITES[name]
            cls = getattr(module, cls_name, None)
            if cls is not None and not getattr(getattr(cls, method), "__obsckpt_wrapped__", False):
                setattr(cls, method, tracking_log_wrapper(getattr(cls, method)))
        else:
            attr, source, source_attr = MANAGER_SITES[name]
            if hasattr(module, attr):
                originals = vars(module).setdefault(ORIGINALS, {})
                originals.setdefault(attr, getattr(module, attr))
                replacement = _replacement(source, source_attr)
                if replacement is None:
                    _pending.add(name)
                    return
                setattr(module, attr, replacement)
        _pending.discard(name)
        _patched.add(name)
        logger.info("obsckpt: patched %s", name)


def bind_pending() -> None:
    """Patch the verl modules whose patch waited for obsckpt's manager module to finish.

    Called by that module's last lines; does nothing when none waits.
    """
    with _lock:
        for name in sorted(_pending):
            module = sys.modules.get(name)
            if module is not None:
                _apply(name, module)


# ----------------------------------------------------------------------
# The trainer: monitor, iteration file, waiting at exit
# ----------------------------------------------------------------------


def _patch_trainer(module: Any, class_name: str, setup_name: str) -> None:
    """Wrap ``class_name`` and every subclass of it, also those defined later.

    Subclasses (verl's experimental trainers, recipes such as DAPO, a job's own
    trainer) often override ``fit``, ``_save_checkpoint`` or the method that
    builds the workers without calling verl's: each override is wrapped too,
    so the monitor exists before the workers, the iteration file is written
    only at commit, and ``fit`` returns only once the last step is committed.
    """
    cls = getattr(module, class_name)
    wrap_torch_save()
    _wrap_trainer_class(cls, setup_name)
    pending = list(cls.__subclasses__())
    while pending:
        sub = pending.pop()
        _wrap_trainer_class(sub, setup_name)
        pending += sub.__subclasses__()
    previous = cls.__dict__.get("__init_subclass__")

    def __init_subclass__(sub: type, /, **kwargs: Any) -> None:
        if previous is not None:
            previous.__get__(None, sub)(**kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)
        _wrap_trainer_class(sub, setup_name)

    cls.__init_subclass__ = classmethod(__init_subclass__)


def _wrap_trainer_class(cls: type, setup_name: str) -> None:
    """Wrap the trainer methods ``cls`` itself defines (not inherited ones) once."""
    module = sys.modules.get(cls.__module__)
    # Looked up in module globals before builtins; a module's own ``open`` is left alone.
    if module is not None and getattr(module, "open", diverting_open) is diverting_open:
        try:
            setattr(module, "open", diverting_open)  # noqa: B010 - a module's global
        except (AttributeError, TypeError):  # a module that takes no attributes
            logger.warning("obsckpt: cannot divert the iteration file write of %s", module)
    makers = {
        setup_name: setup_wrapper,
        "_save_checkpoint": save_wrapper,
        "_load_checkpoint": load_wrapper,
        "fit": fit_wrapper,
    }
    for name, make in makers.items():
        orig = cls.__dict__.get(name)
        if orig is None or not callable(orig) or getattr(orig, "obsckpt", False):
            continue
        wrapper = make(orig)
        wrapper.obsckpt = True
        setattr(cls, name, wrapper)
