"""`auto` against brute force: simulate every planner's plan and apply the tolerance rule by hand."""
import pytest

from gradsync import ConfigError, CostModel, planners, simulate
from gradsync.profile import zoo

CANDIDATES = [name for name in planners.names() if name != "auto"]


def brute_force(profile, cost, tolerance):
    times = {name: simulate(planners.get(name)(profile, cost), profile, cost).iteration_time for name in CANDIDATES}
    best = CANDIDATES[0]
    for name in CANDIDATES[1:]:
        if times[name] < times[best] * (1 - tolerance):
            best = name
    return best, times


@pytest.mark.parametrize("model, preset", [("resnet50", "asc-wfbp-10gbe"), ("bert_base", "us-byte-cluster1"),
                                           ("googlenet", "mg-wfbp-10gbe")])
@pytest.mark.parametrize("tolerance", [0.0, 0.02, 0.3])
def test_auto_keeps_the_simplest_plan_within_the_tolerance_of_the_fastest(model, preset, tolerance):
    profile, cost = zoo(model), CostModel.preset(preset, workers=8)
    expected, times = brute_force(profile, cost, tolerance)
    chosen = planners.get("auto")(profile, cost, tolerance=tolerance).options["chosen"]
    assert chosen == expected
    assert times[chosen] <= min(times.values()) / (1 - tolerance)


def test_a_larger_tolerance_can_only_choose_an_earlier_planner():
    profile, cost = zoo("bert_base"), CostModel.preset("us-byte-cluster1", workers=8)
    order = [planners.get("auto")(profile, cost, tolerance=t).options["chosen"] for t in (0.0, 0.02, 0.1, 0.5, 0.9)]
    positions = [CANDIDATES.index(name) for name in order]
    assert positions == sorted(positions, reverse=True)
    assert len(set(order)) > 1  # the tolerance does change the choice here


@pytest.mark.parametrize("tolerance", [-0.1, 1.0, float("nan"), True, "0.1"])
def test_bad_tolerance_is_refused(tolerance):
    profile, cost = zoo("resnet50"), CostModel.preset("asc-wfbp-10gbe", workers=8)
    with pytest.raises(ConfigError, match="tolerance"):
        planners.get("auto")(profile, cost, tolerance=tolerance)


@pytest.mark.parametrize("channels", [1, 2, 3])
def test_auto_plans_within_the_channels_it_is_given(channels):
    profile, cost = zoo("resnet50"), CostModel.preset("asc-wfbp-10gbe", workers=8)
    times = {}
    for name in CANDIDATES:
        fitted = {"channels": channels} if "channels" in planners.option_names(name) else {}
        candidate = planners.get(name)(profile, cost, **fitted)
        if candidate.channels <= channels:
            times[name] = simulate(candidate, profile, cost).iteration_time
    best = next(iter(times))
    for name, seconds in times.items():
        if seconds < times[best] * (1 - 0.02):
            best = name
    chosen = planners.get("auto")(profile, cost, channels=channels)
    assert chosen.options["chosen"] == best and chosen.channels <= channels
    assert ("bytescheduler" in times) == (channels >= 2)  # its two credit slots need two channels


def test_auto_refuses_when_no_candidate_fits_the_channels():
    profile, cost = zoo("resnet50"), CostModel.preset("asc-wfbp-10gbe", workers=8)
    with pytest.raises(ConfigError, match="more than 1 channel"):
        planners.get("auto")(profile, cost, candidates=("bytescheduler",), channels=1)
    with pytest.raises(ConfigError, match="'channels' must be an integer >= 1"):
        planners.get("auto")(profile, cost, channels=0)
