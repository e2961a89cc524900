"""``after_import``: run a function once a module has been imported, now or whenever it is.

gradsync plugs into libraries it does not import itself (DeepSpeed's engine, Lightning's strategy
registries): importing them would cost every ``import gradsync`` seconds, and they are optional.
A hook waits in ``sys.meta_path`` for the module's import, lets the finders after it find the
module as usual, and runs the waiting functions once the module has executed.
"""
from __future__ import annotations

import importlib.abc
import sys
from typing import Callable


def after_import(name: str, callback: Callable) -> None:
    """``callback(module)`` now if module `name` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    finder = next((entry for entry in sys.meta_path if isinstance(entry, _WaitingFinder)), None)
    if finder is None:
        finder = _WaitingFinder()
        sys.meta_path.insert(0, finder)
    finder.waiting.setdefault(name, []).append(callback)


def initializing(name: str) -> bool:
    """Whether module `name` is being imported now (its body has started and not finished)."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class _WaitingFinder(importlib.abc.MetaPathFinder):
    """Finds the awaited modules through the other finders, with a loader that then calls back."""

    def __init__(self):
        self.waiting: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _CallingLoader(spec.loader, self.waiting.pop(fullname))
                return spec
        return None


class _CallingLoader(importlib.abc.Loader):
    """`loader`, then the callbacks with the executed module; anything else asked of it is `loader`'s."""

    def __init__(self, loader, callbacks: list[Callable]):
        self.loader = loader
        self.callbacks = callbacks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        for callback in self.callbacks:
            callback(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)
