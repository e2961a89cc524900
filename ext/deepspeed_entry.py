"""gradsync's entry in DeepSpeed's engine: once ``gradsync`` is imported, before or after
``deepspeed``, every ``DeepSpeedEngine`` built from a config with a top-level ``"gradsync"``
section runs gradsync's plan (``gradsync.deepspeed.engine.build``).

The entry is the engine's constructor rather than ``deepspeed.initialize``, so that it holds
whoever builds the engine: a script, a ``from deepspeed import initialize`` bound before gradsync
was imported, Lightning's ``DeepSpeedStrategy``, Accelerate's DeepSpeed plugin, HF's Trainer. A
config without the section builds DeepSpeed's engine untouched. This module imports nothing of
DeepSpeed: when DeepSpeed is not loaded yet, the constructor is wrapped as soon as its module is.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

ENGINE_MODULE = "deepspeed.runtime.engine"


def install() -> None:
    """Wrap ``DeepSpeedEngine.__init__`` now if DeepSpeed's engine is loaded, else once it loads."""
    module = sys.modules.get(ENGINE_MODULE)
    if module is not None:
        _wrap_constructor(module)
    elif not any(isinstance(finder, _EngineModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EngineModuleFinder())


def _wrap_constructor(module) -> None:
    engine_class = module.DeepSpeedEngine
    if getattr(engine_class.__init__, "gradsync_entry", False):
        return

    @functools.wraps(engine_class.__init__)
    def __init__(self, *args, **kwargs):
        from .deepspeed.engine import build  # DeepSpeed is fully imported once an engine is built

        build(__init__.__wrapped__, self, *args, **kwargs)

    __init__.gradsync_entry = True
    engine_class.__init__ = __init__


class _EngineModuleFinder(importlib.abc.MetaPathFinder):
    """Finds DeepSpeed's engine module as the path finder does, with a loader that wraps the
    engine's constructor once the module has run; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WrappingLoader(spec.loader)
        return spec


class _WrappingLoader(importlib.abc.Loader):
    """`loader`, then the constructor wrapped; anything else asked of it is `loader`'s."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _wrap_constructor(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)
