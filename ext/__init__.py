"""gradsync: faster gradient synchronisation for data-parallel PyTorch training.

Plans are data: a planner turns a model profile and a cost model into a Plan, the simulator
predicts its iteration, and the runtime executes it on torch.distributed.
"""
from importlib import import_module as _import_module

from . import planners, profile
from .cost import CostModel
from .errors import ConfigError, GradientsChangedInFlight, ParametersChangedBeforeUpdate
from .plan import Op, Plan, Slice
from .profile import ModelProfile
from .runtime import IterationStats, NonFiniteGradient, SyncReport, no_sync, report, wrap
from .simulate import Timeline, simulate
from .deepspeed_entry import install as _install_deepspeed_entry
from .import_hooks import after_import as _after_import, initializing as _initializing

_install_deepspeed_entry()  # the "gradsync" section of a DeepSpeed config, honoured by deepspeed.initialize
_LIGHTNING_PACKAGES = ("pytorch_lightning", "lightning_fabric", "lightning")


def _register_lightning_strategies(package) -> None:
    """`gradsync.strategies` registers the strategy names once Lightning is imported (now, or when
    it is: its import costs seconds), after the outermost Lightning package being imported is done."""
    if not any(_initializing(name) for name in _LIGHTNING_PACKAGES if name != package.__name__):
        _import_module(".strategies", __name__)


for _package in _LIGHTNING_PACKAGES:
    _after_import(_package, _register_lightning_strategies)

__version__ = "0.1.0"

# modules imported on first access (`gradsync.launch.run_local`), not by `import gradsync`: deepspeed
# and Lightning are optional extras, so `gradsync.deepspeed` and `gradsync.strategies` import them
# only when used (kept out of __all__ too)
_LAZY_MODULES = ("deepspeed", "launch", "strategies", "timeline_plot")


def __getattr__(name: str):
    """`gradsync.deepspeed`, `gradsync.launch`, `gradsync.strategies` and `gradsync.timeline_plot`,
    imported when first used."""
    if name in _LAZY_MODULES:
        return _import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "CostModel",
    "GradientsChangedInFlight",
    "ParametersChangedBeforeUpdate",
    "IterationStats",
    "NonFiniteGradient",
    "ModelProfile",
    "Op",
    "Plan",
    "Slice",
    "Timeline",
    "no_sync",
    "report",
    "SyncReport",
    "planners",
    "profile",
    "simulate",
    "wrap",
]
