"""The ranks' reports summarised per row: a block's time is its slowest rank's, a row's time the
median of its blocks; the predictions made again with the median of the job's cost fits; the
same-round pairings that auto's targets and the runtime's overhead are measured by."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from scipy.stats import binom

from benchmarks.netbed import RATE_PRESETS
from benchmarks.simulator_replay import replayed_prediction

from .rows import COMPUTE_ONLY, ROWS
from .workloads import EMULATED_MODELS, EMULATED_SIZE_SCALE, WORKLOADS


@dataclass(frozen=True)
class Setting:
    model: str
    world_size: int
    network: str  # a rate preset (1gbit, 10gbit), Gbit/s, or "topology <name>"
    time_scale: float = 1.0  # an emulated model's slow motion (--time-scale)

    @property
    def title(self) -> str:
        network = self.network
        if self.model in EMULATED_MODELS and not network.startswith("topology"):
            gbps = RATE_PRESETS.get(network) or float(network)
            full_size = gbps * self.time_scale / EMULATED_SIZE_SCALE
            network = (f"{gbps:g} Gbit/s (≙ {full_size:g} Gbit/s for the full-size model)" if self.time_scale == 1 else
                       f"{gbps:g} Gbit/s, times ×{self.time_scale:g} (≙ {full_size:g} Gbit/s for the full-size"
                       " model at the device's speed)")
        return f"{WORKLOADS[self.model].description}, {self.world_size} ranks, {network}"


@dataclass(frozen=True)
class RowResult:
    label: str
    seconds: float  # the median of `blocks`
    blocks: tuple[float, ...]  # per timed round, the slowest rank's time per iteration of its block
    comm: float | None  # non-overlapped communication
    predicted: float | None
    plan: str | None
    trials: list | None = None  # (planner, median seconds) of the plans `auto` timed
    trial_iterations: int | None = None  # the iterations auto's trials took before it settled
    trial_summary: str | None = None  # what the trials kept and why, each gain with its margin (TrialResult.summary)
    settled_after: int | None = None  # the steps before the timed rounds (auto: its follow-up rounds included)
    following: bool = False  # auto's follow-up rounds went on into the timed rounds
    replay: dict | None = None  # what its prediction was made from (benchmarks.simulator_replay)
    codec: float | None = None  # gradsync's encoding and decoding (IterationStats.codec_time)
    first_fit_predicted: float | None = None  # predicted with the cost the rows planned with alone
    replans: tuple[str, ...] = ()  # the re-plannings online during the timed rounds (Replan.summary)
    measuring_blocks: int = 0  # timed blocks during which auto was timing plans (trials, follow-ups)
    decisions: tuple[str, ...] = ()  # rank 0's gradsync log records in the row's steps (DecisionLog)
    calibration_seconds: tuple[float, ...] = ()  # rank 0's time of each step before the timed rounds

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else (self.predicted - self.seconds) / self.seconds

    @property
    def first_fit_error(self) -> float | None:
        return None if self.first_fit_predicted is None else (self.first_fit_predicted - self.seconds) / self.seconds

    @property
    def half_difference(self) -> float | None:
        """How far the measurement repeats within the run: the difference between the medians of
        the first and the second half of the blocks, relative to the row's time."""
        half = len(self.blocks) // 2
        if half == 0:
            return None
        first, second = statistics.median(self.blocks[:half]), statistics.median(self.blocks[half:])
        return abs(first - second) / self.seconds


def summarise(reports: list[dict]) -> dict[str, RowResult]:
    """Per row: the median over blocks of the slowest rank's block time; gradsync's communication
    wait and prediction as medians of the ranks' means; torch rows' communication is their time
    beyond the compute-only reference. A row that planned with the job's cost is predicted again
    with the median of the job's fits (`median_cost`), its prediction made during the run kept as
    `first_fit_predicted`."""
    labels = list(reports[0]["rows"])
    run_cost = median_cost(reports[0]["fits"]) if reports[0].get("fits") else None

    def over_ranks(label: str, key: str, combine) -> tuple[float, ...]:
        """Per block of the row (the overhead's pair has more than the others), over the ranks."""
        return tuple(combine(values) for values in zip(*(r["rows"][label][key] for r in reports), strict=True))

    def median_over_blocks(label: str, key: str, combine) -> float:
        return statistics.median(over_ranks(label, key, combine))

    compute = median_over_blocks(COMPUTE_ONLY, "seconds", max)
    results = {}
    for label in labels:
        row = reports[0]["rows"][label]
        slowest = over_ranks(label, "seconds", max)
        seconds = statistics.median(slowest)
        if row["comm_wait"]:
            comm, predicted = (median_over_blocks(label, "comm_wait", statistics.fmean),
                               median_over_blocks(label, "predicted", statistics.fmean))
        else:
            comm, predicted = (None if label == COMPUTE_ONLY else max(0.0, seconds - compute)), None
        codec = median_over_blocks(label, "codec", statistics.fmean) if row.get("codec") else None
        replay, first_fit = row.get("replay"), None
        if run_cost is not None and replay is not None and replay["cost"] == reports[0]["cost"]:
            replay = {**replay, "cost": run_cost}
            first_fit, predicted = predicted, replayed_prediction(replay)
        results[label] = RowResult(label, seconds, slowest, comm, predicted, row.get("plan"), row.get("trials"),
                                   row.get("trial_iterations"), row.get("trial_summary"), row.get("settled_after"),
                                   row.get("following", False), replay, codec, first_fit,
                                   tuple(row.get("replans", ())), row.get("measuring_blocks", 0),
                                   tuple(row.get("decisions", ())), tuple(row.get("calibration_seconds", ())))
    return results


def median_cost(fits: list[dict]) -> dict:
    """The per-field median of several fits of the cost model (as `CostModel.to_dict` writes them).

    What the host's cores lend to gloo drifts over a run: with 4 ranks at 1 Gbit/s (CNN), five fits
    in a row put the host time per op at 1.44-3.65 ms with wrap's probe, and at 2.14-3.69 ms with
    one taking 6 times as long (`benchmarks.interference --probe-fits 5 --host-probe-ops 96
    --host-probe-repeats 9`). A run's rows are timed across its whole length; their predictions
    take the median of fits before, midway through and after the timed rounds."""
    def middle(key: str):
        if isinstance(fits[0][key], str):
            return fits[0][key]
        if isinstance(fits[0][key], int):  # ops per channel: one of the counts fitted
            return statistics.median_low(fit[key] for fit in fits)
        return statistics.median(fit[key] for fit in fits)

    return {key: middle(key) for key in fits[0]}


def speedup(results: dict[str, RowResult], label: str, baseline: str = ROWS["ddp"].label) -> float | None:
    if baseline not in results or label not in results:
        return None
    return results[baseline].seconds / results[label].seconds


def paired_ratio(results: dict[str, RowResult], label: str, baseline: str = ROWS["ddp"].label) -> float:
    """The row's time relative to `baseline`'s: the median of the ratios of their blocks run back
    to back (`round_order`: they share the host's slow and fast phases, which the ratio of the two
    medians does not cancel)."""
    return statistics.median(row / base for row, base in zip(results[label].blocks, results[baseline].blocks, strict=True))


def round_times(row: RowResult, rounds: int) -> list[float]:
    """A row's time in each timed round: its block's, or the median of its blocks where it ran
    several a round (the overhead's pair)."""
    per_round, extra = divmod(len(row.blocks), rounds)
    if per_round < 1 or extra:
        raise ValueError(f"row {row.label!r}: {len(row.blocks)} blocks do not divide into {rounds} rounds")
    return [statistics.median(row.blocks[index * per_round:(index + 1) * per_round]) for index in range(rounds)]


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values` at `confidence` (the sign test's:
    the k-th smallest and largest value, k from the binomial(n, ½) quantile); None where too few
    values for one (fewer than 6 at 95%)."""
    ordered = sorted(values)
    below = int(binom.ppf((1 - confidence) / 2, len(ordered), 0.5))  # values left out at each end
    if below < 1:
        return None
    return ordered[below - 1], ordered[len(ordered) - below]


def held_out_best(results: dict[str, RowResult], label: str, fixed: list[str]) -> tuple[list[float], list[str]]:
    """The fastest fixed row's time over `label`'s, paired by round, the fastest chosen on the
    other half of the rounds (even rounds against odd, then the other way): the fastest of several
    rows on the rounds it is compared on is the one whose blocks ran fast by chance as much as by
    plan, so comparing with it there understates `label` by its luck (the winner's curse). Returns
    the ratios (the fastest's time / `label`'s, both halves pooled) and the row chosen on each half.
    """
    rounds = len(results[label].blocks)
    times = {name: round_times(results[name], rounds) for name in [label, *fixed]}
    halves = (range(0, rounds, 2), range(1, rounds, 2))
    ratios, chosen = [], []
    for choose_on, compare_on in (halves, halves[::-1]):
        best = min(fixed, key=lambda name: statistics.median(times[name][index] for index in choose_on))
        chosen.append(best)
        ratios += [times[best][index] / times[label][index] for index in compare_on]
    return ratios, chosen
