"""A rank-side probe of the shaped network: the time of one gloo all-reduce of a given size."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def allreduce_seconds(rank: int, world_size: int, nbytes: int, repeats: int = 3) -> float:
    """Median time of `repeats` all-reduces of `nbytes` (after one untimed), slowest rank's view."""
    tensor = torch.ones(nbytes // 4)
    samples = []
    for _ in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        samples.append(time.perf_counter() - started)
    slowest = torch.tensor(statistics.median(samples[1:]), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()
