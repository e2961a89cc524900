"""Lightning Fabric strategies that synchronise gradients with gradsync: ``Fabric(strategy="acp_sgd")``.

Fabric's DDPStrategy launches the ranks and initialises the process group. Instead of wrapping the
model in DistributedDataParallel, ``fabric.setup(model, optimizer)`` attaches gradsync
(``gradsync.wrap``) and hands Fabric its SyncedOptimizer; ``fabric.backward(loss)`` runs
gradsync's hooks and ``optimizer.step()`` waits for the averaged gradients, as with
``gradsync.wrap``; ``fabric.no_backward_sync(model)`` is ``gradsync.no_sync``;
``fabric.clip_gradients`` first waits for the averaged gradients (``optimizer.synchronize()``).
"""
from __future__ import annotations

from contextlib import nullcontext

from typing_extensions import override

from ..errors import ConfigError
from ..runtime import no_sync
from .strategy import LIGHTNING_OPTIONS, GradSyncArguments

# Fabric's DDPStrategy names its precision plugin `precision` (Lightning's `precision_plugin`)
FABRIC_OPTIONS = tuple("precision" if name == "precision_plugin" else name for name in LIGHTNING_OPTIONS)


class GradSyncFabricOverrides(GradSyncArguments):
    """The Fabric DDPStrategy methods that wrapped the model in DistributedDataParallel, attaching
    gradsync instead; mixed into the DDPStrategy of each installed Fabric package."""

    LIGHTNING_OPTIONS = FABRIC_OPTIONS
    PRECISION = "precision"

    def __init__(self, scheduler: str = "auto", compressor=None, options: dict | None = None, **keywords):
        """Args: as GradSyncArguments (the Fabric DDPStrategy's own options pass through)."""
        super().__init__(scheduler, compressor, options, **keywords)
        self._backward_sync_control = _NoSync()

    @override
    def setup_module(self, module):
        raise ConfigError(f"{type(self).__name__} attaches gradsync to a model and its optimizer together: "
                          "call fabric.setup(model, optimizer)")

    @override
    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        """gradsync attached to `module` with `optimizers` (several: each updating its own
        parameters); the module itself and their SyncedOptimizers."""
        return module, self._attach(module, optimizers), scheduler

    @override
    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        self.runtime.flush()
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module, optimizer, clip_val):
        self.runtime.flush()
        return super().clip_gradients_value(module, optimizer, clip_val)


class _NoSync:
    """Fabric's backward-sync control: ``fabric.no_backward_sync(model)`` is gradsync.no_sync."""

    def no_backward_sync(self, module, enabled: bool):
        """Args:
            module: the model Fabric set up (gradsync is attached to it).
            enabled: whether to skip the synchronisation (Fabric passes False to synchronise).
        """
        return no_sync(module) if enabled else nullcontext()
