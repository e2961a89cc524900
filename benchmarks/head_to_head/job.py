"""One rank of a head-to-head setting: every row's model and optimizer (`Variant`), each gradsync
row calibrated alone, then the rows interleaved in blocks, round after round in a balanced order;
the job's cost fitted before, midway through and after the timed rounds."""
from __future__ import annotations

import copy
import itertools
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

import gradsync
from gradsync.runtime import attached
from gradsync.runtime.channels import Channels
from gradsync.runtime.measure.probes import measure_cost
from gradsync.topology import Topology

from benchmarks.simulator_replay import replay_record

from .rows import COMPUTE_ONLY, LOW_RANK, ONE_BUCKET_MB, OVERHEAD_PAIR, OVERHEAD_PAIRS, ROWS, START_ITER, Row
from .workloads import EMULATED_MODELS, LEARNING_RATE, WORKLOADS

CALIBRATION_LIMIT = 300  # steps a gradsync row may take to measure its profile and time its plans
UNTIMED_STEPS = 1  # per block, before its clock starts (see the package docstring)
BLOCK = 2  # timed iterations per block
# at 8 emulated ranks the first iterations after a row's switch run slower: in blocks of 2, two rows of one
# identical op measured 7-8% apart and the merged rows up to 11% above their predictions; in blocks of 8, 0.1%
# and within 3% (REPRODUCTION, history/emulated_simulator.md)
EMULATED_BLOCK = 8


class DecisionLog(logging.Handler):
    """gradsync's log records (rank 0 logs its decisions: auto's trials and follow-up rounds, the
    re-plannings online), each kept by the row whose step emitted it, with that row's step count."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.row: Variant | None = None  # the row stepping now

    def emit(self, record: logging.LogRecord) -> None:
        if self.row is not None:
            self.row.decisions.append(f"step {self.row.steps}: {record.getMessage()}")


DECISIONS = DecisionLog()


@dataclass
class Variant:
    """One row's model and optimizer on this rank, and its measurements per timed block."""

    label: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    gradsync: bool
    seconds: list[float] = field(default_factory=list)
    comm_wait: list[float] = field(default_factory=list)
    codec: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    compute_scales: list[list[float]] = field(default_factory=list)  # per timed block, its iterations'
    settled_after: int | None = None  # the steps `calibrate` took
    following: bool = False  # auto's follow-up rounds went on after them
    replans_before: int = 0  # the re-plannings online (`SyncReport.replans`) before the timed rounds
    steps: int = 0  # the steps run so far
    calibration_seconds: list[float] = field(default_factory=list)  # each step `calibrate` ran
    measuring_blocks: int = 0  # timed blocks during which gradsync was timing plans (trials, follow-ups)
    decisions: list[str] = field(default_factory=list)  # gradsync's log records in its steps (``DecisionLog``)

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        DECISIONS.row = self
        self.steps += 1
        self.optimizer.zero_grad()
        self.loss(self.model(inputs), labels).backward()
        self.optimizer.step()

    def block(self, inputs: torch.Tensor, labels: torch.Tensor, iterations: int, timed: bool) -> None:
        """After a barrier and `UNTIMED_STEPS`, `iterations` timed steps; then gradsync's ops still
        in flight complete and its deferred updates are applied, after the clock has stopped."""
        dist.barrier()
        measuring = self.measuring()
        try:
            for _ in range(UNTIMED_STEPS):
                self.step(inputs, labels)
            started = time.perf_counter()
            for _ in range(iterations):
                self.step(inputs, labels)
            elapsed = time.perf_counter() - started
        except Exception as failure:
            failure.add_note(f"in row {self.label!r}")
            raise
        self.settle()
        if timed:
            self.measuring_blocks += measuring or self.measuring()
            self.seconds.append(elapsed / iterations)
            if self.gradsync:
                recent = list(itertools.islice(reversed(attached(self.model).clock.history), iterations))
                self.comm_wait.append(sum(s.comm_wait for s in recent) / iterations)
                self.codec.append(sum(s.codec_time for s in recent) / iterations)
                self.predicted.append(statistics.fmean(s.predicted_time for s in recent))
                self.compute_scales.append([s.compute_scale for s in recent])

    def calibrate(self, inputs: torch.Tensor, labels: torch.Tensor, follow_up_steps: int) -> None:
        """Consecutive steps until gradsync has measured its profile and timed its plans, then
        until auto's follow-up rounds have settled its choice or `follow_up_steps` more steps are
        spent (the same on every rank), no other row running in between, so that the plans are timed
        on this row alone; the steps it took are `settled_after`, and `following` says whether
        follow-up rounds are still to come."""
        steps = 0
        while self.measuring():
            if steps == CALIBRATION_LIMIT:
                raise RuntimeError(f"row {self.label!r} still calibrating after {CALIBRATION_LIMIT} steps")
            self.timed_step(inputs, labels)
            steps += 1
        limit = steps + follow_up_steps
        while self.gradsync and attached(self.model).installed.following_up and steps < limit:
            self.timed_step(inputs, labels)
            steps += 1
        self.settle()  # no op or deferred update of this row stays in flight beside the next
        self.settled_after, self.following = steps, self.gradsync and attached(self.model).installed.following_up
        self.replans_before = len(attached(self.model).installed.replans) if self.gradsync else 0

    def timed_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """A step of `calibrate`, its time kept in `calibration_seconds`."""
        started = time.perf_counter()
        self.step(inputs, labels)
        self.calibration_seconds.append(time.perf_counter() - started)

    def measuring(self) -> bool:
        """Whether gradsync is timing plans now (auto's trials or follow-up rounds)."""
        return self.gradsync and attached(self.model).measurement is not None

    def settle(self) -> None:
        """Wait for gradsync's outstanding ops and apply its deferred updates."""
        if self.gradsync:
            attached(self.model).flush()

    def report(self) -> dict:
        report = {"seconds": self.seconds, "comm_wait": self.comm_wait, "codec": self.codec, "predicted": self.predicted}
        if self.gradsync:
            sync = attached(self.model)
            report["plan"] = sync.plan.options.get("chosen")  # what `auto` picked
            installed = sync.installed
            trials = installed.trials  # what `auto` timed, if anything
            report["trials"] = None if trials is None else list(zip(trials.labels, trials.seconds))
            report["trial_iterations"] = None if trials is None else trials.iterations
            report["trial_summary"] = None if trials is None else trials.summary()
            report["settled_after"], report["following"] = self.settled_after, self.following
            report["replans"] = [replan.summary() for replan in installed.replans[self.replans_before:]]
            report["measuring_blocks"], report["decisions"] = self.measuring_blocks, self.decisions
            report["calibration_seconds"] = self.calibration_seconds
            report["replay"] = replay_record(installed.layout_plans, sync.codec.steady_rounds(), installed.cost,
                                             installed.rank_profiles, self.compute_scales)
        return report


def make_variant(row: Row, base: nn.Module, cost, topology: dict | None) -> Variant:
    """The row's model and optimizer; a forest row packs trees on the job's topology and fits its
    own cost (its all-reduces are not the ring's)."""
    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    if row.transport == "forest":
        model, optimizer = gradsync.wrap(model, optimizer, scheduler=row.scheduler, compressor=row.compressor,
                                         transport="forest", topology=Topology.from_dict(topology))
        return Variant(row.label, model, optimizer, gradsync=True)
    if row.is_gradsync:
        model, optimizer = gradsync.wrap(model, optimizer, scheduler=row.scheduler, compressor=row.compressor,
                                         cost=cost, **row.options)
        return Variant(row.label, model, optimizer, gradsync=True)
    if not row.powersgd_hook:
        return Variant(row.label, nn.parallel.DistributedDataParallel(model), optimizer, gradsync=False)
    # One bucket (an explicit cap sets the first bucket's too): on gloo the hook launches its Q
    # all-reduce from a completion callback's thread, which races with the next bucket's P
    # all-reduce and mismatches the collectives' order across ranks.
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=ONE_BUCKET_MB)
    state = PowerSGDState(process_group=None, matrix_approximation_rank=LOW_RANK, start_powerSGD_iter=START_ITER)
    ddp.register_comm_hook(state, powerSGD_hook)
    return Variant(row.label, ddp, optimizer, gradsync=False)


# Probe repeats for the job's cost: wrap's 5 leave a fitted a of 0.2-2.9 ms, a host time per op of
# 0.2-0.7 ms and a τ of 1.0-1.9 over six fits in a row on one network (2 ranks, 1 Gbit/s; a 10 ms
# slowdown probe then); 15 give 0.2-1.1 ms, 0.3-0.5 ms and 1.1-1.7.
COST_REPEATS = 15


def shared_cost(model: nn.Module):
    """The cost (a, b, γ, slowdowns, host time per op) fitted once on this job's network, as
    gradsync.wrap would fit it but from more repeats of each probe; every gradsync row plans with it.
    Beside an emulated model's ops the probes' computation waits off the core, as its layers do."""
    channels = Channels(2)
    try:
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return measure_cost(channels, gradient_bytes, repeats=COST_REPEATS, work=getattr(model, "probe_work", None))
    finally:
        channels.destroy()


def balanced_order(count: int, round_index: int) -> list[int]:
    """The order of `count` units in a round of a Williams design: over `count` rounds (twice as
    many for an odd count) every unit runs right after every other one equally often (once; twice
    for an odd count). Round k adds k to the first round's 0, 1, n−1, 2, n−2, …; an odd count's
    second `count` rounds run those orders backwards."""
    first = [0] + [(k + 1) // 2 if k % 2 else count - k // 2 for k in range(1, count)]
    shift = round_index % (count if count % 2 == 0 else 2 * count)
    order = [(unit + shift) % count for unit in first]
    return order if shift < count else order[::-1]


def round_order(labels: list[str], round_index: int = 0, pair: tuple[str, str] = OVERHEAD_PAIR,
                repeats: int = OVERHEAD_PAIRS) -> list[str]:
    """One round's blocks in run order: each row once, except the overhead's pair, which runs
    `repeats` times A B A B … as one unit (same-round ratios are the overhead's samples, and six
    rounds give too few to tell 2% from the host's noise). The units' order changes each round
    (``balanced_order``), so that no row always follows the same one: whatever state a block
    leaves the host and the links in weighs on every row alike.

    Args:
        labels: the rows (the first round's order starts with the first).
        round_index: the round (0: the first warm-up round).
        pair, repeats: the overhead's two rows and how many blocks each runs a round.
    """
    paired = set(pair) <= set(labels)
    units = [list(pair) * repeats if paired and label == pair[0] else [label]
             for label in labels if not (paired and label == pair[1])]
    return [label for unit in balanced_order(len(units), round_index) for label in units[unit]]


def rank_main(rank: int, world_size: int, job: dict) -> dict:
    """One rank of a setting: every row interleaved in blocks; per row, its timed blocks."""
    torch.manual_seed(0)
    gradsync_log = logging.getLogger("gradsync")
    gradsync_log.addHandler(DECISIONS)
    gradsync_log.setLevel(logging.INFO)
    workload = WORKLOADS[job["model"]]
    base = workload.build_model(job["time_scale"]) if job["model"] in EMULATED_MODELS else workload.build_model()
    cost = shared_cost(base)  # the rows plan with this fit
    fits = [cost]
    compute_only = copy.deepcopy(base)
    variants = [Variant(COMPUTE_ONLY, compute_only, torch.optim.SGD(compute_only.parameters(), lr=LEARNING_RATE),
                        gradsync=False)]
    variants += [make_variant(ROWS[key], base, cost, job["topology"]) for key in job["rows"]]
    for variant in variants:
        variant.loss = workload.loss
    generator = torch.Generator().manual_seed(rank)
    inputs, labels = workload.make_inputs(workload.batch, generator), workload.make_targets(workload.batch, generator)
    for variant in variants:
        variant.calibrate(inputs, labels, job["follow_up_steps"])
    by_label = {variant.label: variant for variant in variants}
    midway = job["warmup_rounds"] + job["rounds"] // 2
    cpu_started, wall_started = time.process_time(), time.perf_counter()
    for round_index in range(job["warmup_rounds"] + job["rounds"]):
        if round_index == midway:
            fits.append(shared_cost(base))
        for label in round_order(list(by_label), round_index):
            by_label[label].block(inputs, labels, job["block"], timed=round_index >= job["warmup_rounds"])
    cpu_share = (time.process_time() - cpu_started) / (time.perf_counter() - wall_started)
    fits.append(shared_cost(base))
    reports = {variant.label: variant.report() for variant in variants}
    for variant in variants:
        if variant.gradsync:
            attached(variant.model).detach()
    return {"rows": reports, "cost": cost.to_dict(), "fits": [fit.to_dict() for fit in fits], "cpu_share": cpu_share}
