"""The head-to-head's summary: slowest-rank block times, medians and the paired overhead ratio."""
import pytest

from benchmarks.head_to_head import COMPUTE_ONLY, ROWS, RowResult, Setting, paired_ratio, summarise, targets

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
