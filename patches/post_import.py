"""Run a function on a module right after it is imported, without importing it early.

Some patch targets (``verl.workers.engine.fsdp.transformer_impl``, the rollout registries) are
expensive to import or only imported by some processes. ``when_imported(name, fn)`` calls
``fn(module)`` immediately if ``name`` is already imported, otherwise right after the module's
code has run for the first time, in whichever process imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], None]


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the hooks registered for the module."""

    def __init__(self, loader: importlib.abc.Loader, hooks: list[Hook]):
        self._loader = loader
        self._hooks = hooks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        for hook in self._hooks:
            hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that only wraps the loaders of modules with pending hooks."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Hook]] = {}

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader, self.pending.pop(fullname))
                return spec
        return None


_FINDER = _PostImportFinder()


def when_imported(module_name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once ``module_name`` is imported (now, if it already is)."""
    module = sys.modules.get(module_name)
    if module is not None:
        hook(module)
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.pending.setdefault(module_name, []).append(hook)
