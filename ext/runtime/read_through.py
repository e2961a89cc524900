"""Parameters read after the step hold its updates: while gradsync is attached to a model, the
``parameters()`` and ``named_parameters()`` of each of its modules (those whose class keeps torch's)
apply the updates still deferred to the layers' next forward (``deferred``) before the parameters
are read, outside a forward pass. So an AveragedModel or an EMA updated after each step, a weight
clipping or a log of the weights reads the step's updates, as under torch DDP. Within a forward
pass (a Hugging Face model reads its device through them), each layer's own pre-forward hook
applies its update as it runs. A parameter read as a module's attribute is not seen.
"""
from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import GradSync

# each module whose parameters() apply the deferred updates first -> the runtime whose updates they are
_RUNTIME_OF: "weakref.WeakKeyDictionary[torch.nn.Module, GradSync]" = weakref.WeakKeyDictionary()


def install(model: torch.nn.Module, sync: "GradSync") -> list[torch.nn.Module]:
    """Give `model`'s modules the reading methods (not a module whose class has its own, nor one
    that another attached model shares: it keeps that model's); the modules given them."""
    plain = torch.nn.Module
    modules = [module for module in model.modules() if type(module).parameters is plain.parameters
               and type(module).named_parameters is plain.named_parameters and module not in _RUNTIME_OF]
    for module in modules:
        module.parameters = types.MethodType(_parameters, module)
        module.named_parameters = types.MethodType(_named_parameters, module)
        _RUNTIME_OF[module] = sync
    return modules


def remove(modules: list[torch.nn.Module]) -> None:
    """Give `modules` torch's methods back."""
    for module in modules:
        del module.parameters, module.named_parameters
        del _RUNTIME_OF[module]


def own_parameters(module: torch.nn.Module, recurse: bool = True):
    """torch's ``module.parameters()``, without the updates applied first (torch's calls the
    module's ``named_parameters``, which may be this module's)."""
    return (parameter for _, parameter in torch.nn.Module.named_parameters(module, recurse=recurse))


def _parameters(module: torch.nn.Module, recurse: bool = True):
    """``module.parameters()``, after the deferred updates outside a forward pass; on a copy of the
    module (``copy.deepcopy``), torch's own."""
    _apply_before_read(module)
    return own_parameters(module, recurse)


def _named_parameters(module: torch.nn.Module, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
    """``module.named_parameters()``, as `_parameters`."""
    _apply_before_read(module)
    return torch.nn.Module.named_parameters(module, prefix, recurse, remove_duplicate)


def _apply_before_read(module: torch.nn.Module) -> None:
    sync = _RUNTIME_OF.get(module)
    if sync is not None and sync.deferred.pending and not sync.in_forward:
        sync.flush_deferred()
