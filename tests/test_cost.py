import math

import numpy as np
import pytest

from gradsync import ConfigError, CostModel


def test_allreduce_time_is_eq3_and_zero_for_empty():
    cost = CostModel(1e-3, 2e-9)
    assert cost.allreduce_time(1e6) == pytest.approx(1e-3 + 2e-3)
    assert cost.allreduce_time(0) == 0.0


def test_penalty_eq11():
    cost = CostModel(1e-3, 2e-9, gamma=1.5)
    assert cost.penalty(1e6) == pytest.approx(0.5 * 2e-9 * 1e6)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_ring_table_ii(workers):
    alpha, beta, add = 5e-6, 1e-9, 1e-10
    cost = CostModel.from_network(alpha, beta, workers, sum_time=add)
    n = workers
    assert cost.a == pytest.approx(2 * (n - 1) * alpha)
    assert cost.b == pytest.approx(2 * (n - 1) / n * beta + (n - 1) / n * add)


def test_tree_and_halving_doubling_table_ii():
    tree = CostModel.from_network(1e-6, 1e-9, 8, sum_time=1e-10, algorithm="binary_tree")
    assert (tree.a, tree.b) == pytest.approx((2e-6 * 3, (2e-9 + 1e-10) * 3))
    hd = CostModel.from_network(1e-6, 1e-9, 8, sum_time=1e-10, algorithm="halving_doubling")
    assert hd.b == pytest.approx(2e-9 - (2e-9 + 1e-10) / 8 + 1e-10)


def test_presets_reproduce_the_papers_numbers():
    asc = CostModel.preset("asc-wfbp-10gbe")
    assert (asc.a, asc.b, asc.gamma) == pytest.approx((1.4e-3, 1.7e-9, 1.5))
    us1 = CostModel.preset("us-byte-cluster1")
    assert (us1.a, us1.b) == pytest.approx((910.5e-6, 0.352e-10))
    mg = [CostModel.preset("mg-wfbp-10gbe", workers=n).a for n in (2, 4, 8)]
    assert mg == pytest.approx([90.52e-6, 271.56e-6, 633.64e-6])


def test_fit_recovers_a_b_gamma():
    rng = np.random.default_rng(0)
    sizes = np.linspace(1e3, 64e6, 12)
    times = 0.9e-3 + 1.6e-9 * sizes
    noisy = times * (1 + 0.002 * rng.standard_normal(sizes.size))
    pair_sizes = np.array([8e6, 32e6])
    pair_times = 0.9e-3 + 1.4 * 1.6e-9 * pair_sizes
    cost = CostModel.fit(sizes, noisy, pair_sizes, pair_times)
    assert cost.a == pytest.approx(0.9e-3, rel=0.05)
    assert cost.b == pytest.approx(1.6e-9, rel=0.01)
    assert cost.gamma == pytest.approx(1.4, rel=0.02)
    assert cost.fit_report.samples == 12 and cost.fit_report.r_squared > 0.999


@pytest.mark.parametrize("kwargs, field", [({"a": 0, "b": 1e-9}, "'a'"), ({"a": 1e-3, "b": -1}, "'b'"),
                                           ({"a": 1e-3, "b": 1e-9, "gamma": 0.9}, "'gamma'"),
                                           ({"a": math.nan, "b": 1e-9}, "'a'")])
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        CostModel(**kwargs)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ConfigError, match="asc-wfbp-10gbe"):
        CostModel.preset("nope")


def test_a_cost_model_round_trips_through_its_dict_and_refuses_other_mappings():
    cost = CostModel(1e-3, 2e-9, 1.5, "fitted", host=3e-4, compute_slowdown=1.2, transfer_slowdown=1.4,
                     ops_per_channel=2)
    assert CostModel.from_dict(cost.to_dict()) == cost
    for data, message in (([1e-3, 1e-9], "must be an object"), ({"a": 1e-3}, r"missing \['b'\]"),
                          ({"a": 1e-3, "b": 1e-9, "zeta": 1}, r"unknown key\(s\) \['zeta'\]"),
                          ({"a": True, "b": 1e-9}, "'a' must be a finite number"),
                          ({"a": 1e-3, "b": 1e-9, "gamma": True}, "'gamma' must be a finite number")):
        with pytest.raises(ConfigError, match=message):
            CostModel.from_dict(data)


@pytest.mark.parametrize("workers", [0, 1, -3, True, 2.0])
def test_a_preset_refuses_a_worker_count_no_all_reduce_has(workers):
    # 0 used to fall back silently to the paper's own worker count
    with pytest.raises(ConfigError, match="'workers'"):
        CostModel.preset("asc-wfbp-10gbe", workers=workers)


def test_fit_rejects_degenerate_samples():
    with pytest.raises(ConfigError):
        CostModel.fit([1e6, 1e6], [1e-3, 1e-3])


def test_clamped_fit_keeps_unresolvable_terms_positive():
    sizes = [4e3, 4e4, 4e5]
    falling = [2.1e-4, 2.0e-4, 1.9e-4]  # noise makes the slope negative
    with pytest.raises(ConfigError, match="b="):
        CostModel.fit(sizes, falling)
    cost = CostModel.fit(sizes, falling, clamp=True)
    _, intercept = np.polyfit(sizes, falling, 1)
    assert cost.b == 1e-15 and cost.a == pytest.approx(intercept)


# 4 netbed ranks at 31 Mbit/s: the middle sizes lie below the line through the smallest and the
# largest, and a stream of ops that carry nothing took 2.8 ms per op
BENT_SIZES = [4096, 16384, 65536, 262144, 716800]
BENT_TIMES = [5.35e-3, 7.85e-3, 27.8e-3, 110e-3, 300e-3]


def test_a_least_start_up_holds_a_and_the_slope_is_fitted_under_it():
    free = CostModel.fit(BENT_SIZES, BENT_TIMES, clamp=True)
    assert free.a < 2e-3  # the intercept, below what an empty op costs
    held = CostModel.fit(BENT_SIZES, BENT_TIMES, clamp=True, least_start_up=2.8e-3)
    assert held.a == 2.8e-3

    def squared_error(b):
        return sum((2.8e-3 + b * m - t) ** 2 for m, t in zip(BENT_SIZES, BENT_TIMES))

    # the slope is the least-squares one with a held: no nearby slope fits better
    assert all(squared_error(held.b) < squared_error(held.b * (1 + step)) for step in (-1e-3, 1e-3))
    assert held.fit_report.rmse == pytest.approx(math.sqrt(squared_error(held.b) / len(BENT_SIZES)))
    # a least start-up below the intercept leaves the fit as it was
    assert CostModel.fit(BENT_SIZES, BENT_TIMES, clamp=True, least_start_up=free.a / 2) == free


@pytest.mark.parametrize("least", [-1e-3, math.inf, math.nan])
def test_a_least_start_up_must_be_a_finite_time(least):
    with pytest.raises(ConfigError, match="least start-up"):
        CostModel.fit(BENT_SIZES, BENT_TIMES, least_start_up=least)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_a_ring_all_reduce_is_its_reduce_scatter_then_a_ring_all_gather(workers):
    """The reduce-scatter holds every summation, (N−1)α + (N−1)/N·(β + sum)·m; the all-gather
    after it, (N−1)α + (N−1)/N·β·m, completes Table II's ring all-reduce."""
    alpha, beta, add = 5e-6, 1e-9, 1e-10
    n = workers
    ring = CostModel.from_network(alpha, beta, n, sum_time=add)
    a, b = ring.terms("reduce_scatter")
    assert (a, b) == pytest.approx(((n - 1) * alpha, (n - 1) / n * (beta + add)))
    assert (a + (n - 1) * alpha, b + (n - 1) / n * beta) == pytest.approx((ring.a, ring.b))
    halving = CostModel.from_network(alpha, beta, 8, sum_time=add, algorithm="halving_doubling")
    assert halving.terms("reduce_scatter") == pytest.approx((3 * alpha, 7 / 8 * (beta + add)))


def test_reduce_scatter_without_its_own_terms_costs_half_an_all_reduce():
    cost = CostModel(1e-3, 2e-9)
    assert cost.terms() == (1e-3, 2e-9)
    assert cost.terms("reduce_scatter") == pytest.approx((0.5e-3, 1e-9))
    planned = cost.for_collective("reduce_scatter")
    assert (planned.a, planned.b) == pytest.approx((0.5e-3, 1e-9)) and planned.terms("reduce_scatter") == (
        planned.a / 2, planned.b / 2)
    assert cost.for_collective("allreduce") is cost
    with pytest.raises(ConfigError, match="unknown collective 'broadcast'"):
        cost.terms("broadcast")


def test_reduce_scatter_terms_fitted_on_their_own():
    sizes = np.array([0, 1e5, 1e6, 4e6])
    cost = CostModel(1e-3, 2e-9).with_reduce_scatter_fit(sizes, 3e-4 + 7e-10 * sizes)
    assert cost.terms("reduce_scatter") == pytest.approx((3e-4, 7e-10))
    assert (cost.a, cost.b) == (1e-3, 2e-9)
    assert CostModel.from_dict(cost.to_dict()) == cost
    assert "reduce_scatter_a" not in CostModel(1e-3, 2e-9).to_dict()
    with pytest.raises(ConfigError, match="two distinct sizes"):
        cost.with_reduce_scatter_fit([1e6, 1e6], [1e-3, 1e-3])


@pytest.mark.parametrize("terms, needle", [
    ({"reduce_scatter_a": 1e-4}, "needs its pair"),
    ({"reduce_scatter_a": 1e-4, "reduce_scatter_b": 0.0}, "'reduce_scatter_b' must be a finite number > 0"),
    ({"reduce_scatter_a": float("nan"), "reduce_scatter_b": 1e-9}, "'reduce_scatter_a' must be a finite number"),
])
def test_bad_reduce_scatter_terms(terms, needle):
    with pytest.raises(ConfigError, match=needle):
        CostModel(1e-3, 2e-9, **terms)
