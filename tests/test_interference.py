"""The interference benchmark's rank side on local gloo ranks (no shaped links needed)."""
import pytest

from benchmarks.interference import TRAFFIC_MARGIN, rank_main
from gradsync.launch import run_local


def test_every_rank_launches_the_same_traffic_and_it_outlasts_the_compute():
    reports = run_local(rank_main, 2, {"model": "cnn", "repeats": 2}, timeout=300)
    assert reports[0]["ops"] == reports[1]["ops"] >= 1
    assert reports[0]["op_seconds"] == reports[1]["op_seconds"] > 0
    slowest_alone = max(r["alone"] for r in reports)
    assert reports[0]["ops"] * reports[0]["op_seconds"] >= TRAFFIC_MARGIN * slowest_alone
    assert all(r["alone"] > 0 and r["beside"] > 0 for r in reports)
    for r in reports:  # the passes apart: with 2 repeats each median is a mean, so they add up exactly
        assert r["forward_alone"] > 0 and r["backward_alone"] > 0 and r["forward_beside"] > 0
        assert r["forward_alone"] + r["backward_alone"] == pytest.approx(r["alone"])
        assert r["forward_beside"] + r["backward_beside"] == pytest.approx(r["beside"])
    assert reports[0]["probe"] == reports[1]["probe"] >= 1  # the wrap-time probe's σ, agreed by the ranks
