"""Forest all-reduce against gloo's ring on an emulated heterogeneous cluster (topology issue).

The cluster: the paper's Fig. 3 layout at small scale, 2 machines × 2 GPUs, `--intra` Gbit/s
between GPUs of one machine and `--inter` Gbit/s between every pair of GPUs on different machines,
each rank in its own network namespace with per-pair `tc` limits (benchmarks/netbed). gloo's
all-reduce runs a ring over ranks 0→1→2→3, whose two machine-crossing hops bound it; the forest
spreads the inter-machine traffic over all four cross pairs. Runs alternate (ring, forest, ...)
after a barrier, warm-up excluded; the median of the slowest rank is compared with the packing's
predicted time and the simulator's ring baseline on the same topology.

Run (root): `.venv/bin/python benchmarks/forest_netbed.py [--size-mb 16] [--iterations 5]`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.forest_allreduce import interleaved_medians  # noqa: E402
from benchmarks.netbed import from_topology, launch, netbed  # noqa: E402
from gradsync.topology import ForestAllReduce, baseline_time, cluster  # noqa: E402

OUT = Path(__file__).parent / "results" / "forest_netbed.md"


def topology(intra: float, inter: float):
    return cluster(2, 2, inter_gbps=inter, intra_gbps=intra)


def rank_main(rank: int, world_size: int, intra: float, inter: float, size_mb: float, iterations: int,
              warmup: int, sub_chunk_bytes: int) -> dict:
    forest = ForestAllReduce(topology(intra, inter), sub_chunk_bytes=sub_chunk_bytes)
    medians = interleaved_medians({"ring": dist.all_reduce, "forest": forest.all_reduce}, size_mb, iterations, warmup)
    return medians, forest.predicted_time(int(size_mb * (1 << 20)) // 4 * 4), len(forest.packing.trees)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intra", type=float, default=1.0, help="Gbit/s inside a machine")
    parser.add_argument("--inter", type=float, default=0.1, help="Gbit/s between GPUs of different machines")
    parser.add_argument("--size-mb", type=float, default=16.0)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sub-chunk-kb", type=int, default=256)
    args = parser.parse_args()
    network = topology(args.intra, args.inter)
    nbytes = int(args.size_mb * (1 << 20)) // 4 * 4
    with netbed(from_topology(network)):
        measured, forest_prediction, trees = launch(
            "benchmarks.forest_netbed:rank_main", 4, args.intra, args.inter, args.size_mb, args.iterations,
            args.warmup, args.sub_chunk_kb << 10, timeout=1800)[0]
    predicted = {"ring": baseline_time("ring", network, None, nbytes), "forest": forest_prediction}
    lines = [
        "# Forest all-reduce on an emulated heterogeneous cluster", "",
        f"`.venv/bin/python benchmarks/forest_netbed.py --intra {args.intra:g} --inter {args.inter:g} "
        f"--size-mb {args.size_mb:g} --iterations {args.iterations} --sub-chunk-kb {args.sub_chunk_kb}`: "
        f"2 machines × 2 GPUs in network "
        f"namespaces, {args.intra:g} Gbit/s inside a machine, {args.inter:g} Gbit/s between GPUs of different "
        f"machines (per-pair tc limits), {args.size_mb:g} MB fp32, median of {args.iterations} interleaved runs "
        "(slowest rank).", "",
        "| scheme | measured s | predicted s | measured / predicted |", "|---|---|---|---|",
        *[f"| {name} | {measured[name]:.3f} | {predicted[name]:.3f} | {measured[name] / predicted[name]:.2f} |"
          for name in ("ring", "forest")], "",
        f"Forest speed-up over gloo's ring: measured **{measured['ring'] / measured['forest']:.2f}×**, "
        f"predicted {predicted['ring'] / predicted['forest']:.2f}× ({trees} trees; predictions: the simulator's "
        "ring baseline, and the packing's time with the pipeline fill of its sub-chunks).", ""]
    OUT.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
