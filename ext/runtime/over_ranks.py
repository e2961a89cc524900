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
