"""Head-to-head: torch DDP, its PowerSGD hook and gradsync's plans on an emulated cluster.

Each setting (model × ranks × network) runs as one job on the netbed (one rank per network
namespace, `tc`-shaped links): every rank holds one copy of the model per row, plus a copy trained
without communication (the compute-only reference). Each gradsync row first runs alone until it
has measured its profile and, for `auto`, timed its plans. Then rows run interleaved in blocks —
each round in another order (`round_order`) — after warm-up rounds (DDP's bucket rebuild, the
compressors' uncompressed start); each block starts after a barrier with one untimed step, so
that the timed steps run as in training: the first one's forward waits for that step's ops of a
plan that overlaps the next forward pass, as every later one does, and the last timed step's ops
complete after the clock stops (in training the next forward waits for them), before the next
block: no row borrows another's time. A block's time is its slowest rank's. torch DDP and gradsync
ddp_buckets (the same buckets) run several blocks each per round, alternating: the runtime's
overhead is the median of their back-to-back ratios. One all-reduce cost model is measured per job
and given to every gradsync row; it is fitted twice more, midway through the timed rounds and after
them, and the rows' predictions are made with the median of the three fits (the host's interference
drifts over a run: see `median_cost`), beside those made with the first fit alone.
`--emulated` runs the zoo's ResNet-50, BERT-Base and MobileNet-V2 on emulated accelerators
(gradsync.emulated: the layers' device times waited off the core, tensors scaled down with the link
rates) at 4 and 8 ranks, and reports each setting's CPU use and steal beside its rows.
`--topology` runs the rows on per-pair rate limits of a gradsync topology instead of uniform NICs.
Rows run only when named: mg_wfbp_overlap and optimal_merge_overlap, the plans with their waits
deferred to the next forward (the planners' `overlap_forward`).

    .venv/bin/python -m benchmarks.head_to_head              # every setting (about 30 minutes)
    .venv/bin/python -m benchmarks.head_to_head --quick      # CNN, 2 ranks, 1 Gbit/s, four rows
    .venv/bin/python -m benchmarks.head_to_head --emulated   # the zoo's models on emulated V100s, 4 and 8 ranks
    .venv/bin/python -m benchmarks.head_to_head --models transformer --world-sizes 2 --rates 1gbit \\
        --rows ddp ddp_powersgd acp_sgd
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy.stats import binom
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

import gradsync
from gradsync.emulated import EmulatedModel
from gradsync.launch import RankFailed
from gradsync.profile.model_zoo import zoo
from gradsync.runtime import attached
from gradsync.runtime.channels import Channels
from gradsync.runtime.measure.probes import measure_cost
from gradsync.topology import Topology, load, preset

from benchmarks.netbed import RATE_PRESETS, NetbedUnavailable, from_topology, launch, netbed, uniform
from benchmarks.overhead import small_cnn
from benchmarks.simulator_replay import replay_record, replayed_prediction

LOW_RANK = 4  # PowerSGD's r, equal for the torch hook and gradsync's powersgd and acp_sgd
START_ITER = 2  # uncompressed steps before compression (the least the torch hook allows with error feedback)
LEARNING_RATE = 0.01
ONE_BUCKET_MB = 1024  # larger than any model here
COMPUTE_ONLY = "compute only"
CALIBRATION_LIMIT = 300  # steps a gradsync row may take to measure its profile and time its plans
FOLLOW_UP_STEPS = 3000  # then, steps auto may take to settle its follow-up rounds before the timed rounds
EMULATED_FOLLOW_UP_STEPS = 0  # emulated iterations last up to a second: the follow-ups run within the rows
RESULTS = Path(__file__).parent / "results"


def class_labels(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 10, (batch,), generator=generator)


@dataclass(frozen=True)
class Workload:
    """A model, one rank's synthetic batch of `batch` samples (inputs and targets) and its loss."""

    description: str
    batch: int
    samples: str  # what one sample is, for the report
    build_model: Callable[[], nn.Module]
    make_inputs: Callable[[int, torch.Generator], torch.Tensor]
    make_targets: Callable[[int, torch.Generator], torch.Tensor] = class_labels
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy


class Block(nn.Module):
    """A pre-norm encoder block whose four attention projections and two MLP matrices are
    nn.Linear modules of their own (as in BERT or GPT-2 code): every parameter's module runs."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.query, self.key, self.value, self.out = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = (self.split(projection(h)) for projection in (self.query, self.key, self.value))
        attention = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + self.out(attention)
        return x + self.down(F.gelu(self.up(self.norm2(x))))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)


class Transformer(nn.Module):
    """3 blocks of width 512 over 256 token ids, mean-pooled into 10 classes: large matrices
    (38 MB of gradients in 51 tensors)."""

    def __init__(self, width: int = 512, layers: int = 3, heads: int = 8, vocab: int = 256, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).mean(dim=1))


def images(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=generator)


def tokens(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 32), generator=generator)


# overhead.py's CNN has 26 small tensors (4.7 MB). The batches set each model's balance of
# computation and communication at 1 Gbit/s on CPU ranks (about 100× slower than the papers'
# GPUs): the CNN's backward pass about as long as its gradients' transfer with 2 ranks, where the
# order and merging of the all-reduces decide the step (with 4 images the transfer took about
# twice the computation and no schedule could hide it); torch DDP's transformer step 3.5-5.2× its
# computation (4 and 2 ranks), as for BERT-Base on 10GbE in acp-sgd Table III (S-SGD 805 ms,
# ACP-SGD 193 ms: at least 4.17×; with 4 sequences 2.4-4.8× depending on the host's speed).
WORKLOADS = {"cnn": Workload("CNN (small tensors)", 8, "images of 3×32×32", small_cnn, images),
             "transformer": Workload("transformer (large matrices)", 2, "sequences of 32 tokens", Transformer, tokens)}

# Emulated accelerators (gradsync.emulated): the zoo's models with each layer's forward and backward
# time on EMULATED_DEVICE, waited without occupying a core, and every tensor EMULATED_SIZE_SCALE times
# its size, so that 4 and 8 ranks' transfers, reductions and gradient writes stay within 2 cores: a
# link of R Gbit/s then carries what one of R / EMULATED_SIZE_SCALE Gbit/s carries for the full model.
# --time-scale k runs them in slow motion: every layer's time ×k, so a link of R Gbit/s stands for
# R × k / EMULATED_SIZE_SCALE Gbit/s at the device's speed, while the host's own cost per op stays.
EMULATED_DEVICE = "V100"
EMULATED_SIZE_SCALE = 0.05
EMULATED_MODELS = {"emulated_resnet50": ("resnet50", "ResNet-50"), "emulated_bert_base": ("bert_base", "BERT-Base"),
                   "emulated_mobilenet_v2": ("mobilenet_v2", "MobileNet-V2 (small tensors)")}


def emulated_inputs(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 1, generator=generator)


def weighted_mean(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """An EmulatedModel's loss: its output weighed by the targets (every gradient is its parameter's
    pattern times a scalar of the batch: gradsync.emulated)."""
    return (output * targets).mean()


def emulated_workload(zoo_name: str, description: str) -> Workload:
    """The zoo's `zoo_name` as an EmulatedModel: its times are those of the zoo's batch on the
    device; the batch it is given only weighs the gradients."""
    def build(time_scale: float = 1.0) -> nn.Module:
        return EmulatedModel(zoo(zoo_name, device=EMULATED_DEVICE).scaled(time_scale), EMULATED_SIZE_SCALE)

    return Workload(f"{description} emulated on a {EMULATED_DEVICE}, tensors ×{EMULATED_SIZE_SCALE:g}", 8,
                    "weights (an emulated model's times are its profile's)", build, emulated_inputs,
                    make_targets=emulated_inputs, loss=weighted_mean)


REAL_MODELS = tuple(WORKLOADS)
WORKLOADS.update({key: emulated_workload(*names) for key, names in EMULATED_MODELS.items()})
# ≙ 10 and 40 Gbit/s for the full-size models: the papers' 10GbE, and a faster network
EMULATED_RATES = ("0.5", "2")


@dataclass(frozen=True)
class Row:
    """A torch DDP row (no `scheduler`) or a gradsync row (planner `scheduler` and its `options`,
    optional compressor, transport)."""

    label: str
    scheduler: str | None = None
    options: dict = field(default_factory=dict)
    compressor: dict | None = None
    powersgd_hook: bool = False
    transport: str = "allreduce"

    @property
    def is_gradsync(self) -> bool:
        return self.scheduler is not None


def low_rank(name: str) -> dict:
    return {"type": name, "rank": LOW_RANK, "start_iter": START_ITER}


PLANNER_ROWS = {"wfbp": "wfbp", "ddp_buckets": "ddp", "mg_wfbp": "mg_wfbp", "optimal_merge": "optimal_merge",
                "asc_wfbp": "asc_wfbp", "bytescheduler": "bytescheduler", "us_byte": "us_byte", "auto": "auto"}
# gradsync ddp_buckets runs right after torch DDP: the runtime's overhead is their paired ratio
ROWS = {
    "ddp": Row("torch DDP"),
    "ddp_buckets": Row("gradsync ddp_buckets", scheduler=PLANNER_ROWS["ddp_buckets"]),
    "ddp_powersgd": Row("torch DDP + PowerSGD hook", powersgd_hook=True),
    **{key: Row(f"gradsync {key}", scheduler=planner) for key, planner in PLANNER_ROWS.items()
       if key != "ddp_buckets"},
    "mg_wfbp_overlap": Row("gradsync mg_wfbp overlapping the forward", scheduler="mg_wfbp",
                           options={"overlap_forward": True}),
    "optimal_merge_overlap": Row("gradsync optimal_merge overlapping the forward", scheduler="optimal_merge",
                                 options={"overlap_forward": True}),
    "powersgd": Row("gradsync powersgd", scheduler="auto", compressor=low_rank("powersgd")),
    "acp_sgd": Row("gradsync acp_sgd", scheduler="auto", compressor=low_rank("acp_sgd")),
    "forest": Row("gradsync forest", scheduler="auto", transport="forest"),
    # the cost of giving every rank rank 0's buffers in each backward pass, on plans that overlap the next forward
    "us_byte_no_buffers": Row("gradsync us_byte without buffer broadcast", scheduler="us_byte",
                              options={"broadcast_buffers": False}),
    "mg_wfbp_overlap_no_buffers": Row("gradsync mg_wfbp overlapping, without buffer broadcast", scheduler="mg_wfbp",
                                      options={"overlap_forward": True, "broadcast_buffers": False}),
}
TOPOLOGY_ROWS = ("forest",)  # rows that need a --topology run
ON_REQUEST_ROWS = ("mg_wfbp_overlap", "optimal_merge_overlap", "us_byte_no_buffers",
                   "mg_wfbp_overlap_no_buffers")  # run only where --rows names them
OVERHEAD_PAIR = (ROWS["ddp"].label, ROWS["ddp_buckets"].label)
UNTIMED_STEPS = 1  # per block, before its clock starts (see the module docstring)
BLOCK = 2  # timed iterations per block
# at 8 emulated ranks the first iterations after a row's switch run slower: in blocks of 2, two rows of one
# identical op measured 7-8% apart and the merged rows up to 11% above their predictions; in blocks of 8, 0.1%
# and within 3% (REPRODUCTION, history/emulated_simulator.md)
EMULATED_BLOCK = 8
OVERHEAD_PAIRS = 4  # blocks of each per round, alternating: the overhead's same-round samples
QUICK_ROWS = ("ddp", "ddp_powersgd", "mg_wfbp", "acp_sgd")


# -- rank side -------------------------------------------------------------------------------------
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


def median_cost(fits: list[dict]) -> dict:
    """The per-field median of several fits of the cost model (as `CostModel.to_dict` writes them).

    What the host's cores lend to gloo drifts over a run: with 4 ranks at 1 Gbit/s (CNN), five fits
    in a row put the host time per op at 1.44-3.65 ms with wrap's probe, and at 2.14-3.69 ms with
    one taking 6 times as long (`benchmarks.interference --probe-fits 5 --host-probe-ops 96
    --host-probe-repeats 9`). A run's rows are timed across its whole length; their predictions
    take the median of fits before, midway through and after the timed rounds."""
    def middle(key: str):
        if isinstance(fits[0][key], str):
            return fits[0][key]
        if isinstance(fits[0][key], int):  # ops per channel: one of the counts fitted
            return statistics.median_low(fit[key] for fit in fits)
        return statistics.median(fit[key] for fit in fits)

    return {key: middle(key) for key in fits[0]}


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


# -- summary ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    model: str
    world_size: int
    network: str  # a rate preset (1gbit, 10gbit), Gbit/s, or "topology <name>"
    time_scale: float = 1.0  # an emulated model's slow motion (--time-scale)

    @property
    def title(self) -> str:
        network = self.network
        if self.model in EMULATED_MODELS and not network.startswith("topology"):
            gbps = RATE_PRESETS.get(network) or float(network)
            full_size = gbps * self.time_scale / EMULATED_SIZE_SCALE
            network = (f"{gbps:g} Gbit/s (≙ {full_size:g} Gbit/s for the full-size model)" if self.time_scale == 1 else
                       f"{gbps:g} Gbit/s, times ×{self.time_scale:g} (≙ {full_size:g} Gbit/s for the full-size"
                       " model at the device's speed)")
        return f"{WORKLOADS[self.model].description}, {self.world_size} ranks, {network}"


@dataclass(frozen=True)
class RowResult:
    label: str
    seconds: float  # the median of `blocks`
    blocks: tuple[float, ...]  # per timed round, the slowest rank's time per iteration of its block
    comm: float | None  # non-overlapped communication
    predicted: float | None
    plan: str | None
    trials: list | None = None  # (planner, median seconds) of the plans `auto` timed
    trial_iterations: int | None = None  # the iterations auto's trials took before it settled
    trial_summary: str | None = None  # what the trials kept and why, each gain with its margin (TrialResult.summary)
    settled_after: int | None = None  # the steps before the timed rounds (auto: its follow-up rounds included)
    following: bool = False  # auto's follow-up rounds went on into the timed rounds
    replay: dict | None = None  # what its prediction was made from (benchmarks.simulator_replay)
    codec: float | None = None  # gradsync's encoding and decoding (IterationStats.codec_time)
    first_fit_predicted: float | None = None  # predicted with the cost the rows planned with alone
    replans: tuple[str, ...] = ()  # the re-plannings online during the timed rounds (Replan.summary)
    measuring_blocks: int = 0  # timed blocks during which auto was timing plans (trials, follow-ups)
    decisions: tuple[str, ...] = ()  # rank 0's gradsync log records in the row's steps (DecisionLog)
    calibration_seconds: tuple[float, ...] = ()  # rank 0's time of each step before the timed rounds

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else (self.predicted - self.seconds) / self.seconds

    @property
    def first_fit_error(self) -> float | None:
        return None if self.first_fit_predicted is None else (self.first_fit_predicted - self.seconds) / self.seconds

    @property
    def half_difference(self) -> float | None:
        """How far the measurement repeats within the run: the difference between the medians of
        the first and the second half of the blocks, relative to the row's time."""
        half = len(self.blocks) // 2
        if half == 0:
            return None
        first, second = statistics.median(self.blocks[:half]), statistics.median(self.blocks[half:])
        return abs(first - second) / self.seconds


def summarise(reports: list[dict]) -> dict[str, RowResult]:
    """Per row: the median over blocks of the slowest rank's block time; gradsync's communication
    wait and prediction as medians of the ranks' means; torch rows' communication is their time
    beyond the compute-only reference. A row that planned with the job's cost is predicted again
    with the median of the job's fits (`median_cost`), its prediction made during the run kept as
    `first_fit_predicted`."""
    labels = list(reports[0]["rows"])
    run_cost = median_cost(reports[0]["fits"]) if reports[0].get("fits") else None

    def over_ranks(label: str, key: str, combine) -> tuple[float, ...]:
        """Per block of the row (the overhead's pair has more than the others), over the ranks."""
        return tuple(combine(values) for values in zip(*(r["rows"][label][key] for r in reports), strict=True))

    def median_over_blocks(label: str, key: str, combine) -> float:
        return statistics.median(over_ranks(label, key, combine))

    compute = median_over_blocks(COMPUTE_ONLY, "seconds", max)
    results = {}
    for label in labels:
        row = reports[0]["rows"][label]
        slowest = over_ranks(label, "seconds", max)
        seconds = statistics.median(slowest)
        if row["comm_wait"]:
            comm, predicted = (median_over_blocks(label, "comm_wait", statistics.fmean),
                               median_over_blocks(label, "predicted", statistics.fmean))
        else:
            comm, predicted = (None if label == COMPUTE_ONLY else max(0.0, seconds - compute)), None
        codec = median_over_blocks(label, "codec", statistics.fmean) if row.get("codec") else None
        replay, first_fit = row.get("replay"), None
        if run_cost is not None and replay is not None and replay["cost"] == reports[0]["cost"]:
            replay = {**replay, "cost": run_cost}
            first_fit, predicted = predicted, replayed_prediction(replay)
        results[label] = RowResult(label, seconds, slowest, comm, predicted, row.get("plan"), row.get("trials"),
                                   row.get("trial_iterations"), row.get("trial_summary"), row.get("settled_after"),
                                   row.get("following", False), replay, codec, first_fit,
                                   tuple(row.get("replans", ())), row.get("measuring_blocks", 0),
                                   tuple(row.get("decisions", ())), tuple(row.get("calibration_seconds", ())))
    return results


def speedup(results: dict[str, RowResult], label: str, baseline: str = ROWS["ddp"].label) -> float | None:
    if baseline not in results or label not in results:
        return None
    return results[baseline].seconds / results[label].seconds


def paired_ratio(results: dict[str, RowResult], label: str, baseline: str = ROWS["ddp"].label) -> float:
    """The row's time relative to `baseline`'s: the median of the ratios of their blocks run back
    to back (`round_order`: they share the host's slow and fast phases, which the ratio of the two
    medians does not cancel)."""
    return statistics.median(row / base for row, base in zip(results[label].blocks, results[baseline].blocks, strict=True))


def round_times(row: RowResult, rounds: int) -> list[float]:
    """A row's time in each timed round: its block's, or the median of its blocks where it ran
    several a round (the overhead's pair)."""
    per_round, extra = divmod(len(row.blocks), rounds)
    if per_round < 1 or extra:
        raise ValueError(f"row {row.label!r}: {len(row.blocks)} blocks do not divide into {rounds} rounds")
    return [statistics.median(row.blocks[index * per_round:(index + 1) * per_round]) for index in range(rounds)]


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values` at `confidence` (the sign test's:
    the k-th smallest and largest value, k from the binomial(n, ½) quantile); None where too few
    values for one (fewer than 6 at 95%)."""
    ordered = sorted(values)
    below = int(binom.ppf((1 - confidence) / 2, len(ordered), 0.5))  # values left out at each end
    if below < 1:
        return None
    return ordered[below - 1], ordered[len(ordered) - below]


def held_out_best(results: dict[str, RowResult], label: str, fixed: list[str]) -> tuple[list[float], list[str]]:
    """The fastest fixed row's time over `label`'s, paired by round, the fastest chosen on the
    other half of the rounds (even rounds against odd, then the other way): the fastest of several
    rows on the rounds it is compared on is the one whose blocks ran fast by chance as much as by
    plan, so comparing with it there understates `label` by its luck (the winner's curse). Returns
    the ratios (the fastest's time / `label`'s, both halves pooled) and the row chosen on each half.
    """
    rounds = len(results[label].blocks)
    times = {name: round_times(results[name], rounds) for name in [label, *fixed]}
    halves = (range(0, rounds, 2), range(1, rounds, 2))
    ratios, chosen = [], []
    for choose_on, compare_on in (halves, halves[::-1]):
        best = min(fixed, key=lambda name: statistics.median(times[name][index] for index in choose_on))
        chosen.append(best)
        ratios += [times[best][index] / times[label][index] for index in compare_on]
    return ratios, chosen


def paired_target(ratios: list[float], what: str, goal: float) -> str:
    """"0.98× the best fixed plan (95% interval 0.95–1.01) (target ≥ 0.97×): reached": the median of
    same-round ratios, the interval of that median, the verdict on the median."""
    value = statistics.median(ratios)
    interval = median_interval(ratios)
    spread = "" if interval is None else f" (95% interval {interval[0]:.3f}–{interval[1]:.3f})"
    return f"{value:.3f}× {what}{spread} (target ≥ {goal:g}×): {verdict(value, goal)}"


def cost_line(fits: list[dict], world_size: int) -> str:
    """The job's fitted all-reduce cost, the median of its fits (`median_cost`), with b read as a
    ring's per-link bandwidth (2(N−1)/N bytes per byte); and the range of the fits' host time and
    slowdowns."""
    cost = median_cost(fits)
    link_gbps = 2 * (world_size - 1) / world_size * 8 / cost["b"] / 1e9
    line = (f"fitted all-reduce cost a = {cost['a'] * 1e3:.2f} ms, b ≙ {link_gbps:.2f} Gbit/s per ring link,"
            f" γ = {cost['gamma']:.2f}, {cost['ops_per_channel']} op(s) at once per channel,"
            f" host time per op {cost['host'] * 1e3:.2f} ms,"
            f" slowdowns σ = {cost['compute_slowdown']:.2f} (computation), τ = {cost['transfer_slowdown']:.2f}"
            " (transfers)")
    spread = ", ".join(f"{name} {min(fit[key] for fit in fits) * scale:.2f}–{max(fit[key] for fit in fits) * scale:.2f}"
                       for name, key, scale in (("host ms", "host", 1e3), ("σ", "compute_slowdown", 1),
                                                ("τ", "transfer_slowdown", 1)))
    return (line + f"; the median of {len(fits)} fits (before, midway through and after the timed rounds; the rows"
            f" planned with the first): {spread}")


def setting_table(setting: Setting, results: dict[str, RowResult]) -> list[str]:
    lines = ["| row | median ms | speed-up vs torch DDP | non-overlapped comm ms | compression ms | predicted ms | error |",
             "|---|---|---|---|---|---|---|"]
    for label, row in results.items():
        ratio = speedup(results, label)
        name = f"{label} (→ {row.plan})" if row.plan else label
        if row.trials:
            timed = ", ".join(f"{plan} {seconds * 1e3:.0f}" for plan, seconds in row.trials)
            name = name[:-1] + f"; timed {timed} ms in {row.trial_iterations} iterations)"
        lines.append("| " + " | ".join([
            name, f"{row.seconds * 1e3:.1f}", "—" if ratio is None else f"{ratio:.2f}×",
            "—" if row.comm is None else f"{row.comm * 1e3:.1f}",
            "—" if row.codec is None else f"{row.codec * 1e3:.1f}",
            "—" if row.predicted is None else f"{row.predicted * 1e3:.1f}",
            "—" if row.error is None else f"{row.error:+.1%}"]) + " |")
    return lines


def verdict(value: float | None, goal: float, at_least: bool = True) -> str:
    if value is None:
        return "not measured in this run"
    reached = value >= goal if at_least else value <= goal
    return "reached" if reached else "NOT reached"


def speedup_target(value: float | None, baseline: str, goal: float) -> str:
    """"1.02× torch DDP (target ≥ 1.15×): NOT reached", or that it was not measured."""
    if value is None:
        return f"against {baseline}: not measured in this run"
    return f"{value:.2f}× {baseline} (target ≥ {goal:g}×): {verdict(value, goal)}"


def error_by_world_size(summaries: dict[Setting, dict[str, RowResult]]) -> str:
    """The simulator's median |error| per number of ranks, where the run had more than one (ranks
    beyond the host's cores share them, and with them the network's processing)."""
    errors: dict[int, list[float]] = {}
    for setting, results in summaries.items():
        errors.setdefault(setting.world_size, []).extend(abs(r.error) for r in results.values() if r.error is not None)
    errors = {size: values for size, values in sorted(errors.items()) if values}
    if len(errors) < 2:
        return ""
    return "; by ranks: " + ", ".join(f"{size} ranks {statistics.median(values):.1%} over {len(values)} rows"
                                      for size, values in errors.items())


AUTO_WITHIN = 0.03  # auto's target: within 3% of the best fixed planner


def best_plan_target(results: dict[str, RowResult], plan_rows: list[str], goal: float) -> str:
    """The fastest non-compressing gradsync plan against torch DDP, with its verdict."""
    ratios = {label: speedup(results, label) for label in plan_rows if label in results}
    ratios = {k: v for k, v in ratios.items() if v is not None}
    best = max(ratios, key=ratios.get) if ratios else None
    return "best non-compressing plan" + (f" ({best}) " if best else " ") + speedup_target(ratios.get(best),
                                                                                          "torch DDP", goal)


def emulated_targets(setting: Setting, results: dict[str, RowResult], plan_rows: list[str]) -> list[str]:
    """The emulated regime's targets: on the small-tensor model at 8 ranks, mg_wfbp ≥ 1.15× wfbp
    and the best plan ≥ 1.2× torch DDP; everywhere, the direction of the papers' gains (asc_wfbp
    over mg_wfbp, us_byte over bytescheduler)."""
    lines, label = [], f"- {setting.model}, {setting.world_size} ranks, {setting.network}: "
    if setting.model == "emulated_mobilenet_v2" and setting.world_size == 8:
        lines.append(label + "mg_wfbp " + speedup_target(speedup(results, ROWS["mg_wfbp"].label, ROWS["wfbp"].label),
                                                         "wfbp", 1.15) + "; " + best_plan_target(results, plan_rows, 1.2))
    gains = [(faster, slower) for faster, slower in (("asc_wfbp", "mg_wfbp"), ("us_byte", "bytescheduler"))
             if ROWS[faster].label in results and ROWS[slower].label in results]
    if gains:
        lines.append(label + "; ".join(
            f"{faster} {speedup(results, ROWS[faster].label, ROWS[slower].label):.2f}× {slower}"
            + (" (the same ops: the two rows differ by their measurement alone)"
               if same_ops(results[ROWS[faster].label], results[ROWS[slower].label]) else "")
            for faster, slower in gains) + " (the papers report gains: > 1×)")
    return lines


def same_ops(first: RowResult, second: RowResult) -> bool:
    """Whether two rows ran the same ops in every layout (their plans' planner names aside)."""
    if first.replay is None or second.replay is None:
        return False
    layouts = first.replay["layouts"]
    return layouts.keys() == second.replay["layouts"].keys() and all(
        layouts[name]["plan"]["ops"] == second.replay["layouts"][name]["plan"]["ops"] for name in layouts)


def auto_target(setting: Setting, results: dict[str, RowResult], plan_rows: list[str]) -> str | None:
    """auto against torch DDP (target ≥ 1×) and against the fastest fixed non-compressing plan of
    the setting (target: within 3%), each the median of same-round ratios with its interval, the
    fastest chosen on the other half of the rounds (``held_out_best``); then the ratio of the
    medians over all rounds, and the iterations its trials took; None without an auto row."""
    auto, ddp = ROWS["auto"].label, ROWS["ddp"].label
    if auto not in results:
        return None
    rounds = len(results[auto].blocks)
    line = f"- {setting.model}, {setting.world_size} ranks, {setting.network}: auto (→ {results[auto].plan}) "
    if ddp in results:
        ratios = [base / own for base, own in zip(round_times(results[ddp], rounds), results[auto].blocks)]
        line += paired_target(ratios, "torch DDP", 1.0) + f" (ratio of the medians {speedup(results, auto):.3f}×)"
    else:
        line += speedup_target(None, "torch DDP", 1.0)
    fixed = {label: results[label].seconds for label in plan_rows if label in results and label != auto}
    if fixed and rounds < 2:
        line += "; against the best fixed plan: not measured in this run (it is chosen on other rounds than one)"
    elif fixed:
        ratios, chosen = held_out_best(results, auto, list(fixed))
        best = min(fixed, key=fixed.get)
        line += ("; " + paired_target(ratios, "the best fixed plan", 1 - AUTO_WITHIN)
                 + f" (chosen on the other half of the rounds: {', '.join(dict.fromkeys(chosen))}; over all rounds "
                 f"the fastest row is {best}, {fixed[best] / results[auto].seconds:.3f}× by the ratio of the medians)")
        if same_ops(results[auto], results[best]):
            line += " (auto ran that row's plan, op for op: the two rows differ by their measurement alone)"
    if results[auto].trial_iterations is not None:
        settled = results[auto].settled_after
        if settled is not None:
            line += (f"; its follow-up rounds went on into the timed rounds after {settled} iterations"
                     if results[auto].following else f"; it settled after {settled} iterations")
        line += f"; its trials took {results[auto].trial_iterations} iterations"
    elif results[auto].settled_after is not None:
        line += f"; it settled after {results[auto].settled_after} iterations, without plan trials"
    if results[auto].trial_summary:
        line += f" ({results[auto].trial_summary})"
    if results[auto].measuring_blocks:
        line += (f"; it was timing plans (its trials started again, or follow-up rounds) during "
                 f"{results[auto].measuring_blocks} of its {rounds} timed blocks")
    return line


def targets(summaries: dict[Setting, dict[str, RowResult]]) -> list[str]:
    """The project's targets, each with its measured value and verdict."""
    lines = []
    plan_rows = [row.label for row in ROWS.values()
                 if row.is_gradsync and row.compressor is None and row.transport == "allreduce"]
    for setting, results in summaries.items():
        auto = auto_target(setting, results, plan_rows)
        if auto is not None:
            lines.append(auto)
        if setting.model == "cnn" and setting.network == "1gbit":
            lines.append(f"- CNN, {setting.world_size} ranks, 1 Gbit/s: " + best_plan_target(results, plan_rows, 1.15))
        if setting.model in EMULATED_MODELS:
            lines += emulated_targets(setting, results, plan_rows)
        replanned = [f"{label} {len(result.replans)}× (first at {result.replans[0]})"
                     for label, result in results.items() if result.replans]
        if replanned:
            lines.append(f"- {setting.model}, {setting.world_size} ranks, {setting.network}: re-planned online "
                         f"during the timed rounds (the cost watch): {'; '.join(replanned)}")
        if setting.model == "transformer" and setting.network == "1gbit":
            acp = ROWS["acp_sgd"].label
            lines.append(f"- transformer, {setting.world_size} ranks, 1 Gbit/s: acp_sgd "
                         + speedup_target(speedup(results, acp), "torch DDP", 3.0) + "; "
                         + speedup_target(speedup(results, acp, ROWS["ddp_powersgd"].label), "the PowerSGD hook", 1.3))
    predicted = [r for results in summaries.values() for r in results.values() if r.error is not None]
    median_error = statistics.median(abs(r.error) for r in predicted) if predicted else None
    repeats = [r.half_difference for r in predicted if r.half_difference is not None]
    repeatability = (f"; the measurement itself: a row's first and second half of blocks differ by "
                     f"{statistics.median(repeats):.1%} (median over the same rows)" if repeats else "")
    measured_error = "not measured" if median_error is None else f"{median_error:.1%}"
    first_fit = [abs(r.first_fit_error) for r in predicted if r.first_fit_error is not None]
    with_first_fit = (f"; with the first fit of each job's cost alone (what the rows planned with): "
                      f"{statistics.median(first_fit):.1%} over {len(first_fit)} rows" if first_fit else "")
    lines.append(f"- simulator error, median |error| over {len(predicted)} gradsync rows: {measured_error}"
                 f" (target ≤ 5%): {verdict(median_error, 0.05, at_least=False)}" + repeatability + with_first_fit
                 + error_by_world_size(summaries))
    overheads = [(setting, paired_ratio(results, ROWS["ddp_buckets"].label) - 1)
                 for setting, results in summaries.items()
                 if ROWS["ddp_buckets"].label in results and ROWS["ddp"].label in results]
    if overheads:
        median_overhead = statistics.median(o for _, o in overheads)
        detail = ", ".join(f"{s.model}/{s.world_size}/{s.network} {o:+.1%}" for s, o in overheads)
        lines.append(f"- runtime overhead (gradsync ddp_buckets vs torch DDP: same buckets, {OVERHEAD_PAIRS} blocks"
                     f" each per round, alternating; per setting the median of their back-to-back blocks' ratios),"
                     f" median over settings "
                     f"{median_overhead:+.1%} (target ≤ +2%): {verdict(median_overhead, 0.02, at_least=False)}; "
                     f"per setting: {detail}")
    return lines


NOTES = [
    "Median iteration time over the timed blocks (each block's time is its slowest rank's); speed-up ="
    " torch DDP's time / the row's time. Non-overlapped communication: gradsync's measured wait on"
    " communication (IterationStats.comm_wait of the timed steps); for"
    " torch rows, the row's time minus the compute-only time (forward, backward and step without"
    " communication, measured in the same interleaved loop). Compression: gradsync's encoding and decoding"
    " on the computing thread (IterationStats.codec_time, the ranks' mean; a row without a compressor has"
    " none where its gradients are scaled straight into the op buffers, and counts the reshapes and"
    " copies of the tensors its plan splits over several ops). Predicted: the simulator's iteration time"
    " for the plan the row ran (from its measured profile, its times scaled to the computation's measured"
    " speed, and the job's cost: the median of its fits before, midway through and after the timed rounds);"
    " error = (predicted −"
    " measured) / measured. `→` names the planner `auto` chose, and the plans it timed on the job before"
    " choosing (plan trials, run alone: rounds of 2 iterations per plan, forth then back, torch DDP's buckets"
    " kept unless another plan is faster at 95% confidence; the slowest rank's median visit; the iterations"
    " they took).",
    "auto's targets pair the blocks of a round (the rows run interleaved, so a round's blocks share the host's"
    " phase): the median over rounds of torch DDP's time, or the best fixed plan's, over auto's, with the"
    " sign test's 95% interval of that median. The best fixed plan is chosen on the even rounds and compared"
    " on the odd ones, then the other way round: the fastest of several rows on the rounds it is compared on"
    " is partly the luckiest (the winner's curse), which would understate auto by that luck.",
    f"Compressors: rank {LOW_RANK}, {START_ITER} uncompressed steps first, error feedback, for the torch"
    " PowerSGD hook and gradsync's powersgd and acp_sgd alike; plain SGD (lr 0.01) everywhere. The PowerSGD"
    " hook row runs DDP with one bucket: on gloo the hook's second all-reduce is launched from a callback"
    " thread and, with several buckets, races with the next bucket's first one (collective mismatch).",
]


def workload_notes(models: set[str], time_scale: float = 1.0) -> list[str]:
    """What the run's models compute: real ranks' batches, or the emulated accelerators (in slow
    motion where `time_scale` > 1)."""
    notes = []
    real = [name for name in REAL_MODELS if name in models]
    if real:
        notes.append("One rank's batch of synthetic data: " + ", ".join(
            f"{name} {WORKLOADS[name].batch} {WORKLOADS[name].samples}" for name in real)
            + ", sized for the balance of computation and communication at 1 Gbit/s (REPRODUCTION.md).")
    if models - set(real):
        notes.append(
            f"Emulated models (gradsync.emulated): the zoo's layers with their forward and backward times on a"
            f" {EMULATED_DEVICE}, waited without occupying a core, so that the ranks' cores are left to the"
            f" communication as on the papers' GPUs; every tensor holds {EMULATED_SIZE_SCALE:g} of its elements"
            f" (gradient writes, reductions and transfers stay within 2 cores), so a link of R Gbit/s stands for"
            f" R / {EMULATED_SIZE_SCALE:g} Gbit/s for the full-size model. The compressors' encoding and decoding"
            " is real CPU work on the scaled tensors.")
        if time_scale != 1:
            notes.append(
                f"Slow motion: every emulated layer's forward and backward time is ×{time_scale:g}, so a link of"
                f" R Gbit/s stands for R × {time_scale:g} / {EMULATED_SIZE_SCALE:g} Gbit/s at the device's speed;"
                " the host's own cost per op (Python, gloo, the kernel's network stack) is not slowed, and so"
                f" weighs 1/{time_scale:g} as much as at full speed: a host that much faster than its device, as"
                " the papers' hosts are beside their GPUs.")
    return notes


def markdown(command: str, summaries: dict[Setting, dict[str, RowResult]], costs: dict[Setting, str],
             failures: dict[Setting, str], environment: str) -> str:
    models = {setting.model for setting in [*summaries, *failures]}
    time_scale = max((setting.time_scale for setting in [*summaries, *failures]), default=1.0)  # one per run
    lines = ["# Head-to-head on the emulated cluster", "", f"Command: `{command}`", "", environment, "",
             *NOTES, *workload_notes(models, time_scale), "", "## Targets", "", *targets(summaries), ""]
    for setting in [*summaries, *failures]:
        lines += [f"## {setting.title}", ""]
        if setting in failures:
            lines += [f"Failed: {failures[setting]}", ""]
            continue
        lines += [costs[setting], "", *setting_table(setting, summaries[setting]), "",
                  *decision_lines(summaries[setting])]
    return "\n".join(lines)


def decision_lines(results: dict[str, RowResult]) -> list[str]:
    """Each gradsync row's decisions as rank 0 logged them (auto's trials and follow-up rounds, its
    trials started again, the re-plannings online), by the row's step (its calibration's included)."""
    lines = []
    for label, row in results.items():
        if row.decisions:
            lines += [f"{label}, its decisions (rank 0's log; by the row's step, of {row.settled_after} before the "
                      "timed rounds):", "", *(f"- {decision}" for decision in row.decisions), ""]
    return lines


def replay_file(summaries: dict[Setting, dict[str, RowResult]]) -> dict:
    """Per setting, every row's measured time and blocks (the slowest rank's, in run order, so the
    rows can be paired by round again) and, for gradsync rows, the prediction and what it was
    predicted from: the data benchmarks.simulator_replay re-predicts (a torch row's `replay` is None)."""
    return {setting.title: {label: {"seconds": row.seconds, "blocks": list(row.blocks), "predicted": row.predicted,
                                    "replay": row.replay, "calibration_seconds": list(row.calibration_seconds)}
                            for label, row in results.items()}
            for setting, results in summaries.items()}


def chart(summaries: dict[Setting, dict[str, RowResult]], path: Path) -> None:
    """One panel per setting: each row's speed-up over torch DDP (bars), 1× marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(4, len(summaries))
    rows = -(-len(summaries) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 4.5 * rows), squeeze=False)
    for axis in axes.flat[len(summaries):]:
        axis.set_visible(False)
    for axis, (setting, results) in zip(axes.flat, summaries.items()):
        labels = [label for label in results if label != COMPUTE_ONLY]
        values = [speedup(results, label) or 0.0 for label in labels]
        colors = ["#C44E52" if label.startswith("torch") else "#4C72B0" for label in labels]
        axis.barh(range(len(labels)), values, color=colors)
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.set_yticks(range(len(labels)))
        axis.set_yticklabels([label.replace("gradsync ", "") for label in labels], fontsize="small")
        axis.invert_yaxis()
        axis.set_title(setting.title.replace(", ", "\n", 1), fontsize="small")
        axis.set_xlabel("speed-up vs torch DDP")
        for position, value in enumerate(values):
            axis.text(value, position, f" {value:.2f}", va="center", fontsize="x-small")
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


# -- driver ----------------------------------------------------------------------------------------
def stolen_cpu_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU time the hypervisor has given to others so far (the steal column of the `cpu` line of
    /proc/stat), or None where there is no such column."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def steal_note(before: float | None, after: float | None, seconds: float) -> str:
    """The run's stolen CPU time as a sentence ('' where it was not readable)."""
    if before is None or after is None:
        return ""
    stolen = after - before
    return (f" The hypervisor took {stolen:.1f} s of CPU time from the machine during the run"
            f" ({stolen / (seconds * os.cpu_count()):.1%} of its cores' time).")


def host_line(reports: list[dict], stolen: float | None, seconds: float) -> str:
    """How busy the host was in a setting's rounds: each rank's CPU time (its threads', gloo's
    included) per second of them, and the hypervisor's steal over the job, so that a reader can
    tell a measurement of scheduling from one of the host's contention."""
    shares = [report["cpu_share"] for report in reports]
    line = (f"Host: the ranks used {statistics.fmean(shares):.0%} of a core each on average (at most"
            f" {max(shares):.0%}) during the rounds, {sum(shares):.2f} of the machine's {os.cpu_count()} cores")
    if stolen is not None:
        line += f"; the hypervisor took {stolen / (seconds * os.cpu_count()):.1%} of the cores' time during the job"
    return line + "."


def network_specs(args) -> list[tuple[str, int, object, dict | None]]:
    """(network name, world size, NetSpec, topology as a dict or None) for every network of the run."""
    if args.topology:
        topology = load(args.topology) if Path(args.topology).exists() else preset(args.topology, args.inter_gbps)
        spec = from_topology(topology)
        return [(f"topology {topology.name}", spec.hosts, spec, topology.to_dict())]
    return [(rate, world_size, uniform(world_size, rate if rate in RATE_PRESETS else float(rate)), None)
            for world_size in args.world_sizes for rate in args.rates]


def run_settings(args) -> tuple[dict, dict, dict]:
    job = {"rows": args.rows, "rounds": args.rounds, "warmup_rounds": args.warmup_rounds, "block": args.block,
           "time_scale": args.time_scale, "follow_up_steps": args.follow_up_steps}
    summaries, costs, failures = {}, {}, {}
    for network, world_size, spec, topology in network_specs(args):
        with netbed(spec):
            for model in args.models:
                setting = Setting(model, world_size, network, args.time_scale)
                print(f"running: {setting.title}", flush=True)
                started, steal_before = time.perf_counter(), stolen_cpu_seconds()
                try:
                    reports = launch("benchmarks.head_to_head:rank_main", world_size,
                                     {**job, "model": model, "topology": topology}, timeout=args.timeout)
                except RankFailed as failure:
                    failures[setting] = " / ".join(line[:300] for line in str(failure).splitlines()
                                                   if line.startswith("rank "))
                    print(f"  failed: {failures[setting]}", flush=True)
                    continue
                summaries[setting] = summarise(reports)
                steal_after = stolen_cpu_seconds()
                stolen = None if steal_before is None or steal_after is None else steal_after - steal_before
                costs[setting] = (cost_line(reports[0]["fits"], world_size) + "\n\n"
                                  + host_line(reports, stolen, time.perf_counter() - started))
                print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)
    return summaries, costs, failures


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="python -m benchmarks.head_to_head", description=__doc__.splitlines()[0])
    cli.add_argument("--models", nargs="+", choices=list(WORKLOADS),
                     help=f"default: {', '.join(REAL_MODELS)}; with --emulated {', '.join(EMULATED_MODELS)}")
    cli.add_argument("--world-sizes", nargs="+", type=int, help="default: 2 4; with --emulated 4 8")
    cli.add_argument("--rates", nargs="+", help="NIC rates: 1gbit, 10gbit or Gbit/s (default: "
                     f"{' '.join(RATE_PRESETS)}; with --emulated {' '.join(EMULATED_RATES)})")
    cli.add_argument("--emulated", action="store_true",
                     help=f"the zoo's models on emulated {EMULATED_DEVICE}s (computation that leaves the cores free), "
                          f"4 and 8 ranks, tensors ×{EMULATED_SIZE_SCALE:g}")
    cli.add_argument("--time-scale", type=float, default=1.0,
                     help="emulated models only: every layer's time ×k (slow motion; link rates stand for ×k)")
    cli.add_argument("--topology", help="a gradsync topology preset or file: per-pair rates instead of --rates")
    cli.add_argument("--inter-gbps", type=float, default=1.0, help="inter-machine Gbit/s of a cluster preset")
    cli.add_argument("--rows", nargs="+", choices=list(ROWS),
                     help=f"default: all but {', '.join(ON_REQUEST_ROWS)} "
                          f"({', '.join(TOPOLOGY_ROWS)} only with --topology)")
    cli.add_argument("--rounds", type=int, default=6, help="timed rounds (one block per row each)")
    cli.add_argument("--warmup-rounds", type=int, default=4, help="untimed rounds first")
    cli.add_argument("--block", type=int, help=f"timed iterations per block (default: {BLOCK}; with --emulated "
                     f"{EMULATED_BLOCK})")
    cli.add_argument("--follow-up-steps", type=int,
                     help=f"steps auto may take after its trials to settle its follow-up rounds before the timed "
                          f"rounds (default: {FOLLOW_UP_STEPS}; with --emulated {EMULATED_FOLLOW_UP_STEPS})")
    cli.add_argument("--timeout", type=float, default=1200.0, help="seconds per job before its ranks are killed")
    cli.add_argument("--quick", action="store_true", help="CNN, 2 ranks, 1 Gbit/s, rows " + ", ".join(QUICK_ROWS))
    cli.add_argument("--out", type=Path, default=RESULTS / "head_to_head.md", help="markdown; the PNG goes beside it")
    return cli


def default_rows(topology: bool) -> list[str]:
    """The rows run when --rows is not given: all but the on-request ones, and the topology rows
    only on a topology."""
    return [key for key in ROWS if (topology or key not in TOPOLOGY_ROWS) and key not in ON_REQUEST_ROWS]


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with what was not given filled in: the real-compute or the emulated settings and
    block length, `--quick`'s setting, the default rows."""
    args.models = args.models or list(EMULATED_MODELS if args.emulated else REAL_MODELS)
    args.world_sizes = args.world_sizes or ([4, 8] if args.emulated else [2, 4])
    args.rates = args.rates or list(EMULATED_RATES if args.emulated else RATE_PRESETS)
    args.block = args.block or (EMULATED_BLOCK if args.emulated else BLOCK)
    if args.follow_up_steps is None:
        args.follow_up_steps = EMULATED_FOLLOW_UP_STEPS if args.emulated else FOLLOW_UP_STEPS
    if args.quick:
        args.models, args.world_sizes, args.rates, args.rows, args.rounds = ["cnn"], [2], ["1gbit"], list(QUICK_ROWS), 3
    if args.rows is None:
        args.rows = default_rows(bool(args.topology))
    return args


def main(argv=None) -> None:
    args = with_defaults(parser().parse_args(argv))
    if not args.topology and set(args.rows) & set(TOPOLOGY_ROWS):
        sys.exit(f"head_to_head: rows {', '.join(TOPOLOGY_ROWS)} need --topology (a heterogeneous network)")
    if not args.time_scale > 0 or (args.time_scale != 1 and set(args.models) - set(EMULATED_MODELS)):
        sys.exit("head_to_head: --time-scale must be > 0, and other than 1 only for emulated models")
    if "ddp" not in args.rows:
        args.rows = ["ddp", *args.rows]  # every ratio is to torch DDP
    started, load_before, steal_before = time.perf_counter(), os.getloadavg()[0], stolen_cpu_seconds()
    try:
        summaries, costs, failures = run_settings(args)
    except NetbedUnavailable as missing:
        sys.exit(f"head_to_head: {missing}")
    elapsed = time.perf_counter() - started
    environment = (f"{os.cpu_count()} CPU cores, shared by the ranks (one thread each) and by any other work on the"
                   f" machine (1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after);"
                   f" gloo over veth pairs and a bridge, tc-shaped; {args.warmup_rounds} warm-up and"
                   f" {args.rounds} timed rounds of blocks of {UNTIMED_STEPS} untimed and {args.block} timed iterations; total"
                   f" {elapsed:.0f} s." + steal_note(steal_before, stolen_cpu_seconds(), elapsed))
    command = " ".join(["python -m benchmarks.head_to_head", *(sys.argv[1:] if argv is None else argv)])
    report = markdown(command, summaries, costs, failures, environment)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(replay_file(summaries)) + "\n")
    if summaries:
        chart(summaries, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and the .json and .png beside it\n")
    print(report)


if __name__ == "__main__":
    main()
