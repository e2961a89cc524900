"""The installed plans of a wrapped model, one per wire layout of its codec, their executors and
their predictions, and the measurement that replaces them while it runs (``runtime.measure``).

After the measurement the predictions follow the computation's measured speed
(``runtime.compute_speed``) and, with `replan`, the plans are made again on a re-fitted cost when
the communication's measured time departs from its reference (``runtime.measure.cost_watch``).
Every rank installs the same plans at the same iteration: each installation checks the plans'
hashes on every rank.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch.distributed as dist

from ..agreement import check_same_on_all_ranks, waiting_for
from ..compress import Codec
from ..cost import CostModel
from ..plan import ALLREDUCE, REDUCE_SCATTER, Plan
from .. import planners
from ..planners import BoundPlanner
from ..planning import LayoutPlan, StepPrediction, at_compute_scale, plan_layouts, steady_layouts, step_prediction
from ..profile import ModelProfile
from .channels import Channels
from .compute_speed import ComputeSpeed
from .executor import PlanExecutor
from .host_memory import release_freed_host_memory
from .op_buffers import SharedOpBuffers
from .over_ranks import CombinedReductions, reduction_over_ranks
from .parameter_table import ParameterTable
from .partition import Partition
from .measure import Install, IterationDone, Measurement, ProfileMeasured, TrialsDone
from .measure.calibration import ProfileCalibration
from .measure.cost_watch import CostWatch, Replan
from .measure.trials import ChoiceWatch, PlanTrials, TrialResult
from .report import LayoutReport

log = logging.getLogger("gradsync")
PREDICTIONS_KEPT = 64  # cached predictions (rounds and speed bins) before the cache starts again
CHECKS = "the runtime's checks over the ranks (the computation's speed, the communication's time, auto's choice)"


class InstalledPlans:
    """The plans, executors and predictions in force, and the measurement in progress.

    Args:
        planner: the wrapped scheduler (measurement installs others meanwhile).
        codec: the compressor, set up on the layout's tensors.
        plan_trials: how many of a choosing planner's plans to time once the profile is measured.
        nonfinite, trace, partition, unused_as_zeros: for the executors (``PlanExecutor``); with a
            `partition` and no compressor the plans' ops are reduce-scatters (each rank needs its
            partition alone).
        replan: time the communication and plan again when the network changes (``measure.cost_watch``).
        calibration: the iterations a measured profile skips, then times (``measure_profile``).
    """

    def __init__(self, table: ParameterTable, channels: Channels, planner: BoundPlanner, codec: Codec,
                 nonfinite: str, trace=None, plan_trials: int = 0, partition: Partition | None = None,
                 replan: bool = False, unused_as_zeros: bool = False, *, calibration: tuple[int, int]):
        self.table = table
        self.calibration = calibration
        self.channels = channels
        self.planner = planner
        self.codec = codec
        self.nonfinite = nonfinite
        self.unused_as_zeros = unused_as_zeros
        self.trace = trace
        self.plan_trials = plan_trials
        self.partition = partition
        self.collective = REDUCE_SCATTER if partition is not None and codec.name == Codec.name else ALLREDUCE
        # the plans of reduce-scatters, installed one after another, carve their op buffers from one allocation
        self.shared_buffers = SharedOpBuffers() if self.collective == REDUCE_SCATTER else None
        self.layout_plans: dict[str, LayoutPlan] = {}
        self.plans: dict[str, Plan] = {}
        self.executors: dict[str, PlanExecutor] = {}
        self.profile: ModelProfile | None = None
        self.cost: CostModel | None = None
        self.predictions: dict[tuple[tuple[str, ...], int], StepPrediction] = {}  # by rounds and speed bin
        # the watchers' windows close together: one all-reduce carries them (``over_ranks.CombinedReductions``)
        self.reductions = CombinedReductions(reduction_over_ranks(dist.ReduceOp.MAX, channels.process_group,
                                                                  table.device, CHECKS, channels.timeout))
        self.speed = self._compute_speed()
        self.settling = True  # the first iteration under plans just installed or kept: the switch, no sample
        self.measurement: Measurement | None = None
        self.rank_profiles: tuple[ModelProfile, ...] = ()  # each rank's measured profile (`profile` combines them)
        self.trials: TrialResult | None = None  # what auto's latest trials timed and kept (PlanTrials)
        self.watch: ChoiceWatch | None = None  # checks auto's choice after its trials
        self.replan = replan
        self.cost_watch: CostWatch | None = None  # times the installed plans' communication
        self.replans: list[Replan] = []  # the re-plannings online so far
        self.current = planner  # the planner whose plans are installed

    def install(self, profile: ModelProfile, cost: CostModel, planner: BoundPlanner | None = None) -> None:
        """Plan every wire layout of the codec, check the plans' hashes on every rank, and execute
        the plans from the next backward pass.

        Args:
            profile, cost: what the plans are made on (equal on every rank).
            planner: the bound planner (None: the wrapped scheduler).
        """
        planner = planner or self.planner
        self.current = planner
        layout_plans = {layout: replace(entry, plan=entry.plan.with_transport(self.channels.transport))
                        for layout, entry in plan_layouts(profile, cost, planner, self.codec,
                                                          collective=self.collective).items()}
        plans = {layout: entry.plan for layout, entry in layout_plans.items()}
        with waiting_for("the plan hash check", self.channels.timeout):
            check_same_on_all_ranks(tuple(plan.hash for plan in plans.values()), "plan (plan hash mismatch)",
                                    "give every rank the same model, profile, cost and options",
                                    self.channels.process_group)
        self.layout_plans, self.plans, self.profile, self.cost = layout_plans, plans, profile, cost
        self.predictions, self.speed, self.settling = {}, self._compute_speed(), True
        self.executors = {layout: PlanExecutor(plan, self.table.parameters, self.channels, self.codec, layout,
                                               self.nonfinite, self.trace, self.partition, self.shared_buffers,
                                               self.unused_as_zeros)
                          for layout, plan in plans.items()}
        if self.partition is not None or not self.following_up:  # what the probes and replaced plans freed
            self._release_host_memory()
        if self.replan:
            for executor in self.executors.values():
                executor.time_ops()
            layouts = [(layout, executor.wire_bytes()) for layout, executor in self.executors.items()]
            self.cost_watch = CostWatch(cost, self.collective, layouts, self.reductions.starting(dist.ReduceOp.MIN))

    def measure_profile(self, model_name: str, cost: CostModel) -> None:
        """Time the layers over the next `calibration` iterations, which run one all-reduce at the
        backward pass's end (``measure.calibration``); the wrapped scheduler's plans follow, on the
        measured profile and `cost`."""
        self.install(self.table.profile(model_name), cost, planners.one_bucket())
        self.measurement = ProfileCalibration(self.table, cost.host, self.channels, *self.calibration, model_name,
                                              self.codec.steady_rounds())

    def for_table(self, table: ParameterTable, model_name: str) -> "InstalledPlans":
        """Plans for `table`, a new table of the same model (parameters unfrozen since this one was
        made), with these settings, the cost in force and the re-plannings so far; its profile is
        measured again (`measure_profile`), then planned."""
        successor = InstalledPlans(table, self.channels, self.planner, self.codec, self.nonfinite, self.trace,
                                   self.plan_trials, self.partition, self.replan, self.unused_as_zeros,
                                   calibration=self.calibration)
        successor.replans = self.replans
        successor.measure_profile(model_name, self.cost)
        return successor

    def prediction(self, rounds: tuple[str, ...]) -> StepPrediction:
        """The simulator's prediction for a step sending `rounds`, on the profile's times scaled to
        the measured speed of the computation (``runtime.compute_speed``); cached by the speed's
        bin (``ComputeSpeed.bin``), at most `PREDICTIONS_KEPT` of them."""
        key = (rounds, self.speed.bin())
        if key not in self.predictions:
            if len(self.predictions) >= PREDICTIONS_KEPT:
                self.predictions.clear()
            scaled = at_compute_scale(self.layout_plans, self.speed.scale)
            self.predictions[key] = step_prediction(scaled, rounds, self.cost)
        return self.predictions[key]

    def layout_reports(self) -> dict[str, LayoutReport]:
        return {layout: LayoutReport(layout, entry.plan, entry.wire, self.cost)
                for layout, entry in self.layout_plans.items()}

    @property
    def following_up(self) -> bool:
        """Whether a measurement runs, or auto's follow-up rounds are still to come: its choice may
        yet change."""
        return self.measurement is not None or (self.watch is not None and self.watch.follow_up is not None)

    @property
    def steady_layouts(self) -> tuple[str, ...]:
        return tuple(steady_layouts(self.codec))

    def iteration_done(self, done: IterationDone, predicted_busy: float) -> None:
        """After a synchronised iteration: the measurement in progress goes on; else the predictions
        follow the computation's speed, the communication is compared with its reference (a change
        of the network re-plans) and auto's choice is checked. The first iteration under plans just
        installed, or just kept by the trials, is no watcher's sample (it runs the switch): every
        watcher starts there, and their windows close together. The reductions of the windows that
        closed now are sent at the end, in one all-reduce."""
        try:
            self._observe(done, predicted_busy)
        finally:
            self.reductions.send()

    def _observe(self, done: IterationDone, predicted_busy: float) -> None:
        busy = [(layout, seconds) for layout, executor in self.executors.items()
                for seconds in executor.take_busy_times()]
        if self.measurement is not None:
            self._carry_out(self.measurement.iteration_done(done))
            return
        if self.settling:
            self.settling = False
            return
        self.speed.observe(done.stats.busy_time, predicted_busy)
        if self.cost_watch is not None:
            refitted = self.cost_watch.observe(busy, done.stats.iteration_time)
            if refitted is not None:
                self._plan_again(refitted, done.stats.iteration)
                return
        if self.watch is not None:
            again = self.watch.observe(done)
            if again is not None:  # the trials again, or follow-up rounds (from the plans installed now)
                self.watch, self.measurement = None, again
                if again.first.planner is not self.current:
                    self._carry_out(again.first)

    def _carry_out(self, request: Install | ProfileMeasured | TrialsDone | None) -> None:
        """What the measurement asked for."""
        if isinstance(request, Install):
            self.install(request.profile, self.cost, request.planner)
        elif isinstance(request, ProfileMeasured):
            self.rank_profiles = request.rank_profiles
            self._release_host_memory()  # what the calibration's probes freed, before any plan trials
            self._choose_plans(request.profile)
        elif isinstance(request, TrialsDone):
            if request.planner is not None:
                self.install(self.profile, self.cost, request.planner)
            self.trials, self.watch, self.measurement = request.result, request.watch, None
            self.settling = True
            if not self.following_up:
                self._release_host_memory()  # what the plans timed freed

    def _choose_plans(self, profile: ModelProfile, incumbent: BoundPlanner | None = None) -> None:
        """Install the wrapped planner's plans on `profile` and the cost in force, after timing them
        against each other where it chooses among others (``measure.trials``): against torch DDP's
        buckets at first; after a re-planning (`incumbent`: the planner whose plans run now), its new
        choice alone against the incumbent's plans on the new cost, so that a run that is fast
        already is not slowed by timing plans that are not."""
        self.measurement = PlanTrials.start(profile, self.cost, self.codec, self.planner, self.plan_trials,
                                            self.channels, self.table.device,
                                            self.reductions.starting(dist.ReduceOp.MAX), self.collective, incumbent)
        self._carry_out(self.measurement.first if self.measurement is not None else Install(profile))

    def _plan_again(self, cost: CostModel, iteration: int) -> None:
        """The network changed: plan again on the re-fitted `cost` from the next iteration (every
        rank decided it at the same `iteration`, on values combined over the ranks)."""
        replan = Replan(iteration, self.cost_watch.drift, self.cost, cost)
        self.replans.append(replan)
        if self.channels.rank == 0:
            log.info("gradsync: %s", replan.summary())
        if self.trace is not None:
            self.trace.mark(f"re-planned: communication {replan.drift:.2f}x its reference time")
        self.cost, self.watch = cost, None
        self._choose_plans(self.profile, incumbent=self.current)

    def _release_host_memory(self) -> None:
        """Hand the host heap's free pages back to the OS (``runtime.host_memory``) on a CPU model:
        after the calibration's probes, at each installation of plans that stay, and under ZeRO (a
        partition) at every installation, whose replaced buffers would otherwise add to the peak
        memory ZeRO is there to cut. Not otherwise at the installations of auto's plan trials and
        follow-up rounds: the iterations after each would fault afresh on the pages of the tensors
        they write (hundreds a transformer iteration while follow-up rounds run)."""
        if self.table.device.type == "cpu":
            release_freed_host_memory()

    def _compute_speed(self) -> ComputeSpeed:
        """Rescales the predictions to the slowest rank's measured speed (every rank reaches the
        same iterations)."""
        return ComputeSpeed(start=self.reductions.starting(dist.ReduceOp.MAX))
