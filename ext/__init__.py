"""gradsync: faster gradient synchronisation for data-parallel PyTorch training.

Plans are data: a planner turns a model profile and a cost model into a Plan, the simulator
predicts its iteration, and the runtime executes it on torch.distributed.
"""
from . import planners, profile
from .cost import CostModel
from .errors import ConfigError
from .plan import Op, Plan, Slice
from .profile import ModelProfile
from .runtime import IterationStats, NonFiniteGradient, no_sync, wrap
from .simulate import Timeline, simulate
from . import strategies  # registers the Lightning strategy names when Lightning is installed

__version__ = "0.1.0"

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
    "planners",
    "strategies",
    "profile",
    "simulate",
    "wrap",
]
