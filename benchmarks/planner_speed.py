"""Planner and simulator speed: every planner on densenet201 (604 tensors) and us_byte on
bert_large with S_p = 4 MB, each under 1 s; one simulated iteration of 600 tensors under 50 ms.

Run: `make bench` (or `.venv/bin/python benchmarks/planner_speed.py`). Prints the measured
median of a few runs beside each target.
"""
from __future__ import annotations

import statistics
import time

import gradsync
from gradsync import CostModel, planners, simulate
from gradsync.profile import zoo


def median_seconds(call, repeats: int = 3) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    cost = CostModel.preset("asc-wfbp-10gbe")
    densenet = zoo("densenet201")
    bert = zoo("bert_large")
    rows = []
    for name in planners.names():
        rows.append((f"{name} on densenet201 ({densenet.num_tensors} tensors)",
                     median_seconds(lambda: planners.get(name)(densenet, cost)), 1.0))
    rows.append(("us_byte on bert_large (S_p = 4 MB)",
                 median_seconds(lambda: planners.get("us_byte")(bert, cost, partition_bytes=4_000_000)), 1.0))
    wfbp = planners.get("wfbp")(densenet, cost)
    rows.append((f"simulate wfbp on densenet201 ({len(wfbp.ops)} ops)",
                 median_seconds(lambda: simulate(wfbp, densenet, cost), repeats=10), 0.05))
    print(f"gradsync {gradsync.__version__}: planner and simulator speed (median seconds)")
    print(f"{'what':<52}{'seconds':>10}{'target':>9}{'':>6}")
    for what, seconds, target in rows:
        print(f"{what:<52}{seconds:>10.4f}{target:>9.3f}  {'ok' if seconds <= target else 'SLOW'}")


if __name__ == "__main__":
    main()
