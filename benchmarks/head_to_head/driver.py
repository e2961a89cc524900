"""The head-to-head's command line: the settings run one job each on the netbed, then the report
written beside the JSON and the chart."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gradsync.launch import RankFailed
from gradsync.topology import load, preset

import benchmarks.head_to_head as package
from benchmarks.netbed import RATE_PRESETS, NetbedUnavailable, from_topology, launch, netbed, uniform

from .job import BLOCK, EMULATED_BLOCK, UNTIMED_STEPS
from .report import chart, cost_line, host_line, markdown, replay_file, steal_note, stolen_cpu_seconds
from .results import Setting, summarise
from .rows import ON_REQUEST_ROWS, QUICK_ROWS, ROWS, TOPOLOGY_ROWS
from .workloads import EMULATED_DEVICE, EMULATED_MODELS, EMULATED_RATES, EMULATED_SIZE_SCALE, REAL_MODELS, WORKLOADS

RESULTS = Path(__file__).parents[1] / "results"
FOLLOW_UP_STEPS = 3000  # steps auto may take after its trials to settle its follow-up rounds before the timed rounds
EMULATED_FOLLOW_UP_STEPS = 0  # emulated iterations last up to a second: the follow-ups run within the rows


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
                    reports = launch("benchmarks.head_to_head.job:rank_main", world_size,
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
    cli = argparse.ArgumentParser(prog="python -m benchmarks.head_to_head", description=package.__doc__.splitlines()[0])
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
