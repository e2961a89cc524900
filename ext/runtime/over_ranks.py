"""Numbers combined over the ranks without stopping training.

The runtime's watchers (the computation's speed, the cost watch, auto's choice watch) each compare
a window of iterations over the ranks. A blocking all-reduce at the end of each window makes every
rank wait for a round trip on the network, and for the slowest rank, once per window and per
watcher: on 2 ranks over 10 Gbit/s that cost 2% of the mean iteration time (``benchmarks.overhead
--rate 10gbit``, torch DDP's buckets against torch DDP). Instead the reduction is started asynchronously
at the iteration that closes the window and read at the next one, by when it has completed behind
that iteration's computation. Every rank starts and reads at the same iterations, so every rank
still decides alike, one iteration after the window. A reduction that is replaced before it is read
(new plans installed meanwhile) is dropped alike on every rank; the backend completes it.
The watchers whose windows close at the same iteration share one all-reduce (``CombinedReductions``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..agreement import waiting_for

Reading = Callable[[], list[float]]  # the reduced values, waiting for them if they are not in yet
StartReduction = Callable[[list[float]], Reading]  # starts one reduction of a rank's values


def reduction_over_ranks(op, process_group, device: torch.device, what: str, timeout: float) -> StartReduction:
    """Start an asynchronous all-reduce (`op`, in float64) of a few numbers per call.

    Args:
        op: the ``dist.ReduceOp`` (MAX: the slowest rank's; MIN: the least over the ranks).
        process_group: the ranks.
        device: where the backend takes its tensors (CUDA for NCCL).
        what: names the reduction in the error when a peer does not come (``agreement.waiting_for``).
        timeout: the process group's timeout, seconds (for that error).
    """
    def start(values: list[float]) -> Reading:
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        work = dist.all_reduce(tensor, op=op, group=process_group, async_op=True)

        def read() -> list[float]:
            with waiting_for(what, timeout):
                work.wait()
            return tensor.tolist()
        return read
    return start


def on_this_rank(values: list[float]) -> Reading:
    """The StartReduction of a single rank: its values are the reduced ones."""
    values = list(values)
    return lambda: values


class PendingReduction:
    """At most one reduction in flight: started at a window's end, read at the next iteration."""

    def __init__(self, start: StartReduction):
        self.start_reduction = start
        self.reading: Reading | None = None

    def start(self, values: list[float]) -> None:
        self.reading = self.start_reduction(values)

    def take(self) -> list[float] | None:
        """The reduced values of the reduction started at the last call's iteration, or None."""
        reading, self.reading = self.reading, None
        return None if reading is None else reading()


class CombinedReductions:
    """The reductions the watchers start at one iteration, sent as one all-reduce.

    On 8 ranks sharing 2 cores each small all-reduce took a rank about 0.5 ms of processor time
    (gloo's ring wakes every rank's worker thread 14 times), whatever it carried; the compute
    speed, the cost watch and auto's choice watch each started their own. Their windows close at
    the same iterations (``InstalledPlans`` starts them together), so one all-reduce carries them
    all. Every value travels as a maximum: a minimum as the maximum of its negation. `send`, at
    the end of the iteration, starts the all-reduce of the values started since the last one; a
    reading of values not yet sent sends them first.

    Args:
        start: starts one MAX reduction over the ranks (``reduction_over_ranks``).
    """

    def __init__(self, start: StartReduction):
        self.start_reduction = start
        self.batch = _Batch()

    def starting(self, op) -> StartReduction:
        """Starts a reduction of `op` (``dist.ReduceOp.MAX`` or ``MIN``) whose values wait for the
        next `send`."""
        if op not in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            raise ValueError(f"combined reductions take MAX or MIN, got {op!r}")
        sign = 1.0 if op == dist.ReduceOp.MAX else -1.0

        def start(values: list[float]) -> Reading:
            if self.batch.reading is not None:  # sent by an early reading: later values go with the next
                self.batch = _Batch()
            batch, offset = self.batch, len(self.batch.values)
            batch.values.extend(sign * value for value in values)
            span = slice(offset, len(batch.values))
            return lambda: [sign * value for value in batch.read(self.start_reduction)[span]]
        return start

    def send(self) -> None:
        """Start the all-reduce of the values started since the last one (none: nothing)."""
        if self.batch.values:
            self.batch.send(self.start_reduction)
            self.batch = _Batch()


class _Batch:
    """The values of one combined all-reduce, and its reading once sent."""

    def __init__(self):
        self.values: list[float] = []
        self.reading: Reading | None = None
        self.reduced: list[float] | None = None

    def send(self, start: StartReduction) -> None:
        if self.reading is None:
            self.reading = start(self.values)

    def read(self, start: StartReduction) -> list[float]:
        if self.reduced is None:
            self.send(start)
            self.reduced = self.reading()
        return self.reduced
