"""`auto` against brute force: simulate every planner's plan and apply the tolerance rule by hand."""
import pytest

from gradsync import ConfigError, CostModel, planners, simulate
from gradsync.profile import zoo
from helpers import toy_profile

CANDIDATES = [name for name in planners.names() if name != "auto"]


def brute_force(profile, cost, tolerance):
    """The tolerance rule by hand over every planner's plan, each as made and then with its waits
    deferred (planned again with ``overlap_forward``): (planner, deferred), the times by planner."""
    variants = [(name, overlap) for name in CANDIDATES for overlap in (False, True)]
    times = {variant: simulate(planners.get(variant[0])(profile, cost, overlap_forward=variant[1]), profile,
                               cost).iteration_time for variant in variants}
    best = variants[0]
    for variant in variants[1:]:
        if times[variant] < times[best] * (1 - tolerance):
            best = variant
    return best, {name: times[(name, False)] for name in CANDIDATES}


@pytest.mark.parametrize("model, preset", [("resnet50", "asc-wfbp-10gbe"), ("bert_base", "us-byte-cluster1"),
                                           ("googlenet", "mg-wfbp-10gbe")])
@pytest.mark.parametrize("tolerance", [0.0, 0.02, 0.3])
def test_auto_keeps_the_simplest_plan_within_the_tolerance_of_the_fastest(model, preset, tolerance):
    profile, cost = zoo(model), CostModel.preset(preset, workers=8)
    (expected, deferred), times = brute_force(profile, cost, tolerance)
    plan = planners.get("auto")(profile, cost, tolerance=tolerance, overlap_forward=None)
    assert plan.options["chosen"] == expected and plan.options.get("overlap_forward", False) == deferred
    assert times[expected] <= min(times.values()) / (1 - tolerance)


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


@pytest.mark.parametrize("candidates", [(), "mg_wfbp", 3, [None]])
def test_auto_refuses_candidates_that_are_not_a_list_of_planner_names(candidates):
    profile, cost = zoo("resnet50"), CostModel.preset("asc-wfbp-10gbe", workers=8)
    with pytest.raises(ConfigError, match="candidate"):
        planners.get("auto")(profile, cost, candidates=candidates)


def test_auto_takes_candidates_from_a_json_list():
    profile, cost = zoo("resnet50"), CostModel.preset("asc-wfbp-10gbe", workers=8)
    assert planners.get("auto")(profile, cost, candidates=["wfbp"]).options["chosen"] == "wfbp"


def first_layers_last_profile():
    """Two small input layers and a large output layer, whose all-reduce (20 ms at the cost below)
    is still travelling when the backward pass ends: the small ones pass it (two ops per channel),
    and with the waits deferred the input layers' forward (6 ms) runs while it travels."""
    return toy_profile([(1000, 3, 2), (1000, 3, 2), (500_000, 3, 2)])


def test_asked_to_choose_auto_defers_the_waits_where_that_is_faster_by_more_than_the_tolerance():
    profile, cost = first_layers_last_profile(), CostModel(1e-4, 1e-8, gamma=2.0, ops_per_channel=2)
    (expected, deferred), _ = brute_force(profile, cost, 0.02)
    plan = planners.get("auto")(profile, cost, overlap_forward=None)
    assert deferred and plan.options["chosen"] == expected and plan.options["overlap_forward"] is True
    assert all(op.deferred for op in plan.ops if op.phase == "backward")
    made = planners.get(expected)(profile, cost)
    assert simulate(plan, profile, cost).iteration_time < 0.98 * simulate(made, profile, cost).iteration_time
    by_default = planners.get("auto")(profile, cost)
    assert "overlap_forward" not in by_default.options and not any(op.deferred for op in by_default.ops)
    assert all(op.deferred for op in planners.get("auto")(profile, cost, overlap_forward=True).ops)


@pytest.mark.parametrize("name", CANDIDATES)
def test_every_planner_defers_its_waits_on_request_and_refuses_a_non_boolean(name):
    profile, cost = first_layers_last_profile(), CostModel(1e-4, 1e-9)
    made, deferred = (planners.get(name)(profile, cost, overlap_forward=flag) for flag in (False, True))
    assert deferred == made.with_deferred_waits() and not any(op.deferred for op in made.ops)
    with pytest.raises(ConfigError, match="overlap_forward"):
        planners.get(name)(profile, cost, overlap_forward="yes")
    with pytest.raises(ConfigError, match="overlap_forward"):
        planners.get("auto")(profile, cost, overlap_forward=1)
