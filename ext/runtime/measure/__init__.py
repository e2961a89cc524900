"""Measuring on the live job: what the plans are made on.

- ``probes``: the network probes at wrap time, which calibrate the cost model (a, b, γ, the
  slowdowns, the host time per op);
- ``layers``: per-layer forward and backward times, combined over the ranks;
- ``calibration``: the first iterations, run under the calibration plan (every gradient in one
  all-reduce when the backward pass ends) while layers are timed: the measured profile;
- ``trials``: a choosing planner's (``auto``) plans timed in turn: the one to keep.

A measurement in progress (``Measurement``) is told of every synchronised iteration
(``IterationDone``) and answers with what it asks of the runtime: plans to install (``Install``) or
its result (``ProfileMeasured``, ``TrialsDone``); it never writes into the runtime.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...plan import Plan
from ...planners import BoundPlanner
from ...profile import ModelProfile
from ..statistics import IterationStats

if TYPE_CHECKING:
    from .trials import ChoiceWatch, TrialResult


def median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else 0.0


def now(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True)
class IterationDone:
    """A synchronised iteration has ended.

    Args:
        stats: its statistics.
        rounds: the wire layouts it sent; `next_rounds`: those the next iteration sends.
        timed_plan: the plan whose ops launched in its backward pass.
        skipped: its step was skipped for non-finite gradients (on every rank).
    """

    stats: IterationStats
    rounds: tuple[str, ...]
    next_rounds: tuple[str, ...]
    timed_plan: Plan
    skipped: bool


@dataclass(frozen=True)
class Install:
    """Run the plans `planner` (None: the wrapped scheduler) makes on `profile` from the next
    backward pass; the measurement goes on."""

    profile: ModelProfile
    planner: BoundPlanner | None = None


@dataclass(frozen=True)
class ProfileMeasured:
    """The profile is measured: `profile` combines the ranks' `rank_profiles` (``slowest_times``)."""

    profile: ModelProfile
    rank_profiles: tuple[ModelProfile, ...]


@dataclass(frozen=True)
class TrialsDone:
    """The trials are over: install `planner`'s plans (None: keep the installed ones); `result`
    says what was timed and decided; `watch` checks the choice from now on."""

    planner: BoundPlanner | None
    result: "TrialResult"
    watch: "ChoiceWatch"


class Measurement:
    """A measurement in progress: the engine reports its hooks (no-ops by default) and every
    synchronised iteration to it. `times_layers`: it reads every owner module's forward start
    (``module_start``), for which the engine hooks every module's forward; else it hooks only
    those a plan needs, so that what is timed runs as it will afterwards."""

    times_layers = False

    def forward_start(self) -> None:
        """A forward pass begins."""

    def module_start(self, module_name: str) -> None:
        """The forward of owner module `module_name` begins."""

    def gradient_ready(self, name: str) -> None:
        """The gradient of parameter `name` is computed."""

    def exclude(self, seconds: float) -> None:
        """`seconds` of the current forward were spent on deferred updates, not on the layer."""

    def iteration_done(self, done: IterationDone) -> Install | ProfileMeasured | TrialsDone | None:
        """A synchronised iteration has ended: what the runtime should do (None: nothing)."""
        return None
