"""Forest all-reduce against gloo's own all-reduce on unconstrained local ranks.

Every rank holds the same buffer sizes; the two all-reduces alternate (gloo, forest, gloo, ...),
each after a barrier, the first `--warmup` pairs excluded; the median of the slowest rank is kept.
The topology is the complete graph of the ranks with equal links (loopback has no structure), so
the packing is K_n's (one-hop trees) and the comparison measures the executor's own cost.
Target (topology issue): 64 MB on 4 ranks within 1.3× of gloo.

Run: `.venv/bin/python benchmarks/forest_allreduce.py [--ranks 4] [--sizes-mb 1 16 64]`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gradsync.launch import run_local
from gradsync.topology import complete
from gradsync.topology.allreduce import DEFAULT_SUB_CHUNK_BYTES, ForestAllReduce

TARGET = 1.3
OUT = Path(__file__).parent / "results" / "forest_allreduce.md"


def interleaved_medians(runs: dict, size_mb: float, iterations: int, warmup: int) -> dict[str, float]:
    """Each all-reduce of `runs` (name -> function of a tensor) in turn on a buffer of `size_mb`,
    after a barrier; the median over `iterations` (after `warmup`) of the slowest rank's seconds."""
    buffer = torch.ones(int(size_mb * (1 << 20)) // 4)
    samples = {name: [] for name in runs}
    for iteration in range(warmup + iterations):
        for name, run in runs.items():
            dist.barrier()
            started = time.perf_counter()
            run(buffer)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if iteration >= warmup:
                samples[name].append(elapsed.item())
            buffer.fill_(1.0)
    return {name: statistics.median(times) for name, times in samples.items()}


def worker(rank: int, world_size: int, sizes_mb: list[float], iterations: int, warmup: int, sub_chunk_bytes: int):
    forest = ForestAllReduce(complete(world_size), sub_chunk_bytes=sub_chunk_bytes)
    runs = {"gloo": dist.all_reduce, "forest": forest.all_reduce}
    return {size_mb: interleaved_medians(runs, size_mb, iterations, warmup) for size_mb in sizes_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sub-chunk-kb", type=int, default=DEFAULT_SUB_CHUNK_BYTES >> 10)
    args = parser.parse_args()
    results = run_local(worker, args.ranks, args.sizes_mb, args.iterations, args.warmup, args.sub_chunk_kb << 10)[0]
    lines = [f"{args.ranks} local ranks, complete-{args.ranks} topology, sub-chunks of {args.sub_chunk_kb} KiB, "
             f"median of {args.iterations} interleaved runs (slowest rank)", "",
             "| size | gloo ms | forest ms | forest / gloo |", "|---|---|---|---|"]
    for size_mb, times in results.items():
        ratio = times["forest"] / times["gloo"]
        lines.append(f"| {size_mb:g} MB | {times['gloo'] * 1e3:.1f} | {times['forest'] * 1e3:.1f} | {ratio:.2f}"
                     + (f" (target ≤ {TARGET}) |" if size_mb == 64 else " |"))
    print("\n".join(lines))
    command = " ".join([".venv/bin/python", "benchmarks/forest_allreduce.py", *sys.argv[1:]])
    OUT.write_text("\n".join(["# Forest all-reduce against gloo on local ranks", "", f"`{command}`: " + lines[0],
                               *lines[1:], ""]))


if __name__ == "__main__":
    main()
