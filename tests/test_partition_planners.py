"""ByteScheduler and US-Byte (us-byte §2.3–4): hand-computed timelines, Theorem 1 by brute force,
and US-Byte's closed-form model (eqs. 3–12) against the simulator.

Hand examples use a = 1 ms and b = 0.25 ms/byte, so an op of n fp32 elements lasts 1 + n ms; all
times in their comments are in ms.
"""
import itertools
import random

import pytest
from helpers import MS, toy_profile

from gradsync import ConfigError, CostModel, simulate
from gradsync.plan import BACKWARD, FORWARD, Plan, Slice
from gradsync.planners import bytescheduler, get, us_byte
from gradsync.planners.partition import DEFAULT_PARTITION_BYTES, gradient_groups
from gradsync.profile import LayerProfile, ModelProfile, TensorSpec

B, F = BACKWARD, FORWARD


def hand_cost(gamma=1.0):
    return CostModel(1 * MS, 0.25 * MS, gamma)


def in_ms(values):
    return [pytest.approx(v * MS, abs=1e-12) for v in values]


def slices_of(plan):
    return [[(s.tensor, s.offset, s.length) for s in op.slices] for op in plan.ops]


def random_profile(rng, layers):
    """1–3 tensors per layer, fp32 or fp16, random sizes and times (seconds)."""

    def tensors(i):
        count = rng.randint(1, 3)
        return tuple(TensorSpec(f"l{i}t{j}", rng.randint(1, 40), rng.choice([4, 4, 2])) for j in range(count))

    def layer(i):
        return LayerProfile(f"l{i}", tensors(i), rng.uniform(0, 3), rng.uniform(0, 3))

    return ModelProfile("random", tuple(layer(i) for i in range(layers)))


def random_cases(seed, count, max_layers=6):
    """(profile, cost, S_p) triples; γ is 1 here, since US-Byte and credit 1 use one channel."""
    rng = random.Random(seed)
    for _ in range(count):
        profile = random_profile(rng, rng.randint(1, max_layers))
        yield profile, CostModel(rng.uniform(0.1, 2), rng.uniform(0.01, 0.2)), rng.choice([4, 8, 16, 40])


# -- basic blocks ------------------------------------------------------------------------------
def test_blocks_are_contiguous_elements_of_the_layers_tensors_split_by_element_size():
    # fp32 tensors a (3) and b (5) form one group of 8 elements; S_p = 12 bytes = 3 fp32 elements,
    # so m = ⌈32/12⌉ = 3 blocks: [0,3) = a, [3,6) = b[0:3], [6,8) = b[3:5]. fp16 c (4) is its own
    # group: 6 elements per block, one block.
    layer = LayerProfile("mixed", (TensorSpec("a", 3), TensorSpec("b", 5), TensorSpec("c", 4, 2)), 0.0, 1.0)
    profile = ModelProfile("p", (layer,))
    fp32, fp16 = gradient_groups(profile, 12)
    assert (fp32.nbytes, fp32.block_bytes, fp32.num_blocks) == (32, 12, 3)
    assert fp32.slices(0, 1) == (Slice("a", 0, 3),)
    assert fp32.slices(1, 1) == (Slice("b", 0, 3),)
    assert fp32.slices(2, 1) == (Slice("b", 3, 2),)
    assert fp32.slices(0, 3) == (Slice("a", 0, 3), Slice("b", 0, 5))
    assert (fp16.num_blocks, fp16.slices(0, 1)) == (1, (Slice("c", 0, 4),))
    # eq. 8: Δt = (m·S_p − M)·b = (36 − 32)·b
    assert us_byte.shortfall(fp32, CostModel(1.0, 0.5)) == pytest.approx(4 * 0.5)


# -- ByteScheduler -----------------------------------------------------------------------------
# Layer 0: 4 elements (2 blocks of 8 bytes), t_b = 1; layer 1: 6 elements (3 blocks), t_b = 2.
# Backward: layer 1 is ready at 2, layer 0 at 3 (end of backward). Every block lasts 1 + 2 = 3.
BYTESCHEDULER_PROFILE = [(4, 1, 1), (6, 1, 2)]


@pytest.mark.parametrize(
    "credit, gamma, blocks, starts, channels, phases, iteration",
    [
        # One slot: L1b0 at 2; at 5 layer 0 is ready and more urgent: L0b0, L0b1, then L1b1, L1b2.
        # Forward starts at 5 (L1b0 ends), layer 0 waits for 11 → 12, layer 1 for 17 → 18.
        (1, 1.0, ["t1@0", "t0@0", "t0@2", "t1@2", "t1@4"], [2, 5, 8, 11, 14], [0] * 5, [B, F, F, F, F], 18),
        # Two slots, no contention: L1b0, L1b1 on 2–5; L0b0, L0b1 on 5–8; L1b2 on 8–11.
        # Layer 0's forward 8–9, layer 1's 11–12.
        (2, 1.0, ["t1@0", "t1@2", "t0@0", "t0@2", "t1@4"], [2, 2, 5, 5, 8], [0, 1, 0, 1, 0], [B, B, F, F, F], 12),
        # γ = 2: two transmitting ops each take 2·2 = 4 after their start-up: 2–7, 7–12, then 12–15.
        # Forward: layer 0 12–13, layer 1 15–16.
        (2, 2.0, ["t1@0", "t1@2", "t0@0", "t0@2", "t1@4"], [2, 2, 7, 7, 12], [0, 1, 0, 1, 0], [B, B, F, F, F], 16),
    ],
)
def test_bytescheduler_hand_computed(credit, gamma, blocks, starts, channels, phases, iteration):
    profile, cost = toy_profile(BYTESCHEDULER_PROFILE), hand_cost(gamma)
    plan = get("bytescheduler")(profile, cost, partition_bytes=8, credit=credit).validate(profile)
    assert [f"{s[0][0]}@{s[0][1]}" for s in slices_of(plan)] == blocks
    assert [op.channel for op in plan.ops] == channels
    assert [op.phase for op in plan.ops] == phases
    timeline = simulate(plan, profile, cost)
    assert [span.start for span in timeline.ops] == in_ms(starts)
    assert timeline.iteration_time == pytest.approx(iteration * MS)


def test_bytescheduler_emulation_matches_the_simulator():
    rng = random.Random(7)
    for profile, cost, partition_bytes in random_cases(seed=3, count=60):
        for credit in (1, 2, 3):
            contended = CostModel(cost.a, cost.b, rng.choice([1.0, 1.5, 2.0]))
            launches = bytescheduler.emulate(profile, contended, partition_bytes, credit)
            plan = get("bytescheduler")(profile, contended, partition_bytes=partition_bytes, credit=credit)
            plan.validate(profile)
            assert len(plan.ops) == sum(g.num_blocks for g in gradient_groups(profile, partition_bytes))
            timeline = simulate(plan, profile, contended)
            assert [span.start for span in timeline.ops] == [pytest.approx(l.start, abs=1e-9) for l in launches]


# -- US-Byte: hand-computed ------------------------------------------------------------------
# S_p = 4 bytes = 1 fp32 element, so an op of n blocks lasts T_ar(n) = 1 + n.
# Layers 0, 1, 2 hold 2, 3, 4 blocks; t_b = 1, 2.5, 1; layer 2 is ready at 1, layer 1 at 3.5,
# layer 0 at 4.5 (end of backward); every t_f = 1.
MERGE_PROFILE = [(2, 1, 1), (3, 1, 2.5), (4, 1, 1)]


def test_us_byte_algorithm_1_with_sequential_priorities():
    # During layer 1's backward (1 → 3.5) the gap is 2.5: Case 2, ΔB = ⌈(2.5 − 1)/1⌉ = 2 blocks of
    # layer 2, 1–4. During layer 0's backward (→ 4.5) the gap is 0.5 < a: Case 1, one block of
    # layer 1 (now most urgent), 4–6. Phase two from 6: layer 0 (2) 6–9, layer 1 (2) 9–12,
    # layer 2 (2) 12–15. Forward: 9–10, 12–13, 15–16.
    profile, cost = toy_profile(MERGE_PROFILE), hand_cost()
    groups = gradient_groups(profile, 4)
    schedule = us_byte.phase_one(groups, [0, 1, 2], cost, profile)
    assert [(op.group, op.first_block, op.blocks) for op in schedule.ops] == [(2, 0, 2), (1, 0, 1)]
    assert [op.start for op in schedule.ops] == in_ms([1, 4])
    assert schedule.remaining == [2, 2, 2]
    assert us_byte.iteration_time(schedule, groups, profile, cost) == pytest.approx(16 * MS)


def test_us_byte_greedy_raises_the_output_layer_and_merges_its_blocks():
    # Algorithm 2, l = 2: layer 2's first op starts at 1, all of it would end at 1 + T_ar(4) = 6,
    # after every layer is ready, so eq. 13 gives k = 1: P1 = (1, 2, 0). Algorithm 1 then sends
    # 2 blocks of layer 2 at 1 (Case 2 as above); at 4 layer 2 is still most urgent, so lines
    # 13–14 merge: from 1 the gap to 4.5 is 3.5, ΔB = ⌈2.5⌉ = 3 blocks, 1–5. Phase two from 5:
    # layer 0 (2) 5–8, layer 1 (3) 8–12, layer 2 (1) 12–14. Forward: 8–9, 12–13, 14–15: t = 15 < 16.
    profile, cost = toy_profile(MERGE_PROFILE), hand_cost()
    plan = get("us_byte")(profile, cost, partition_bytes=4).validate(profile)
    assert slices_of(plan) == [[("t2", 0, 3)], [("t0", 0, 2)], [("t1", 0, 3)], [("t2", 3, 1)]]
    assert [op.phase for op in plan.ops] == [B, F, F, F]
    assert {op.channel for op in plan.ops} == {0}
    timeline = simulate(plan, profile, cost)
    assert [span.start for span in timeline.ops] == in_ms([1, 5, 8, 12])
    assert timeline.iteration_time == pytest.approx(15 * MS)


def test_us_byte_sends_fewer_ops_and_ends_sooner_than_bytescheduler_and_wfbp():
    # ByteScheduler (credit 1): 9 one-block ops of 2: layer 2's blocks 1–3, 3–5; from 5 layer 0
    # (5–9), layer 1 (9–15), layer 2's last two (15–19). Forward 9–10, 15–16, 19–20: t = 20.
    # WFBP: layer 2 1–6, layer 1 6–10, layer 0 10–13, then forward 13–16: t = 16.
    profile, cost = toy_profile(MERGE_PROFILE), hand_cost()
    us = get("us_byte")(profile, cost, partition_bytes=4)
    byte = get("bytescheduler")(profile, cost, partition_bytes=4, credit=1)
    assert (len(us.ops), len(byte.ops)) == (4, 9)
    assert simulate(byte, profile, cost).iteration_time == pytest.approx(20 * MS)
    assert simulate(get("wfbp")(profile, cost), profile, cost).iteration_time == pytest.approx(16 * MS)


def test_us_byte_case_3_idle_channel_then_case_2():
    # t_b = 1.5, 10, 1: layer 2 ready at 1, layer 1 at 11, layer 0 at 12.5. From 1 the gap to 11
    # is 10 ≥ T_ar(4) = 5: Case 3, all of layer 2, 1–6; nothing is left, so the channel idles to 11
    # (lines 10–12). Gap 1.5 to 12.5: Case 2, ⌈0.5⌉ = 1 block of layer 1, 11–13. Phase two:
    # layer 0 (2) 13–16, layer 1 (2) 16–19. Forward: 16–17, 19–20, 20–21. Raising layer 1
    # (l = 1, k = 1) changes nothing, layer 2 ends before layer 1 is ready (k = l): t = 21.
    profile, cost = toy_profile([(2, 1, 1.5), (3, 1, 10), (4, 1, 1)]), hand_cost()
    plan = get("us_byte")(profile, cost, partition_bytes=4).validate(profile)
    assert slices_of(plan) == [[("t2", 0, 4)], [("t1", 0, 1)], [("t0", 0, 2)], [("t1", 1, 2)]]
    assert [op.phase for op in plan.ops] == [B, B, F, F]
    timeline = simulate(plan, profile, cost)
    assert [span.start for span in timeline.ops] == in_ms([1, 11, 13, 16])
    assert timeline.iteration_time == pytest.approx(21 * MS)


def test_wfbp_equivalent_sends_whole_layers_output_first_then_phase_two_in_order():
    # MERGE_PROFILE with whole-layer ops: layer 2 (4 elements) 1–6; layer 1 is ready at 3.5 but
    # the channel is busy until 6, after backward (4.5), so layers 0 (6–9) and 1 (9–13) go to phase
    # two in order. Forward: 9–10, 13–14, 14–15.
    profile, cost = toy_profile(MERGE_PROFILE), hand_cost()
    candidate = us_byte.wfbp_equivalent(profile, cost)
    plan = Plan(tuple(us_byte.candidate_ops(candidate)))
    assert slices_of(plan) == [[("t2", 0, 4)], [("t0", 0, 2)], [("t1", 0, 3)]]
    assert candidate.time == pytest.approx(15 * MS)
    assert simulate(plan, profile, cost).iteration_time == pytest.approx(candidate.time)


# -- US-Byte: model, bounds and Theorem 1 on random cases ---------------------------------------
def test_us_byte_closed_form_equals_the_simulator_for_any_priorities():
    rng = random.Random(11)
    for profile, cost, partition_bytes in random_cases(seed=5, count=150):
        groups = gradient_groups(profile, partition_bytes)
        priorities = rng.sample(range(len(groups)), len(groups))
        schedule = us_byte.phase_one(groups, priorities, cost, profile)
        predicted = us_byte.iteration_time(schedule, groups, profile, cost)
        candidate = us_byte.Candidate(groups, priorities, schedule, predicted)
        plan = Plan(tuple(us_byte.candidate_ops(candidate))).validate(profile)
        timeline = simulate(plan, profile, cost)
        assert timeline.iteration_time == pytest.approx(predicted, rel=1e-9)
        assert [span.start for span in timeline.ops[: len(schedule.ops)]] == [
            pytest.approx(op.start, rel=1e-9) for op in schedule.ops
        ]


def test_us_byte_is_never_slower_than_bytescheduler_wfbp_or_its_own_start():
    for profile, cost, partition_bytes in random_cases(seed=9, count=150):
        plan = get("us_byte")(profile, cost, partition_bytes=partition_bytes).validate(profile)
        assert {op.channel for op in plan.ops} == {0}
        ours = simulate(plan, profile, cost).iteration_time
        groups = gradient_groups(profile, partition_bytes)
        start = us_byte.phase_one(groups, list(range(len(groups))), cost, profile)
        others = {
            "sequential start": us_byte.iteration_time(start, groups, profile, cost),
            "wfbp": simulate(get("wfbp")(profile, cost), profile, cost).iteration_time,
            "bytescheduler": simulate(
                get("bytescheduler")(profile, cost, partition_bytes=partition_bytes, credit=1), profile, cost
            ).iteration_time,
        }
        for name, theirs in others.items():
            assert ours <= theirs * (1 + 1e-9), name


def test_us_byte_overlaps_the_backward_of_an_input_layer_without_parameters():
    # Layer 0 ("input") has no parameters and 4 ms of backward; layer 1 ("fc", 1M fp32 = 4 MB,
    # one block of the default S_p) is ready at 0. a = 1 ms, b = 1 ns/byte: its op lasts 5 ms.
    # WFBP: fc 0–5 during backward (0–4), forward 5–6 (input), 6–8 (fc): t = 8. Phase one runs
    # to the end of backward at 4 (eq. 9), so US-Byte sends fc in it too, 0–5, and also ends at 8;
    # sent in phase two from 4 it would end at 9 and t would be 11.
    profile = ModelProfile("input_without_parameters", (
        LayerProfile("input", (), 1 * MS, 4 * MS),
        LayerProfile("fc", (TensorSpec("fc.weight", 1_000_000),), 2 * MS, 0.0),
    ))
    cost = CostModel(1 * MS, 1e-9)
    wfbp = simulate(get("wfbp")(profile, cost), profile, cost).iteration_time
    assert wfbp == pytest.approx(8 * MS)
    plan = get("us_byte")(profile, cost).validate(profile)
    assert slices_of(plan) == [[("fc.weight", 0, 1_000_000)]]
    assert [op.phase for op in plan.ops] == [B]
    timeline = simulate(plan, profile, cost)
    assert [span.start for span in timeline.ops] == in_ms([0])
    assert timeline.iteration_time == pytest.approx(8 * MS)
    assert timeline.iteration_time <= wfbp * (1 + 1e-9)
    for groups in (gradient_groups(profile, DEFAULT_PARTITION_BYTES), gradient_groups(profile, profile.total_bytes)):
        schedule = us_byte.phase_one(groups, [0], cost, profile)
        assert [(op.group, op.first_block, op.blocks, op.start) for op in schedule.ops] == [(0, 0, 1, 0.0)]
        assert (schedule.remaining, schedule.end) == ([0], pytest.approx(5 * MS))


def random_profile_with_parameterless_layers(rng, layers):
    """Like random_profile, but layers (the input layer more often) may have no parameters; those
    (activations, pooling) get a tenth of the forward time, so it rarely hides a late phase two."""
    profile = random_profile(rng, layers)
    bare = [rng.random() < (0.5 if i == 0 else 0.3) for i in range(layers)]
    bare[rng.randrange(layers)] = False  # a profile needs one gradient tensor
    return ModelProfile("random_bare", tuple(
        LayerProfile(layer.name, (), layer.forward_time / 10, layer.backward_time) if empty else layer
        for layer, empty in zip(profile.layers, bare)
    ))


def test_us_byte_is_never_slower_than_wfbp_with_parameterless_layers():
    rng = random.Random(17)
    bare_input = 0
    for _ in range(40):
        profile = random_profile_with_parameterless_layers(rng, rng.randint(2, 6))
        cost = CostModel(rng.uniform(0.1, 2), rng.uniform(0.01, 0.2))
        partition_bytes = rng.choice([4, 8, 16, 40])
        plan = get("us_byte")(profile, cost, partition_bytes=partition_bytes).validate(profile)
        ours = simulate(plan, profile, cost).iteration_time
        wfbp = simulate(get("wfbp")(profile, cost), profile, cost).iteration_time
        assert ours <= wfbp * (1 + 1e-9)
        candidate = us_byte.wfbp_equivalent(profile, cost)  # its promise, and the closed form = the simulator
        assert candidate.time <= wfbp * (1 + 1e-9)
        assert simulate(Plan(tuple(us_byte.candidate_ops(candidate))), profile, cost).iteration_time == \
            pytest.approx(candidate.time, rel=1e-9)
        bare_input += not profile.layers[0].tensors
    assert bare_input >= 10  # enough cases of the defect's shape


def test_theorem_1_sequential_phase_two_beats_every_permutation():
    compared = 0
    for profile, cost, partition_bytes in random_cases(seed=13, count=60, max_layers=5):
        plan = get("us_byte")(profile, cost, partition_bytes=partition_bytes)
        layer_of = profile.layer_of_tensor()
        backward = tuple(op for op in plan.ops if op.phase == BACKWARD)
        by_layer = {}  # a layer's phase-two ops (one per gradient group) stay together
        for op in plan.ops:
            if op.phase == FORWARD:
                by_layer.setdefault(layer_of[op.slices[0].tensor], []).append(op)
        assert list(by_layer) == sorted(by_layer)
        sequential = simulate(plan, profile, cost).iteration_time
        for order in itertools.permutations(by_layer.values()):
            permuted = Plan(backward + tuple(op for ops in order for op in ops)).validate(profile)
            assert sequential <= simulate(permuted, profile, cost).iteration_time * (1 + 1e-9)
        compared += len(by_layer) >= 3
    assert compared >= 10  # enough cases where the order has something to get wrong


# -- options -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, options, field",
    [
        ("bytescheduler", {"partition_bytes": 0}, "partition_bytes"),
        ("bytescheduler", {"partition_bytes": -4}, "partition_bytes"),
        ("bytescheduler", {"partition_bytes": 4.5}, "partition_bytes"),
        ("bytescheduler", {"credit": 0}, "credit"),
        ("bytescheduler", {"credit": True}, "credit"),
        ("bytescheduler", {"threshold": 1}, "threshold"),
        ("us_byte", {"partition_bytes": 0}, "partition_bytes"),
        ("us_byte", {"credit": 2}, "credit"),
    ],
)
def test_bad_options_are_config_errors_naming_the_field(name, options, field):
    profile = toy_profile(MERGE_PROFILE)
    with pytest.raises(ConfigError, match=field):
        get(name)(profile, hand_cost(), **options)
