"""Rebind names in a host framework's modules to obsckpt's objects, whatever the import order.

A :class:`Rebinder` takes a table of host modules and, for each, the names to
rebind and where obsckpt's object lives (``"obsckpt.module:name"``). Its
:meth:`~Rebinder.patch` rebinds the names in the host modules already
imported, and installs an import hook that rebinds them in each other host
module right after its code has run; a process that never imports them pays
nothing. The host's own objects stay reachable through :func:`original`.

:func:`with_setup_hook` and :func:`wrap_ray_init` carry a module's setup to
every process of the Ray job the driver starts next.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# On a rebound host module: {name: the host's own object that name was bound to}.
ORIGINALS = "_obsckpt_originals"


class Rebinder:
    """Rebinds ``sites``: ``{host module: {name: "obsckpt.module:name"}}``."""

    def __init__(self, sites: dict[str, dict[str, str]]) -> None:
        self.sites = sites
        self._lock = threading.RLock()
        self._done: set[str] = set()
        self._finder: AfterImport | None = None
        # target -> the host's own object it replaced (for modules that imported the
        # name from a site already rebound: their original is the host's, not obsckpt's)
        self._host_objects: dict[str, Any] = {}

    def patch(self) -> None:
        """Rebind in every site imported so far, and in the others when imported (idempotent)."""
        with self._lock:
            for name in self.sites:
                module = sys.modules.get(name)
                if module is not None:
                    self.apply(name, module)
            if self._finder is None:
                self._finder = AfterImport(self._wanted, self.apply)
                sys.meta_path.insert(0, self._finder)

    def _wanted(self, name: str) -> bool:
        return name in self.sites and name not in self._done

    def is_patched(self, module_name: str) -> bool:
        """Whether the names of ``module_name`` are rebound in this process."""
        return module_name in self._done

    def apply(self, name: str, module: Any) -> None:
        """Rebind the names of site ``name`` in ``module`` (once)."""
        with self._lock:
            if name in self._done:
                return
            originals = vars(module).setdefault(ORIGINALS, {})
            for attr, target in self.sites[name].items():
                if not hasattr(module, attr):
                    continue  # a host version without that name
                source, _, source_attr = target.partition(":")
                replacement = getattr(importlib.import_module(source), source_attr)
                current = getattr(module, attr)
                if current is replacement:  # imported from a site rebound before it
                    current = self._host_objects.get(target, current)
                else:
                    self._host_objects.setdefault(target, current)
                originals.setdefault(attr, current)
                setattr(module, attr, replacement)
            self._done.add(name)
            logger.info("obsckpt: rebound %s in %s", sorted(self.sites[name]), name)


def original(module_name: str, attr: str) -> Any:
    """The host's own ``attr`` of ``module_name``, whether or not it was rebound."""
    module = importlib.import_module(module_name)
    return vars(module).get(ORIGINALS, {}).get(attr, getattr(module, attr))


class AfterImport(importlib.abc.MetaPathFinder):
    """An import hook: ``after(name, module)`` runs right after each ``wanted`` module's code.

    Install it first in ``sys.meta_path``; the module is found by the finders
    after it, as it would have been.
    """

    def __init__(self, wanted: Callable[[str], bool], after: Callable[[str, Any], None]) -> None:
        self._wanted = wanted
        self._after = after

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not self._wanted(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenCall(spec.loader, fullname, self._after)
                return spec
        return None


class _ThenCall(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str, after: Callable[[str, Any], None]) -> None:
        self._loader = loader
        self._name = name
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._after(self._name, module)


# ----------------------------------------------------------------------
# Reaching every process of a Ray job
# ----------------------------------------------------------------------


def with_setup_hook(base: dict[str, Any] | None, hook: str) -> dict[str, Any]:
    """``base`` (a Ray ``runtime_env``) with ``worker_process_setup_hook=hook``.

    Raises:
        ValueError: ``base`` already names another ``worker_process_setup_hook``.
    """
    env = dict(base or {})
    present = env.get("worker_process_setup_hook")
    if present not in (None, hook):
        raise ValueError(
            f"runtime_env already has worker_process_setup_hook={present!r}; call "
            f"{hook}() from that hook instead of adding obsckpt's"
        )
    env["worker_process_setup_hook"] = hook
    return env


_wrapped_inits: set[str] = set()
_init_lock = threading.Lock()


def wrap_ray_init(ray: Any, key: str, runtime_env: Callable[[dict[str, Any] | None], dict]) -> None:
    """Make ``ray.init`` pass its ``runtime_env`` through ``runtime_env`` first (once per ``key``)."""
    with _init_lock:
        if key in _wrapped_inits:
            return
        init = ray.init

        @functools.wraps(init)
        def init_with_obsckpt(*args: Any, **kwargs: Any) -> Any:
            env = kwargs.get("runtime_env")
            if env is not None and not isinstance(env, dict):  # an OmegaConf node
                env = _plain(env)
            kwargs["runtime_env"] = runtime_env(env)
            return init(*args, **kwargs)

        ray.init = init_with_obsckpt
        _wrapped_inits.add(key)


def _plain(node: Any) -> dict[str, Any]:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    except (ImportError, ValueError):
        return dict(node)
