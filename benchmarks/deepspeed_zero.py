"""DeepSpeed ZeRO-2 with gradsync's plans against DeepSpeed's own reduction, on the netbed.

2 ranks, each in its own network namespace behind a `tc`-shaped 1 Gbit/s link (benchmarks/netbed),
train the head-to-head's transformer (38 MB of fp32 gradients in 51 tensors; 2 sequences of 32
tokens per rank) with Adam under ZeRO stage 2, one CPU thread per rank. Rows:
- DeepSpeed's own ZeRO-2 with ``overlap_comm: true`` (its other settings as it ships them, one
  reduce bucket of 5e8 elements), and the same with 5e6-element buckets;
- gradsync's section in the same config: non-compressing planners (reduce-scatters of each
  rank's partition), and ``acp_sgd`` (rank 4) under ``auto``.
Each row runs as its own job (its own processes), so the growth of each rank's peak resident
memory from before the engine is built is the row's own. A gradsync row first trains until it
has measured its profile and network and chosen its plan; every row then warms up and times
`steps` steps after a barrier, the slowest rank's time. Rows run in rounds (every row once per
round); the table gives each row's median over the rounds and its median ratio to DeepSpeed's
own in the same round.

    .venv/bin/python -m benchmarks.deepspeed_zero [--rounds 2] [--steps 10]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.head_to_head.workloads import Transformer, tokens
from benchmarks.netbed import launch, netbed, uniform

OUT = Path(__file__).parent / "results" / "deepspeed_zero.md"
BATCH = 2
ADAM = {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}
DEEPSPEED = "deepspeed"
ROWS = {
    DEEPSPEED: {},
    "deepspeed, 5e6-element buckets": {"zero": {"reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}},
    **{f"gradsync {name}": {"gradsync": {"scheduler": name}} for name in ("wfbp", "mg_wfbp", "asc_wfbp", "us_byte",
                                                                           "auto")},
    "gradsync acp_sgd": {"gradsync": {"scheduler": "auto", "compressor": {"type": "acp_sgd", "rank": 4}}},
}
COMPRESSED = ("gradsync acp_sgd",)
GATHER = "gather probe"  # not a row: ZeRO's parameter all-gather alone, each way
MAX_SETTLING_STEPS = 120  # a gradsync row's steps to measure and choose its plan, at most


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def deepspeed_on_the_netbed():
    """DeepSpeed's communication on the netbed's process group (one rank per emulated machine)."""
    import deepspeed

    os.environ["LOCAL_RANK"] = "0"
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group
    return deepspeed


def rank_main(rank: int, world_size: int, row: str, steps: int, warmup: int) -> dict:
    """One row on this rank: seconds per step (the slowest rank's), peak memory growth (MB) and
    what gradsync chose."""
    import gradsync  # noqa: F401  (its entry in DeepSpeed's engine)

    deepspeed = deepspeed_on_the_netbed()
    before = peak_rss_mb()
    torch.manual_seed(0)
    model = Transformer()
    spec = ROWS[row]
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": ADAM, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 2, "overlap_comm": True, **spec.get("zero", {})},
              **({"gradsync": spec["gradsync"]} if "gradsync" in spec else {})}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(rank)

    def step() -> None:
        engine.backward(F.cross_entropy(engine(tokens(BATCH, generator)), torch.randint(0, 10, (BATCH,),
                                                                                       generator=generator)))
        engine.step()

    built = peak_rss_mb() - before
    settling = 0
    while "gradsync" in spec and engine.gradsync.report().measuring and settling < MAX_SETTLING_STEPS:
        step()
        settling += 1
    settled = peak_rss_mb() - before
    for _ in range(warmup):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    result = {"seconds": elapsed.item() / steps, "memory_mb": peak_rss_mb() - before, "settling_steps": settling,
              "memory_built_mb": built, "memory_settled_mb": settled}
    if "gradsync" in spec:
        report = engine.gradsync.report()
        timed = report.history[-steps:]
        result["comm_wait_ms"] = 1e3 * statistics.median(stats.comm_wait for stats in timed)
        result["codec_ms"] = 1e3 * statistics.median(stats.codec_time for stats in timed)
        result["plan"] = report.plan_summary()
        result["collectives"] = sorted({op.collective for op in engine.gradsync.plan.ops})
    engine.destroy()
    return result


def gather_probe(rank: int, world_size: int, repeats: int = 3) -> dict:
    """ZeRO's all-gather of the transformer's parameters (fp32, each rank's partition) alone, as
    DeepSpeed runs it and as gradsync's takeover does (``gradsync.deepspeed.gather``), alternated:
    the median milliseconds of each, the slowest rank's."""
    from deepspeed.runtime.utils import all_gather_dp_groups

    from gradsync.deepspeed.gather import gather_in_pieces

    deepspeed_on_the_netbed()
    size = -(-sum(p.numel() for p in Transformer().parameters()) // world_size)
    flat = torch.zeros(world_size * size)
    partitions = [list(flat.split(size))]
    group = dist.new_group(backend="gloo")
    times = {"deepspeed": [], "gradsync": []}
    for _ in range(repeats):
        for name, gather in (("deepspeed", all_gather_dp_groups), ("gradsync", gather_in_pieces)):
            dist.barrier()
            started = time.perf_counter()
            gather(groups_flat=[flat], partitioned_param_groups=partitions, dp_process_group=[group],
                   start_alignment_factor=2, allgather_bucket_size=5e8)
            times[name].append(time.perf_counter() - started)
    slowest = torch.tensor([statistics.median(times[name]) for name in times])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"partition_mb": size * 4 / 1e6, **{name: 1e3 * t for name, t in zip(times, slowest.tolist())}}


def table(rounds: list[dict[str, list[dict]]], args) -> list[str]:
    """The report: per row the medians over rounds, ratios within each round."""
    def median_of(row, value):
        return statistics.median(value(results[row]) for results in rounds)

    def seconds(reports):
        return reports[0]["seconds"]

    def memory(reports):
        return max(report["memory_mb"] for report in reports)

    lines = ["# DeepSpeed ZeRO-2: gradsync against DeepSpeed's own reduction", "",
             f"`.venv/bin/python -m benchmarks.deepspeed_zero --rounds {args.rounds} --steps {args.steps} "
             f"--warmup {args.warmup}`: 2 ranks in network namespaces at 1 Gbit/s (tc), real CPU computation "
             "(one thread per rank on 2 cores), the head-to-head's transformer (38 MB of fp32 gradients), "
             f"{BATCH} sequences of 32 tokens per rank, Adam, ZeRO stage 2. Each row is its own job; times are the "
             "slowest rank's per step, the median over rounds; ratios are DeepSpeed's own time over the row's in "
             "the same round (above 1: faster); memory is the larger rank's growth of peak resident memory "
             "from before the engine is built.", "",
             "| row | s/step | speed vs DeepSpeed | peak memory growth (MB) | memory vs DeepSpeed | plan |",
             "|---|---:|---:|---:|---:|---|"]
    for row in args.rows:
        speed = statistics.median(seconds(r[DEEPSPEED]) / seconds(r[row]) for r in rounds)
        relative_memory = statistics.median(memory(r[row]) / memory(r[DEEPSPEED]) for r in rounds)
        plan = rounds[-1][row][0].get("plan", "DeepSpeed's buckets")
        lines.append(f"| {row} | {median_of(row, seconds):.3f} | {speed:.2f}× | {median_of(row, memory):.0f} | "
                     f"{relative_memory:.2f} | {plan} |")
    def speed_of(row: str) -> float:
        return statistics.median(seconds(r[DEEPSPEED]) / seconds(r[row]) for r in rounds)

    lines += ["", "Targets:", ""]
    uncompressed = [row for row in args.rows if row.startswith("gradsync") and row not in COMPRESSED]
    if uncompressed:
        best = max(uncompressed, key=speed_of)
        lines.append(f"- best non-compressing plan ({best}) >= 1.05× DeepSpeed's own: {speed_of(best):.2f}× "
                     f"({'reached' if speed_of(best) >= 1.05 else 'not reached'});")
    if "gradsync acp_sgd" in args.rows:
        acp_speed = speed_of("gradsync acp_sgd")
        lines.append(f"- acp_sgd >= 2× DeepSpeed's own: {acp_speed:.2f}× "
                     f"({'reached' if acp_speed >= 2 else 'not reached'});")
    gradsync_rows = [row for row in args.rows if row.startswith("gradsync")]
    if gradsync_rows:
        worst_memory = max(statistics.median(memory(r[row]) / memory(r[DEEPSPEED]) for r in rounds)
                           for row in gradsync_rows)
        lines.append(f"- every gradsync row's peak memory within 10% of DeepSpeed's own: largest ratio "
                     f"{worst_memory:.2f} ({'reached' if worst_memory <= 1.10 else 'not reached'}).")
    from gradsync.deepspeed.gather import PIECE_BYTES, PIECES_IN_FLIGHT

    probes = [r[GATHER][0] for r in rounds]
    lines += ["", f"ZeRO's all-gather of the updated parameters alone ({probes[0]['partition_mb']:.0f} MB per rank, "
              "fp32; median over rounds): DeepSpeed's, one all-gather per group, "
              f"{statistics.median(p['deepspeed'] for p in probes):.0f} ms; gradsync's, in pieces of "
              f"{PIECE_BYTES // 2**20} MiB, {PIECES_IN_FLIGHT} in flight at a time, {statistics.median(p['gradsync'] for p in probes):.0f} ms. "
              "Every gradsync row's step gathers this way (over gloo)."]
    return lines + [""]


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--rounds", type=int, default=2)
    cli.add_argument("--steps", type=int, default=10, help="timed steps per row and round")
    cli.add_argument("--warmup", type=int, default=3, help="untimed steps before them (after gradsync settles)")
    cli.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    args = cli.parse_args()
    if DEEPSPEED not in args.rows:
        cli.error(f"the rows need {DEEPSPEED!r}, the baseline")
    environment = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    rounds = []
    with netbed(uniform(2, "1gbit")):
        for index in range(args.rounds):
            results = {GATHER: launch("benchmarks.deepspeed_zero:gather_probe", 2, timeout=600,
                                      environment=environment)}
            for row in args.rows:
                started = time.perf_counter()
                results[row] = launch("benchmarks.deepspeed_zero:rank_main", 2, row, args.steps, args.warmup,
                                      timeout=1200, environment=environment)
                print(f"round {index + 1}, {row}: {results[row][0]['seconds']:.3f} s/step, "
                      f"{max(r['memory_mb'] for r in results[row]):.0f} MB (built "
                      f"{max(r['memory_built_mb'] for r in results[row]):.0f}, measured "
                      f"{max(r['memory_settled_mb'] for r in results[row]):.0f})"
                      + (f", comm wait {results[row][0]['comm_wait_ms']:.0f} ms, codec {results[row][0]['codec_ms']:.0f} ms"
                         if "codec_ms" in results[row][0] else "")
                      + f" ({time.perf_counter() - started:.0f} s)", flush=True)
            rounds.append(results)
    lines = table(rounds, args)
    OUT.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
