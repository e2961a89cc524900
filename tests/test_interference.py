"""The interference benchmark's rank side on local gloo ranks (no shaped links needed)."""
from benchmarks.interference import TRAFFIC_MARGIN, rank_main
from gradsync.launch import run_local


def test_every_rank_launches_the_same_traffic_and_it_outlasts_the_compute():
    reports = run_local(rank_main, 2, {"model": "cnn", "repeats": 2}, timeout=300)
    assert reports[0]["ops"] == reports[1]["ops"] >= 1
    assert reports[0]["op_seconds"] == reports[1]["op_seconds"] > 0
    slowest_alone = max(r["alone"] for r in reports)
    assert reports[0]["ops"] * reports[0]["op_seconds"] >= TRAFFIC_MARGIN * slowest_alone
    assert all(r["alone"] > 0 and r["beside"] > 0 for r in reports)
    assert reports[0]["probe"] == reports[1]["probe"] >= 1  # the wrap-time probe's σ, agreed by the ranks
