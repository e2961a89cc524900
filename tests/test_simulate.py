"""Hand-computed timelines. Every toy tensor is fp32, so numel 1000 is 4000 bytes; with a = 1 ms and
b = 1 µs/byte one such all-reduce takes 1 + 4 = 5 ms."""
import pytest

from gradsync import CostModel, Op, Plan, Slice, planners, simulate
from gradsync.plan import FORWARD
from gradsync.profile import LayerProfile, ModelProfile, TensorSpec
from gradsync.simulate import contention_slowdown
from helpers import MS, toy_profile

COST = CostModel(1 * MS, 1e-6)


def test_wfbp_three_layers():
    profile = toy_profile([(1000, 1, 2)] * 3)
    timeline = simulate(planners.get("wfbp")(profile, COST), profile, COST)
    # ready at 2, 4, 6 ms; ops 2→7, 7→12, 12→17; forward 17→20
    assert [t for s in timeline.ops for t in (s.start, s.end)] == pytest.approx([2 * MS, 7 * MS, 7 * MS, 12 * MS,
                                                                                 12 * MS, 17 * MS])
    assert timeline.iteration_time == pytest.approx(20 * MS)
    assert timeline.noncovered_comm == pytest.approx(11 * MS)  # 20 - 9 of compute


def test_update_time_runs_between_synchronisation_and_the_next_forward():
    profile = toy_profile([(1000, 1, 2)] * 3).with_update_time(4 * MS)
    timeline = simulate(planners.get("wfbp")(profile, COST), profile, COST)
    # as in the WFBP case above: the last op ends at 17; update 17→21; forward 21→24
    assert timeline.iteration_time == pytest.approx(24 * MS)
    assert timeline.noncovered_comm == pytest.approx(11 * MS)  # the update is not communication


def test_a_layer_sent_in_the_forward_phase_is_updated_right_before_its_forward():
    two = toy_profile([(1000, 1, 2), (1000, 1, 2)]).with_update_time(6 * MS)  # 3 ms per layer
    plan = Plan((Op((Slice("t1", 0, 1000),)), Op((Slice("t0", 0, 1000),), phase=FORWARD)))
    # t1 2→7; t0's forward-phase op 7→12; layer 1's update 7→10; layer 0 waits for t0, is updated
    # 12→15 and runs 15→16; layer 1 16→17
    assert simulate(plan, two, COST).iteration_time == pytest.approx(17 * MS)


def test_comm_hidden_behind_backward_costs_nothing():
    profile = toy_profile([(1000, 1, 10)] * 3)
    timeline = simulate(planners.get("wfbp")(profile, COST), profile, COST)
    # ready at 10, 20, 30; each op 5 ms, the last ends at 35 → forward 35→38
    assert timeline.iteration_time == pytest.approx(38 * MS)
    assert timeline.noncovered_comm == pytest.approx(5 * MS)


def test_forward_phase_gates_each_layer_us_byte_eq11():
    profile = toy_profile([(1000, 1, 2), (1000, 1, 2)])
    sequential = Plan((Op((Slice("t0", 0, 1000),), phase=FORWARD), Op((Slice("t1", 0, 1000),), phase=FORWARD)))
    reversed_ = Plan((Op((Slice("t1", 0, 1000),), phase=FORWARD), Op((Slice("t0", 0, 1000),), phase=FORWARD)))
    # backward ends at 4; ops 4→9 (t0) and 9→14 (t1); forward of layer 0 at 9→10, layer 1 at 14→15
    assert simulate(sequential, profile, COST).iteration_time == pytest.approx(15 * MS)
    # reversed: t1 4→9, t0 9→14; forward layer 0 14→15, layer 1 15→16
    assert simulate(reversed_, profile, COST).iteration_time == pytest.approx(16 * MS)


def test_two_simultaneous_allreduces_follow_eq9():
    layer = LayerProfile("l", (TensorSpec("x", 1000), TensorSpec("y", 1000)), 0.0, 2 * MS)
    profile = ModelProfile("m", (layer,))
    cost = CostModel(1 * MS, 1e-6, gamma=1.5)
    plan = Plan((Op((Slice("x", 0, 1000),)), Op((Slice("y", 0, 1000),), channel=1)))
    timeline = simulate(plan, profile, cost)
    # both start at 2 ms and take a + γ·b·m = 1 + 1.5·4 = 7 ms
    assert [s.end for s in timeline.ops] == pytest.approx([9 * MS, 9 * MS])


def test_partial_overlap_shares_bandwidth():
    profile = toy_profile([(1000, 0, 3), (1000, 0, 0)])
    cost = CostModel(1 * MS, 1e-6, gamma=1.5)
    plan = Plan((Op((Slice("t1", 0, 1000),)), Op((Slice("t0", 0, 1000),), channel=1)))
    timeline = simulate(plan, profile, cost)
    # t1: start-up 0→1, transmits alone 1→4 (3 of 4 ms done); t0: start-up 3→4.
    # From 4 both transmit at 1/1.5: t1's last 1 ms takes 1.5 → ends 5.5; t0 has done 1 ms of 4
    # by then, the other 3 alone → ends 8.5.
    assert [s.end for s in timeline.ops] == pytest.approx([5.5 * MS, 8.5 * MS])
    assert timeline.iteration_time == pytest.approx(8.5 * MS)


def test_one_channel_ignores_gamma():
    profile = toy_profile([(1000, 1, 2)] * 3)
    plan = planners.get("wfbp")(profile, COST)
    high_gamma = CostModel(COST.a, COST.b, gamma=3.0)
    assert simulate(plan, profile, high_gamma).iteration_time == simulate(plan, profile, COST).iteration_time


def test_slowdown_model():
    assert contention_slowdown(1.5, 1) == 1.0
    assert contention_slowdown(1.5, 2) == 1.5
    assert contention_slowdown(1.5, 3) == 2.0

