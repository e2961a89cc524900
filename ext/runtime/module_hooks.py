"""Module hooks that act on their own module alone.

A hook registered on a module travels with its copies: ``copy.deepcopy`` of a model gradsync is
attached to (as ``torch.optim.swa_utils.AveragedModel`` and exponential-moving-average helpers
make) copies its hook dictionaries. A hook that is a bound method of the runtime would be
deep-copied with the runtime, process groups and all, and fail; a plain function is shared by the
copy, and would act on the runtime when the copy runs. ``on_module`` makes a hook a plain function
that does nothing when called for another module than its own.
"""
from __future__ import annotations

from typing import Callable


def on_module(module, hook: Callable) -> Callable:
    """`hook`, called only for `module` itself: a copy of the module carries it, and there it does
    nothing. A plain function, so that copying the module copies no runtime with it (a bound
    method would be deep-copied with its object, process groups and all)."""
    def hook_on_module(called_on, *arguments):
        if called_on is module:
            return hook(called_on, *arguments)
        return None
    return hook_on_module
