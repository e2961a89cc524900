"""`gradsync topo simulate` and `gradsync topo plan`: forest packing against the baselines, and the trees.

`add_topo_commands(subparsers)` registers the `topo` command on the main parser's subparsers;
`run_topo(args)` dispatches to `run_topo_simulate` or `run_topo_plan`.
"""
from __future__ import annotations

import argparse
import json
import math

from ..errors import ConfigError
from .baselines import BASELINES, baseline_time
from .forest import PROBLEMS, ForestPacking
from .model import Topology, load
from .packing import plan_forest
from .presets import active_from_spec, preset


def add_topo_commands(subparsers) -> None:
    """Add `topo simulate` and `topo plan` to the `gradsync` command's subparsers."""
    topo = subparsers.add_parser("topo", help="topology-adaptive forest packing (reduce/broadcast trees)")
    commands = topo.add_subparsers(dest="topo_command", required=True)
    simulate = commands.add_parser("simulate", help="communication time of one synchronisation per scheme")
    _common(simulate)
    simulate.add_argument("--size-gb", type=float, default=1.33, help="data size in GB (1e9 bytes)")
    simulate.add_argument("--sub-chunks", type=int, default=None, help="pipelining sub-chunks (default: ideal)")
    plan = commands.add_parser("plan", help="print the trees and weights; draw them")
    _common(plan)
    plan.add_argument("--draw", help="write the trees as a PNG")
    plan.add_argument("--save", help="write the packing as JSON")


def _common(sub: argparse.ArgumentParser) -> None:
    source = sub.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="AxB-pcie, AxB-nvlink (e.g. 4x4-pcie), dgx1, complete-N, ring-N, oneway-ring-N")
    source.add_argument("--topology", help="a topology file (YAML or JSON)")
    sub.add_argument("--inter-gbps", type=float, default=10.0, help="inter-machine Gbit/s for AxB presets")
    sub.add_argument("--active", default=None,
                     help="per machine: counts '2,3,4,1', letters 'AG', labels 2G/3G/4H; or worker names")
    sub.add_argument("--problem", default="overlap", help=f"one of: {', '.join(PROBLEMS)}")
    sub.add_argument("--json", action="store_true")


def run_topo(args) -> None:
    {"simulate": run_topo_simulate, "plan": run_topo_plan}[args.topo_command](args)


def _check_problem(problem: str) -> None:
    if problem not in PROBLEMS:
        raise ConfigError(f"--problem: unknown {problem!r}; valid: {', '.join(PROBLEMS)}")


def _setting(args) -> tuple[Topology, tuple[str, ...]]:
    topology = load(args.topology) if args.topology else preset(args.preset, inter_gbps=args.inter_gbps)
    return topology, active_from_spec(topology, args.active)


def run_topo_simulate(args) -> None:
    """Forest packing (problems (4) and (8)) and each baseline: seconds, and baseline/forest ratios."""
    _check_problem(args.problem)
    if not args.size_gb > 0:
        raise ConfigError(f"--size-gb must be positive, got {args.size_gb}")
    topology, active = _setting(args)
    nbytes = args.size_gb * 1e9
    packings = {f"forest ({p})": plan_forest(topology, active, problem=p) for p in PROBLEMS}
    rows = {name: packing.time(nbytes, args.sub_chunks) for name, packing in packings.items()}
    rows.update({name: baseline_time(name, topology, active, nbytes) for name in BASELINES})
    chosen = rows[f"forest ({args.problem})"]
    best_baseline = min(rows[name] for name in BASELINES)
    summary = {"topology": topology.name, "topology_hash": topology.hash, "active": list(active),
               "size_bytes": nbytes, "problem": args.problem,
               "schemes": [{"scheme": name, "time_s": t, "ratio_to_forest": t / chosen} for name, t in rows.items()],
               "speedup_over_best_baseline": best_baseline / chosen,
               "forest_gap_to_upper_bound": packings[f"forest ({args.problem})"].gap}
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    print(f"{topology.name}: {len(active)} active of {len(topology.workers)} workers, "
          f"{args.size_gb:g} GB all-reduce")
    print(f"{'scheme':<22}{'time ms':>12}{'× forest':>10}")
    for row in summary["schemes"]:
        print(f"{row['scheme']:<22}{row['time_s'] * 1e3:>12.2f}{row['ratio_to_forest']:>10.2f}")
    print(f"forest ({args.problem}) is {summary['speedup_over_best_baseline']:.2f}x faster than the best baseline; "
          f"gap to upper bound {summary['forest_gap_to_upper_bound']:.2%}")


def run_topo_plan(args) -> None:
    """Print the packing's trees (root, kind, weight, edges); optionally save JSON and draw a PNG."""
    _check_problem(args.problem)
    topology, active = _setting(args)
    packing = plan_forest(topology, active, problem=args.problem)
    if args.save:
        with open(args.save, "w") as handle:
            handle.write(packing.to_json())
    if args.draw:
        draw_packing(packing, topology, args.draw)
    if args.json:
        print(json.dumps({**packing.to_dict(), "throughput_gbps": packing.throughput, "hash": packing.hash}, indent=1))
        return
    print(f"{topology.name}: {PROBLEMS[args.problem]}; {len(packing.trees)} trees, throughput "
          f"{packing.throughput:.3f} Gbit/s ({'exact' if packing.exact else f'gap {packing.gap:.2%} to {packing.bound_kind} bound'})")
    for tree in packing.trees:
        edges = " ".join(f"{u}>{v}" for u, v in tree.edges())
        print(f"  {tree.kind:<18} root {tree.root:<8} w {tree.weight:10.4f}  {edges}")
    if args.draw:
        print(f"  drawing written to {args.draw}")


def draw_packing(packing: ForestPacking, topology: Topology, path: str, limit: int = 16) -> None:
    """One panel per tree (the `limit` heaviest), nodes on a circle in topology order.

    Args:
        packing: the packing whose trees are drawn.
        topology: the topology it was planned on, for its nodes.
        path: the PNG file to write.
        limit: the most trees drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = sorted(packing.trees, key=lambda t: -t.weight)[:limit]
    nodes = topology.nodes
    position = {n: (math.cos(2 * math.pi * i / len(nodes)), math.sin(2 * math.pi * i / len(nodes)))
                for i, n in enumerate(nodes)}
    columns = min(4, len(trees))
    rows = math.ceil(len(trees) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 3.2 * rows), squeeze=False)
    for axis in axes.flat:
        axis.set_axis_off()
    for axis, tree in zip(axes.flat, trees):
        for u, v in tree.edges():
            axis.annotate("", xy=position[v], xytext=position[u],
                          arrowprops={"arrowstyle": "->", "color": "#4C72B0", "lw": 1.0})
        for n, (x, y) in position.items():
            colour = "#C44E52" if n == tree.root else ("#55A868" if n in packing.active else "#BBBBBB")
            axis.plot(x, y, "o", color=colour, markersize=5)
        axis.set_title(f"{tree.kind} @ {tree.root}\nw = {tree.weight:.3g}", fontsize=8)
        axis.set_xlim(-1.2, 1.2)
        axis.set_ylim(-1.2, 1.2)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
