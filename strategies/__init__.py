"""Lightning strategies that run training with gradsync's runtime (registered on import).

``import gradsync`` registers, in the StrategyRegistry of each installed Lightning package
(``pytorch_lightning`` and ``lightning.pytorch``), one name per registered planner (its
``PlannerSpec.strategy_name``: wfbp, ddp_buckets, ..., gradsync_auto), per compressor (acp_sgd,
powersgd, signsgd, topk; scheduled by optimal_merge) and per transport (forest: the auto plan over
reduce/broadcast trees packed on the topology), and one for every planner or compressor registered
later, so that ``Trainer(strategy="acp_sgd", accelerator="cpu", devices=2)`` works. For other
options, pass ``GradSyncStrategy(scheduler=..., compressor=..., **gradsync.wrap options)``.
`strategy_entries()` lists the names.
"""
from importlib.util import find_spec

from .strategy import GradSyncOverrides, strategy_entries


def _importable(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


__all__ = ["strategy_entries"]

if _importable("pytorch_lightning"):
    from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

    class GradSyncStrategy(GradSyncOverrides, DDPStrategy):
        """`pytorch_lightning` strategy: DDP's launch and data handling, gradsync's synchronisation."""

    GradSyncStrategy.register_strategies(StrategyRegistry)
    __all__.append("GradSyncStrategy")

if _importable("lightning.pytorch"):
    from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
    from lightning.pytorch.strategies import StrategyRegistry as LightningStrategyRegistry

    class LightningGradSyncStrategy(GradSyncOverrides, LightningDDPStrategy):
        """The same strategy for the unified `lightning` package (``lightning.pytorch``)."""

    LightningGradSyncStrategy.register_strategies(LightningStrategyRegistry)
    __all__.append("LightningGradSyncStrategy")
