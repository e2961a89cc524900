"""The project's targets, each with its measured value and verdict: auto against torch DDP and the
fastest fixed plan (paired by round), the best plan's speed-ups, the papers' gains on the emulated
models, the simulator's error and the runtime's overhead."""
from __future__ import annotations

import statistics

from .results import RowResult, Setting, held_out_best, median_interval, paired_ratio, round_times, speedup
from .rows import OVERHEAD_PAIRS, ROWS
from .workloads import EMULATED_MODELS


def paired_target(ratios: list[float], what: str, goal: float) -> str:
    """"0.98× the best fixed plan (95% interval 0.95–1.01) (target ≥ 0.97×): reached": the median of
    same-round ratios, the interval of that median, the verdict on the median."""
    value = statistics.median(ratios)
    interval = median_interval(ratios)
    spread = "" if interval is None else f" (95% interval {interval[0]:.3f}–{interval[1]:.3f})"
    return f"{value:.3f}× {what}{spread} (target ≥ {goal:g}×): {verdict(value, goal)}"


def verdict(value: float | None, goal: float, at_least: bool = True) -> str:
    if value is None:
        return "not measured in this run"
    reached = value >= goal if at_least else value <= goal
    return "reached" if reached else "NOT reached"


def speedup_target(value: float | None, baseline: str, goal: float) -> str:
    """"1.02× torch DDP (target ≥ 1.15×): NOT reached", or that it was not measured."""
    if value is None:
        return f"against {baseline}: not measured in this run"
    return f"{value:.2f}× {baseline} (target ≥ {goal:g}×): {verdict(value, goal)}"


def error_by_world_size(summaries: dict[Setting, dict[str, RowResult]]) -> str:
    """The simulator's median |error| per number of ranks, where the run had more than one (ranks
    beyond the host's cores share them, and with them the network's processing)."""
    errors: dict[int, list[float]] = {}
    for setting, results in summaries.items():
        errors.setdefault(setting.world_size, []).extend(abs(r.error) for r in results.values() if r.error is not None)
    errors = {size: values for size, values in sorted(errors.items()) if values}
    if len(errors) < 2:
        return ""
    return "; by ranks: " + ", ".join(f"{size} ranks {statistics.median(values):.1%} over {len(values)} rows"
                                      for size, values in errors.items())


AUTO_WITHIN = 0.03  # auto's target: within 3% of the best fixed planner


def best_plan_target(results: dict[str, RowResult], plan_rows: list[str], goal: float) -> str:
    """The fastest non-compressing gradsync plan against torch DDP, with its verdict."""
    ratios = {label: speedup(results, label) for label in plan_rows if label in results}
    ratios = {k: v for k, v in ratios.items() if v is not None}
    best = max(ratios, key=ratios.get) if ratios else None
    return "best non-compressing plan" + (f" ({best}) " if best else " ") + speedup_target(ratios.get(best),
                                                                                          "torch DDP", goal)


def emulated_targets(setting: Setting, results: dict[str, RowResult], plan_rows: list[str]) -> list[str]:
    """The emulated regime's targets: on the small-tensor model at 8 ranks, mg_wfbp ≥ 1.15× wfbp
    and the best plan ≥ 1.2× torch DDP; everywhere, the direction of the papers' gains (asc_wfbp
    over mg_wfbp, us_byte over bytescheduler)."""
    lines, label = [], f"- {setting.model}, {setting.world_size} ranks, {setting.network}: "
    if setting.model == "emulated_mobilenet_v2" and setting.world_size == 8:
        lines.append(label + "mg_wfbp " + speedup_target(speedup(results, ROWS["mg_wfbp"].label, ROWS["wfbp"].label),
                                                         "wfbp", 1.15) + "; " + best_plan_target(results, plan_rows, 1.2))
    gains = [(faster, slower) for faster, slower in (("asc_wfbp", "mg_wfbp"), ("us_byte", "bytescheduler"))
             if ROWS[faster].label in results and ROWS[slower].label in results]
    if gains:
        lines.append(label + "; ".join(
            f"{faster} {speedup(results, ROWS[faster].label, ROWS[slower].label):.2f}× {slower}"
            + (" (the same ops: the two rows differ by their measurement alone)"
               if same_ops(results[ROWS[faster].label], results[ROWS[slower].label]) else "")
            for faster, slower in gains) + " (the papers report gains: > 1×)")
    return lines


def same_ops(first: RowResult, second: RowResult) -> bool:
    """Whether two rows ran the same ops in every layout (their plans' planner names aside)."""
    if first.replay is None or second.replay is None:
        return False
    layouts = first.replay["layouts"]
    return layouts.keys() == second.replay["layouts"].keys() and all(
        layouts[name]["plan"]["ops"] == second.replay["layouts"][name]["plan"]["ops"] for name in layouts)


def auto_target(setting: Setting, results: dict[str, RowResult], plan_rows: list[str]) -> str | None:
    """auto against torch DDP (target ≥ 1×) and against the fastest fixed non-compressing plan of
    the setting (target: within 3%), each the median of same-round ratios with its interval, the
    fastest chosen on the other half of the rounds (``held_out_best``); then the ratio of the
    medians over all rounds, and the iterations its trials took; None without an auto row."""
    auto, ddp = ROWS["auto"].label, ROWS["ddp"].label
    if auto not in results:
        return None
    rounds = len(results[auto].blocks)
    line = f"- {setting.model}, {setting.world_size} ranks, {setting.network}: auto (→ {results[auto].plan}) "
    if ddp in results:
        ratios = [base / own for base, own in zip(round_times(results[ddp], rounds), results[auto].blocks)]
        line += paired_target(ratios, "torch DDP", 1.0) + f" (ratio of the medians {speedup(results, auto):.3f}×)"
    else:
        line += speedup_target(None, "torch DDP", 1.0)
    fixed = {label: results[label].seconds for label in plan_rows if label in results and label != auto}
    if fixed and rounds < 2:
        line += "; against the best fixed plan: not measured in this run (it is chosen on other rounds than one)"
    elif fixed:
        ratios, chosen = held_out_best(results, auto, list(fixed))
        best = min(fixed, key=fixed.get)
        line += ("; " + paired_target(ratios, "the best fixed plan", 1 - AUTO_WITHIN)
                 + f" (chosen on the other half of the rounds: {', '.join(dict.fromkeys(chosen))}; over all rounds "
                 f"the fastest row is {best}, {fixed[best] / results[auto].seconds:.3f}× by the ratio of the medians)")
        if same_ops(results[auto], results[best]):
            line += " (auto ran that row's plan, op for op: the two rows differ by their measurement alone)"
    if results[auto].trial_iterations is not None:
        settled = results[auto].settled_after
        if settled is not None:
            line += (f"; its follow-up rounds went on into the timed rounds after {settled} iterations"
                     if results[auto].following else f"; it settled after {settled} iterations")
        line += f"; its trials took {results[auto].trial_iterations} iterations"
    elif results[auto].settled_after is not None:
        line += f"; it settled after {results[auto].settled_after} iterations, without plan trials"
    if results[auto].trial_summary:
        line += f" ({results[auto].trial_summary})"
    if results[auto].measuring_blocks:
        line += (f"; it was timing plans (its trials started again, or follow-up rounds) during "
                 f"{results[auto].measuring_blocks} of its {rounds} timed blocks")
    return line


def targets(summaries: dict[Setting, dict[str, RowResult]]) -> list[str]:
    """The project's targets, each with its measured value and verdict."""
    lines = []
    plan_rows = [row.label for row in ROWS.values()
                 if row.is_gradsync and row.compressor is None and row.transport == "allreduce"]
    for setting, results in summaries.items():
        auto = auto_target(setting, results, plan_rows)
        if auto is not None:
            lines.append(auto)
        if setting.model == "cnn" and setting.network == "1gbit":
            lines.append(f"- CNN, {setting.world_size} ranks, 1 Gbit/s: " + best_plan_target(results, plan_rows, 1.15))
        if setting.model in EMULATED_MODELS:
            lines += emulated_targets(setting, results, plan_rows)
        replanned = [f"{label} {len(result.replans)}× (first at {result.replans[0]})"
                     for label, result in results.items() if result.replans]
        if replanned:
            lines.append(f"- {setting.model}, {setting.world_size} ranks, {setting.network}: re-planned online "
                         f"during the timed rounds (the cost watch): {'; '.join(replanned)}")
        if setting.model == "transformer" and setting.network == "1gbit":
            acp = ROWS["acp_sgd"].label
            lines.append(f"- transformer, {setting.world_size} ranks, 1 Gbit/s: acp_sgd "
                         + speedup_target(speedup(results, acp), "torch DDP", 3.0) + "; "
                         + speedup_target(speedup(results, acp, ROWS["ddp_powersgd"].label), "the PowerSGD hook", 1.3))
    predicted = [r for results in summaries.values() for r in results.values() if r.error is not None]
    median_error = statistics.median(abs(r.error) for r in predicted) if predicted else None
    repeats = [r.half_difference for r in predicted if r.half_difference is not None]
    repeatability = (f"; the measurement itself: a row's first and second half of blocks differ by "
                     f"{statistics.median(repeats):.1%} (median over the same rows)" if repeats else "")
    measured_error = "not measured" if median_error is None else f"{median_error:.1%}"
    first_fit = [abs(r.first_fit_error) for r in predicted if r.first_fit_error is not None]
    with_first_fit = (f"; with the first fit of each job's cost alone (what the rows planned with): "
                      f"{statistics.median(first_fit):.1%} over {len(first_fit)} rows" if first_fit else "")
    lines.append(f"- simulator error, median |error| over {len(predicted)} gradsync rows: {measured_error}"
                 f" (target ≤ 5%): {verdict(median_error, 0.05, at_least=False)}" + repeatability + with_first_fit
                 + error_by_world_size(summaries))
    overheads = [(setting, paired_ratio(results, ROWS["ddp_buckets"].label) - 1)
                 for setting, results in summaries.items()
                 if ROWS["ddp_buckets"].label in results and ROWS["ddp"].label in results]
    if overheads:
        median_overhead = statistics.median(o for _, o in overheads)
        detail = ", ".join(f"{s.model}/{s.world_size}/{s.network} {o:+.1%}" for s, o in overheads)
        lines.append(f"- runtime overhead (gradsync ddp_buckets vs torch DDP: same buckets, {OVERHEAD_PAIRS} blocks"
                     f" each per round, alternating; per setting the median of their back-to-back blocks' ratios),"
                     f" median over settings "
                     f"{median_overhead:+.1%} (target ≤ +2%): {verdict(median_overhead, 0.02, at_least=False)}; "
                     f"per setting: {detail}")
    return lines
