"""Plan trials: the plans of a planner that chooses among others (``auto``) timed on the live job,
and the one to keep."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...agreement import waiting_for
from ...compress import Codec
from ...cost import CostModel
from ...planners import BoundPlanner
from ...planning import Alternative, plan_alternatives
from ...profile import ModelProfile
from ..channels import Channels
from . import Install, IterationDone, Measurement, TrialsDone, median, now

TRIAL_ITERATIONS = 2  # timed per visit of a plan, after one to settle; rounded up to whole codec cycles
TRIAL_ROUNDS = 2  # visits of each plan


def trial_order(count: int, rounds: int) -> list[int]:
    """The order in which `count` plans are visited: `rounds` passes, every other one reversed
    (0 1 2 2 1 0 …), so that a steady drift of the host's speed weighs on every plan alike."""
    order: list[int] = []
    for index in range(rounds):
        order += list(range(count)) if index % 2 == 0 else list(reversed(range(count)))
    return order


def kept_trial(seconds: list[float], tolerance: float) -> int:
    """The index of the trial to keep: the fastest, unless trial 0 (auto's choice) is within
    `tolerance` of it; among equal times the earliest."""
    fastest = min(range(len(seconds)), key=seconds.__getitem__)
    return 0 if seconds[fastest] >= seconds[0] * (1 - tolerance) else fastest


class PlanTrials(Measurement):
    """Times the plans of `alternatives` (auto, then auto restricted to one candidate each) on the live
    job, visiting them in `trial_order` for `iterations` iterations per visit, after one iteration
    to settle each switch (a visit that follows one of the same plan needs neither the switch nor
    the settling), and keeps the plan with the smallest median iteration time over its visits, the
    slowest rank's; auto's own choice stays unless that is faster by more than `tolerance`
    (measurements are noisy too).

    Args:
        profile: the measured profile the plans are made on.
        alternatives: the plans to time, auto's own choice first (``planning.plan_alternatives``).
        iterations: timed iterations per visit.
        tolerance: auto's tolerance.
        channels: for the all-reduce of the ranks' medians.
        device: the model's device (timing waits for its queued work).
    """

    def __init__(self, profile: ModelProfile, alternatives: list[Alternative], iterations: int, tolerance: float,
                 channels: Channels, device: torch.device):
        self.profile = profile
        self.alternatives = alternatives
        self.iterations = iterations
        self.tolerance = tolerance
        self.channels = channels
        self.device = device
        self.order = trial_order(len(alternatives), TRIAL_ROUNDS)
        self.visit = 0  # position in `order`
        self.taken = 0  # samples taken in this visit
        self.settling = True  # the next iteration still applies the previous plan's deferred updates
        self.last_end = now(device)  # when the iteration being timed began
        self.samples: list[list[float]] = [[] for _ in alternatives]

    @classmethod
    def start(cls, profile: ModelProfile, cost: CostModel, codec: Codec, planner: BoundPlanner, count: int,
              channels: Channels, device: torch.device) -> "PlanTrials | None":
        """Trials of up to `count` plans of `planner` (install ``first`` now); None when there is
        nothing to compare (a planner that does not choose, `count` < 2, or every candidate makes
        the same plans)."""
        if count < 2 or not planner.chooses:
            return None
        alternatives = plan_alternatives(profile, cost, codec, planner, count)
        if len(alternatives) < 2:
            return None
        cycle = len(codec.steady_rounds())  # whole cycles (ACP-SGD: a P step and a Q step)
        return cls(profile, alternatives, cycle * math.ceil(TRIAL_ITERATIONS / cycle), planner.tolerance,
                   channels, device)

    @property
    def first(self) -> Install:
        """The plans the trials start with."""
        return Install(self.profile, self.alternatives[self.order[0]].planner)

    def iteration_done(self, done: IterationDone) -> Install | TrialsDone | None:
        ended = now(self.device)
        started, self.last_end = self.last_end, ended
        if self.settling:  # this iteration's forward still applied the previous plan's deferred updates
            self.settling = False
            return None
        if done.skipped:  # a step skipped for non-finite gradients (on every rank) is no sample
            return None
        index = self.order[self.visit]
        self.samples[index].append(ended - started)
        self.taken += 1
        if self.taken < self.iterations:
            return None
        self.visit, self.taken = self.visit + 1, 0
        if self.visit == len(self.order):
            return self._keep_fastest(index)
        if self.order[self.visit] == index:
            return None
        self.settling = True
        return Install(self.profile, self.alternatives[self.order[self.visit]].planner)

    def _keep_fastest(self, installed: int) -> TrialsDone:
        """The fastest trial (`kept_trial` on the slowest rank's medians); `installed` is the trial
        whose plans run now."""
        slowest = torch.tensor([median(samples) for samples in self.samples], dtype=torch.float64,
                               device=self.device)
        with waiting_for("the plan trials' result", self.channels.timeout):
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.channels.process_group)
        medians = slowest.tolist()
        fastest = kept_trial(medians, self.tolerance)
        times = tuple((alternative.label, seconds) for alternative, seconds in zip(self.alternatives, medians))
        return TrialsDone(None if fastest == installed else self.alternatives[fastest].planner, times)
