"""Interference on the emulated cluster: how much slower a model's forward and backward pass runs
while all-reduces are in flight beside it.

The simulator (gradsync.simulate) takes compute times from a profile and communication times from
a + b·bytes, each measured on its own, and slows the computation by the cost model's
`compute_slowdown` σ while ops are in flight; `cost="measure"` takes σ from matrix products timed
beside an all-reduce. On this testbed the ranks, gloo's threads and the kernel's network stack
share the machine's cores; here the slowdown is measured on the models' own passes, beside the
wrap-time probe's σ, per model, number of ranks and NIC rate:

- compute alone: one forward and backward pass (no communication), median;
- compute beside traffic: the same pass, started right after launching enough back-to-back
  all-reduces of the model's gradient size (asynchronous, on their own process group) to outlast
  it, median; the traffic is then waited for;
- slowdown = beside / alone, the slowest rank's; and the same for the forward and the backward
  pass apart (each pass's medians: a forward beside traffic is what a plan that defers its waits
  into the next forward runs);
- where the slowdown comes from: the computing thread's CPU time over the pass (alone and beside,
  medians), so that beside − alone splits into time on the core (the same work taking more
  cycles: caches shared with the transfers, interrupts served on its core) and time off it (the
  thread preempted by gloo's threads and the kernel's network processing), with how often it was
  preempted per pass;
- transfer slowdown τ: the traffic timed alone and beside the pass, the rate it kept beside the
  pass (`slowdowns_of`, as the probe takes it), the median over the passes, the ranks' median;
- probe σ and τ: `measure_cost`'s compute_slowdown and transfer_slowdown on the same job, fitted
  `--probe-fits` times in a row: the median, and the range (how far one fit can land); and its
  host time per op from the same fits (with `--host-probe-ops` and `--host-probe-repeats`, from a
  longer or shorter host probe than wrap's after each fit).

    .venv/bin/python -m benchmarks.interference            # 2 and 4 ranks, 1 and 10 Gbit/s (about 6 minutes)
    .venv/bin/python -m benchmarks.interference --world-sizes 4 --rates 1gbit --models cnn \
        --probe-fits 5 --host-probe-ops 96 --host-probe-repeats 9   # does a longer host probe steady it?
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradsync.runtime.channels import Channels
from gradsync.runtime.measure.probes import measure_cost, measure_host, slowdowns_of

from benchmarks.head_to_head.workloads import WORKLOADS
from benchmarks.netbed import RATE_PRESETS, NetbedUnavailable, launch, netbed, uniform

RESULTS = Path(__file__).parent / "results"
TRAFFIC_MARGIN = 3.0  # the traffic launched lasts this many times the compute alone (it must outlast it beside)


def rank_main(rank: int, world_size: int, job: dict) -> dict:
    """Median compute time alone and beside traffic on this rank (seconds; whole passes, the
    forward and backward pass apart, and the computing thread's time on and off a core with its
    preemptions), the traffic's size and its slowdown beside the pass."""
    torch.manual_seed(0)
    workload = WORKLOADS[job["model"]]
    model = workload.build_model()
    generator = torch.Generator().manual_seed(rank)
    inputs = workload.make_inputs(workload.batch, generator)
    labels = torch.randint(0, 10, (workload.batch,), generator=generator)
    group = dist.new_group(backend="gloo")
    gradient = torch.zeros(sum(p.numel() for p in model.parameters()))  # zeros: sums stay finite

    def compute() -> Pass:
        model.zero_grad()
        switches, cpu = preemptions(), time.thread_time()
        started = time.perf_counter()
        loss = F.cross_entropy(model(inputs), labels)
        forward_end = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
        return Pass(forward_end - started, ended - forward_end, time.thread_time() - cpu, preemptions() - switches)

    def allreduce() -> float:
        started = time.perf_counter()
        dist.all_reduce(gradient, group=group)
        return time.perf_counter() - started

    for _ in range(2):  # warm-up
        compute(), allreduce()
    passes_alone = [compute() for _ in range(job["repeats"])]
    alone = statistics.median(one.seconds for one in passes_alone)
    one_op = statistics.median(allreduce() for _ in range(job["repeats"]))
    slowest = torch.tensor([alone, one_op], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the same numbers, so the same ops, on every rank
    ops = max(1, math.ceil(TRAFFIC_MARGIN * slowest[0].item() / slowest[1].item()))
    buffers = [gradient.clone() for _ in range(ops)]

    def traffic(beside_compute: bool) -> tuple[Pass | None, float]:
        """The pass, if run, and the traffic's seconds."""
        dist.barrier()
        started = time.perf_counter()
        works = [dist.all_reduce(buffer, group=group, async_op=True) for buffer in buffers]
        passed = compute() if beside_compute else None
        for work in works:
            work.wait()
        return passed, time.perf_counter() - started

    beside, transfer_slowdowns = [], []
    for _ in range(job["repeats"]):
        traffic_alone = traffic(False)[1]
        passed, traffic_beside = traffic(True)
        beside.append(passed)
        transfer_slowdowns.append(slowdowns_of(alone, traffic_alone, passed.seconds, traffic_beside)[1])
    host_probe = job.get("host_probe", {})  # measure_host's ops and repeats where not wrap's

    def probe(channels: Channels):
        """The cost wrap fits; with `host_probe`, its host time per op from such a host probe."""
        cost = measure_cost(channels, gradient.numel() * gradient.element_size())
        return dataclasses.replace(cost, host=measure_host(channels, cost, **host_probe)) if host_probe else cost

    channels = Channels(2)
    try:
        probes = [probe(channels) for _ in range(job["probe_fits"])]
    finally:
        channels.destroy()
    medians = {f"{key}_{when}": statistics.median(getattr(one, key) for one in passes)
               for when, passes in (("alone", passes_alone), ("beside", beside))
               for key in ("forward", "backward", "cpu", "off_core", "preemptions")}
    return {"alone": alone, "beside": statistics.median(one.seconds for one in beside), **medians,
            "transfer_slowdown": statistics.median(transfer_slowdowns),
            "ops": ops, "op_seconds": slowest[1].item(),
            "probe_sigma": [probe.compute_slowdown for probe in probes],
            "probe_tau": [probe.transfer_slowdown for probe in probes],
            "probe_host": [probe.host for probe in probes]}


@dataclasses.dataclass(frozen=True)
class Pass:
    """One forward and backward pass: each one's seconds, the computing thread's CPU seconds over
    both, and how often the thread was preempted."""
    forward: float
    backward: float
    cpu: float
    preemptions: int

    @property
    def seconds(self) -> float:
        return self.forward + self.backward

    @property
    def off_core(self) -> float:
        """The pass's seconds without the computing thread on a core."""
        return self.seconds - self.cpu


def preemptions() -> int:
    """The calling thread's involuntary context switches so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def where_slowed(report: dict) -> str:
    """A rank's extra time per pass beside traffic, on the core (more CPU time for the same pass)
    and off it, with its preemptions per pass alone → beside (medians over the passes)."""
    on_core = report["cpu_beside"] - report["cpu_alone"]
    off_core = report["off_core_beside"] - report["off_core_alone"]
    return (f"{on_core * 1e3:+.1f} / {off_core * 1e3:+.1f} | "
            f"{report['preemptions_alone']:.0f} → {report['preemptions_beside']:.0f}")


def fits(values: list[float], unit: str = "×") -> str:
    """A probe's fits: their median, and their range when there are several."""
    median = f"{statistics.median(values):.2f}{unit}"
    return median if len(values) == 1 else f"{median} ({min(values):.2f}–{max(values):.2f})"


def run(args) -> list[str]:
    rows = []
    for world_size in args.world_sizes:
        for rate in args.rates:
            with netbed(uniform(world_size, rate)):
                for model in args.models:
                    print(f"running: {model}, {world_size} ranks, {rate}", flush=True)
                    reports = launch("benchmarks.interference:rank_main", world_size,
                                     {"model": model, "repeats": args.repeats, "probe_fits": args.probe_fits,
                                      "host_probe": host_probe_options(args)},
                                     timeout=args.timeout)
                    alone, beside = (max(r[key] for r in reports) for key in ("alone", "beside"))
                    passes = [max(r[f"{kind}_beside"] for r in reports) / max(r[f"{kind}_alone"] for r in reports)
                              for kind in ("forward", "backward")]
                    tau = statistics.median(r["transfer_slowdown"] for r in reports)
                    slowest = max(reports, key=lambda r: r["beside"])
                    rows.append(f"| {model} | {world_size} | {rate} | {alone * 1e3:.1f} | {beside * 1e3:.1f} | "
                                f"{beside / alone:.2f}× | {passes[0]:.2f}× | {passes[1]:.2f}× | {where_slowed(slowest)} | "
                                f"{fits(reports[0]['probe_sigma'])} | {tau:.2f}× | {fits(reports[0]['probe_tau'])} | "
                                f"{fits([host * 1e3 for host in reports[0]['probe_host']], ' ms')} | "
                                f"{reports[0]['ops']} × {reports[0]['op_seconds'] * 1e3:.1f} |")
    return rows


def host_probe_options(args) -> dict[str, int]:
    """The host probe's `measure_host` options given on the command line (none: wrap's probe)."""
    given = {"ops": args.host_probe_ops, "repeats": args.host_probe_repeats}
    return {name: value for name, value in given.items() if value is not None}


def main(argv=None) -> None:
    cli = argparse.ArgumentParser(prog="python -m benchmarks.interference", description=__doc__.splitlines()[0])
    cli.add_argument("--models", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    cli.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    cli.add_argument("--rates", nargs="+", choices=list(RATE_PRESETS), default=list(RATE_PRESETS))
    cli.add_argument("--repeats", type=int, default=9)
    cli.add_argument("--probe-fits", type=int, default=3, help="times the wrap-time probe is fitted per job")
    cli.add_argument("--host-probe-ops", type=int, help="ops per run of the host probe (default: wrap's)")
    cli.add_argument("--host-probe-repeats", type=int,
                     help="pairs of runs (without and with ops) the host probe takes the median of (default: wrap's)")
    cli.add_argument("--timeout", type=float, default=600.0, help="seconds per job before its ranks are killed")
    cli.add_argument("--out", type=Path, default=RESULTS / "interference.md")
    args = cli.parse_args(argv)
    if min([args.probe_fits, *host_probe_options(args).values()]) < 1:
        cli.error("--host-probe-ops, --host-probe-repeats and --probe-fits must be at least 1")
    command = " ".join(["python -m benchmarks.interference", *(sys.argv[1:] if argv is None else argv)])
    load_before = os.getloadavg()[0]
    try:
        rows = run(args)
    except NetbedUnavailable as missing:
        sys.exit(f"interference: {missing}")
    lines = ["# Interference: compute beside communication on the emulated cluster", "",
             f"Command: `{command}`. {os.cpu_count()} CPU cores shared by the ranks (one "
             f"thread each) and gloo; 1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
             f"medians of {args.repeats} passes, the slowest rank's; the probe fitted {args.probe_fits} times per job"
             f" (host probe: {host_probe_options(args) or 'as wrap fits it'}).", "",
             "One forward and backward pass alone, and beside back-to-back all-reduces of the model's gradient size "
             "that outlast it; forward, backward: the slowdown of each pass apart; τ: the traffic's slowdown beside "
             "the pass; extra ms on / off core: the slowest rank's (beside − alone) split into its computing thread's "
             "extra CPU time and the rest (preempted, waiting for a core; medians of each part, which need not add up to "
             "the whole pass's), with its preemptions per pass alone → beside; "
             "probe σ, probe τ: the slowdowns `cost=\"measure\"` measures with matrix products (the "
             "simulator's model); probe host per op: the computing thread's time per op it measures.", "",
             "| model | ranks | NIC | compute alone ms | beside traffic ms | slowdown | forward | backward |"
             " extra ms on / off core | preemptions per pass | probe σ | τ | probe τ | probe host per op |"
             " traffic: ops × ms alone |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
