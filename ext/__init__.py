"""gradsync: faster gradient synchronisation for data-parallel PyTorch training.

Plans are data: a planner turns a model profile and a cost model into a Plan, the simulator
predicts its iteration, and the runtime executes it on torch.distributed.
"""
from importlib import import_module as _import_module

from . import planners, profile
from .cost import CostModel
from .errors import ConfigError
from .plan import Op, Plan, Slice
from .profile import ModelProfile
from .runtime import IterationStats, NonFiniteGradient, SyncReport, no_sync, report, wrap
from .simulate import Timeline, simulate
from . import strategies  # registers the Lightning strategy names when Lightning is installed
from .deepspeed_entry import install as _install_deepspeed_entry

_install_deepspeed_entry()  # the "gradsync" section of a DeepSpeed config, honoured by deepspeed.initialize

__version__ = "0.1.0"

# modules imported on first access (`gradsync.launch.run_local`), not by `import gradsync`: deepspeed
# is an optional extra, so `gradsync.deepspeed` imports it only when used (kept out of __all__ too)
_LAZY_MODULES = ("deepspeed", "launch", "timeline_plot")


def __getattr__(name: str):
    """`gradsync.deepspeed`, `gradsync.launch` and `gradsync.timeline_plot`, imported when first used."""
    if name in _LAZY_MODULES:
        return _import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "CostModel",
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
    "strategies",
    "profile",
    "simulate",
    "wrap",
]
