"""Rebind names in a host framework's modules to obsckpt's objects, whatever the import order.

A :class:`Rebinder` takes a table of host modules and, for each, the names to
rebind and where obsckpt's object lives (``"obsckpt.module:name"``). Its
:meth:`~Rebinder.patch` rebinds the names in the host modules already
imported, and installs an import hook that rebinds them in each other host
module right after its code has run; a process that never imports them pays
nothing. The host's own objects stay reachable through :meth:`~Rebinder.original`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
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
        self._finder: _RebindOnImport | None = None
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
                self._finder = _RebindOnImport(self)
                sys.meta_path.insert(0, self._finder)

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


class _RebindOnImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of a site module so its names are rebound right after its code runs."""

    def __init__(self, rebinder: Rebinder) -> None:
        self._rebinder = rebinder

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self._rebinder.sites or self._rebinder.is_patched(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RebindingLoader(spec.loader, fullname, self._rebinder)
                return spec
        return None


class _RebindingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str, rebinder: Rebinder) -> None:
        self._loader = loader
        self._name = name
        self._rebinder = rebinder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._rebinder.apply(self._name, module)
