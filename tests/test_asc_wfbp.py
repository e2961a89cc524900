"""ASC-WFBP (asc-wfbp Theorem 1, Algorithm 1) on hand-computed cases.

Every toy tensor is fp32; with a = 1 ms and b = 1 µs/byte, numel 250 (1000 bytes) takes
1 + 1 = 2 ms to all-reduce and numel 2500 takes 1 + 10 = 11 ms. Forward times are 0, so the
iteration time is when the last all-reduce ends.
"""
import random

import pytest

from gradsync import ConfigError, CostModel, planners, simulate
from gradsync.planners.asc_wfbp import MERGED, NORMAL, SIMULTANEOUS, determine_layer_types
from gradsync.profile import LayerProfile, ModelProfile, TensorSpec
from helpers import MS, toy_profile

asc_wfbp = planners.get("asc_wfbp")
wfbp = planners.get("wfbp")


def cost(gamma=1.5):
    return CostModel(1 * MS, 1e-6, gamma=gamma)


def iteration_ms(plan, profile, cost_model):
    return simulate(plan.validate(profile), profile, cost_model).iteration_time / MS


def layout(plan):
    """(tensors, channel) of every op, in plan order."""
    return [(op.tensors(), op.channel) for op in plan.ops]


def test_q1_comm_hidden_by_next_layer_gives_normal_layers():
    # layer 1 ready at 1, all-reduced 1 → 3 ≤ ready(0) = 6: Q1 (eq. 21) → normal
    profile = toy_profile([(250, 0, 5), (250, 0, 1)])
    assert determine_layer_types(profile, cost()).kinds == {1: NORMAL, 0: NORMAL}
    plan = asc_wfbp(profile, cost())
    assert layout(plan) == [(["t1"], 0), (["t0"], 0)]
    assert iteration_ms(plan, profile, cost()) == pytest.approx(8)  # t0: 6 → 8


def test_startup_dominating_merges_layer_into_the_next():
    # layer 1: normal 1 → 3 > ready(0) = 1.5 (¬Q1); 1.5 < 1 + a (Q2); 1 + 2 < 1.5 is false (¬Q3)
    profile = toy_profile([(250, 0, 0.5), (250, 0, 1)])
    assert determine_layer_types(profile, cost()).kinds == {1: MERGED, 0: NORMAL}
    plan = asc_wfbp(profile, cost())
    assert layout(plan) == [(["t1", "t0"], 0)]
    # one op 1.5 → 1.5 + 1 + 2 = 4.5, against WFBP's 1 → 3 → 5
    assert iteration_ms(plan, profile, cost()) == pytest.approx(4.5)
    assert iteration_ms(wfbp(profile, cost()), profile, cost()) == pytest.approx(5)


# t2 (11 ms) all-reduces 1 → 12; t1 is ready at 2, and as a normal layer would run 12 → 14.
LONG_THEN_SMALL = [(250, 0, 8), (250, 0, 1), (2500, 0, 1)]


def test_long_transmission_overlapping_a_ready_layer_goes_simultaneous():
    # layer 1: ¬Q1 (14 > 10); Q2 (10 < 12 + 1); eq. 13 penalty 0.5·1e-6·10000·(1 − 1/11) = 4.545 ms,
    # Q3: 2 + 2 + 4.545 < 10 → SC. Layer 0 (the input layer) is SC beside t2 (Alg. 1, line 18).
    profile = toy_profile(LONG_THEN_SMALL)
    schedule = determine_layer_types(profile, cost())
    assert schedule.kinds == {2: NORMAL, 1: SIMULTANEOUS, 0: SIMULTANEOUS}
    assert [(op.layers, op.channel) for op in schedule.ops] == [((2,), 0), ((1,), 1), ((0,), 1)]
    assert schedule.ops[1].end - schedule.ops[1].start == pytest.approx((2 + 50 / 11) * MS)
    plan = asc_wfbp(profile, cost())
    assert layout(plan) == [(["t2"], 0), (["t1"], 1), (["t0"], 1)]
    # t2: start-up 1 → 2, 1 ms alone; t1: start-up 2 → 3, then both at 1/1.5: t1 ends 4.5, t2 has
    # 8 ms left → 12.5; t0: start-up 10 → 11, t2 has 1.5 left: both slowed until t0 ends at 12.5,
    # t2 then has 0.5 left alone → 13.
    timeline = simulate(plan, profile, cost())
    assert [span.start / MS for span in timeline.ops] == pytest.approx([1, 2, 10])
    assert timeline.iteration_time / MS == pytest.approx(13)
    assert iteration_ms(wfbp(profile, cost()), profile, cost()) == pytest.approx(16)


# As above, but layer 0 is ready at 13.5 ≥ τ_c(1) + a = 13: ¬Q2 for layer 1.
LONG_THEN_SMALL_LATE = [(250, 0, 11.5), (250, 0, 1), (2500, 0, 1)]


def test_not_q2_gives_simultaneous_whatever_the_penalty():
    # layer 1: ¬Q1 (14 > 13.5) ∧ ¬Q2 → SC (eq. 39); at 13.5 nothing is in flight, so layer 0 is normal
    profile = toy_profile(LONG_THEN_SMALL_LATE)
    assert determine_layer_types(profile, cost()).kinds == {2: NORMAL, 1: SIMULTANEOUS, 0: NORMAL}
    plan = asc_wfbp(profile, cost())
    assert layout(plan) == [(["t2"], 0), (["t1"], 1), (["t0"], 1)]
    # t1 beside t2 ends 4.5, t2 ends 12.5; t0 13.5 → 15.5 (one channel: 1 → 12 → 14 → 16)
    assert iteration_ms(plan, profile, cost()) == pytest.approx(15.5)


def test_large_gamma_keeps_every_op_on_one_channel():
    # eq. 40 still makes layer 1 SC (¬Q2 does not look at γ), but beside t2 at γ = 10 both crawl:
    # the simulator check keeps the one-channel plan, WFBP's 1 → 12 → 14 → 16.
    profile = toy_profile(LONG_THEN_SMALL_LATE)
    assert determine_layer_types(profile, cost(10.0)).kinds[1] == SIMULTANEOUS
    plan = asc_wfbp(profile, cost(10.0))
    assert {op.channel for op in plan.ops} == {0}
    assert iteration_ms(plan, profile, cost(10.0)) == pytest.approx(16)


# t4 (numel 10000, 41 ms) all-reduces 1 → 42 on channel 0 while the small layers 3..0 arrive.
ONE_LONG_FOUR_SMALL = [(250, 0, 6), (250, 0, 1), (250, 0, 8), (250, 0, 1), (10000, 0, 1)]


def test_third_channel_takes_a_layer_when_two_ops_are_in_flight():
    cheap = cost(1.1)
    profile = toy_profile(ONE_LONG_FOUR_SMALL)
    # layer 3 (ready 2): penalty 0.1·1e-6·40000·(1 − 1/41), 2 + 2 + 3.9 < ready(2) = 10: Q3 → SC,
    # channel 1 until 7.9. Layer 2 (ready 10): normal on channel 1 would be 10 → 12 > 11 (¬Q1),
    # 11 < 10 + a is false (¬Q2) → SC beside t4, channel 1 until 15.1. Layer 1 (ready 11): both
    # channels busy; normal 15.1 → 17.1 > 17 (¬Q1), 17 ≥ 16.1 (¬Q2).
    two = determine_layer_types(profile, cheap, channels=2)
    assert two.kinds == {4: NORMAL, 3: SIMULTANEOUS, 2: SIMULTANEOUS, 1: NORMAL, 0: NORMAL}
    assert [op.channel for op in two.ops] == [0, 1, 1, 1, 1]
    three = determine_layer_types(profile, cheap, channels=3)
    assert three.kinds == {4: NORMAL, 3: SIMULTANEOUS, 2: SIMULTANEOUS, 1: SIMULTANEOUS, 0: SIMULTANEOUS}
    assert [op.channel for op in three.ops] == [0, 1, 1, 2, 1]
    one = determine_layer_types(profile, cheap, channels=1)  # MG-WFBP: everything queues behind t4
    assert one.kinds == {4: NORMAL, 3: MERGED, 2: MERGED, 1: MERGED, 0: NORMAL}


def test_one_channel_has_no_simultaneous_layer():
    profile = toy_profile(LONG_THEN_SMALL)
    assert SIMULTANEOUS not in determine_layer_types(profile, cost(), channels=1).kinds.values()
    plan = asc_wfbp(profile, cost(), channels=1)
    assert {op.channel for op in plan.ops} == {0}
    # layer 1 merges into layer 0 (Q2, eq. 24): t2 1 → 12, (t1, t0) 12 → 15
    assert layout(plan) == [(["t2"], 0), (["t1", "t0"], 0)]
    assert iteration_ms(plan, profile, cost()) == pytest.approx(15)


def random_profile(rng, layers):
    return ModelProfile(
        "random",
        tuple(
            LayerProfile(f"l{i}", (TensorSpec(f"t{i}", int(10 ** rng.uniform(2, 6.5))),),
                         rng.uniform(0, 1) * MS, rng.uniform(0, 4) * MS)
            for i in range(layers)
        ),
    )


def random_cases(count):
    rng = random.Random(7)
    for _ in range(count):
        profile = random_profile(rng, rng.randint(1, 25))
        gamma = rng.choice([1.0, 1.2, 1.5, 2.0, 3.0, 10.0])
        yield profile, CostModel(10 ** rng.uniform(-4.5, -2.5), 10 ** rng.uniform(-10, -8.5), gamma=gamma)


def test_random_profiles_validate_and_never_lose_to_wfbp_or_to_fewer_channels():
    for profile, cost_model in random_cases(120):
        times = [iteration_ms(asc_wfbp(profile, cost_model, channels=k), profile, cost_model)
                 for k in (1, 2, 3)]
        baseline = iteration_ms(wfbp(profile, cost_model), profile, cost_model)
        assert times[2] <= times[1] <= times[0] <= baseline * (1 + 1e-12)


def test_one_channel_comm_time_model_is_the_simulator_without_contention():
    # On one channel no op shares the link, so CALCCOMMTIME's τ_c and τ_c + t_c are exact.
    for profile, cost_model in random_cases(40):
        schedule = determine_layer_types(profile, cost_model, channels=1)
        plan = asc_wfbp(profile, cost_model, channels=1)
        spans = simulate(plan, profile, cost_model).ops
        simulated = [time for span in spans for time in (span.start, span.end)]
        assert simulated == pytest.approx([time for op in schedule.ops for time in (op.start, op.end)])


def test_layer_mixing_element_sizes_gets_one_op_per_size_on_one_channel():
    mixed = LayerProfile("mixed", (TensorSpec("w", 2500, 2), TensorSpec("bias", 10, 4)), 0.0, 1 * MS)
    profile = ModelProfile("m", (LayerProfile("first", (TensorSpec("t0", 250),), 0.0, 8 * MS), mixed))
    plan = asc_wfbp(profile, cost())
    assert plan.validate(profile) is plan
    assert layout(plan)[:2] == [(["bias"], 0), (["w"], 0)]


def test_layers_without_gradients_are_skipped():
    empty = LayerProfile("relu", (), 0.0, 1 * MS)
    layers = toy_profile(LONG_THEN_SMALL).layers
    profile = ModelProfile("m", (layers[0], empty, layers[1], layers[2]))
    assert set(determine_layer_types(profile, cost()).kinds) == {0, 2, 3}
    asc_wfbp(profile, cost()).validate(profile)


def test_options_are_recorded_and_checked():
    profile = toy_profile(LONG_THEN_SMALL)
    assert asc_wfbp(profile, cost(), channels=3).options == {"channels": 3}
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="channels"):
            asc_wfbp(profile, cost(), channels=bad)
    with pytest.raises(ConfigError, match="unknown option"):
        asc_wfbp(profile, cost(), bucket_cap_bytes=1)
