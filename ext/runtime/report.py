"""The read-only report of a wrapped model (``gradsync.report(model)``): everything the front-ends
show (the CLI, the recipes and their W&B logging, the Lightning strategy, the DeepSpeed engine),
so that none of them reads the runtime's internals."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from ..cost import CostModel
from ..plan import Plan
from ..planners import chosen_label, chosen_planner
from ..profile import ModelProfile
from ..simulate import Timeline, simulate

if TYPE_CHECKING:
    from .measure.cost_watch import Replan
    from .measure.trials import TrialResult
    from .statistics import IterationStats


@dataclass(frozen=True)
class LayoutReport:
    """One wire layout's installed plan ("plain": uncompressed; ACP-SGD's "P" and "Q"), the
    profile of what travels that it was made on, and the cost it is predicted with."""

    layout: str
    plan: Plan
    wire: ModelProfile
    cost: CostModel

    @cached_property
    def timeline(self) -> Timeline:
        """The simulator's timeline of the plan (an iteration sending this layout alone)."""
        return simulate(self.plan, self.wire, self.cost)

    def summary(self) -> dict:
        return {"planner": self.plan.planner, "chosen": chosen_planner(self.plan), "ops": len(self.plan.ops),
                "channels": self.plan.channels, "hash": self.plan.hash,
                "predicted_ms": self.timeline.iteration_time * 1e3}


@dataclass(frozen=True)
class SyncReport:
    """A snapshot of a wrapped model's synchronisation.

    Args:
        scheduler: the scheduler given to ``wrap`` (with its options, e.g. ``us_byte {...}``).
        compressor: the codec's name ("identity": none).
        layouts: per wire layout, the installed plan (the calibration plan while measuring).
        steady_layouts: the layouts a step sends once the codec is warmed up, in sending order.
        measuring: whether the profile, the cost or a choosing planner's trials are still measured.
        trials: what a choosing planner's (auto's) latest trials timed and kept, with why
            (``TrialResult.summary()``), or None.
        replans: each time the plans were made again online, on a cost re-fitted when the network
            changed (``Replan.summary()``), oldest first.
        iteration: iterations run so far.
        history: the recent iterations' statistics, oldest first.
        gradient_bytes: the uncompressed bytes of the gradients it synchronises.
    """

    scheduler: str
    compressor: str
    layouts: dict[str, LayoutReport]
    steady_layouts: tuple[str, ...]
    measuring: bool
    trials: "TrialResult | None"
    replans: tuple["Replan", ...]
    iteration: int
    history: tuple["IterationStats", ...]
    gradient_bytes: int

    @property
    def latest(self) -> "IterationStats | None":
        """The last iteration's statistics (None before the first)."""
        return self.history[-1] if self.history else None

    @property
    def steady(self) -> LayoutReport:
        """The layout a steady step sends first (ACP-SGD: the P step)."""
        return self.layouts[self.steady_layouts[0]]

    def plan_summary(self) -> str:
        """One line on what runs: each steady layout's plan (its planner, ops and predicted
        iteration time), or that the measurement runs first."""
        if self.measuring:
            return "timing the layers, the network and the candidate plans before the plan is chosen"
        return "; ".join(f"{layout}: {summary['chosen']} plan of {summary['ops']} op(s), "
                         f"{summary['predicted_ms']:.1f} ms predicted"
                         for layout, summary in ((layout, self.layouts[layout].summary())
                                                 for layout in self.steady_layouts))

    @property
    def chosen(self) -> str:
        """The planner whose plans the steady layouts run (a choosing planner's choice)."""
        return chosen_label(self.layouts[layout].plan for layout in self.steady_layouts)
