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

from .import_hooks import after_import

ENGINE_MODULE = "deepspeed.runtime.engine"


def install() -> None:
    """Wrap ``DeepSpeedEngine.__init__`` now if DeepSpeed's engine is loaded, else once it loads."""
    after_import(ENGINE_MODULE, _wrap_constructor)


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
