"""The `gradsync` command: list the model zoo, build a plan, compare schedulers in the simulator."""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import dataclass, replace
from typing import Sequence

from . import compress, planners
from .planning import LayoutPlan, predict_cycle
from .cost import PRESETS, CostModel, check_workers
from .errors import ConfigError
from .profile import ModelProfile, zoo, zoo_names
from .profile.devices import resolve_device
from .simulate import simulate
from .topology.cli import add_topo_commands, run_topo


def _option(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE parsed as JSON when it is JSON (numbers, lists), else kept as text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradsync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("list", help="list the schedulers and compressors (built-in and installed) and their options")
    listing = commands.add_parser("zoo", help="list the model zoo")
    listing.add_argument("--json", action="store_true")

    def workload(sub: argparse.ArgumentParser) -> None:
        source = sub.add_mutually_exclusive_group(required=True)
        source.add_argument("--model", help=f"zoo model: {', '.join(zoo_names())}")
        source.add_argument("--profile", help="a ModelProfile JSON file")
        sub.add_argument("--batch-size", type=int, default=None)
        sub.add_argument("--device", default="V100", help="GPU preset for the zoo's compute times")
        sub.add_argument("--workers", type=int, default=None, help="number of workers N")
        sub.add_argument("--cluster", help=f"cost preset: {', '.join(PRESETS)}")
        sub.add_argument("--a", type=float, help="all-reduce start-up time in seconds")
        sub.add_argument("--b", type=float, help="all-reduce time per byte in seconds")
        sub.add_argument("--gamma", type=float, default=None, help="contention factor (>= 1)")
        sub.add_argument("--host", type=float, default=0.0,
                         help="seconds of the computing thread each op takes (default 0, as in the papers)")
        sub.add_argument("--compute-slowdown", type=float, default=1.0,
                         help="times slower the computation runs while an op transmits (default 1)")
        sub.add_argument("--transfer-slowdown", type=float, default=1.0,
                         help="times slower transmissions run while the thread computes (default 1)")
        sub.add_argument("--ops-per-channel", type=int, default=1,
                         help="ops one channel runs at once (default 1, as in the papers; gloo runs 2)")
        sub.add_argument("--compressor", default=None, help=f"one of: {', '.join(compress.names())}")
        sub.add_argument("-c", "--compressor-option", type=_option, action="append", default=[],
                         metavar="KEY=VALUE", help="compressor option, e.g. -c rank=4")
        sub.add_argument("--json", action="store_true")

    build = commands.add_parser("plan", help="build one scheduler's plan and predict its iteration")
    workload(build)
    build.add_argument("--scheduler", required=True, help=f"one of: {', '.join(planners.names())}")
    build.add_argument("-o", "--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                       help="planner option, e.g. -o partition_bytes=4000000 -o channels=2")
    build.add_argument("--timeline", help="write the simulated timeline as a PNG")
    build.add_argument("--save", help="write the plan as JSON")

    compare = commands.add_parser("simulate", help="compare schedulers in the simulator")
    workload(compare)
    compare.add_argument("--schedulers", default="all", help="comma-separated names, or 'all'")
    add_topo_commands(commands)
    return parser


def _profile(args) -> ModelProfile:
    if args.profile:
        return ModelProfile.load(args.profile)
    return zoo(args.model, batch_size=args.batch_size, device=args.device)


def _cost(args) -> CostModel:
    if args.workers is not None:
        check_workers(args.workers)
    explicit = args.a is not None or args.b is not None
    if explicit and args.cluster:
        raise ConfigError("give either --cluster or --a/--b, not both")
    if explicit:
        if args.a is None or args.b is None:
            raise ConfigError("--a and --b must be given together")
        return CostModel(args.a, args.b, 1.0 if args.gamma is None else args.gamma, host=args.host,
                         compute_slowdown=args.compute_slowdown, transfer_slowdown=args.transfer_slowdown,
                         ops_per_channel=args.ops_per_channel)
    if not args.cluster:
        raise ConfigError(f"give --cluster (one of: {', '.join(PRESETS)}) or --a and --b")
    cost = CostModel.preset(args.cluster, workers=args.workers)
    return replace(cost, gamma=cost.gamma if args.gamma is None else args.gamma, host=args.host,
                   compute_slowdown=args.compute_slowdown, transfer_slowdown=args.transfer_slowdown,
                   ops_per_channel=args.ops_per_channel)


@dataclass
class Prediction:
    """One scheduler (with a codec) on one workload: its plans and the predicted steady state."""

    scheduler: str
    layout_plans: dict[str, LayoutPlan]
    step_time: float  # mean over the codec's steady cycle of steps
    allreduces: float  # per step, likewise
    compute_time: float

    def summary(self) -> dict:
        first = next(iter(self.layout_plans.values())).plan
        return {
            "scheduler": self.scheduler,
            "iteration_time_ms": self.step_time * 1e3,
            "noncovered_comm_ms": max(0.0, self.step_time - self.compute_time) * 1e3,
            "allreduces": self.allreduces,
            "channels": first.channels,
            "plan_hash": first.hash,
        }


def _predict(args, profile: ModelProfile, cost: CostModel, planner: planners.BoundPlanner) -> Prediction:
    codec = compress.get(args.compressor, **dict(args.compressor_option))
    codec.setup(profile.tensor_map(), 2 if args.workers is None else args.workers, seed=0)
    flops = None
    if not args.profile:
        device = resolve_device(args.device)
        flops = device.peak_flops * device.efficiency
    layout_plans, step_time = predict_cycle(profile, cost, planner, codec, flops)
    cycle = codec.steady_rounds()
    allreduces = sum(len(layout_plans[layout].plan.ops) for rounds in cycle for layout in rounds) / len(cycle)
    return Prediction(planner.name, layout_plans, step_time, allreduces, profile.forward_time + profile.backward_time)


def _run_list(args) -> None:
    from .listing import TABLES

    print("\n\n".join(table() for table in TABLES.values()))


def _run_zoo(args) -> None:
    rows = []
    for name in zoo_names():
        profile = zoo(name)
        rows.append({"model": name, "parameters": profile.num_parameters, "tensors": profile.num_tensors,
                     "layers": len(profile.layers)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'model':<14}{'parameters':>14}{'tensors':>9}{'layers':>8}")
    for row in rows:
        print(f"{row['model']:<14}{row['parameters']:>14,}{row['tensors']:>9}{row['layers']:>8}")


def _run_plan(args) -> None:
    profile, cost = _profile(args), _cost(args)
    prediction = _predict(args, profile, cost, planners.bind(args.scheduler, **dict(args.option)))
    layout_plans = prediction.layout_plans
    if args.save:
        with open(args.save, "w") as handle:
            json.dump({layout: entry.plan.to_dict() for layout, entry in layout_plans.items()}, handle, indent=1)
    first_layout, first = next(iter(layout_plans.items()))
    timeline = simulate(first.plan, first.wire, cost)
    if args.timeline:
        from .timeline_plot import plot_timeline

        plot_timeline(timeline, args.timeline, f"{profile.name}: {first.plan.planner}")
    summary = {**prediction.summary(), "model": profile.name, "cost": cost.to_dict()}
    if args.json:
        print(json.dumps({**summary, "plans": {k: v.plan.to_dict() for k, v in layout_plans.items()}}, indent=1))
        return
    codec = f", compressor {args.compressor}" if args.compressor else ""
    print(f"{profile.name}: {first.plan.planner}{codec} on {cost.name} "
          f"(a={cost.a:.4g} s, b={cost.b:.4g} s/B, γ={cost.gamma})")
    print(f"  predicted iteration {summary['iteration_time_ms']:.3f} ms, non-overlapped communication "
          f"{summary['noncovered_comm_ms']:.3f} ms, {summary['allreduces']:g} all-reduces per step")
    for layout, entry in layout_plans.items():
        label = "" if layout == "plain" else f" [{layout}]"
        print(f"  plan{label}: {len(entry.plan.ops)} ops on {entry.plan.channels} channel(s), "
              f"hash {entry.plan.hash[:16]}")
    print(f"  ops of {'the plan' if len(layout_plans) == 1 else first_layout}:")
    for span, op in zip(timeline.ops, first.plan.ops):
        carried = op.slices[0].tensor if len(op.slices) == 1 else f"{op.slices[0].tensor} … {op.slices[-1].tensor}"
        print(f"  op {span.op:>4} ch{span.channel} {span.phase:<8} {span.nbytes / 2**20:9.3f} MiB "
              f"{span.start * 1e3:9.3f} → {span.end * 1e3:9.3f} ms  {carried}")
    if args.timeline:
        print(f"  timeline written to {args.timeline}")


def _run_simulate(args) -> None:
    profile, cost = _profile(args), _cost(args)
    names = planners.names() if args.schedulers == "all" else [n.strip() for n in args.schedulers.split(",")]
    rows = []
    for name in names:
        prediction = _predict(args, profile, cost, planners.bind(name))
        rows.append(prediction.summary())
        chosen = planners.chosen_planner(next(iter(prediction.layout_plans.values())).plan)
        if chosen != name:
            rows[-1]["scheduler"] = f"{name} ({chosen})"
    baseline = simulate(planners.get("wfbp")(profile, cost), profile, cost).iteration_time * 1e3
    for row in rows:
        row["speedup_over_wfbp"] = baseline / row["iteration_time_ms"]
    if args.json:
        print(json.dumps({"model": profile.name, "cost": cost.to_dict(), "compressor": args.compressor,
                          "rows": rows}, indent=1))
        return
    codec = f" with {args.compressor}" if args.compressor else ""
    print(f"{profile.name}{codec} on {cost.name} (a={cost.a:.4g} s, b={cost.b:.4g} s/B, γ={cost.gamma}); "
          "speedup against uncompressed wfbp")
    print(f"{'scheduler':<26}{'iteration ms':>14}{'vs wfbp':>9}{'non-overlapped ms':>19}{'all-reduces':>13}")
    for row in rows:
        print(f"{row['scheduler']:<26}{row['iteration_time_ms']:>14.3f}{row['speedup_over_wfbp']:>8.3f}x"
              f"{row['noncovered_comm_ms']:>19.3f}{row['allreduces']:>13g}")


def _warn(message, *_args, **_kwargs) -> None:
    print(f"gradsync: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    warnings.showwarning = _warn
    try:
        {"list": _run_list, "zoo": _run_zoo, "plan": _run_plan, "simulate": _run_simulate,
         "topo": run_topo}[args.command](args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"gradsync: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
