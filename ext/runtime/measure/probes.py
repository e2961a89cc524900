"""Network probes at wrap time, which calibrate the cost model: a + b·bytes from timed all-reduces
(and from timed reduce-scatters, for plans of them), γ from pairs run at once on two channels
(asc-wfbp eq. 9), how many ops a channel runs at once from small ones launched together on it, the
least start-up from a stream of ops that carry nothing, the slowdowns of computation and
communication from the two timed alone and together, and the computing thread's time per op
(`host`) from computation run with and without small ops launched between its slices."""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from ...cost import CostModel
from ...plan import ALLREDUCE, BACKWARD, REDUCE_SCATTER, Op, Plan, Slice
from ..channels import Channels
from ..executor import PlanExecutor
from . import median, now


SMALLEST_PROBE_BYTES = 4096
LARGEST_PROBE_BYTES = 16 << 20  # the probes' memory is the model's peak's
RESOLVED = 8  # b is resolved by a size that takes this many times the smallest one's time


def measure_cost(channels: Channels, largest_bytes: int, dtype=torch.float32, device="cpu",
                 repeats: int = 5, collective: str = ALLREDUCE, work: ProbeWork | None = None) -> CostModel:
    """Fit a + b·bytes from timed all-reduces on channel 0, γ from two at once on channels 0 and 1,
    and for `collective` ``reduce_scatter`` its own a + b·bytes from timed reduce-scatters (each
    rank receiving an equal part); how many ops a channel runs at once (``ops_at_once``); then
    the slowdowns and the host time per op.

    Sizes run from 4 KiB by factors of 4 to the model's gradient bytes, the largest op a plan can
    send, and on until one takes `RESOLVED` times the smallest one's time (so that b is resolved);
    never beyond LARGEST_PROBE_BYTES: the probes run at wrap time, beside the model and its
    optimizer, and must not set the job's peak memory. Sizes past the plans' ops would weigh most
    in the least-squares fit, and where the time bends there (on a slow link, 4 MiB for a model of
    0.7 MB) they took a to zero. Each size's time is the median of `repeats` runs, maximised over
    ranks (the slowest rank is the one the others wait for; every rank then stops at the same size).
    a is at least what an op carrying nothing costs in a stream of them (``empty_op_seconds``),
    times the ops a channel runs at once, so that the simulator takes a stream of small ops as long
    as the runtime does: on 4 netbed ranks at 31 Mbit/s the sizes' times (5.4, 7.9, 28, 110 and
    300 ms from 4 KiB to 0.7 MB) bend below the line through the smallest and largest, and their
    intercept was 0.06 ms where an empty op takes 2.8 ms.

    Args:
        channels: the job's channels (a collective over their process group).
        largest_bytes: the model's gradient bytes.
        dtype, device: of the probes' buffers (the gradients').
        repeats: timed runs per size.
        collective: the plans' ops' (``planning.plan_layouts``).
        work: the computation the slowdown and host probes run beside the ops (default: matrix
            products on `device`; a model whose computation leaves the host's cores carries its own
            as `probe_work`, as ``gradsync.emulated.EmulatedModel`` does).
    """
    element = torch.tensor([], dtype=dtype).element_size()
    device = torch.device(device)

    def elements(size: int) -> int:
        return max(1, size // element)

    def buffer(size: int) -> torch.Tensor:
        return torch.ones(elements(size), dtype=dtype, device=device)

    def timed(tensors: list[torch.Tensor], scatter: bool = False, one_channel: bool = False) -> float:
        """Median seconds of `tensors` all-reduced at once, one per channel, or all on channel 0 from
        a barrier (so that no rank's late arrival stretches them; or the first reduce-scattered)."""
        samples = []
        for _ in range(repeats + 1):
            if one_channel:
                dist.barrier(group=channels.process_group)
            started = now(device)
            if scatter:
                works = [channels.reduce_scatter(0, list(tensors[0].tensor_split(channels.world_size)))]
            else:
                works = [channels.all_reduce(0 if one_channel else channel, tensor)
                         for channel, tensor in enumerate(tensors)]
            for handle in works:
                handle.wait()
            samples.append(now(device) - started)
        return median(samples[1:])

    def slowest(times: list[float]) -> list[float]:
        maximum = torch.tensor(times, dtype=torch.float64, device=device)  # on the backend's device
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=channels.process_group)
        return maximum.tolist()

    sizes, times = [SMALLEST_PROBE_BYTES], []
    while True:
        times += slowest([timed([buffer(sizes[-1])])])
        following = next_probe_size(sizes, times, largest_bytes)
        if following is None:
            break
        sizes.append(following)
    pair_sizes = sizes[-2:] if len(channels) > 1 else []
    threads = channels.ops_per_channel
    pairs = [timed([buffer(s), buffer(s)]) for s in pair_sizes]
    start_ups = ([timed([buffer(sizes[0]) for _ in range(count)], one_channel=True) for count in (1, threads)]
                 if threads > 1 else [])  # one thread runs one op at a time
    scatters = [timed([buffer(s)], scatter=True) for s in sizes] if collective == REDUCE_SCATTER else []
    empty_op = [empty_op_seconds(channels, dtype, device, repeats)]
    agreed = iter(slowest(pairs + start_ups + scatters + empty_op))
    pairs, start_ups, scatters, (empty_op,) = ([next(agreed) for _ in part]
                                               for part in (pairs, start_ups, scatters, empty_op))
    at_once = ops_at_once(threads, *start_ups) if start_ups else 1
    byte_sizes = [elements(s) * element for s in sizes]
    fitted = CostModel.fit(byte_sizes, times, byte_sizes[len(sizes) - len(pair_sizes):], pairs,
                           name="measured", clamp=True, least_start_up=at_once * empty_op)
    if scatters:
        fitted = fitted.with_reduce_scatter_fit(byte_sizes, scatters, clamp=True)
    work = work or ProbeWork(dtype, device)  # one calibration for both probes that compute
    slowed = replace(fitted, ops_per_channel=at_once,
                     **measure_slowdowns(channels, fitted, dtype, device, repeats, work))
    return replace(slowed, host=measure_host(channels, slowed, dtype, device, repeats, work=work))


def ops_at_once(threads: int, alone: float, together: float) -> int:
    """How many ops a channel runs at once (the cost model's `ops_per_channel`): of its `threads`
    small all-reduces launched together (`together` seconds, against `alone` for one, each timed
    from a barrier), as many as their time says ran side by side, ``threads·alone / together``
    rounded, from 1 to `threads`. A gloo group's two worker threads ran two 4 KiB all-reduces in
    1.75 times one's time on 2 netbed ranks, 1.61 times on 8 (both round to 1): their start-ups
    barely overlap. Timed back to back, without the barrier, one op waits for the last rank's
    arrival and two share that wait: on 8 ranks they gave 2.

    Args:
        threads: the channel's worker threads (``Channels.ops_per_channel``).
        alone, together: seconds of one small all-reduce, and of `threads` of them launched at once.
    """
    return max(1, min(threads, round(threads * alone / together)))


def next_probe_size(sizes: list[int], times: list[float], largest_bytes: int) -> int | None:
    """The all-reduce size to time after `sizes` (bytes, timed in `times` seconds), or None where
    the sweep ends (``measure_cost``): 4 times the last, the model's gradient bytes where they lie
    between, at most LARGEST_PROBE_BYTES; it ends at the gradient bytes once a size has taken
    `RESOLVED` times the first one's time.

    Args:
        sizes, times: the sizes timed so far, smallest first, and their times.
        largest_bytes: the model's gradient bytes.
    """
    size = sizes[-1]
    if size >= LARGEST_PROBE_BYTES or (size >= largest_bytes and times[-1] >= RESOLVED * times[0]):
        return None
    return min(LARGEST_PROBE_BYTES, int(largest_bytes) if size < largest_bytes < 4 * size else 4 * size)


class ProbeWork:
    """Slices of computation for the probes: 128×128 matrix products, timed on the device."""

    def __init__(self, dtype, device):
        self.matrix = torch.ones(128, 128, dtype=dtype, device=device)
        self.device = self.matrix.device
        self.run(4)
        self.per_product = median([self.run(8) / 8 for _ in range(3)])

    def run(self, count: int) -> float:
        """Seconds that `count` products take."""
        started = now(self.matrix.device)
        for _ in range(count):
            torch.mm(self.matrix, self.matrix)
        return now(self.matrix.device) - started

    def count_for(self, seconds: float) -> int:
        """Products in about `seconds`."""
        return max(1, math.ceil(seconds / max(self.per_product, 1e-7)))


def _median_over_ranks(channels: Channels, local: float, device) -> float:
    per_rank = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(channels.world_size)]
    dist.all_gather(per_rank, torch.tensor([local], dtype=torch.float64, device=device), group=channels.process_group)
    return median([float(value.item()) for value in per_rank])


SLOWDOWN_PROBE_SECONDS = 0.04  # with 10 ms, three fits in a row gave τ 2.56-4.86 (benchmarks/interference.py)
MAX_SLOWDOWN = 20.0


def measure_slowdowns(channels: Channels, cost: CostModel, dtype=torch.float32, device="cpu",
                      repeats: int = 5, work: ProbeWork | None = None) -> dict[str, float]:
    """The cost model's `compute_slowdown` σ and `transfer_slowdown` τ: about 40 ms of computation
    (matrix products) and an all-reduce on channel 0 that outlasts it (three times as long by
    `cost`, at most 64 MiB) timed alone and then together (`slowdowns_of`); each the median over
    `repeats` such triples and then over the ranks; at least 1.

    Args:
        channels, dtype, device, repeats, work: as ``measure_cost``.
        cost: the fitted a and b (they size the all-reduce).
    """
    work = work or ProbeWork(dtype, device)
    count = work.count_for(SLOWDOWN_PROBE_SECONDS)
    element = torch.tensor([], dtype=dtype).element_size()
    nbytes = min(64 << 20, max(4096, (3 * SLOWDOWN_PROBE_SECONDS - cost.a) / cost.b))
    buffer = torch.zeros(int(nbytes) // element, dtype=dtype, device=device)

    def timed(compute: bool, transfer: bool) -> tuple[float, float]:
        """(computation seconds, all-reduce seconds)."""
        dist.barrier(group=channels.process_group)
        started = now(work.device)
        handle = channels.all_reduce(0, buffer) if transfer else None
        computed = work.run(count) if compute else 0.0
        if handle is not None:
            handle.wait()
        return computed, now(work.device) - started

    timed(True, True)  # warm-up
    compute, transfer = [], []
    for _ in range(repeats):
        alone = timed(True, False)[0]
        transfer_alone = timed(False, True)[1]
        sigma, tau = slowdowns_of(alone, transfer_alone, *timed(True, True))
        compute.append(sigma)
        transfer.append(tau)
    return {"compute_slowdown": max(1.0, _median_over_ranks(channels, median(compute), device)),
            "transfer_slowdown": max(1.0, _median_over_ranks(channels, median(transfer), device))}


def slowdowns_of(compute_alone: float, transfer_alone: float, compute_together: float,
                 transfer_together: float) -> tuple[float, float]:
    """(σ, τ) from one probe: σ = together / alone for the computation; the transfer, which
    outlasts it, progressed at 1/τ while the computation ran, so its extra time is D − D/τ with D
    the computation's time together; τ capped at 20.

    Args:
        compute_alone, transfer_alone: seconds of the computation and of the all-reduce, each alone.
        compute_together, transfer_together: their seconds when run at once.
    """
    extra = transfer_together - transfer_alone
    tau = compute_together / max(compute_together - extra, compute_together / MAX_SLOWDOWN)
    return compute_together / compute_alone, min(MAX_SLOWDOWN, tau)


HOST_PROBE_OPS = 16


def empty_ops(channels: Channels, ops: int, dtype, device) -> tuple[list[str], PlanExecutor]:
    """A PlanExecutor of `ops` backward-phase ops on channel 0, each all-reducing one element of
    its own parameter, and the parameters' names in launch order: ops that barely transmit.

    Args:
        channels: the job's channels (the plan's transport is theirs).
        ops: how many ops.
        dtype, device: of the parameters.
    """
    names = [f"probe{i}" for i in range(ops)]
    parameters = {}
    for name in names:
        parameters[name] = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        parameters[name].grad = torch.ones_like(parameters[name])
    plan = Plan(tuple(Op((Slice(name, 0, 1),), BACKWARD) for name in names)).with_transport(channels.transport)
    return names, PlanExecutor(plan, parameters, channels)


def empty_op_seconds(channels: Channels, dtype=torch.float32, device="cpu", repeats: int = 5,
                     ops: int = HOST_PROBE_OPS) -> float:
    """Seconds per op of `ops` single-element ops launched back to back through a PlanExecutor on
    channel 0, as the runtime launches a plan's, from a barrier until the last ends; this rank's
    median over `repeats`. On the netbed at 31 Mbit/s a stream of them took 2.8 ms per op on 4
    ranks and 5.6 ms on 8, an isolated one 8 and 12 ms: a stream, not an isolated op, is what a
    plan of many small ops sends.

    Args:
        channels, dtype, device, repeats: as ``measure_cost``.
        ops: ops per timed stream.
    """
    device = torch.device(device)
    names, executor = empty_ops(channels, ops, dtype, device)
    samples = []
    for _ in range(repeats + 1):
        executor.start_iteration(0)
        dist.barrier(group=channels.process_group)
        started = now(device)
        for name in names:
            executor.mark_ready(name)
        executor.wait_all()
        samples.append((now(device) - started) / ops)
    return median(samples[1:])


def measure_host(channels: Channels, cost: CostModel, dtype=torch.float32, device="cpu", repeats: int = 5,
                 ops: int = HOST_PROBE_OPS, work: ProbeWork | None = None) -> float:
    """Seconds of the computing thread one op costs: `ops` slices of computation (matrix
    products, each about twice `cost.a`, so that an op is mostly done before the next
    launches) timed alone and then with one single-element op launched through a PlanExecutor
    after each slice, as the runtime does; the difference per op, the median over `repeats` such
    pairs and then over the ranks (one rank descheduled in one pair must not set it for all). The
    ops are completed after the clock stops: what remains of their transfers then is
    communication, not the computing thread's time. A single-element op barely transmits, so the
    simulator's slowdown σ (charged while ops transmit) takes no share of the difference.

    Args:
        channels, dtype, device, repeats, work: as ``measure_cost``.
        cost: the fitted a (it sizes the slices).
        ops: ops launched per timed run.
    """
    names, executor = empty_ops(channels, ops, dtype, device)
    work = work or ProbeWork(dtype, device)
    count = work.count_for(2 * cost.a)

    def timed(launch: bool) -> float:
        executor.start_iteration(0)
        dist.barrier(group=channels.process_group)
        started = now(work.device)
        for name in names:
            work.run(count)
            if launch:
                executor.mark_ready(name)
        elapsed = now(work.device) - started
        if launch:
            executor.wait_all()
        return elapsed

    timed(True)  # warm-up
    differences = []
    for _ in range(repeats):
        alone = timed(False)
        differences.append(timed(True) - alone)
    return max(0.0, _median_over_ranks(channels, median(differences), device) / ops)
