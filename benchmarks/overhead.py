"""Runtime overhead: gradsync against torch DDP on 2 CPU ranks, over unconstrained loopback or,
with `--rate`, the netbed's tc-shaped links (root).

Each rank holds one copy of a small CNN per variant; iterations run interleaved (DDP, gradsync
`ddp`, `wfbp`, `mg_wfbp`, DDP, ...) after a warm-up that also covers gradsync's measurement
iterations, each one started after a barrier. gradsync's `ddp` scheduler builds torch DDP's
buckets, so its ratio to torch DDP is the runtime's own overhead: per iteration (the medians), and
with the work gradsync does once every few iterations (the means: its watchers' reductions over the
ranks, ``runtime.over_ranks``). Beside the time, the CPU time of the thread that runs the
iteration (the ranks' mean, median over the iterations): the work gradsync does in Python where
torch DDP's reducer runs in C++, which only the transfers can hide. The simulator's prediction for
each plan (from the measured profile and cost) is printed beside the measured median.

Run: `.venv/bin/python -m benchmarks.overhead [--iterations 30] [--rate 10gbit]`.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.launch import run_local
from gradsync.runtime import attached

from benchmarks.netbed import RATE_PRESETS, launch, netbed, uniform

SCHEDULERS = ("ddp", "wfbp", "mg_wfbp")


def small_cnn() -> nn.Module:
    """A CNN with many small tensors: 8 conv + batch-norm blocks and a classifier."""
    layers, channels = [], 3
    for width in (32, 32, 64, 64, 128, 128, 256, 256):
        layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
        if width in (64, 256):
            layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


def worker(rank: int, world_size: int, iterations: int, warmup: int):
    torch.manual_seed(0)
    base = small_cnn()
    variants = {"torch DDP": nn.parallel.DistributedDataParallel(copy.deepcopy(base))}
    optimizers = {"torch DDP": torch.optim.SGD(variants["torch DDP"].parameters(), lr=0.01, momentum=0.9)}
    for name in SCHEDULERS:
        model = copy.deepcopy(base)
        variants[name], optimizers[name] = gradsync.wrap(
            model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), scheduler=name)
    generator = torch.Generator().manual_seed(rank)
    images = torch.randn(32, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (32,), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for iteration in range(warmup + iterations):
        for name, model in variants.items():
            optimizer = optimizers[name]
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.thread_time()
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            if iteration >= warmup:
                times[name].append(time.perf_counter() - started)
                cpu[name].append(time.thread_time() - cpu_started)
    predicted = {name: attached(variants[name]).installed.prediction(("plain",)).time for name in SCHEDULERS}
    ops = {name: len(attached(variants[name]).plan.ops) for name in SCHEDULERS}
    for name in SCHEDULERS:
        attached(variants[name]).detach()
    return times, predicted, ops, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--rate", choices=list(RATE_PRESETS), help="on the netbed at this rate (default: loopback)")
    args = parser.parse_args()
    if args.rate:
        with netbed(uniform(2, args.rate)):
            results = launch("benchmarks.overhead:worker", 2, args.iterations, args.warmup)
    else:
        results = run_local(worker, 2, args.iterations, args.warmup)
    # per iteration, the slower rank's time is the job's time
    variants = list(results[0][0])
    slowest = {v: [max(r[0][v][i] for r in results) for i in range(args.iterations)] for v in variants}
    medians = {v: statistics.median(times) for v, times in slowest.items()}
    means = {v: statistics.mean(times) for v, times in slowest.items()}
    predicted, ops = results[0][1], results[0][2]
    cpu = {v: statistics.median(statistics.mean(r[3][v][i] for r in results) for i in range(args.iterations))
           for v in variants}
    network = f"the netbed at {args.rate}" if args.rate else "loopback"
    print(f"2 CPU ranks, gloo over {network}, small CNN, batch 32; {args.iterations} interleaved iterations")
    print(f"{'variant':<16}{'median ms':>11}{'vs torch DDP':>14}{'mean ms':>10}{'vs torch DDP':>14}{'CPU ms':>9}"
          f"{'all-reduces':>13}{'predicted ms':>14}{'error':>8}")
    for variant in variants:
        row = (f"{variant:<16}{medians[variant] * 1e3:>11.2f}{medians[variant] / medians['torch DDP']:>13.3f}x"
               f"{means[variant] * 1e3:>10.2f}{means[variant] / means['torch DDP']:>13.3f}x{cpu[variant] * 1e3:>9.2f}")
        if variant in predicted:
            error = (predicted[variant] - medians[variant]) / medians[variant]
            row += f"{ops[variant]:>13}{predicted[variant] * 1e3:>14.2f}{error:>+8.1%}"
        print(row)
    for statistic, values in (("medians", medians), ("means", means)):
        overhead = values["ddp"] / values["torch DDP"] - 1
        print(f"runtime overhead (gradsync `ddp` buckets vs torch DDP, {statistic}): {overhead:+.1%} "
              "(target: at most +2%)")
    print(f"the iterating thread's CPU per iteration, gradsync `ddp` buckets vs torch DDP: "
          f"{(cpu['ddp'] - cpu['torch DDP']) * 1e3:+.2f} ms ({cpu['ddp'] / cpu['torch DDP'] - 1:+.1%})")


if __name__ == "__main__":
    main()
