"""The head-to-head's summary: slowest-rank block times, medians, the paired overhead ratio, the
measurement's repeatability, predictions with the median of the job's cost fits and the stolen CPU
time."""
import collections
import dataclasses
import json
import math
import os
import random
import statistics

import pytest

from benchmarks.head_to_head.job import DecisionLog, Variant, balanced_order, round_order
from benchmarks.head_to_head.report import (cost_line, decision_lines, replay_file, setting_table, steal_note,
                                            stolen_cpu_seconds)
from benchmarks.head_to_head.results import (RowResult, Setting, held_out_best, median_cost, median_interval,
                                             paired_ratio, round_times, summarise)
from benchmarks.head_to_head.rows import COMPUTE_ONLY, ON_REQUEST_ROWS, OVERHEAD_PAIRS, ROWS, TOPOLOGY_ROWS
from benchmarks.head_to_head.targets import targets
from benchmarks.head_to_head.driver import default_rows
from benchmarks.simulator_replay import replay_record, replayed_prediction
from gradsync import compress, planners
from gradsync.planning import predict_cycle
from gradsync.cost import CostModel
from gradsync.profile import zoo
from gradsync.runtime.measure.trials import TrialResult, Verdict

DDP, BUCKETS = ROWS["ddp"].label, ROWS["ddp_buckets"].label


def rank_report(blocks: dict[str, list[float]]) -> dict:
    """One rank's report with torch-row entries (no communication wait or prediction)."""
    return {"rows": {label: {"seconds": seconds, "comm_wait": [], "predicted": []} for label, seconds in blocks.items()}}


def test_each_block_counts_its_slowest_rank_and_a_row_its_median_block():
    reports = [rank_report({COMPUTE_ONLY: [1.0, 1.0, 1.0], DDP: [2.0, 5.0, 3.0]}),
               rank_report({COMPUTE_ONLY: [1.0, 1.5, 1.0], DDP: [4.0, 1.0, 3.5]})]
    results = summarise(reports)
    assert results[DDP].blocks == (4.0, 5.0, 3.5) and results[DDP].seconds == 4.0
    assert results[DDP].comm == pytest.approx(4.0 - 1.0)  # beyond the compute-only median


def test_gradsync_rows_report_the_ranks_mean_wait_and_compression_time_median_over_blocks():
    acp = ROWS["acp_sgd"].label
    reports = [rank_report({COMPUTE_ONLY: [1.0] * 3, DDP: [3.0] * 3}), rank_report({COMPUTE_ONLY: [1.0] * 3, DDP: [3.0] * 3})]
    for report, codec in zip(reports, ([0.2, 0.4, 0.1], [0.4, 0.2, 0.3])):
        report["rows"][acp] = {"seconds": [1.5] * 3, "comm_wait": [0.1, 0.3, 0.2], "codec": codec,
                               "predicted": [1.4] * 3}
    results = summarise(reports)
    assert results[acp].codec == pytest.approx(0.3) and results[acp].comm == pytest.approx(0.2)
    assert results[DDP].codec is None
    table = setting_table(Setting("transformer", 2, "1gbit"), results)
    assert "compression ms" in table[0]
    assert table[-1] == f"| {acp} | 1500.0 | 2.00× | 200.0 | 300.0 | 1400.0 | -6.7% |"
    assert table[3].startswith(f"| {DDP} | 3000.0 | 1.00× | 2000.0 | — |")


def test_rows_keep_their_own_block_counts():
    reports = [rank_report({COMPUTE_ONLY: [1.0, 1.0], DDP: [2.0, 5.0, 3.0, 2.5]}),
               rank_report({COMPUTE_ONLY: [1.0, 3.0], DDP: [4.0, 1.0, 3.5, 2.0]})]
    results = summarise(reports)
    assert results[COMPUTE_ONLY].blocks == (1.0, 3.0) and results[DDP].blocks == (4.0, 5.0, 3.5, 2.5)


def test_the_overhead_is_the_median_of_same_round_ratios():
    # a slow phase of the host (round 2) hits both rows of the round, a fast one (round 4) only
    # torch DDP's block: the ratio of the two rows' medians calls that +5%, the same-round ratios +1%
    ddp = [4.0, 8.0, 4.4, 3.0]
    buckets = [4.04, 8.08, 4.444, 4.4]
    results = summarise([rank_report({COMPUTE_ONLY: [1.0] * 4, DDP: ddp, BUCKETS: buckets})])
    assert results[BUCKETS].seconds / results[DDP].seconds == pytest.approx(4.422 / 4.2)
    assert paired_ratio(results, BUCKETS) == pytest.approx(1.01)
    [line] = [line for line in targets({Setting("cnn", 2, "10gbit"): results}) if "overhead" in line]
    assert "+1.0%" in line and "NOT" not in line


def test_an_overhead_above_two_percent_is_not_reached():
    results = summarise([rank_report({COMPUTE_ONLY: [1.0] * 3, DDP: [1.0, 2.0, 3.0], BUCKETS: [1.03, 2.06, 3.09]})])
    [line] = [line for line in targets({Setting("cnn", 2, "10gbit"): results}) if "overhead" in line]
    assert "+3.0%" in line and "NOT reached" in line


def test_rows_with_different_round_counts_are_not_paired():
    results = summarise([rank_report({COMPUTE_ONLY: [1.0] * 3, DDP: [1.0] * 3, BUCKETS: [1.0] * 3})])
    shorter = {**results, BUCKETS: RowResult(BUCKETS, 1.0, (1.0, 1.0), None, None, None)}
    with pytest.raises(ValueError):
        paired_ratio(shorter, BUCKETS)


def test_gradsync_ddp_buckets_runs_right_after_torch_ddp():
    assert list(ROWS)[:2] == ["ddp", "ddp_buckets"]


def test_a_round_alternates_the_overhead_pair_and_runs_every_other_row_once():
    labels = [COMPUTE_ONLY, DDP, "gradsync wfbp", BUCKETS, "gradsync acp_sgd"]
    assert round_order(labels, repeats=3) == [COMPUTE_ONLY, DDP, BUCKETS, DDP, BUCKETS, DDP, BUCKETS,
                                              "gradsync acp_sgd", "gradsync wfbp"]
    assert round_order(labels).count(DDP) == OVERHEAD_PAIRS > 1
    assert round_order([COMPUTE_ONLY, DDP, "gradsync wfbp"]) == [COMPUTE_ONLY, DDP, "gradsync wfbp"]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 7])
def test_over_a_cycle_of_rounds_every_row_runs_right_after_every_other_equally_often(count):
    cycle = count if count % 2 == 0 else 2 * count
    orders = [balanced_order(count, k) for k in range(cycle)]
    assert all(sorted(order) == list(range(count)) for order in orders)
    follows = collections.Counter((order[index - 1], order[index]) for order in orders for index in range(1, count))
    assert set(follows) == {(a, b) for a in range(count) for b in range(count) if a != b}
    assert set(follows.values()) <= {cycle // count}
    assert balanced_order(count, cycle + 1) == orders[1 % cycle]


def test_the_overhead_pair_moves_as_one_unit_between_rounds():
    labels = [COMPUTE_ONLY, DDP, BUCKETS, "gradsync wfbp"]
    orders = [round_order(labels, k, repeats=2) for k in range(3)]
    for order in orders:
        start = order.index(DDP)
        assert order[start:start + 4] == [DDP, BUCKETS, DDP, BUCKETS] and len(order) == 6
    assert len({tuple(order) for order in orders}) == 3


def test_the_simulator_error_is_reported_beside_the_measurements_own_repeatability():
    steady = RowResult("gradsync wfbp", 2.0, (2.0, 2.0, 2.0, 2.0), None, 2.2, None)
    phased = RowResult("gradsync mg_wfbp", 1.5, (1.0, 1.0, 2.0, 2.0), None, 1.5, None)  # a slow second half
    assert steady.half_difference == 0.0 and phased.half_difference == pytest.approx(1.0 / 1.5)
    assert RowResult("gradsync wfbp", 2.0, (2.0,), None, 2.0, None).half_difference is None
    results = {COMPUTE_ONLY: RowResult(COMPUTE_ONLY, 1.0, (1.0,) * 4, None, None, None),
               steady.label: steady, phased.label: phased}
    [line] = [line for line in targets({Setting("cnn", 2, "10gbit"): results}) if "simulator" in line]
    assert "median |error| over 2 gradsync rows: 5.0%" in line and "differ by 33.3%" in line


def test_the_simulator_error_is_also_given_per_number_of_ranks():
    def results(*errors: float) -> dict[str, RowResult]:
        return {f"gradsync row {i}": RowResult(f"gradsync row {i}", 1.0, (1.0,) * 4, None, 1.0 + error, None)
                for i, error in enumerate(errors)}

    summaries = {Setting("cnn", 2, "1gbit"): results(0.01, -0.03, 0.02), Setting("cnn", 4, "1gbit"): results(0.10, -0.06),
                 Setting("transformer", 4, "1gbit"): results(-0.08)}
    [line] = [line for line in targets(summaries) if "simulator" in line]
    assert "over 6 gradsync rows: 4.5%" in line
    assert line.endswith("; by ranks: 2 ranks 2.0% over 3 rows, 4 ranks 8.0% over 3 rows")
    [line] = [line for line in targets({Setting("cnn", 2, "1gbit"): results(0.01)}) if "simulator" in line]
    assert "by ranks" not in line


def test_stolen_cpu_time_is_read_from_the_steal_column(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text("cpu  7202930 471 1411317 4285856 45943 0 189073 28632 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert stolen_cpu_seconds(stat) == 28632 / os.sysconf("SC_CLK_TCK")
    stat.write_text("intr 1 2 3\n")
    assert stolen_cpu_seconds(stat) is None and stolen_cpu_seconds(tmp_path / "missing") is None
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert steal_note(10.0, 13.0, 100.0) == (" The hypervisor took 3.0 s of CPU time from the machine during the run"
                                             " (1.5% of its cores' time).")
    assert steal_note(None, 13.0, 100.0) == ""


def test_a_target_whose_rows_did_not_run_is_reported_as_not_measured():
    acp, hook = ROWS["acp_sgd"].label, ROWS["ddp_powersgd"].label
    results = summarise([rank_report({COMPUTE_ONLY: [1.0] * 3, DDP: [3.3] * 3, acp: [1.0] * 3})])
    [line] = targets({Setting("transformer", 2, "1gbit"): results})[:1]
    assert "acp_sgd 3.30× torch DDP (target ≥ 3×): reached" in line
    assert "against the PowerSGD hook: not measured in this run" in line and "0.00×" not in line
    with_hook = summarise([rank_report({COMPUTE_ONLY: [1.0] * 3, DDP: [3.3] * 3, acp: [1.0] * 3, hook: [1.2] * 3})])
    [line] = targets({Setting("transformer", 2, "1gbit"): with_hook})[:1]
    assert "1.20× the PowerSGD hook (target ≥ 1.3×): NOT reached" in line
    [cnn_line, simulator_line] = targets({Setting("cnn", 2, "1gbit"): results})
    assert "best non-compressing plan against torch DDP: not measured in this run" in cnn_line
    assert "over 0 gradsync rows: not measured (target ≤ 5%): not measured in this run" in simulator_line


def test_the_best_non_compressing_plan_counts_every_uncompressed_gradsync_row_that_ran():
    overlap, acp = ROWS["mg_wfbp_overlap"].label, ROWS["acp_sgd"].label
    results = summarise([rank_report({COMPUTE_ONLY: [1.0] * 3, DDP: [1.2] * 3, BUCKETS: [1.1] * 3,
                                      overlap: [1.0] * 3, acp: [0.5] * 3})])
    [line, _, _] = targets({Setting("cnn", 2, "1gbit"): results})
    assert f"best non-compressing plan ({overlap}) 1.20× torch DDP" in line and "reached" in line
    assert ROWS["mg_wfbp_overlap"].options == {"overlap_forward": True}


def test_the_targets_name_the_rows_that_re_planned_during_the_timed_rounds():
    auto = ROWS["auto"].label
    report = rank_report({COMPUTE_ONLY: [0.5] * 3, DDP: [1.2] * 3, BUCKETS: [1.2] * 3, auto: [1.1] * 3})
    setting = Setting("transformer", 2, "10gbit")
    assert not any("re-planned" in line for line in targets({setting: summarise([report])}))
    report["rows"][auto]["replans"] = ["iteration 2301: the communication took 1.62x its reference time; ...",
                                       "iteration 2410: the communication took 0.58x its reference time; ..."]
    replanned = [line for line in targets({setting: summarise([report])}) if "re-planned" in line]
    assert replanned == ["- transformer, 2 ranks, 10gbit: re-planned online during the timed rounds (the cost watch): "
                         f"{auto} 2× (first at iteration 2301: the communication took 1.62x its reference time; ...)"]


def test_gradsync_s_log_records_are_kept_by_the_row_stepping_and_listed_under_its_table():
    import logging

    log = logging.getLogger("gradsync.test_head_to_head")
    handler = DecisionLog()
    log.addHandler(handler)
    try:
        rows = [Variant(label, None, None, gradsync=True) for label in ("a", "b")]
        log.warning("before any row steps")  # kept by none
        for row, steps in zip(rows, (3, 7)):
            handler.row, row.steps = row, steps
            log.warning("gradsync auto: kept %s", row.label)
    finally:
        log.removeHandler(handler)
    assert [row.decisions for row in rows] == [["step 3: gradsync auto: kept a"], ["step 7: gradsync auto: kept b"]]
    auto = ROWS["auto"].label
    report = rank_report({COMPUTE_ONLY: [0.5] * 3, DDP: [1.2] * 3, auto: [1.1] * 3})
    report["rows"][auto].update(decisions=rows[0].decisions, settled_after=700)
    assert decision_lines(summarise([report])) == [
        f"{auto}, its decisions (rank 0's log; by the row's step, of 700 before the timed rounds):", "",
        "- step 3: gradsync auto: kept a", ""]


def test_auto_s_target_says_in_how_many_timed_blocks_it_was_timing_plans():
    auto = ROWS["auto"].label
    report = rank_report({COMPUTE_ONLY: [0.5] * 4, DDP: [1.2] * 4, auto: [1.1] * 4})
    setting = Setting("transformer", 2, "10gbit")
    [line, *_] = targets({setting: summarise([report])})
    assert "timing plans" not in line
    report["rows"][auto]["measuring_blocks"] = 3
    [line, *_] = targets({setting: summarise([report])})
    assert line.endswith("; it was timing plans (its trials started again, or follow-up rounds) during 3 of its 4 "
                         "timed blocks")


def test_auto_is_judged_against_torch_ddp_and_the_best_fixed_plan():
    auto, mg_wfbp, wfbp = ROWS["auto"].label, ROWS["mg_wfbp"].label, ROWS["wfbp"].label
    report = rank_report({COMPUTE_ONLY: [0.5] * 3, DDP: [1.2] * 3, wfbp: [1.3] * 3, mg_wfbp: [1.0] * 3,
                          auto: [1.02] * 3})
    report["rows"][auto].update(plan="mg_wfbp", trials=[["ddp", 1.2], ["mg_wfbp", 1.0]], trial_iterations=49)
    [line, *_] = targets({Setting("transformer", 2, "10gbit"): summarise([report])})
    assert line.startswith("- transformer, 2 ranks, 10gbit: auto (→ mg_wfbp) 1.176× torch DDP (target ≥ 1×): reached "
                           "(ratio of the medians 1.176×)")
    assert ("0.980× the best fixed plan (target ≥ 0.97×): reached (chosen on the other half of the rounds: "
            "gradsync mg_wfbp; over all rounds the fastest row is gradsync mg_wfbp, 0.980× by the ratio of the medians)"
            in line)
    assert line.endswith("its trials took 49 iterations") and "op for op" not in line
    report["rows"][auto]["settled_after"] = 700  # its follow-up rounds included
    [line, *_] = targets({Setting("transformer", 2, "10gbit"): summarise([report])})
    assert line.endswith("; it settled after 700 iterations; its trials took 49 iterations")
    report["rows"][auto]["following"] = True  # the follow-up step budget spent first
    [line, *_] = targets({Setting("transformer", 2, "10gbit"): summarise([report])})
    assert line.endswith("; its follow-up rounds went on into the timed rounds after 700 iterations; "
                         "its trials took 49 iterations")
    report["rows"][auto].update(trial_iterations=None, following=False)  # no plan worth timing: no trials
    [line, *_] = targets({Setting("transformer", 2, "10gbit"): summarise([report])})
    assert line.endswith("; it settled after 700 iterations, without plan trials")
    report["rows"][auto]["trial_iterations"] = 49
    del report["rows"][auto]["settled_after"], report["rows"][auto]["following"]
    # the trials' own verdict, each gain with its margin, follows where the rank reported it
    verdict = TrialResult(("ddp", "mg_wfbp"), (0.012, 0.0118), (0.011, 0.0105),
                          Verdict(0, False, (0.0, 0.017), (0.0, 0.024), 16, (1,)), 129)
    report["rows"][auto]["trial_summary"] = verdict.summary()
    [line, *_] = targets({Setting("transformer", 2, "10gbit"): summarise([report])})
    assert line.endswith("its trials took 49 iterations (kept ddp: the trial budget ran out before any other plan "
                         "was found faster with confidence; the undecided ones are timed again every 64 iterations "
                         "(16 rounds, 129 iterations; speed-up over ddp: mg_wfbp +1.7% ± 2.4%); the simulator "
                         "predicts them within 4.8% of each other)")
    del report["rows"][auto]["trial_summary"]
    # auto running the best row's own ops: the report says their gap is the measurement's
    for label, ops in ((auto, [{"slices": [["w", 0, 8]]}]), (mg_wfbp, [{"slices": [["w", 0, 8]]}])):
        report["rows"][label]["replay"] = {"layouts": {"plain": {"plan": {"planner": label, "ops": ops}}}}
    [line, *_] = targets({Setting("transformer", 2, "10gbit"): summarise([report])})
    assert "(auto ran that row's plan, op for op: the two rows differ by their measurement alone)" in line
    report["rows"][auto]["replay"]["layouts"]["plain"]["plan"]["ops"] = [{"slices": [["w", 0, 4]]}]
    [line, *_] = targets({Setting("transformer", 2, "10gbit"): summarise([report])})
    assert "op for op" not in line
    slower = rank_report({COMPUTE_ONLY: [0.5] * 3, DDP: [1.0] * 3, mg_wfbp: [0.9] * 3, auto: [1.05] * 3})
    [line, *_] = targets({Setting("cnn", 2, "10gbit"): summarise([slower])})
    assert "0.952× torch DDP (target ≥ 1×): NOT reached" in line and "0.857× the best fixed plan" in line
    assert "NOT reached" in line.split("best fixed plan")[1]


def test_auto_s_targets_pair_the_blocks_of_a_round_with_the_medians_interval():
    auto, mg_wfbp = ROWS["auto"].label, ROWS["mg_wfbp"].label
    # the host runs slow in five rounds of eight; auto is 2% slower than mg_wfbp in every round but the
    # last, where it ran fast while mg_wfbp ran slow: the ratio of the medians says auto 18% faster
    slow = [1, 0, 1, 0, 1, 0, 1, 1]
    mg = [1.5 if s else 1.0 for s in slow]
    own = [value * 1.02 for value in mg]
    own[-1] = 1.02
    ddp_blocks = [value * 1.1 for value in mg for _ in range(OVERHEAD_PAIRS)]  # the overhead's pair: several a round
    report = rank_report({COMPUTE_ONLY: [0.5] * 8, DDP: ddp_blocks, mg_wfbp: mg, auto: own})
    [line, *_] = targets({Setting("cnn", 2, "1gbit"): summarise([report])})
    assert "auto (→ None) 1.078× torch DDP (95% interval 1.078–1.618) (target ≥ 1×): reached" in line
    assert "0.980× the best fixed plan (95% interval 0.980–1.471) (target ≥ 0.97×): reached" in line
    assert "the fastest row is gradsync mg_wfbp, 1.176× by the ratio of the medians" in line
    one_round = rank_report({COMPUTE_ONLY: [0.5], DDP: [1.1] * OVERHEAD_PAIRS, mg_wfbp: [1.0], auto: [1.02]})
    [line, *_] = targets({Setting("cnn", 2, "1gbit"): summarise([one_round])})
    assert "; against the best fixed plan: not measured in this run" in line
    without_ddp = rank_report({COMPUTE_ONLY: [0.5] * 2, mg_wfbp: [1.0] * 2, auto: [1.02] * 2})
    [line, *_] = targets({Setting("cnn", 2, "1gbit"): summarise([without_ddp])})
    assert "auto (→ None) against torch DDP: not measured in this run; 0.980× the best fixed plan" in line


def test_the_medians_interval_is_the_narrowest_sign_test_interval_at_95_percent():
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) is None  # five values: even (min, max) covers 93.8%
    assert median_interval(list(range(6, 0, -1))) == (1, 6)  # 96.9%
    for n in range(6, 60):
        low, high = median_interval(list(range(1, n + 1)))
        assert high == n + 1 - low  # symmetric
        outside = sum(math.comb(n, k) for k in range(low)) / 2 ** n  # P(fewer than `low` values below the median)
        assert 1 - 2 * outside >= 0.95  # it covers the median at 95%
        closer = outside + math.comb(n, low) / 2 ** n
        assert 1 - 2 * closer < 0.95  # one value further in would not
    assert median_interval(list(range(1, 25))) == (7, 18)


def test_a_row_s_rounds_take_the_median_of_its_blocks_where_it_ran_several():
    row = RowResult(DDP, 1.0, (1.0, 3.0, 2.0, 9.0, 8.0, 7.0), None, None, None)
    assert round_times(row, 2) == [2.0, 8.0] and round_times(row, 6) == list(row.blocks)
    with pytest.raises(ValueError, match="do not divide"):
        round_times(row, 4)


def test_the_best_fixed_plan_is_chosen_on_the_other_half_of_the_rounds():
    auto, mg_wfbp, wfbp = ROWS["auto"].label, ROWS["mg_wfbp"].label, ROWS["wfbp"].label
    rows = {auto: [1.0] * 4, mg_wfbp: [0.8, 1.0, 0.8, 1.0], wfbp: [1.0, 0.9, 1.0, 0.9]}
    results = {label: RowResult(label, 1.0, tuple(blocks), None, None, None) for label, blocks in rows.items()}
    ratios, chosen = held_out_best(results, auto, [mg_wfbp, wfbp])
    # mg_wfbp is fastest on the even rounds, so compared on the odd ones (1.0), and wfbp the other way (1.0)
    assert chosen == [mg_wfbp, wfbp] and ratios == [1.0, 1.0, 1.0, 1.0]


def test_choosing_the_best_fixed_plan_on_other_rounds_removes_the_winners_curse():
    """Seven rows of the same true time, 10% noise per block: the fastest of the six fixed rows,
    taken on the rounds it is compared on, looks faster than auto; held out it does not."""
    generator = random.Random(7)
    naive, held_out = [], []
    labels = [f"fixed {index}" for index in range(6)]
    for _ in range(300):
        results = {label: RowResult(label, 0.0, tuple(generator.lognormvariate(0, 0.1) for _ in range(12)),
                                    None, None, None) for label in ["auto", *labels]}
        medians = {label: statistics.median(row.blocks) for label, row in results.items()}
        naive.append(min(medians[label] for label in labels) / medians["auto"])
        held_out.append(statistics.median(held_out_best(results, "auto", labels)[0]))
    assert statistics.fmean(naive) < 0.96  # auto judged 4% slower than plans no faster than it
    assert abs(statistics.fmean(held_out) - 1) < 0.01


def test_the_stored_record_keeps_every_rows_blocks_for_pairing_them_again():
    auto = ROWS["auto"].label
    report = rank_report({COMPUTE_ONLY: [0.5, 0.6], DDP: [1.0, 1.2, 1.1, 1.3], auto: [0.9, 1.1]})
    stored = json.loads(json.dumps(replay_file({Setting("cnn", 2, "1gbit"): summarise([report])})))
    [rows] = stored.values()
    assert rows[DDP] == {"seconds": 1.15, "blocks": [1.0, 1.2, 1.1, 1.3], "predicted": None, "replay": None,
                         "calibration_seconds": []}
    assert rows[auto]["blocks"] == [0.9, 1.1] and rows[COMPUTE_ONLY]["blocks"] == [0.5, 0.6]


def test_emulated_runs_time_longer_blocks_unless_told():
    from benchmarks.head_to_head.driver import parser, with_defaults
    from benchmarks.head_to_head.job import BLOCK, EMULATED_BLOCK

    def block(*argv):
        return with_defaults(parser().parse_args(list(argv))).block

    assert (block(), block("--emulated"), block("--emulated", "--block", "3")) == (BLOCK, EMULATED_BLOCK, 3)
    assert EMULATED_BLOCK > BLOCK


def test_emulated_runs_leave_auto_s_follow_ups_to_the_timed_rounds_unless_told():
    from benchmarks.head_to_head.driver import EMULATED_FOLLOW_UP_STEPS, FOLLOW_UP_STEPS, parser, with_defaults

    def steps(*argv):
        return with_defaults(parser().parse_args(list(argv))).follow_up_steps

    assert (steps(), steps("--emulated"), steps("--emulated", "--follow-up-steps", "500")) == (
        FOLLOW_UP_STEPS, EMULATED_FOLLOW_UP_STEPS, 500)
    assert EMULATED_FOLLOW_UP_STEPS < FOLLOW_UP_STEPS


def test_on_request_rows_run_only_when_named_and_topology_rows_only_on_a_topology():
    assert set(default_rows(topology=True)) == set(ROWS) - set(ON_REQUEST_ROWS)
    assert set(default_rows(topology=False)) == set(ROWS) - set(ON_REQUEST_ROWS) - set(TOPOLOGY_ROWS)


def fit(host: float, sigma: float, a: float = 1e-3, ops: int = 2) -> dict:
    return CostModel(a=a, b=8e-9, gamma=1.5, host=host, compute_slowdown=sigma, transfer_slowdown=1.1,
                     ops_per_channel=ops).to_dict()


def test_the_median_cost_takes_each_field_apart():
    fits = [fit(1e-3, 1.2, a=3e-3), fit(4e-3, 1.9, a=1e-3), fit(2e-3, 1.5, a=2e-3)]
    assert median_cost(fits) == fit(2e-3, 1.5, a=2e-3)
    line = cost_line(fits, 2)
    assert "host time per op 2.00 ms" in line and "σ = 1.50" in line and "a = 2.00 ms" in line
    assert "2 op(s) at once per channel" in line
    # a count stays one of the counts fitted, also from an even number of fits
    assert median_cost([fit(1e-3, 1.2, ops=1), fit(1e-3, 1.2, ops=2)])["ops_per_channel"] == 1
    assert "median of 3 fits" in line and "host ms 1.00–4.00, σ 1.20–1.90, τ 1.10–1.10" in line


def test_rows_planned_with_the_jobs_cost_are_predicted_with_the_median_of_its_fits():
    first, fits = fit(1e-3, 1.2), [fit(1e-3, 1.2), fit(5e-3, 2.0), fit(3e-3, 1.6)]
    profile = zoo("resnet50")
    codec = compress.build(None)
    codec.setup({t.name: t for layer in profile.layers for t in layer.tensors}, 2, seed=0)
    plans, at_first_fit = predict_cycle(profile, CostModel.from_dict(first), planners.bind("wfbp"), codec)
    record = json.loads(json.dumps(replay_record(plans, codec.steady_rounds(), CostModel.from_dict(first))))
    wfbp, forest = ROWS["wfbp"].label, "gradsync forest"
    report = rank_report({COMPUTE_ONLY: [1.0] * 3, DDP: [3.0] * 3})
    own_cost = {**record, "cost": fit(2e-3, 1.0)}  # a row that fitted its own cost (forest)
    for label, replay in ((wfbp, record), (forest, own_cost)):
        report["rows"][label] = {"seconds": [0.5] * 3, "comm_wait": [0.01] * 3, "predicted": [at_first_fit] * 3,
                                 "replay": replay}
    results = summarise([{**report, "cost": first, "fits": fits}])
    expected = replayed_prediction({**record, "cost": median_cost(fits)})
    assert results[wfbp].predicted == pytest.approx(expected) and expected > at_first_fit * 1.02
    assert results[wfbp].first_fit_predicted == pytest.approx(at_first_fit)
    assert results[wfbp].replay["cost"] == median_cost(fits)  # the stored record replays to the prediction
    assert results[forest].predicted == pytest.approx(at_first_fit) and results[forest].first_fit_predicted is None
    [line] = [line for line in targets({Setting("cnn", 2, "1gbit"): results}) if "simulator" in line]
    first_fit_error = abs(at_first_fit - 0.5) / 0.5
    assert f"with the first fit of each job's cost alone (what the rows planned with): {first_fit_error:.1%} over 1 rows" in line


def test_an_emulated_workload_takes_its_profiles_time_without_a_core_and_trains_every_tensor():
    """--emulated: the zoo's ResNet-50 on an emulated V100 (tensors scaled), its loss and batch;
    one step waits the profile's forward and backward times, mostly off the core, and writes a
    gradient into every parameter."""
    import time

    import torch

    from benchmarks.head_to_head.workloads import EMULATED_DEVICE, EMULATED_SIZE_SCALE, WORKLOADS

    workload = WORKLOADS["emulated_resnet50"]
    model = workload.build_model()
    profile = zoo("resnet50", device=EMULATED_DEVICE)
    parameters = list(model.parameters())
    assert len(parameters) == sum(len(layer.tensors) for layer in profile.layers)
    full = sum(spec.numel for layer in profile.layers for spec in layer.tensors)
    assert sum(p.numel() for p in parameters) == pytest.approx(full * EMULATED_SIZE_SCALE, rel=0.05)
    generator = torch.Generator().manual_seed(0)
    inputs, targets = workload.make_inputs(workload.batch, generator), workload.make_targets(workload.batch, generator)
    variant = Variant("emulated", model, torch.optim.SGD(parameters, lr=0.1), gradsync=False, loss=workload.loss)
    variant.step(inputs, targets)  # first-call costs out of the timing
    cpu, wall = time.process_time(), time.perf_counter()
    variant.step(inputs, targets)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall >= 0.95 * sum(layer.forward_time + layer.backward_time for layer in profile.layers)
    assert cpu < 0.5 * wall
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in parameters)


def test_the_host_line_gives_the_ranks_cpu_use_and_the_steal():
    from benchmarks.head_to_head.report import host_line

    line = host_line([{"cpu_share": 0.2}, {"cpu_share": 0.4}], stolen=2.0, seconds=100.0)
    cores = os.cpu_count()
    assert "30% of a core each on average (at most 40%)" in line and f"0.60 of the machine's {cores} cores" in line
    assert f"{2.0 / (100.0 * cores):.1%} of the cores' time" in line


def test_the_emulated_targets_compare_mg_wfbp_with_wfbp_and_the_papers_pairs():
    from benchmarks.head_to_head.targets import emulated_targets

    seconds = {"ddp": 1.2, "wfbp": 1.3, "mg_wfbp": 1.0, "asc_wfbp": 0.8, "bytescheduler": 1.1, "us_byte": 1.0}
    results = {ROWS[key].label: RowResult(ROWS[key].label, value, (value,), None, None, None)
               for key, value in seconds.items()}
    plan_rows = [ROWS[key].label for key in seconds if key != "ddp"]
    small, large = (emulated_targets(Setting(model, 8, "0.5"), results, plan_rows)
                    for model in ("emulated_mobilenet_v2", "emulated_resnet50"))
    assert "mg_wfbp 1.30× wfbp (target ≥ 1.15×): reached" in small[0]
    assert "best non-compressing plan (gradsync asc_wfbp) 1.50× torch DDP (target ≥ 1.2×): reached" in small[0]
    assert all("asc_wfbp 1.25× mg_wfbp; us_byte 1.10× bytescheduler" in lines[-1] for lines in (small, large))
    assert len(large) == 1  # the small-tensor targets only where the issue sets them
    # two planners that made the same ops (one merged op on one channel): the report says so
    one_op = {"layouts": {"plain": {"plan": {"planner": "x", "ops": [{"slices": [["w", 0, 8]], "channel": 0}]}}}}
    for key in ("mg_wfbp", "asc_wfbp"):
        results[ROWS[key].label] = dataclasses.replace(results[ROWS[key].label], replay=one_op)
    [line] = emulated_targets(Setting("emulated_resnet50", 8, "0.5"), results, plan_rows)
    assert ("asc_wfbp 1.25× mg_wfbp (the same ops: the two rows differ by their measurement alone); "
            "us_byte 1.10× bytescheduler (the papers report gains: > 1×)") in line


def test_slow_motion_stretches_an_emulated_models_times_and_the_rate_it_stands_for():
    """--time-scale k: every layer's forward and backward time ×k, the tensors unchanged; a link of
    R Gbit/s then stands for R × k / size scale Gbit/s at the device's speed, and the report says so."""
    from benchmarks.head_to_head.report import workload_notes
    from benchmarks.head_to_head.workloads import EMULATED_SIZE_SCALE, WORKLOADS

    workload = WORKLOADS["emulated_mobilenet_v2"]
    normal, slow = workload.build_model(), workload.build_model(8.0)
    for layer, stretched in zip(normal.emulated_profile.layers, slow.emulated_profile.layers):
        assert stretched.forward_time == pytest.approx(8 * layer.forward_time)
        assert stretched.backward_time == pytest.approx(8 * layer.backward_time)
        assert stretched.tensors == layer.tensors
    full_size = 0.0625 * 8 / EMULATED_SIZE_SCALE
    assert f"times ×8 (≙ {full_size:g} Gbit/s for the full-size model" in Setting(
        "emulated_mobilenet_v2", 8, "0.0625", 8.0).title
    assert "≙ 10 Gbit/s" in Setting("emulated_mobilenet_v2", 8, "0.5").title
    assert any("Slow motion" in note for note in workload_notes({"emulated_mobilenet_v2"}, 8.0))
    assert not any("Slow motion" in note for note in workload_notes({"emulated_mobilenet_v2"}))
