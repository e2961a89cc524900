"""Lightning strategies that run training with gradsync's runtime (registered on import).

``import gradsync`` registers (once Lightning is imported, before or after gradsync: this module
is imported then, ``gradsync.import_hooks``), in the StrategyRegistry of each installed Lightning package
(``pytorch_lightning`` and ``lightning.pytorch``), one name per registered planner (its
``PlannerSpec.strategy_name``: wfbp, ddp_buckets, ..., gradsync_auto), per compressor (acp_sgd,
powersgd, signsgd, topk; scheduled by optimal_merge) and per transport (forest: the auto plan over
reduce/broadcast trees packed on the topology), and one for every planner or compressor registered
later, so that ``Trainer(strategy="acp_sgd", accelerator="cpu", devices=2)`` works. For other
options, pass ``GradSyncStrategy(scheduler=..., compressor=..., **gradsync.wrap options)``.
`strategy_entries()` lists the names. The same names are registered with Lightning Fabric
(``Fabric(strategy="acp_sgd")``, `GradSyncFabricStrategy`).
"""
from importlib.util import find_spec

from .strategy import DeferredUpdatesFirst, GradSyncOverrides, strategy_entries


def _importable(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


__all__ = ["strategy_entries"]

if _importable("pytorch_lightning"):
    from pytorch_lightning import Callback
    from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

    class _DeferredUpdatesFirst(DeferredUpdatesFirst, Callback):
        """`pytorch_lightning` callback: the strategy's deferred updates before other callbacks' hooks."""

    class GradSyncStrategy(GradSyncOverrides, DDPStrategy):
        """`pytorch_lightning` strategy: DDP's launch and data handling, gradsync's synchronisation."""

        DEFERRED_UPDATES_CALLBACK = _DeferredUpdatesFirst

    GradSyncStrategy.register_strategies(StrategyRegistry)
    __all__.append("GradSyncStrategy")

    from .comm_hook import CompressionHookCallback

    class CompressionHook(CompressionHookCallback, Callback):
        """`pytorch_lightning` callback: gradsync's communication hook under Lightning's own DDP."""

    __all__.append("CompressionHook")

if _importable("lightning_fabric"):
    from lightning_fabric.strategies import STRATEGY_REGISTRY, DDPStrategy as FabricDDPStrategy

    from .fabric import GradSyncFabricOverrides

    class GradSyncFabricStrategy(GradSyncFabricOverrides, FabricDDPStrategy):
        """`lightning_fabric` strategy: ``Fabric(strategy="acp_sgd")``, gradsync's synchronisation."""

    GradSyncFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    __all__.append("GradSyncFabricStrategy")

if _importable("lightning.fabric"):
    from lightning.fabric.strategies import STRATEGY_REGISTRY as LIGHTNING_FABRIC_REGISTRY
    from lightning.fabric.strategies import DDPStrategy as LightningFabricDDPStrategy

    from .fabric import GradSyncFabricOverrides

    class LightningGradSyncFabricStrategy(GradSyncFabricOverrides, LightningFabricDDPStrategy):
        """The same Fabric strategy for the unified `lightning` package (``lightning.fabric``)."""

    LightningGradSyncFabricStrategy.register_strategies(LIGHTNING_FABRIC_REGISTRY)
    __all__.append("LightningGradSyncFabricStrategy")

if _importable("lightning.pytorch"):
    from lightning.pytorch import Callback as LightningCallback
    from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
    from lightning.pytorch.strategies import StrategyRegistry as LightningStrategyRegistry

    class _LightningDeferredUpdatesFirst(DeferredUpdatesFirst, LightningCallback):
        """The same callback for the unified `lightning` package (``lightning.pytorch``)."""

    class LightningGradSyncStrategy(GradSyncOverrides, LightningDDPStrategy):
        """The same strategy for the unified `lightning` package (``lightning.pytorch``)."""

        DEFERRED_UPDATES_CALLBACK = _LightningDeferredUpdatesFirst

    LightningGradSyncStrategy.register_strategies(LightningStrategyRegistry)
    __all__.append("LightningGradSyncStrategy")

    from .comm_hook import CompressionHookCallback

    class LightningCompressionHook(CompressionHookCallback, LightningCallback):
        """The same callback for the unified `lightning` package (``lightning.pytorch``)."""

    __all__.append("LightningCompressionHook")
