"""Re-planning online on the netbed: the link's rate drops and recovers mid-run, and gradsync re-fits
its cost from its own ops' times and plans again, without stopping training.

    python -m benchmarks.replanning [--rows auto mg_wfbp] [--model emulated_resnet50]

Per row, three jobs of 2 ranks on one emulated model (its computation waited, no core used:
``gradsync.emulated``), run one after another:
- changing: starts at `--fast` Gbit/s; rank 0 sets every link to `--slow` before iteration
  `--change-at` and back before `--return-at` (``netbed.rate_commands``, run in the root namespace);
- fresh at `--slow` and fresh at `--fast`: gradsync started at that rate, for `--fresh-steps`; its
  steady time is the median of its last `--steady` iterations.
Reported per row and change: the iterations from the change until the changing run's iteration time
(a running median of `SMOOTHING`) stays within `WITHIN` of the fresh run's steady time (no more than
that above it: faster counts as within); the
re-plannings (``gradsync.report(model).replans``); and whether the ranks' parameters were identical
at every iteration (a checksum per iteration, compared across ranks). Every job's iteration times
go into the JSON beside the report.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import gradsync
from gradsync.runtime import attached

from .head_to_head.workloads import EMULATED_MODELS, EMULATED_SIZE_SCALE, LEARNING_RATE, WORKLOADS
from .netbed import NetbedUnavailable, NetSpec, launch, netbed, rate_commands, uniform
from .netbed.bed import run_commands

RESULTS = Path(__file__).parent / "results"
WITHIN = 0.05  # the target: within 5% of a fresh run at the new rate...
SETTLE_TARGET = 50  # ...within this many iterations of the change
SMOOTHING = 5  # iterations in the running median compared with the fresh run


def set_rate(spec: NetSpec, gbps: float) -> None:
    """Every host's link of the cluster built from `spec` at `gbps`, from inside a rank's namespace (as root)."""
    run_commands(rate_commands(spec, gbps))


def rank_main(rank: int, world_size: int, job: dict) -> dict:
    """One rank of a job: `job["steps"]` iterations, the rate set as `job["rates"]` says
    ({iteration: Gbit/s}, by rank 0 after a barrier); per iteration its time, replans so far and a
    parameter checksum."""
    torch.manual_seed(0)
    workload = WORKLOADS[job["model"]]
    model = workload.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    model, optimizer = gradsync.wrap(model, optimizer, scheduler=job["scheduler"])
    generator = torch.Generator().manual_seed(rank)
    inputs, targets = workload.make_inputs(workload.batch, generator), workload.make_targets(workload.batch, generator)
    changes = {int(step): gbps for step, gbps in job["rates"].items()}
    seconds, replans, checksums = [], [], []
    for step in range(job["steps"]):
        if step in changes:
            torch.distributed.barrier()
            if rank == 0:
                set_rate(uniform(world_size, job["start_gbps"]), changes[step])
            torch.distributed.barrier()
        started = time.perf_counter()
        optimizer.zero_grad()
        workload.loss(model(inputs), targets).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
        sync = attached(model)
        sync.flush()  # the checksum reads every parameter updated
        replans.append(sync.clock.history[-1].replans)  # as the statistics count them
        checksums.append(float(sum(p.detach().double().sum() for p in model.parameters())))
    report = gradsync.report(model)
    result = {"seconds": seconds, "replans": replans, "checksums": checksums,
              "replanned": [replan.summary() for replan in report.replans],
              "chosen": report.chosen, "b": report.layouts[report.steady_layouts[0]].cost.b}
    attached(model).detach()
    return result


def settled_after(seconds: list[float], start: int, end: int, target: float) -> int | None:
    """Iterations from `start` until the running median of `SMOOTHING` stays at most `WITHIN` above
    `target` up to `end` (None: it never does); faster than the fresh run counts as within."""
    medians = [statistics.median(seconds[i - SMOOTHING + 1:i + 1]) for i in range(start + SMOOTHING - 1, end)]
    inside = [m <= (1 + WITHIN) * target for m in medians]
    for offset in range(len(inside)):
        if all(inside[offset:]):
            return offset + SMOOTHING - 1
    return None


def slowest_rank(ranks: list[dict]) -> list[float]:
    """Each iteration's time on the slower rank."""
    return [max(times) for times in zip(*(rank["seconds"] for rank in ranks))]


def run_job(args, scheduler: str, start_gbps: float, steps: int, rates: dict[int, float]) -> list[dict]:
    job = {"model": args.model, "scheduler": scheduler, "steps": steps, "start_gbps": start_gbps,
           "rates": {str(k): v for k, v in rates.items()}}
    with netbed(uniform(2, start_gbps)):
        return launch("benchmarks.replanning:rank_main", 2, job, timeout=args.timeout)


def row_lines(args, scheduler: str, series: dict) -> list[str]:
    """The row's three jobs and their lines of the report; each job's iteration times (the slower
    rank's) go into `series`."""
    steps = args.return_at + (args.return_at - args.change_at)
    changing = run_job(args, scheduler, args.fast, steps, {args.change_at: args.slow, args.return_at: args.fast})
    fresh = {gbps: run_job(args, scheduler, gbps, args.fresh_steps, {}) for gbps in (args.slow, args.fast)}
    steady = {gbps: statistics.median(slowest_rank(ranks)[-args.steady:]) for gbps, ranks in fresh.items()}
    slowest = slowest_rank(changing)
    series[scheduler] = {"changing": slowest,
                         **{f"fresh at {gbps:g}": slowest_rank(ranks) for gbps, ranks in fresh.items()}}
    identical = all(ranks[0]["checksums"] == ranks[1]["checksums"] for ranks in [changing, *fresh.values()])
    lines = [f"### {scheduler}", ""]
    for label, start, end, gbps in (("drop", args.change_at, args.return_at, args.slow),
                                    ("recovery", args.return_at, steps, args.fast)):
        after = settled_after(slowest, start, end, steady[gbps])
        tail = statistics.median(slowest[end - args.steady:end])
        verdict = "reached" if after is not None and after <= SETTLE_TARGET else "NOT reached"
        lines.append(f"- {label} to {gbps:g} Gbit/s at iteration {start}: within {WITHIN:.0%} of a fresh run at "
                     f"{gbps:g} Gbit/s ({steady[gbps] * 1e3:.1f} ms) after "
                     f"{'never' if after is None else f'{after} iterations'} (target ≤ {SETTLE_TARGET}): {verdict}; "
                     f"its last {args.steady} iterations {tail * 1e3:.1f} ms ({tail / steady[gbps]:.3f}×)")
    lines.append(f"- re-plannings: {'; '.join(changing[0]['replanned']) or 'none'}")
    lines.append(f"- b probed by the fresh runs at wrap: {fresh[args.slow][0]['b'] * 1e9:.3g} ns/byte at {args.slow:g} "
                 f"Gbit/s, {fresh[args.fast][0]['b'] * 1e9:.3g} at {args.fast:g}")
    lines.append(f"- statistics: replans counted {changing[0]['replans'][-1]} at the end; plans chosen: changing run "
                 f"{changing[0]['chosen']}, fresh at {args.slow:g} {fresh[args.slow][0]['chosen']}, fresh at "
                 f"{args.fast:g} {fresh[args.fast][0]['chosen']}")
    lines.append(f"- parameters identical on both ranks at every iteration of the three jobs: {identical}")
    lines.append("")
    return lines


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="python -m benchmarks.replanning", description=__doc__.splitlines()[0])
    cli.add_argument("--rows", nargs="+", default=["auto", "mg_wfbp"], help="gradsync schedulers")
    cli.add_argument("--model", default="emulated_resnet50", choices=list(EMULATED_MODELS))
    cli.add_argument("--fast", type=float, default=1.0, help="Gbit/s at the start and after the recovery")
    cli.add_argument("--slow", type=float, default=0.25, help="Gbit/s after the drop")
    cli.add_argument("--change-at", type=int, default=80, help="the iteration before which the rate drops")
    cli.add_argument("--return-at", type=int, default=180, help="the iteration before which it recovers")
    cli.add_argument("--fresh-steps", type=int, default=140, help="iterations of each fresh run")
    cli.add_argument("--steady", type=int, default=40, help="iterations of a steady median")
    cli.add_argument("--timeout", type=float, default=1800.0, help="seconds per job before its ranks are killed")
    cli.add_argument("--out", type=Path, default=RESULTS / "replanning.md")
    return cli


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    started = time.perf_counter()
    try:
        series = {}
        sections = [line for scheduler in args.rows for line in row_lines(args, scheduler, series)]
    except NetbedUnavailable as missing:
        sys.exit(f"replanning: {missing}")
    command = " ".join(["python -m benchmarks.replanning", *(sys.argv[1:] if argv is None else argv)])
    report = "\n".join([
        "# Re-planning online when the link's rate changes", "", f"Command: `{command}`", "",
        f"2 ranks on the netbed; {WORKLOADS[args.model].description} (its computation waited without a core: a link "
        f"of R Gbit/s stands for R / {EMULATED_SIZE_SCALE:g} for the full-size model). Iteration time: the slower "
        f"rank's. Each row: a run whose links drop from {args.fast:g} to {args.slow:g} Gbit/s before iteration "
        f"{args.change_at} and recover before {args.return_at}, and fresh runs started at each rate (their steady "
        f"time: the median of their last {args.steady} iterations); total {time.perf_counter() - started:.0f} s.",
        "", *sections])
    args.out.write_text(report + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "seconds": series}) + "\n")
    print(report)


if __name__ == "__main__":
    main()
