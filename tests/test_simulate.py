"""Hand-computed timelines. Every toy tensor is fp32, so numel 1000 is 4000 bytes; with a = 1 ms and
b = 1 µs/byte one such all-reduce takes 1 + 4 = 5 ms."""
import pytest

from gradsync import CostModel, Op, Plan, Slice, planners, simulate
from gradsync.errors import ConfigError
from gradsync.planning import LayoutPlan, predict_step, step_prediction
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


def test_a_deferred_op_gates_the_forward_of_its_layers_not_the_step():
    # backward: layer 1 0→2 (t1 ready), layer 0 2→4 (t0 ready); updates 0.4 ms (t0) and 1.6 ms (t1)
    profile = toy_profile([(1000, 1, 2), (4000, 2, 2)]).with_update_time(2 * MS)
    made = Plan((Op((Slice("t0", 0, 1000),)), Op((Slice("t1", 0, 4000),))))
    # t0 4→9, t1 (16000 B) 9→26 on one channel; at the step: updates 26→28, forward 28→29, 29→31
    assert simulate(made, profile, COST).iteration_time == pytest.approx(31 * MS)
    # deferred: layer 0 waits for t0 only, is updated 9→9.4 and runs 9.4→10.4 while t1 travels;
    # layer 1 waits for t1: updated 26→27.6, runs 27.6→29.6
    timeline = simulate(made.with_deferred_waits(), profile, COST)
    assert timeline.iteration_time == pytest.approx(29.6 * MS)
    assert [span.start for span in timeline.layers if span.kind == "forward"] == pytest.approx([9.4 * MS, 27.6 * MS])
    # backward order: t1 2→19, t0 19→24; deferring moves the update of layer 1 after layer 0's forward
    backward_order = Plan((Op((Slice("t1", 0, 4000),)), Op((Slice("t0", 0, 1000),))))
    assert simulate(backward_order, profile, COST).iteration_time == pytest.approx(29 * MS)  # 24+2+1+2
    assert simulate(backward_order.with_deferred_waits(), profile, COST).iteration_time == pytest.approx(29 * MS)


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



HOST = CostModel(1 * MS, 1e-6, host=0.5 * MS)


def test_each_op_delays_the_layers_computed_after_its_launch():
    profile = toy_profile([(1000, 1, 2)] * 3)
    timeline = simulate(planners.get("wfbp")(profile, HOST), profile, HOST)
    # layer 2 ready at 2, its op launches 2→2.5 and starts at 2.5; layer 1 computes 2.5→4.5, op
    # launched 4.5→5; layer 0 5→7, op 7→7.5, backward ends at 7.5. Ops 2.5→7.5, 7.5→12.5, 12.5→17.5;
    # forward 17.5→20.5
    assert [s.start for s in timeline.ops] == pytest.approx([2.5 * MS, 7.5 * MS, 12.5 * MS])
    assert [s.end for s in timeline.layers if s.kind == "backward"] == pytest.approx([7 * MS, 4.5 * MS, 2 * MS])
    assert timeline.iteration_time == pytest.approx(20.5 * MS)


def test_host_time_of_hidden_ops_shows_in_the_iteration():
    profile = toy_profile([(1000, 1, 10)] * 3)
    merged = Plan((Op(tuple(Slice(f"t{i}", 0, 1000) for i in (2, 1, 0))),))
    # without host time: 38 ms (see above); with it, each of wfbp's three ops costs 0.5 ms of the
    # backward: ready at 10, 20.5, 31 (+0.5 launching), the last op 31.5→36.5, forward 36.5→39.5
    assert simulate(planners.get("wfbp")(profile, HOST), profile, HOST).iteration_time == pytest.approx(39.5 * MS)
    # one merged op: launched at 30→30.5, 30.5→43.5 for 12 KB, forward 43.5→46.5
    assert simulate(merged, profile, HOST).iteration_time == pytest.approx(46.5 * MS)


def test_ops_launch_in_channel_order_and_forward_phase_ops_at_the_end_of_backward():
    profile = toy_profile([(1000, 1, 2)] * 3)
    # t0 (ready last) first on the channel: t2's op waits for it and launches in layer 0's hook
    plan = Plan((Op((Slice("t0", 0, 1000),)), Op((Slice("t2", 0, 1000),)),
                 Op((Slice("t1", 0, 1000),), phase=FORWARD)))
    timeline = simulate(plan, profile, HOST)
    # backward 0→6 uninterrupted; both backward ops launch after layer 0: 6→6.5, 6.5→7; the
    # forward-phase op 7→7.5. Ops 6.5→11.5, 11.5→16.5, 16.5→21.5; updates and the forward of
    # layer 0 at 16.5→17.5, layer 1 waits for its op: 21.5→22.5, layer 2 22.5→23.5
    assert [s.start for s in timeline.ops] == pytest.approx([6.5 * MS, 11.5 * MS, 16.5 * MS])
    assert timeline.backward_end == pytest.approx(7 * MS)
    assert timeline.iteration_time == pytest.approx(23.5 * MS)


def test_host_must_be_a_finite_number_at_least_zero():
    for bad in (-1e-3, float("nan"), True, "1"):
        with pytest.raises(ConfigError, match="'host'"):
            CostModel(1 * MS, 1e-6, host=bad)


def test_computation_runs_slower_while_ops_transmit():
    profile = toy_profile([(1000, 1, 10)] * 3)
    slowed = CostModel(1 * MS, 1e-6, compute_slowdown=2.0)
    timeline = simulate(planners.get("wfbp")(profile, slowed), profile, slowed)
    # layer 2 0→10 alone; its op starts up 10→11 (layer 1 at full speed: 1 ms of work) and
    # transmits 11→15 (2 ms of work), so layer 1 ends alone at 22; op 22→23→27 beside layer 0
    # likewise, which ends at 34; op 34→39; forward 39→42 (38 ms without the slowdown)
    assert [s.end for s in timeline.layers if s.kind == "backward"] == pytest.approx([34 * MS, 22 * MS, 10 * MS])
    assert [s.end for s in timeline.ops] == pytest.approx([15 * MS, 27 * MS, 39 * MS])
    assert timeline.iteration_time == pytest.approx(42 * MS)


def test_transmissions_run_slower_while_the_thread_computes():
    profile = toy_profile([(1000, 1, 10)] * 3)
    slowed = CostModel(1 * MS, 1e-6, transfer_slowdown=2.0)
    timeline = simulate(planners.get("wfbp")(profile, slowed), profile, slowed)
    # op t2: start-up 10→11 (not slowed), 4 ms of transmission at half rate beside layer 1 → 19;
    # t1 20→21→29 beside layer 0; t0 30→31→35 while the thread waits; forward 35→38
    assert [s.end for s in timeline.ops] == pytest.approx([19 * MS, 29 * MS, 35 * MS])
    assert timeline.iteration_time == pytest.approx(38 * MS)


def test_forward_phase_ops_slow_the_forward_they_overlap():
    profile = toy_profile([(1000, 4, 2), (1000, 1, 2)])
    plan = Plan((Op((Slice("t0", 0, 1000),)), Op((Slice("t1", 0, 1000),), phase=FORWARD)))
    # backward 0→4; t0 4→9; t1 (forward phase) 9→14, starting up until 10; layer 0's forward
    # from 9, full speed until 10, half speed while t1 transmits (2 of its 4 ms by 14), alone
    # 14→15; layer 1 waits for t1: 15→16
    plain = simulate(plan, profile, COST)
    slowed = simulate(plan, profile, CostModel(1 * MS, 1e-6, compute_slowdown=2.0))
    assert [s.end for s in plain.layers if s.kind == "forward"] == pytest.approx([13 * MS, 15 * MS])
    assert [s.end for s in slowed.layers if s.kind == "forward"] == pytest.approx([15 * MS, 16 * MS])


def test_busy_time_is_the_computing_threads_work_with_its_slowdowns_and_launches():
    profile = toy_profile([(1000, 1, 10)] * 3)
    # no slowdown: the thread's work is the profile's 33 ms, 30 of them in the backward pass
    plain = simulate(planners.get("wfbp")(profile, COST), profile, COST)
    assert (plain.busy_time, plain.backward_busy) == pytest.approx((33 * MS, 30 * MS))
    # σ = 2 (worked above): layers 2, 1, 0 take 10, 12 and 12 ms, the forward 3 ms after waiting 34→39
    slowed_cost = CostModel(1 * MS, 1e-6, compute_slowdown=2.0)
    slowed = simulate(planners.get("wfbp")(profile, slowed_cost), profile, slowed_cost)
    assert (slowed.busy_time, slowed.backward_busy) == pytest.approx((37 * MS, 34 * MS))
    # each launch is 0.5 ms of the thread's time, waiting is not
    launching = simulate(planners.get("wfbp")(profile, HOST), profile, HOST)
    assert (launching.busy_time, launching.backward_busy) == pytest.approx((34.5 * MS, 31.5 * MS))
    assert launching.iteration_time == pytest.approx(39.5 * MS)


def test_a_later_rounds_all_reduces_are_waited_for_not_worked():
    profile = toy_profile([(1000, 1, 2)] * 3)
    plan = planners.get("wfbp")(profile, COST)
    layouts = {"P": LayoutPlan(plan, profile), "Q": LayoutPlan(plan, profile.with_update_time(1 * MS))}
    one, two = step_prediction(layouts, ("P",), COST), step_prediction(layouts, ("P", "Q"), COST)
    assert (one.time, one.busy) == pytest.approx((20 * MS, 9 * MS))  # wfbp's 20 ms above
    # round P's ops end at 17; Q's three ops (gradients all ready) 17→32; Q's update 32→33, forward 33→36
    assert (two.time, two.busy) == pytest.approx((36 * MS, 10 * MS))
    assert predict_step(layouts, ("P", "Q"), COST) == two.time


@pytest.mark.parametrize("attr", ["compute_slowdown", "transfer_slowdown"])
def test_slowdowns_must_be_finite_numbers_at_least_one(attr):
    for bad in (0.5, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ConfigError, match=f"'{attr}'"):
            CostModel(1 * MS, 1e-6, **{attr: bad})


def test_a_channel_runs_ops_per_channel_ops_at_once_sharing_the_link():
    profile = toy_profile([(1000, 1, 2)] * 3)
    two = CostModel(1 * MS, 1e-6, gamma=1.5, ops_per_channel=2)
    timeline = simulate(planners.get("wfbp")(profile, two), profile, two)
    # ready at 2, 4, 6 ms (each op: 1 ms start-up, 4 ms transmission alone). t2 starts at 2 and
    # transmits alone 3→5 (2 ms done); t1 starts at 4 beside it; from 5 both transmit at 1/1.5:
    # t2 ends at 8, t1 has 2 ms left. t0 waits for a free slot: starts at 8, starts up until 9
    # while t1 transmits alone (1 ms left); both at 1/1.5: t1 ends at 10.5, t0 (3 ms left) at
    # 13.5; forward 13.5→16.5 (20 ms with one op per channel)
    assert [s.start for s in timeline.ops] == pytest.approx([2 * MS, 4 * MS, 8 * MS])
    assert [s.end for s in timeline.ops] == pytest.approx([8 * MS, 10.5 * MS, 13.5 * MS])
    assert timeline.iteration_time == pytest.approx(16.5 * MS)


def test_ops_per_channel_must_be_an_integer_at_least_one():
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="'ops_per_channel'"):
            CostModel(1 * MS, 1e-6, ops_per_channel=bad)


def test_a_reduce_scatter_lasts_its_own_a_plus_b_bytes():
    """One op over 3 layers of 4000 bytes each, after the backward pass (6 ms): a reduce-scatter
    with a = 0.2 ms and b = 0.3 µs/byte ends 0.2 + 3.6 ms later; an all-reduce 1 + 12 ms later."""
    profile = toy_profile([(1000, 1, 2)] * 3)
    cost = CostModel(1 * MS, 1e-6, reduce_scatter_a=0.2 * MS, reduce_scatter_b=0.3e-6)
    merged = Plan((Op(tuple(Slice(f"t{i}", 0, 1000) for i in range(3))),))
    for collective, duration in (("allreduce", 13 * MS), ("reduce_scatter", 3.8 * MS)):
        timeline = simulate(merged.with_collective(collective), profile, cost)
        assert timeline.ops[0].end - timeline.ops[0].start == pytest.approx(duration)
        assert timeline.iteration_time == pytest.approx(6 * MS + duration + 3 * MS)


@pytest.mark.parametrize("name", planners.names())
def test_every_planner_plans_reduce_scatters_with_their_cost(name):
    """The plan of reduce-scatters is the planner's plan on the reduce-scatter's cost, each op a
    reduce-scatter; its simulated iteration is what that plan runs in."""
    from gradsync import compress
    from gradsync.planning import plan_layouts

    profile = toy_profile([(1000, 1, 2), (50, 1, 0.1), (50, 1, 0.1), (2000, 1, 3)])
    cost = CostModel(1 * MS, 1e-6, gamma=1.2, reduce_scatter_a=0.01 * MS, reduce_scatter_b=0.4e-6)
    codec = compress.get("identity")
    codec.setup({spec.name: spec for layer in profile.layers for spec in layer.tensors}, 2, seed=0)
    planner = planners.bind(name)
    [entry] = plan_layouts(profile, cost, planner, codec, collective="reduce_scatter").values()
    assert {op.collective for op in entry.plan.ops} == {"reduce_scatter"}
    alone = planner(profile, cost.for_collective("reduce_scatter"))
    assert [op.slices for op in entry.plan.ops] == [op.slices for op in alone.ops]
    assert simulate(entry.plan, profile, cost).iteration_time == pytest.approx(
        simulate(alone, profile, cost.for_collective("reduce_scatter")).iteration_time)
    if name in ("mg_wfbp", "asc_wfbp", "auto"):  # their merges follow a: cheaper start-ups, other plans
        assert [op.slices for op in alone.ops] != [op.slices for op in planner(profile, cost).ops]
