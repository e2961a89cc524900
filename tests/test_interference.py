"""The interference benchmark's rank side on local gloo ranks (no shaped links needed)."""
import pytest

from benchmarks.interference import TRAFFIC_MARGIN, fits, main, rank_main, where_slowed
from gradsync.launch import run_local


def test_every_rank_launches_the_same_traffic_and_it_outlasts_the_compute():
    job = {"model": "cnn", "repeats": 2, "probe_fits": 2, "host_probe": {"ops": 4, "repeats": 2}}  # a shorter host probe than wrap's
    reports = run_local(rank_main, 2, job, timeout=300)
    assert reports[0]["ops"] == reports[1]["ops"] >= 1
    assert reports[0]["op_seconds"] == reports[1]["op_seconds"] > 0
    slowest_alone = max(r["alone"] for r in reports)
    assert reports[0]["ops"] * reports[0]["op_seconds"] >= TRAFFIC_MARGIN * slowest_alone
    assert all(r["alone"] > 0 and r["beside"] > 0 for r in reports)
    for r in reports:  # the passes apart: with 2 repeats each median is a mean, so they add up exactly
        assert r["forward_alone"] > 0 and r["backward_alone"] > 0 and r["forward_beside"] > 0
        assert r["forward_alone"] + r["backward_alone"] == pytest.approx(r["alone"])
        assert r["forward_beside"] + r["backward_beside"] == pytest.approx(r["beside"])
    for key in ("probe_sigma", "probe_tau", "probe_host"):  # the wrap-time probe's fits, agreed by the ranks
        assert reports[0][key] == reports[1][key] and len(reports[0][key]) == 2
    assert min(reports[0]["probe_sigma"] + reports[0]["probe_tau"]) >= 1 and min(reports[0]["probe_host"]) >= 0
    assert all(1 <= r["transfer_slowdown"] <= 20 for r in reports)
    for r in reports:  # one thread's CPU time cannot exceed the pass's wall time: on and off core are both >= 0
        for when in ("alone", "beside"):
            assert 0 < r[f"cpu_{when}"] and r[f"off_core_{when}"] >= -1e-4
            assert r[f"cpu_{when}"] + r[f"off_core_{when}"] == pytest.approx(r[when])
            assert r[f"preemptions_{when}"] >= 0


def test_the_slowdown_splits_into_more_cpu_time_and_time_off_the_core():
    report = {"cpu_alone": 0.090, "cpu_beside": 0.100, "off_core_alone": 0.002, "off_core_beside": 0.017,
              "preemptions_alone": 6, "preemptions_beside": 64}
    assert where_slowed(report) == "+10.0 / +15.0 | 6 → 64"


def test_probe_fits_show_their_median_and_range():
    assert fits([1.5]) == "1.50×"
    assert fits([2.0, 1.25, 3.5]) == "2.00× (1.25–3.50)"
    assert fits([0.5, 0.7], " ms") == "0.60 ms (0.50–0.70)"


@pytest.mark.parametrize("option", ["--host-probe-ops", "--host-probe-repeats", "--probe-fits"])
def test_a_probe_of_no_ops_or_no_repeats_is_refused_before_any_network_is_made(option, capsys):
    with pytest.raises(SystemExit):
        main([option, "0"])
    assert "must be at least 1" in capsys.readouterr().err
