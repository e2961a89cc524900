"""Re-predict a head-to-head's gradsync rows with the simulator as it is now.

`python -m benchmarks.head_to_head` stores, beside its markdown, a JSON file with, per setting and
gradsync row, the row's measured median time, the prediction made during the run and what that
prediction was made from: the plan and wire profile of every layout, the codec's steady cycle of
rounds, the cost model, each rank's measured profile and the factor on the profile's times each
timed block was predicted with (gradsync.runtime.compute_speed). Replaying re-runs only the
simulator on them, so a change to the model can be judged on the same measurements (a new netbed run differs by
its own noise).

    .venv/bin/python -m benchmarks.simulator_replay [benchmarks/results/head_to_head.json]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import replace
from pathlib import Path

from gradsync.planning import LayoutPlan, at_compute_scale, predict_steady
from gradsync.cost import CostModel
from gradsync.plan import Plan
from gradsync.profile import ModelProfile
from gradsync.runtime.measure.layers import slowest_times

DEFAULT_RECORD = Path(__file__).parent / "results" / "head_to_head.json"
RANKS_IN_TITLE = re.compile(r", (\d+) ranks, ")  # a setting's title (benchmarks.head_to_head.Setting.title)


def replay_record(layout_plans: dict[str, LayoutPlan], cycle: list[tuple[str, ...]], cost: CostModel,
                  rank_profiles: list[ModelProfile] = (), compute_scales: list[list[float]] = ()) -> dict:
    """What a row's prediction is made from, as JSON-ready data: each layout's plan and wire
    profile, the rounds of the codec's steady cycle (a timed block covers whole cycles) and the
    cost model; with each rank's measured profile, which the wire profiles were combined from; with
    the compute scale of each timed block's iterations (`IterationStats.compute_scale`)."""
    return {"layouts": {layout: {"plan": entry.plan.to_dict(), "wire": entry.wire.to_dict(),
                                 "codec_seconds": list(entry.codec_seconds)}
                        for layout, entry in layout_plans.items()},
            "cycle": [list(rounds) for rounds in cycle], "cost": cost.to_dict(),
            "rank_profiles": [profile.to_dict() for profile in rank_profiles],
            "compute_scales": [list(block) for block in compute_scales]}


def replayed_prediction(record: dict) -> float:
    """The mean predicted step time over the stored cycle, simulated now: where the record keeps
    each rank's profile, with the layer times the runtime now combines from them (`slowest_times`);
    where it keeps compute scales, per timed block the mean over its iterations' scales, and then
    the median over the blocks (as the head-to-head takes the measured time's)."""
    cost = CostModel.from_dict(record["cost"])
    ranks = [ModelProfile.from_dict(data) for data in record.get("rank_profiles", [])]
    combined = slowest_times(ranks) if ranks else None
    layout_plans = {layout: LayoutPlan(Plan.from_dict(entry["plan"]),
                                       timed_as(ModelProfile.from_dict(entry["wire"]), combined),
                                       tuple(entry.get("codec_seconds", (0.0, 0.0))))  # measured: 0
                    for layout, entry in record["layouts"].items()}
    cycle = [tuple(rounds) for rounds in record["cycle"]]
    blocks = record.get("compute_scales") or [[1.0]]
    at_scale = {scale: predict_steady(at_compute_scale(layout_plans, scale), cycle, cost)
                for scale in {scale for block in blocks for scale in block}}
    return statistics.median(statistics.fmean(at_scale[scale] for scale in block) for block in blocks)


def timed_as(wire: ModelProfile, profile: ModelProfile | None) -> ModelProfile:
    """`wire` with the layer times of `profile` (a measured profile's wire profile has its layers'
    times: the codec's work is inside them); `wire` itself without one."""
    if profile is None:
        return wire
    times = {layer.name: layer for layer in profile.layers}
    layers = tuple(replace(layer, forward_time=times[layer.name].forward_time,
                           backward_time=times[layer.name].backward_time, update_time=times[layer.name].update_time)
                   for layer in wire.layers)
    return ModelProfile(wire.name, layers, dict(wire.metadata))


def replay(stored: dict, slowdowns: tuple[float, float] | None = None) -> list[tuple[str, str, float, float, float]]:
    """(setting, row, measured, stored prediction, prediction now) of every gradsync row; with
    `slowdowns` (σ, τ) in place of the fitted ones, e.g. (1, 1) for a computation that leaves the
    core to the transfers."""
    rows = []
    for setting, entries in stored.items():
        for label, row in entries.items():
            record = row.get("replay")
            if record is None:  # a torch row: measured only
                continue
            if slowdowns is not None:
                cost = {**record["cost"], "compute_slowdown": slowdowns[0], "transfer_slowdown": slowdowns[1]}
                record = {**record, "cost": cost}
            rows.append((setting, label, row["seconds"], row["predicted"], replayed_prediction(record)))
    return rows


def main(argv=None) -> None:
    cli = argparse.ArgumentParser(prog="python -m benchmarks.simulator_replay", description=__doc__.splitlines()[0])
    cli.add_argument("record", type=Path, nargs="?", default=DEFAULT_RECORD, help="a head-to-head JSON file")
    cli.add_argument("--slowdowns", type=float, nargs=2, metavar=("SIGMA", "TAU"),
                     help="predict with these slowdowns instead of the fitted ones")
    args = cli.parse_args(argv)
    rows = replay(json.loads(args.record.read_text()), args.slowdowns)
    if not rows:
        raise SystemExit(f"simulator_replay: no gradsync row to replay in {args.record}")
    print("| setting | row | measured ms | stored prediction (error) | prediction now (error) |")
    print("|---|---|---|---|---|")
    for setting, label, measured, stored, now in rows:
        print(f"| {setting} | {label} | {measured * 1e3:.1f} | {stored * 1e3:.1f} ({(stored - measured) / measured:+.1%})"
              f" | {now * 1e3:.1f} ({(now - measured) / measured:+.1%}) |")
    for name, column in (("stored", 3), ("now", 4)):
        errors = [abs(row[column] - row[2]) / row[2] for row in rows]
        by_ranks = errors_by_world_size(rows, column)
        detail = "".join(f"; {size} ranks {statistics.median(values):.1%} over {len(values)}"
                         for size, values in by_ranks.items()) if len(by_ranks) > 1 else ""
        print(f"median |error| {name}: {statistics.median(errors):.1%} over {len(errors)} rows" + detail)


def errors_by_world_size(rows: list[tuple[str, str, float, float, float]], column: int) -> dict[int, list[float]]:
    """|error| of the prediction in `column` (of `replay`'s rows), grouped by the setting's number of ranks."""
    groups: dict[int, list[float]] = {}
    for row in rows:
        match = RANKS_IN_TITLE.search(row[0])
        if match:
            groups.setdefault(int(match[1]), []).append(abs(row[column] - row[2]) / row[2])
    return dict(sorted(groups.items()))


if __name__ == "__main__":
    main()
