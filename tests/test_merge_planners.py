"""mg_wfbp (mg-wfbp Algorithm 1) and optimal_merge (exact DP over contiguous groups).

Toy tensors are fp32 (numel 1000 = 4000 bytes); with a = 1 ms and b = 1 µs/byte an all-reduce of
n bytes takes 1 + n/1000 ms. Paper layer k is profile layer k − 1; "t<i>" is profile layer i's tensor.
"""
import itertools
import random

import pytest

from gradsync import ConfigError, CostModel, planners, simulate
from gradsync.planners.mg_wfbp import merge_units
from gradsync.planners.optimal_merge import Groups, earliest_ends
from gradsync.profile import LayerProfile, ModelProfile, TensorSpec
from helpers import MS, toy_profile

COST = CostModel(1 * MS, 1e-6)
MERGE_PLANNERS = ("mg_wfbp", "optimal_merge")


def groups(plan):
    return [op.tensors() for op in plan.ops]


def comm_end(name, profile, cost=COST, **options):
    return simulate(planners.get(name)(profile, cost, **options), profile, cost).comm_end


# -- hand-computed examples --------------------------------------------------------------------


def test_greedy_merge_is_not_always_optimal():
    # t0: 4000 B (5 ms), t1: 12000 B (13 ms), t2: 1000 B (2 ms); backward 1.5, 0.5, 0 ms, so
    # t2 is ready at 0, t1 at 0.5, t0 at 2.0.
    profile = toy_profile([(1000, 0, 1.5), (3000, 0, 0.5), (250, 0, 0)])
    # Algorithm 1: τ_c(3) = 0; l = 3: τ_b(1) − τ_c(3) = 0.5 − 0 < a = 1 → merge, t_c(2) = T(13000) = 14,
    # τ_c(2) = max(0 + 0, 0.5) = 0.5; l = 2: τ_b(0) − τ_c(2) = 2.0 − 0.5 = 1.5 ≥ 1 → keep.
    # τ_c(1) = max(0.5 + 14, 2.0) = 14.5, last all-reduce ends at 14.5 + 5 = 19.5.
    mg = planners.get("mg_wfbp")(profile, COST)
    assert groups(mg) == [["t2", "t1"], ["t0"]]
    assert simulate(mg, profile, COST).comm_end == pytest.approx(19.5 * MS)
    # The four partitions: {t2}{t1}{t0}: 0→2, 2→15, 15→20; {t2 t1}{t0}: 19.5 (above);
    # {t2}{t1 t0}: 0→2, then ready 2.0, 2→2+17 = 19; {t2 t1 t0}: ready 2.0, 2→2+18 = 20.
    best = planners.get("optimal_merge")(profile, COST)
    assert groups(best) == [["t2"], ["t1", "t0"]]
    assert simulate(best, profile, COST).comm_end == pytest.approx(19 * MS)
    assert comm_end("wfbp", profile) == pytest.approx(20 * MS)


def test_merges_chain_until_backward_hides_the_start_up():
    # four layers of 1000 B (2 ms each); backward 5, 0.5, 0.5, 0 ms → ready t3 0, t2 0.5, t1 1.0, t0 6.0.
    profile = toy_profile([(250, 0, 5), (250, 0, 0.5), (250, 0, 0.5), (250, 0, 0)])
    # l = 4: 0.5 − 0 < 1 → merge, t_c(3) = T(2000) = 3, τ_c(3) = max(0, 0.5) = 0.5;
    # l = 3: 1.0 − 0.5 < 1 → merge, t_c(2) = T(3000) = 4, τ_c(2) = max(0.5, 1.0) = 1.0;
    # l = 2: 6.0 − 1.0 = 5 ≥ 1 → keep; τ_c(1) = max(1.0 + 4, 6.0) = 6.0, end 6.0 + 2 = 8.
    mg = planners.get("mg_wfbp")(profile, COST)
    assert groups(mg) == [["t3", "t2", "t1"], ["t0"]]
    assert simulate(mg, profile, COST).comm_end == pytest.approx(8 * MS)
    # The input layer's own op cannot end before 6 + 2 = 8, so 8 is optimal. WFBP reaches it too
    # (0→2, 2→4, 4→6, 6→8) with four ops; one op ends at 6 + 5 = 11; the other two-op partitions
    # end at 10 ({t3}{t2 t1 t0}: 6→6+4) and 9 ({t3 t2}{t1 t0}: 6→6+3). The tie goes to this plan.
    assert comm_end("wfbp", profile) == pytest.approx(8 * MS)
    assert groups(planners.get("optimal_merge")(profile, COST)) == [["t3", "t2", "t1"], ["t0"]]


def test_optimal_merge_two_layers_keeps_them_apart_when_backward_hides_one():
    profile = toy_profile([(1000, 0, 3), (1000, 0, 1)])  # ready t1 at 1, t0 at 4
    # apart: 1→6, 6→11; together: ready 4, 4→4 + T(8000) = 13
    plan = planners.get("optimal_merge")(profile, COST)
    assert groups(plan) == [["t1"], ["t0"]]
    assert simulate(plan, profile, COST).comm_end == pytest.approx(11 * MS)


def test_optimal_merge_two_layers_merges_when_start_up_dominates():
    profile = toy_profile([(250, 0, 0.5), (250, 0, 0)])  # ready t1 at 0, t0 at 0.5
    # apart: 0→2, 2→4; together: ready 0.5, 0.5→0.5 + T(2000) = 3.5
    plan = planners.get("optimal_merge")(profile, COST)
    assert groups(plan) == [["t1", "t0"]]
    assert simulate(plan, profile, COST).comm_end == pytest.approx(3.5 * MS)


# -- the paper's conditions --------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 2, 4, 9])
def test_no_merge_when_every_communication_is_hidden(layers):
    # Case 1 of §III: t_c(l) = 5 ms ≤ t_b(l − 1) = 50 ms, so τ_b(l−2) − τ_c(l) = 50 ≥ a for every l.
    profile = toy_profile([(1000, 1, 50)] * layers)
    assert planners.get("mg_wfbp")(profile, COST).ops == planners.get("wfbp")(profile, COST).ops


@pytest.mark.parametrize("layers", [2, 3, 7])
def test_single_op_when_start_up_dominates(layers):
    # a = 1 s against backward times of 1 ms: τ_b(l−2) − τ_c(l) ≤ t_b(l−1) < a for every l.
    cost = CostModel(1.0, 1e-9)
    profile = toy_profile([(1000, 1, 1)] * layers)
    for name in MERGE_PLANNERS:
        plan = planners.get(name)(profile, cost)
        assert len(plan.ops) == 1
        assert len(plan.ops[0].slices) == layers


def test_a_layer_travels_in_one_op():
    # weight 4000 B and bias 40 B per layer (5.04 ms alone), backward 50 ms each: ready at 50, 100, 150.
    profile = ModelProfile(
        "m",
        tuple(
            LayerProfile(f"l{i}", (TensorSpec(f"w{i}", 1000), TensorSpec(f"b{i}", 10)), 0, 50 * MS)
            for i in range(3)
        ),
    )
    # Algorithm 1 merges nothing (100 − 50 and 150 − 100 ≥ a) but keeps each layer's weight and bias
    # in one op, where WFBP sends each tensor alone.
    assert groups(planners.get("mg_wfbp")(profile, COST)) == [["b2", "w2"], ["b1", "w1"], ["b0", "w0"]]
    assert len(planners.get("wfbp")(profile, COST).ops) == 6
    # The earliest end is 150 + 5.04 (the input layer's own op). Merging layers 2 and 1 still ends
    # by then (100 → 100 + 1 + 8.08 = 109.08 ≤ 150); all three in one op ends at 150 + 13.12.
    # So the fewest ops at the earliest end are two.
    best = planners.get("optimal_merge")(profile, COST)
    assert groups(best) == [["b2", "w2", "b1", "w1"], ["b0", "w0"]]
    assert simulate(best, profile, COST).comm_end == pytest.approx(155.04 * MS)


def test_element_sizes_never_share_an_op():
    mixed = LayerProfile("mixed", (TensorSpec("w16", 100, 2), TensorSpec("b32", 10, 4)), 0, 0)
    half = LayerProfile("half", (TensorSpec("h", 100, 2),), 0, 0)
    profile = ModelProfile("m", (half, mixed))
    cost = CostModel(1.0, 1e-9)  # start-up dominates: everything merges that may
    # backward order b32, w16, h: the fp32 bias cannot join the fp16 tensors, even of its own layer
    for name in MERGE_PLANNERS:
        plan = planners.get(name)(profile, cost).validate(profile)
        assert groups(plan) == [["b32"], ["w16", "h"]]


@pytest.mark.parametrize("name", MERGE_PLANNERS)
def test_unknown_option_is_rejected(name):
    with pytest.raises(ConfigError, match="unknown option.*'threshold'"):
        planners.get(name)(toy_profile([(10, 1, 1)]), COST, threshold=3)


# -- brute force and comparisons on random profiles ---------------------------------------------


def random_profile(rng, layers, element_sizes=(4,)):
    """Layer sizes spread over 10²–5·10⁶ elements as in mg-wfbp Fig. 5a; some layers have a bias."""
    specs = []
    for i in range(layers):
        size = rng.choice(element_sizes)
        tensors = [TensorSpec(f"w{i}", int(10 ** rng.uniform(2, 6.7)), size)]
        if rng.random() < 0.5:
            tensors.append(TensorSpec(f"b{i}", rng.randint(1, 2000), rng.choice(element_sizes)))
        specs.append(LayerProfile(f"l{i}", tuple(tensors), rng.uniform(0, 3) * MS, rng.uniform(0, 6) * MS))
    return ModelProfile("random", tuple(specs))


def random_cost(rng):
    """From a fast network with a tiny start-up to a slow one where start-up dominates."""
    return CostModel(10 ** rng.uniform(-5, -2), 10 ** rng.uniform(-10.5, -8))


def sequential_end(groups_of_tensors, ready, nbytes, cost):
    """End of the last op when groups run one after another, each from max(ready, previous end)."""
    end = 0.0
    for group in groups_of_tensors:
        end = max(end, max(ready[t] for t in group)) + cost.a + cost.b * sum(nbytes[t] for t in group)
    return end


def contiguous_partitions(items):
    for cuts in itertools.product((False, True), repeat=len(items) - 1):
        groups_, current = [], [items[0]]
        for item, cut in zip(items[1:], cuts):
            if cut:
                groups_.append(current)
                current = []
            current.append(item)
        yield groups_ + [current]


def brute_force(profile, cost, units):
    """Earliest end over every contiguous partition of `units` (lists of tensors in backward order)
    whose groups hold one element size, and the fewest ops among the partitions that reach it."""
    layer_of = profile.layer_of_tensor()
    ready_of_layer = profile.backward_ready_times()
    tensors = profile.tensor_map()
    ready = {name: ready_of_layer[layer_of[name]] for name in tensors}
    nbytes = {name: spec.nbytes for name, spec in tensors.items()}
    outcomes = []
    for partition in contiguous_partitions(units):
        flat = [[t for unit in group for t in unit] for group in partition]
        if all(len({tensors[t].bytes_per_element for t in group}) == 1 for group in flat):
            outcomes.append((sequential_end(flat, ready, nbytes, cost), len(flat)))
    best = min(end for end, _ in outcomes)
    return best, min(ops for end, ops in outcomes if end <= best * (1 + 1e-12))


def backward_tensor_names(profile):
    return [t.name for layer in reversed(profile.layers) for t in reversed(layer.tensors)]


@pytest.mark.parametrize("seed", range(50))
def test_optimal_merge_equals_brute_force_over_layer_partitions(seed):
    rng = random.Random(seed)
    profile, cost = random_profile(rng, rng.randint(1, 10)), random_cost(rng)
    layers = [[t.name for t in reversed(layer.tensors)] for layer in reversed(profile.layers)]
    plan = planners.get("optimal_merge")(profile, cost).validate(profile)
    timeline = simulate(plan, profile, cost)
    end, ops = brute_force(profile, cost, layers)
    assert (timeline.comm_end, len(plan.ops)) == (pytest.approx(end, rel=1e-12), ops)
    assert timeline.iteration_time == pytest.approx(timeline.comm_end + profile.forward_time, rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_optimal_merge_equals_brute_force_over_tensor_partitions_with_mixed_element_sizes(seed):
    # Finer than layers: any tensor may end a group, so this also checks that splitting a layer
    # never helps, and that groups of one element size are the only constraint.
    rng = random.Random(1000 + seed)
    profile, cost = random_profile(rng, rng.randint(1, 6), element_sizes=(2, 4)), random_cost(rng)
    tensors = [[name] for name in backward_tensor_names(profile)]
    plan = planners.get("optimal_merge")(profile, cost).validate(profile)
    end, ops = brute_force(profile, cost, tensors)
    assert (simulate(plan, profile, cost).comm_end, len(plan.ops)) == (pytest.approx(end, rel=1e-12), ops)


def test_simulator_on_one_channel_gives_the_dp_value():
    rng = random.Random(7)
    for _ in range(20):
        profile, cost = random_profile(rng, rng.randint(1, 40)), random_cost(rng)
        dp_ends = earliest_ends(Groups(merge_units(profile), cost))
        plan = planners.get("optimal_merge")(profile, cost)
        assert simulate(plan, profile, cost).comm_end == pytest.approx(dp_ends[-1], rel=1e-12)


DDP_CAPS = [{}, {"bucket_cap_bytes": 1 << 20}, {"bucket_cap_bytes": 1 << 16, "first_bucket_bytes": 1 << 12}]


@pytest.mark.parametrize("seed", range(30))
def test_optimal_merge_never_worse_than_the_other_planners(seed):
    rng = random.Random(2000 + seed)
    profile, cost = random_profile(rng, rng.randint(2, 60)), random_cost(rng)
    best = simulate(planners.get("optimal_merge")(profile, cost).validate(profile), profile, cost).iteration_time
    others = [("mg_wfbp", {}), ("wfbp", {})] + [("ddp", caps) for caps in DDP_CAPS]
    for name, options in others:
        plan = planners.get(name)(profile, cost, **options).validate(profile)
        assert best <= simulate(plan, profile, cost).iteration_time * (1 + 1e-12), (name, options)


@pytest.mark.parametrize("seed", range(10))
def test_mixed_element_sizes_never_worse_than_wfbp_and_mg_wfbp(seed):
    rng = random.Random(3000 + seed)
    profile, cost = random_profile(rng, rng.randint(2, 30), element_sizes=(2, 4)), random_cost(rng)
    best = comm_end("optimal_merge", profile, cost)
    for name in ("mg_wfbp", "wfbp"):
        planners.get(name)(profile, cost).validate(profile)
        assert best <= comm_end(name, profile, cost) * (1 + 1e-12), name


def test_large_profile_plans_are_valid_and_ordered():
    rng = random.Random(604)
    profile, cost = random_profile(rng, 604), CostModel.preset("mg-wfbp-10gbe")
    order = backward_tensor_names(profile)
    times = {}
    for name in MERGE_PLANNERS:
        plan = planners.get(name)(profile, cost).validate(profile)
        assert [t for op in plan.ops for t in op.tensors()] == order  # contiguous, backward order
        assert {op.channel for op in plan.ops} == {0} and {op.phase for op in plan.ops} == {"backward"}
        times[name] = simulate(plan, profile, cost).iteration_time
    assert times["optimal_merge"] <= times["mg_wfbp"] * (1 + 1e-12)
