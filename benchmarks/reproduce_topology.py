"""Reproduce the forest-packing paper's Fig. 4–7 settings in gradsync's fluid model.

A 1.33 GB all-reduce (Sec. VI-A) on the Fig. 3 clusters: forest packing (problem (8), and (4) for
Fig. 7) against the best of the baselines (ring, NCCL double binary tree, sharded PS, Blink-like,
Plink-like). The paper reports 2.9×, 2.1×, 1.2× at 10/25/40 Gbit/s with all workers active, parity
at 100 Gbit/s, up to 18.3× with partial active sets, and up to 30% from overlap. Also times the
planning of 8 × 8 GPUs (target: under 10 s).

    python benchmarks/reproduce_topology.py [--out benchmarks/results/reproduce_topology.md] [--quick]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from gradsync.topology import BASELINES, active_from_spec, baseline_time, cluster, plan_forest

SIZE = 1.33e9
PAPER_ALL_ACTIVE = {10: "2.9×", 25: "2.1×", 40: "1.2×", 100: "1.0×"}


def compare(topology, spec: str, problem: str = "overlap") -> dict:
    active = active_from_spec(topology, spec)
    start = time.perf_counter()
    packing = plan_forest(topology, active, problem=problem)
    seconds = time.perf_counter() - start
    baselines = {name: baseline_time(name, topology, active, SIZE) for name in BASELINES}
    best = min(baselines, key=baselines.get)
    forest = packing.time(SIZE)
    return {"forest": forest, "best": best, "best_time": baselines[best], "ratio": baselines[best] / forest,
            "gap": packing.gap, "bound": packing.bound_kind, "plan_s": seconds, "trees": len(packing.trees)}


def fig4(shapes, speeds) -> list[str]:
    lines = ["## Fig. 4 — all workers active (PCIe machines; 8-GPU machines use the DGX-1 cube-mesh)", "",
             "| cluster | inter Gbit/s | forest ms | best baseline | baseline ms | speed-up | paper (mean over clusters) | gap to bound | trees | plan s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for machines, gpus in shapes:
        for inter in speeds:
            row = compare(cluster(machines, gpus, inter), "all")
            lines.append(f"| {machines}x{gpus} | {inter} | {row['forest'] * 1e3:.1f} | {row['best']} | "
                         f"{row['best_time'] * 1e3:.1f} | {row['ratio']:.2f}× | {PAPER_ALL_ACTIVE[inter]} | "
                         f"{row['gap']:.2%} ({row['bound']}) | {row['trees']} | {row['plan_s']:.2f} |")
    return lines


def partial(title: str, machines: int, gpus: int, intra: str, speeds, specs) -> list[str]:
    lines = [f"## {title}", "", "| active per machine | inter Gbit/s | forest ms | best baseline | baseline ms | "
             "speed-up | gap to bound | plan s |", "|---|---|---|---|---|---|---|---|"]
    for inter in speeds:
        for spec in specs:
            row = compare(cluster(machines, gpus, inter, intra), spec)
            lines.append(f"| ({spec}) | {inter} | {row['forest'] * 1e3:.1f} | {row['best']} | "
                         f"{row['best_time'] * 1e3:.1f} | {row['ratio']:.2f}× | {row['gap']:.2%} ({row['bound']}) | "
                         f"{row['plan_s']:.2f} |")
    return lines


def fig7(speeds, specs) -> list[str]:
    lines = ["## Fig. 7 — overlap (problem (8)) vs. separate stages (problem (4)), 4x4 PCIe", "",
             "| active per machine | inter Gbit/s | (4) ms | (8) ms | saving |", "|---|---|---|---|---|"]
    for inter in speeds:
        topology = cluster(4, 4, inter)
        for spec in specs:
            active = active_from_spec(topology, spec)
            separate = plan_forest(topology, active, problem="separate").time(SIZE)
            overlap = plan_forest(topology, active, problem="overlap").time(SIZE)
            lines.append(f"| ({spec}) | {inter} | {separate * 1e3:.1f} | {overlap * 1e3:.1f} | "
                         f"{1 - overlap / separate:.1%} |")
    return lines


def planning_speed() -> list[str]:
    topology = cluster(8, 8, 10.0)
    start = time.perf_counter()
    packing = plan_forest(topology)
    seconds = time.perf_counter() - start
    verdict = "under" if seconds < 10 else "OVER"
    return ["## Planning speed", "",
            f"8 machines × 8 GPUs, all active, 10 Gbit/s: {seconds:.2f} s ({verdict} the 10 s target), "
            f"{len(packing.trees)} trees, throughput {packing.throughput:.1f} Gbit/s, "
            f"gap {packing.gap:.2%} to the {packing.bound_kind} bound."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/reproduce_topology.md")
    parser.add_argument("--quick", action="store_true", help="small clusters only")
    args = parser.parse_args()
    speeds = (10, 25, 40, 100)
    shapes = ((2, 4), (4, 4)) if args.quick else ((2, 4), (4, 4), (8, 4), (2, 8), (4, 8), (8, 8))
    fig5_specs = ("1,1,1,1", "2,2,2,2", "1,2,3,4", "2,3,4,1", "4,4,1,1", "3,3,3,3")
    fig6_specs = ("2G,2G,2G,2G,2G,2G,2G,2G", "2G,3G,4H,6,2G,3G,4H,6", "4H,4H,4H,4H,4H,4H,4H,4H",
                  "6,6,6,6,2G,2G,2G,2G")
    sections = [planning_speed(), fig4(shapes, speeds),
                partial("Fig. 5 — partial active sets, 4x4 PCIe", 4, 4, "pcie", speeds, fig5_specs)]
    if not args.quick:
        sections.append(partial("Fig. 6 — partial active sets, 8x8 DGX-1 machines (NVLink), 100 Gbit/s", 8, 8,
                                "nvlink", (100,), fig6_specs))
    sections.append(fig7(speeds, ("1,1,1,1", "2,3,4,1", "4,4,4,4")))
    text = "\n\n".join("\n".join(section) for section in sections) + "\n"
    print(text)
    Path(args.out).write_text("# Forest packing: reproduction of Fig. 4–7 (1.33 GB all-reduce)\n\n" + text)


if __name__ == "__main__":
    main()
