"""Measuring the model's per-layer times and the network's all-reduce cost on the live job.

Per-layer times follow the MG-WFBP authors' method, hooks timing each layer while the first
iterations run (with a device synchronise on GPU), but with all gradients in one all-reduce launched
when the backward pass ends rather than under WFBP: no op is in flight while the layers run, so
their times carry neither the ops' host time nor their slowdown; the backward time of a layer
is the gap between its gradients becoming ready and those of the layer after it; the update time is
the engine's serial work outside the layers (buffer broadcast, optimizer step, a codec's decoding
and its later rounds' encoding). Layer times depend on what runs beside them (a codec's encoding in
the gradient hooks), so layers timed while the codec was still warming up are timed again on as
many steady iterations. The cost model is fitted from timed
all-reduces of several sizes, γ from pairs run at once on two channels (asc-wfbp eq. 9), the
slowdowns of computation and communication from the two timed alone and together, the computing thread's
time per op (`host`) from computation run with and without small ops launched through the executor
between its slices. The host time of the timed plan's op is taken out of the layers' times before
planning. Every rank plans with rank 0's layers, each with its largest times over the ranks, scaled
to the slowest rank's totals (`slowest_times`), and with the cost measured together.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from ..agreement import gather_from_all, waiting_for
from ..cost import CostModel
from ..plan import BACKWARD, Op, Plan, Slice
from ..planners import BoundPlanner, chosen_planner, one_bucket
from ..planning import plan_alternatives, steady_layouts
from ..profile import LayerProfile, ModelProfile
from .channels import Channels
from .executor import PlanExecutor
from .layout import ParameterLayout

def _median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else 0.0


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class LayerTimer:
    """Forward and backward time per owning module over the iterations it is told to count."""

    def __init__(self, layout: ParameterLayout):
        self.layout = layout
        self.device = layout.device
        self.module_of = {name: m for m, names in layout.owners.items() for name in names}
        self.order: list[str] = []
        self.forward_ends: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.forward_samples: dict[str, list[float]] = {m: [] for m in layout.owners}
        self.backward_samples: dict[str, list[float]] = {m: [] for m in layout.owners}
        self.forward_begin = 0.0
        self.stalled = 0.0  # time inside the current layer's forward that is not its own (deferred updates)
        self.handles = [module.register_forward_hook(self._forward_end_for(name))
                        for name, module in layout.modules.items()]

    def forward_start(self) -> None:
        self.forward_begin = _now(self.device)
        self.order, self.forward_ends, self.ready = [], {}, {}
        self.stalled = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` spent in the current forward out of the layer being timed."""
        self.stalled += seconds

    def module_start(self, module_name: str) -> None:
        if module_name not in self.forward_ends and module_name not in self.order:
            self.order.append(module_name)

    def _forward_end_for(self, module_name: str):
        def forward_end(_module, _inputs, _output):
            if module_name not in self.forward_ends:
                self.forward_ends[module_name] = _now(self.device) - self.stalled
        return forward_end

    def gradient_ready(self, name: str) -> None:
        self.ready[self.module_of[name]] = _now(self.device)

    def count_iteration(self) -> None:
        """Turn this iteration's timestamps into per-layer samples."""
        previous = self.forward_begin
        for module_name, end in sorted(self.forward_ends.items(), key=lambda item: item[1]):
            self.forward_samples[module_name].append(end - previous)
            previous = end
        previous = max(self.forward_ends.values(), default=self.forward_begin) + self.stalled
        for module_name, ready in sorted(self.ready.items(), key=lambda item: item[1]):
            self.backward_samples[module_name].append(ready - previous)
            previous = ready

    def profile(self, name: str, update_time: float = 0.0) -> ModelProfile:
        """Each layer's median time over the counted iterations (robust to one disturbed iteration)."""
        profile = self.layout.profile(
            name,
            self.order,
            {m: _median(s) for m, s in self.forward_samples.items()},
            {m: _median(s) for m, s in self.backward_samples.items()},
        )
        return profile.with_update_time(update_time)

    def clear(self) -> None:
        """Forget the counted samples."""
        for samples in (*self.forward_samples.values(), *self.backward_samples.values()):
            samples.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def measure_cost(channels: Channels, largest_bytes: int, dtype=torch.float32, device="cpu",
                 repeats: int = 5) -> CostModel:
    """Fit a + b·bytes from timed all-reduces on channel 0, γ from two at once on channels 0 and 1;
    then the slowdowns, the host time per op and how many ops a channel runs at once.

    Sizes run from 4 KiB to the model's gradient bytes (at least 4 MiB, so that b is resolvable;
    at most 64 MiB). Each size's time is the median of `repeats` runs, maximised over ranks (the
    slowest rank is the one the others wait for).
    """
    element = torch.tensor([], dtype=dtype).element_size()
    largest = max(4 << 20, min(int(largest_bytes), 64 << 20))
    sizes = []
    size = 4096
    while size < largest:
        sizes.append(size)
        size *= 4
    sizes.append(largest)
    buffers = {s: torch.ones(max(1, s // element), dtype=dtype, device=device) for s in sizes}

    def timed(size: int, channel_list: list[int]) -> float:
        samples = []
        for _ in range(repeats + 1):
            started = _now(buffers[size].device)
            works = [channels.all_reduce(c, buffers[size] if c == 0 else buffers[size].clone()) for c in channel_list]
            for work in works:
                work.wait()
            samples.append(_now(buffers[size].device) - started)
        return statistics.median(samples[1:])

    times = [timed(s, [0]) for s in sizes]
    pair_sizes = sizes[-2:] if len(channels) > 1 else []
    pair_times = [timed(s, [0, 1]) for s in pair_sizes]
    slowest = torch.tensor(times + pair_times, dtype=torch.float64, device=device)  # on the backend's device
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=channels.process_group)
    measured = slowest.tolist()
    byte_sizes = [buffers[s].numel() * element for s in sizes]
    fitted = CostModel.fit(byte_sizes, measured[: len(sizes)], byte_sizes[len(sizes) - len(pair_sizes):],
                           measured[len(sizes):], name="measured", clamp=True)
    slowed = replace(fitted, ops_per_channel=channels.ops_per_channel,
                     **measure_slowdowns(channels, fitted, dtype, device, repeats))
    return replace(slowed, host=measure_host(channels, slowed, dtype, device, repeats))


class ProbeWork:
    """Slices of computation for the probes: 128×128 matrix products, timed on the device."""

    def __init__(self, dtype, device):
        self.matrix = torch.ones(128, 128, dtype=dtype, device=device)
        self.run(4)
        self.per_product = _median([self.run(8) / 8 for _ in range(3)])

    def run(self, count: int) -> float:
        """Seconds that `count` products take."""
        started = _now(self.matrix.device)
        for _ in range(count):
            torch.mm(self.matrix, self.matrix)
        return _now(self.matrix.device) - started

    def count_for(self, seconds: float) -> int:
        """Products in about `seconds`."""
        return max(1, math.ceil(seconds / max(self.per_product, 1e-7)))


def _median_over_ranks(channels: Channels, local: float, device) -> float:
    per_rank = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(channels.world_size)]
    dist.all_gather(per_rank, torch.tensor([local], dtype=torch.float64, device=device), group=channels.process_group)
    return _median([float(value.item()) for value in per_rank])


SLOWDOWN_PROBE_SECONDS = 0.04  # with 10 ms, three fits in a row gave τ 2.56-4.86 (benchmarks/interference.py)
MAX_SLOWDOWN = 20.0


def measure_slowdowns(channels: Channels, cost: CostModel, dtype=torch.float32, device="cpu",
                      repeats: int = 5) -> dict[str, float]:
    """The cost model's `compute_slowdown` σ and `transfer_slowdown` τ: about 40 ms of computation
    (matrix products) and an all-reduce on channel 0 that outlasts it (three times as long by
    `cost`, at most 64 MiB) timed alone and then together (`slowdowns_of`); each the median over
    `repeats` such triples and then over the ranks; at least 1."""
    work = ProbeWork(dtype, device)
    count = work.count_for(SLOWDOWN_PROBE_SECONDS)
    element = torch.tensor([], dtype=dtype).element_size()
    nbytes = min(64 << 20, max(4096, (3 * SLOWDOWN_PROBE_SECONDS - cost.a) / cost.b))
    buffer = torch.zeros(int(nbytes) // element, dtype=dtype, device=device)

    def timed(compute: bool, transfer: bool) -> tuple[float, float]:
        """(computation seconds, all-reduce seconds)."""
        dist.barrier(group=channels.process_group)
        started = _now(work.matrix.device)
        handle = channels.all_reduce(0, buffer) if transfer else None
        computed = work.run(count) if compute else 0.0
        if handle is not None:
            handle.wait()
        return computed, _now(work.matrix.device) - started

    timed(True, True)  # warm-up
    compute, transfer = [], []
    for _ in range(repeats):
        alone = timed(True, False)[0]
        transfer_alone = timed(False, True)[1]
        sigma, tau = slowdowns_of(alone, transfer_alone, *timed(True, True))
        compute.append(sigma)
        transfer.append(tau)
    return {"compute_slowdown": max(1.0, _median_over_ranks(channels, _median(compute), device)),
            "transfer_slowdown": max(1.0, _median_over_ranks(channels, _median(transfer), device))}


def slowdowns_of(compute_alone: float, transfer_alone: float, compute_together: float,
                 transfer_together: float) -> tuple[float, float]:
    """(σ, τ) from one probe: σ = together / alone for the computation; the transfer, which
    outlasts it, progressed at 1/τ while the computation ran, so its extra time is D − D/τ with D
    the computation's time together; τ capped at 20."""
    extra = transfer_together - transfer_alone
    tau = compute_together / max(compute_together - extra, compute_together / MAX_SLOWDOWN)
    return compute_together / compute_alone, min(MAX_SLOWDOWN, tau)


HOST_PROBE_OPS = 16


def measure_host(channels: Channels, cost: CostModel, dtype=torch.float32, device="cpu", repeats: int = 5,
                 ops: int = HOST_PROBE_OPS) -> float:
    """Seconds of the computing thread one op costs: `ops` slices of computation (matrix
    products, each about twice `cost.a`, so that an op is mostly done before the next
    launches) timed alone and then with one single-element op launched through a PlanExecutor
    after each slice, as the runtime does; the difference per op, the median over `repeats` such
    pairs and then over the ranks (one rank descheduled in one pair must not set it for all). The
    ops are completed after the clock stops: what remains of their transfers then is
    communication, not the computing thread's time. A single-element op barely transmits, so the
    simulator's slowdown σ (charged while ops transmit) takes no share of the difference."""
    names = [f"probe{i}" for i in range(ops)]
    parameters = {}
    for name in names:
        parameters[name] = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        parameters[name].grad = torch.ones_like(parameters[name])
    plan = Plan(tuple(Op((Slice(name, 0, 1),), BACKWARD) for name in names)).with_transport(channels.transport)
    executor = PlanExecutor(plan, parameters, channels)
    work = ProbeWork(dtype, device)
    count = work.count_for(2 * cost.a)

    def timed(launch: bool) -> float:
        executor.start_iteration(0)
        dist.barrier(group=channels.process_group)
        started = _now(work.matrix.device)
        for name in names:
            work.run(count)
            if launch:
                executor.mark_ready(name)
        elapsed = _now(work.matrix.device) - started
        if launch:
            executor.wait_all()
        return elapsed

    timed(True)  # warm-up
    differences = []
    for _ in range(repeats):
        alone = timed(False)
        differences.append(timed(True) - alone)
    return max(0.0, _median_over_ranks(channels, _median(differences), device) / ops)


def without_host(profile: ModelProfile, plan: Plan, host: float) -> ModelProfile:
    """`profile` as measured while `plan` ran, with the host time of its backward-phase ops taken
    out of the backward pass, in proportion to each layer's share of it (the ops' processor time
    falls wherever their transfers run)."""
    backward = profile.backward_time
    charged = host * sum(1 for op in plan.ops if op.phase == BACKWARD)
    if backward <= 0 or charged <= 0:
        return profile
    scale = max(0.0, backward - charged) / backward
    layers = tuple(LayerProfile(l.name, l.tensors, l.forward_time, l.backward_time * scale, l.update_time)
                   for l in profile.layers)
    return ModelProfile(profile.name, layers, dict(profile.metadata))


class Measurement:
    """What the engine reports to a measurement in progress (``GradSync.measurement``); by default
    nothing is done with it."""

    def forward_start(self) -> None:
        """A forward pass begins."""

    def module_start(self, module_name: str) -> None:
        """The forward of owner module `module_name` begins."""

    def gradient_ready(self, name: str) -> None:
        """The gradient of parameter `name` is computed."""

    def exclude(self, seconds: float) -> None:
        """`seconds` of the current forward were spent on deferred updates, not on the layer."""

    def iteration_done(self, sync) -> None:
        """A synchronised iteration of `sync` has ended."""


class ProfileCalibration(Measurement):
    """Runs `warmup` + `iterations` iterations under the calibration plans (every gradient in one
    all-reduce at the end of the backward pass), timing layers in the last `iterations`, then
    installs the planner's plan built on the ranks' slowest times. When some timed iterations
    were not in the codec's steady state, `iterations` steady ones are timed again under the
    calibration plans, and while the codec still warms up a plan made on the first timing runs in
    the meantime. With a planner that chooses among others (``auto``) and `plan_trials` > 1, the
    plans worth comparing are then timed (PlanTrials)."""

    def __init__(self, layout: ParameterLayout, cost: CostModel, warmup: int, iterations: int, name: str,
                 steady_rounds: list[tuple[str, ...]], plan_trials: int):
        self.plan_trials = plan_trials
        self.timer = LayerTimer(layout)
        self.cost = cost
        self.warmup = warmup
        self.iterations = iterations
        self.name = name
        self.steady_rounds = set(steady_rounds)
        self.seen = 0
        self.counted = 0
        self.all_steady = True
        self.interim: ModelProfile | None = None  # the profile of the plan run while the codec warms up
        self.update_samples: list[float] = []  # IterationStats.update_time of the counted iterations

    def forward_start(self) -> None:
        self.timer.forward_start()

    def module_start(self, module_name: str) -> None:
        self.timer.module_start(module_name)

    def gradient_ready(self, name: str) -> None:
        self.timer.gradient_ready(name)

    def exclude(self, seconds: float) -> None:
        self.timer.exclude(seconds)

    def iteration_done(self, sync) -> None:
        self.seen += 1
        steady = sync.rounds_now in self.steady_rounds
        next_steady = sync.codec.rounds(sync.sync_steps) in self.steady_rounds
        if self.seen <= self.warmup:
            return
        if self.interim is not None:  # the codec warms up under a plan made on its warm-up iterations
            if next_steady:
                sync.install_plan(self.interim, self.cost, one_bucket())
                self.interim = None
            return
        self.timer.count_iteration()
        self.update_samples.append(sync.history[-1].update_time)
        self.counted += 1
        self.all_steady = self.all_steady and steady
        if self.counted < self.iterations:
            return
        if not self.all_steady:  # time steady iterations again, under the calibration plans
            if not next_steady:  # meanwhile, a plan made on these
                self.interim = self._slowest_profile(sync)
                sync.install_plan(self.interim, self.cost)
            self.timer.clear()
            self.update_samples.clear()
            self.counted, self.all_steady = 0, True
            return
        measured = self._slowest_profile(sync)
        trials = PlanTrials.start(sync, measured, self.cost, self.plan_trials)
        if trials is None:
            sync.install_plan(measured, self.cost)
        self.timer.remove()
        sync.measurement = trials

    def _slowest_profile(self, sync) -> ModelProfile:
        """The timed profile, its plan's host time taken out, combined over the ranks
        (`slowest_times`), on every rank; each rank's own is kept in `sync.rank_profiles`."""
        timed_plan = sync.plans[sync.rounds_now[0]]  # the plan whose ops launched in the timed backward passes
        profile = without_host(self.timer.profile(self.name, _median(self.update_samples)), timed_plan, self.cost.host)
        with waiting_for("the gather of the ranks' layer times", sync.channels.timeout):
            gathered = gather_from_all(profile.to_dict(), sync.channels.process_group)
        sync.rank_profiles = [ModelProfile.from_dict(data) for data in gathered]
        return slowest_times(sync.rank_profiles)


def slowest_times(profiles: list[ModelProfile]) -> ModelProfile:
    """The first profile's layers, in its order, each with its largest forward, backward and
    update time over `profiles` (one per rank), then the layers' forward times scaled so that they
    sum to the slowest rank's own forward time, and the backward and update times alike.

    A synchronised iteration waits for the slowest rank at every op, not at every layer: ranks
    slowed at different layers (descheduled on a shared host) do not each delay it, so the sum of
    the per-layer maxima overstates it (on the emulated cluster by up to 10% with 2 ranks, up to 66%
    with 4 ranks on 2 cores); the maxima only set how the slowest total spreads over the layers,
    and keep a layer that only other ranks run."""
    by_name = [{layer.name: layer for layer in profile.layers} for profile in profiles]
    first = profiles[0]
    largest = {attr: [max(getattr(layers[layer.name], attr) for layers in by_name) for layer in first.layers]
               for attr in ("forward_time", "backward_time", "update_time")}
    for attr, times in largest.items():
        slowest_rank = max(sum(getattr(layer, attr) for layer in profile.layers) for profile in profiles)
        summed = sum(times)
        factor = slowest_rank / summed if summed > 0 else 1.0
        largest[attr] = [seconds * factor for seconds in times]
    layers = tuple(replace(layer, **{attr: times[index] for attr, times in largest.items()})
                   for index, layer in enumerate(first.layers))
    return ModelProfile(first.name, layers, dict(first.metadata))


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
    slowest rank's; auto's own choice stays unless that is faster by more than auto's `tolerance`
    (measurements are noisy too)."""

    def __init__(self, sync, profile: ModelProfile, cost: CostModel, alternatives: list[BoundPlanner],
                 iterations: int):
        self.profile, self.cost = profile, cost
        self.alternatives = alternatives
        self.iterations = iterations
        self.order = trial_order(len(alternatives), TRIAL_ROUNDS)
        self.visit = 0  # position in `order`
        self.taken = 0  # samples taken in this visit
        self.device = sync.layout.device
        self.last_end = _now(self.device)  # when the iteration being timed began
        self.samples: list[list[float]] = [[] for _ in alternatives]
        self.labels: list[str] = [""] * len(alternatives)  # the planners each trial's steady plans came from
        self._install(sync, self.order[0])

    @classmethod
    def start(cls, sync, profile: ModelProfile, cost: CostModel, count: int) -> "PlanTrials | None":
        """Trials of up to `count` plans of a planner that chooses among others, the first one
        installed; None, and nothing installed, when there is nothing to compare (a planner that
        does not choose, `count` < 2, or every candidate makes the same plans)."""
        if count < 2 or not sync.planner.chooses:
            return None
        alternatives = plan_alternatives(profile, cost, sync.codec, sync.planner, count)
        if len(alternatives) < 2:
            return None
        cycle = len(sync.codec.steady_rounds())  # whole cycles (ACP-SGD: a P step and a Q step)
        return cls(sync, profile, cost, alternatives, cycle * math.ceil(TRIAL_ITERATIONS / cycle))

    def _install(self, sync, index: int) -> None:
        sync.install_plan(self.profile, self.cost, self.alternatives[index])
        chosen = {chosen_planner(sync.plans[layout]) for layout in steady_layouts(sync.codec)}
        self.labels[index] = "/".join(sorted(chosen))
        self.settling = True

    def iteration_done(self, sync) -> None:
        ended = _now(self.device)
        started, self.last_end = self.last_end, ended
        if self.settling:  # this iteration's forward still applied the previous plan's deferred updates
            self.settling = False
            return
        if sync.last_step_skipped:  # a step skipped for non-finite gradients (on every rank) is no sample
            return
        index = self.order[self.visit]
        self.samples[index].append(ended - started)
        self.taken += 1
        if self.taken < self.iterations:
            return
        self.visit, self.taken = self.visit + 1, 0
        if self.visit == len(self.order):
            self._keep_fastest(sync, index)
        elif self.order[self.visit] != index:
            self._install(sync, self.order[self.visit])

    def _keep_fastest(self, sync, installed: int) -> None:
        """Keep the fastest trial (`kept_trial` on the slowest rank's medians); `installed` is the
        trial whose plans run now."""
        slowest = torch.tensor([_median(samples) for samples in self.samples], dtype=torch.float64,
                               device=self.device)
        with waiting_for("the plan trials' result", sync.channels.timeout):
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=sync.channels.process_group)
        medians = slowest.tolist()
        fastest = kept_trial(medians, sync.planner.tolerance)
        if fastest != installed:
            sync.install_plan(self.profile, self.cost, self.alternatives[fastest])
        sync.trial_times = list(zip(self.labels, medians))
        sync.measurement = None
