"""Re-planning online: the communication's measured time against its own reference, the cost
re-fitted when the network changes, and every rank switching to the new plans at the same iteration."""
import math
import os
import threading
import time

import pytest
import torch
from torch import nn

import gradsync
from gradsync.cost import CostModel
from gradsync.launch import run_local
from gradsync.runtime.channels import Channels
from gradsync.runtime.executor import PlanExecutor
from gradsync.runtime.measure.cost_watch import (AGREE, DRIFT, FLOOR, MAX_REFERENCE_WINDOWS, NOTICEABLE, PERSIST,
                                                 REFERENCE_WINDOWS, WINDOW, CostWatch, per_byte_change)

A, B = 1e-4, 1e-9
SIZES = (40_000, 400_000, 4_000_000)  # the ops of an iteration, bytes (8 ms of busy time)
LAYOUTS = [("plain", sum(SIZES))]
CONTENTION = 1.7  # the computation beside the ops slows them by this factor
SETTLED = REFERENCE_WINDOWS * WINDOW  # iterations a watch times before its first comparison


def busy(extra_b: float = 0.0, contention: float = CONTENTION, extra: float = 0.0):
    """One iteration's (layout, busy seconds): its ops one after another at a + b·m, slowed by
    `contention`, plus what a link whose b grew by `extra_b` adds, plus `extra` seconds."""
    return [("plain", sum(contention * (A + B * size) + extra_b * size for size in SIZES) + extra)]


def iteration_time(times) -> float:
    return 2 * sum(seconds for _, seconds in times)  # the communication is half of the iteration


def reduced_by(combine):
    """A reduction over scripted ranks: `combine` applied to a window's values when it starts, the
    result read at the next iteration (``runtime.over_ranks``)."""
    def start(values):
        result = combine(values)
        return lambda: result
    return start


def watch_over(iterations, combine=lambda values: values, cost=CostModel(A, B), times=iteration_time, watch=None):
    """CostWatch (or `watch`) over `iterations`, the plans made on `cost`:
    [(iteration, re-fitted cost)]."""
    watch = watch or CostWatch(cost, "allreduce", LAYOUTS, reduced_by(combine))
    return [(index, cost) for index, measured in enumerate(iterations)
            if (cost := watch.observe(measured, times(measured))) is not None]


def test_the_per_byte_change_is_the_summed_change_over_the_summed_bytes():
    assert per_byte_change([100, 300], [1e-6, 3e-6]) == pytest.approx(1e-8)
    assert per_byte_change([], []) == 0.0


def test_rescaled_b_scales_every_collectives_b_alone():
    cost = CostModel(A, B, gamma=1.2, host=1e-5, reduce_scatter_a=A / 3, reduce_scatter_b=B / 3)
    rescaled = cost.rescaled_b(4.0)
    assert (rescaled.a, rescaled.b) == pytest.approx((A, 4 * B))
    assert rescaled.terms("reduce_scatter") == pytest.approx((A / 3, 4 * B / 3))
    assert (rescaled.gamma, rescaled.host) == (1.2, 1e-5)
    assert rescaled.rescaled_b(1.0).name == rescaled.name == "custom (re-fitted)"


def test_a_slower_link_is_refitted_after_persisting_windows_and_a_steady_one_never():
    steady = [busy()] * (SETTLED + 6 * WINDOW)
    assert watch_over(steady) == []
    change = SETTLED + 2 * WINDOW  # the rate drops 4x after two windows as before: 3b·m more wire time
    slower = steady[:change] + [busy(extra_b=3 * B)] * (4 * WINDOW)
    iteration, cost = watch_over(slower)[0]
    assert iteration == change + PERSIST * WINDOW  # the iteration after the PERSIST-th slow window
    assert (cost.a, cost.b) == pytest.approx((A, 4 * B), rel=1e-6)  # the contention is no part of it


def test_one_slow_window_a_small_drift_or_an_insignificant_change_is_not_a_change():
    start = [busy()] * (SETTLED + WINDOW)
    one_slow = start + [busy(extra_b=3 * B)] * WINDOW + [busy()] * (3 * WINDOW)
    assert watch_over(one_slow) == []
    below = busy()[0][1] * (DRIFT - 1) * 0.8  # slower, but by less than DRIFT
    assert watch_over(start + [busy(extra=below)] * (4 * WINDOW)) == []
    # slower then faster in consecutive windows is no persisting change either
    alternating = start + ([busy(extra_b=3 * B)] * WINDOW + [busy(contention=0.5)] * WINDOW) * 2
    assert watch_over(alternating) == []
    # 4x slower, beside an iteration a hundred times as long as the communication
    slower = start + [busy(extra_b=3 * B)] * (4 * WINDOW)
    assert watch_over(slower, times=lambda measured: 100 * iteration_time(measured)) == []


def test_sub_millisecond_ops_stretched_by_the_hosts_noise_are_no_change_of_the_link():
    """Windows at 2.0 and 1.5 ms against a reference of 0.38 ms (as measured on 2 loopback ranks
    on a busy host): past DRIFT and SIGNIFICANT of a 4 ms iteration, under NOTICEABLE; the same
    windows ten times as long are a change."""
    reference = 0.38e-3

    def windows(scale: float):
        steady = [[("plain", scale * reference)]] * SETTLED
        noisy = [[("plain", scale * seconds)] for seconds in (2.0e-3, 1.5e-3, 1.5e-3) for _ in range(WINDOW)]
        return steady + noisy + steady[:WINDOW]
    assert 1.5e-3 - reference < NOTICEABLE <= 10 * (1.5e-3 - reference)
    assert watch_over(windows(1), times=lambda _: 4e-3) == []
    assert watch_over(windows(10), times=lambda _: 40e-3) != []


def test_a_faster_link_is_refitted_too_and_the_least_time_over_the_ranks_decides():
    faster = [busy(extra_b=3 * B)] * SETTLED + [busy()] * (3 * WINDOW)  # back from 4b to b
    _, cost = watch_over(faster, cost=CostModel(A, 4 * B))[0]
    assert (cost.a, cost.b) == pytest.approx((A, B), rel=1e-6)
    # a change larger than the term itself leaves it at its floor
    _, floored = watch_over(faster, cost=CostModel(A, B))[0]
    assert floored.b == pytest.approx(FLOOR * B)
    # 4x slower on this rank alone (it waited for its peer): the peer's times, the least, decide
    slower_here = [busy()] * SETTLED + [busy(extra_b=3 * B)] * (3 * WINDOW)
    assert watch_over(slower_here) != []
    peer = [busy()[0][1], iteration_time(busy())]
    assert watch_over(slower_here, combine=lambda values: [min(v, p) for v, p in zip(values, peer)]) == []


def test_a_burst_of_load_while_the_reference_is_timed_is_left_out_of_it():
    burst = busy(contention=3 * CONTENTION)  # the host's load triples the ops' time for one window
    after_burst = [burst] * WINDOW + [busy()] * (6 * WINDOW)
    assert watch_over(after_burst) == []  # one reference over both windows would make the rest "faster"
    # the reference waits for two windows that agree; a link slowing after it is whole is still found
    whole = (REFERENCE_WINDOWS + 1) * WINDOW
    slower = after_burst[:whole + WINDOW] + [busy(extra_b=3 * B)] * (4 * WINDOW)
    iteration, cost = watch_over(slower)[0]
    assert iteration == whole + WINDOW + PERSIST * WINDOW
    assert (cost.a, cost.b) == pytest.approx((A, 4 * B), rel=1e-6)  # on the steady windows' reference


def test_windows_that_never_agree_give_the_median_over_the_most_windows_as_reference():
    steady, heavy = busy()[0][1], busy(contention=2 * CONTENTION)[0][1]
    assert heavy > AGREE * steady  # the two do not agree
    watch = CostWatch(CostModel(A, B), "allreduce", LAYOUTS, reduced_by(lambda values: values))
    alternating = ([busy()] * WINDOW + [busy(contention=2 * CONTENTION)] * WINDOW) * MAX_REFERENCE_WINDOWS
    assert watch_over(alternating[:MAX_REFERENCE_WINDOWS * WINDOW], watch=watch) == []
    assert watch.reference is None  # the last window's times are read at the next iteration
    watch_over(alternating[MAX_REFERENCE_WINDOWS * WINDOW:][:1], watch=watch)
    assert watch.reference == [pytest.approx(steady)]  # 3 steady windows of 5
    # two windows agree at once when within AGREE of each other (beside iterations of the
    # communication alone), or apart by less than SIGNIFICANT of an iteration (here 4x slower)
    for extra, times in ((steady * (AGREE - 1) * 0.9, lambda measured: measured[0][1]),
                         (steady * 3, lambda measured: 100 * steady)):
        watch = CostWatch(CostModel(A, B), "allreduce", LAYOUTS, reduced_by(lambda values: values))
        watch_over([busy()] * WINDOW + [busy(extra=extra)] * WINDOW + [busy()], watch=watch, times=times)
        assert watch.reference == [pytest.approx(steady + extra / 2)]


def test_a_rank_without_timings_still_takes_part_in_every_comparison():
    calls = []

    def combine(values):
        calls.append(values)
        return values
    watch = CostWatch(CostModel(A, B), "allreduce", LAYOUTS, reduced_by(combine))
    for _ in range(SETTLED + 2 * WINDOW):
        assert watch.observe([], 0.01) is None
    assert calls == [[math.inf, 0.01]] * (REFERENCE_WINDOWS + 2)  # every window, the reference's included


class SlowWork:
    """A collective that completes `delay` seconds after the real one: a slower link."""

    def __init__(self, work, delay: float):
        self.future = torch.futures.Future()
        work.get_future().add_done_callback(
            lambda _: threading.Timer(delay, lambda: self.future.set_result(None)).start())

    def wait(self) -> bool:
        self.future.wait()
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def get_future(self):
        return self.future


LINK = {"per_byte": 0.0}  # the emulated link's extra seconds per byte (0: the real one alone)
SLOW_FROM, MAX_STEPS = 30, 240  # the link slows at this step at the earliest (its reference whole)


def reference_whole(model) -> bool:
    """Whether the cost watch of the plans in force has its reference (``CostWatch``, step 2)."""
    watch = gradsync.runtime.attached(model).installed.cost_watch
    return watch is not None and watch.reference is not None


def train_through_a_rate_change(rank: int, world_size: int, replan: bool, trace_path: str | None):
    """Training whose link slows from step SLOW_FROM on, once the reference is whole (without
    re-planning: at SLOW_FROM), and recovers once the plans made again for it have their reference;
    to two steps after the second re-planning (or MAX_STEPS). Every rank takes each decision at the
    same step."""
    real = Channels.all_reduce

    def all_reduce(self, channel, tensor):
        work = real(self, channel, tensor)
        extra = LINK["per_byte"] * tensor.numel() * tensor.element_size()
        return SlowWork(work, extra) if extra else work
    Channels.all_reduce = all_reduce
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = gradsync.wrap(model, optimizer, "mg_wfbp", cost=CostModel(A, B), replan=replan,
                                     trace=trace_path, plan_trials=0)
    generator = torch.Generator().manual_seed(rank)
    replans_seen, changes = [], []  # the steps the link slowed and recovered at
    for step in range(MAX_STEPS):
        replans = gradsync.report(model).replans
        if len(changes) == len(replans) < 2 and step >= SLOW_FROM and (reference_whole(model) or not replan):
            changes.append(step)
            LINK["per_byte"] = 5e-8 if len(changes) == 1 else 0.0  # 3.3 ms more per 64 KiB
        if len(replans) == 2 and step >= replans[1].iteration + 2:
            break
        loss = model(torch.randn(16, 128, generator=generator)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        replans_seen.append(gradsync.report(model).latest.replans)
    report = gradsync.report(model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    result = {"replans": [(r.iteration, r.drift, r.before.b, r.after.b) for r in report.replans],
              "replans_seen": replans_seen, "changes": changes, "parameters": flat,
              "cost_b": report.layouts["plain"].cost.b}
    gradsync.runtime.attached(model).detach()
    return result


def test_two_ranks_replan_at_the_same_iteration_when_the_link_slows_and_again_when_it_recovers(tmp_path):
    ranks = run_local(train_through_a_rate_change, 2, True, str(tmp_path / "trace.json"), timeout=300)
    first, second = ranks
    assert [r[0] for r in first["replans"]] == [r[0] for r in second["replans"]]  # the same iterations
    assert first["changes"] == second["changes"]
    assert torch.equal(first["parameters"], second["parameters"])
    replans = first["replans"]
    assert len(replans) == 2, (replans, first["changes"])
    (slow_at, slow_drift, b_before, b_slow), (fast_at, fast_drift, _, b_fast) = replans
    slow_from, fast_from = first["changes"]
    # iterations count from wrap: 4 of them calibrate the profile before the plans are installed
    assert slow_from < slow_at <= slow_from + 1 + (PERSIST + 1) * WINDOW
    assert slow_at < fast_from < fast_at <= fast_from + 1 + (PERSIST + 1) * WINDOW
    assert slow_drift >= DRIFT and fast_drift <= 1 / DRIFT
    assert b_slow > 2 * b_before and b_fast < b_slow / 2
    assert first["cost_b"] == b_fast  # the plans in force were made on the last re-fitted cost
    seen = first["replans_seen"]
    # in the statistics: the iterations from the one after the decision run the new plans
    assert (seen[slow_at], seen[slow_at + 1], seen[fast_at], seen[fast_at + 1]) == (0, 1, 1, 2)
    marks = (tmp_path / "trace.rank0.json").read_text().count("re-planned")
    assert marks == 2  # and in the trace


def test_replanning_can_be_turned_off():
    first, second = run_local(train_through_a_rate_change, 2, False, None, timeout=300)
    assert first["replans"] == second["replans"] == [] and first["changes"] == [SLOW_FROM]
    assert first["cost_b"] == B
    with pytest.raises(gradsync.ConfigError, match="'replan' must be true or false"):
        gradsync.runtime.check_wrap_arguments(replan="yes")


def record_busy_times() -> list[float]:
    """A list that every busy time the runtime takes from its executors is added to (in a spawned rank)."""
    taken, take = [], PlanExecutor.take_busy_times

    def recorded(executor):
        times = take(executor)
        taken.extend(times)
        return times
    PlanExecutor.take_busy_times = recorded
    return taken


LAG = 0.06  # s: a rank's pause, far above an op's transfer of 16 KiB on loopback


def busy_times_waited_for_and_found_complete(rank: int, world_size: int) -> dict:
    """The rank's busy times, and whether its op is timed by a callback, in two phases of 5
    iterations: rank 1 launching `LAG` late (rank 0's thread waits for the op), then rank 0 pausing
    `LAG` between its backward and its step (its op completes meanwhile)."""
    taken = record_busy_times()
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01), "ddp", plan_trials=0)
    sync = gradsync.runtime.attached(model)
    for executor in sync.installed.executors.values():
        executor.time_ops()
    phases = {}
    for phase in ("waited for", "found complete"):
        taken.clear()
        for _ in range(5):  # the first iteration's busy time is taken at the second's end
            loss = model(torch.randn(8, 64)).square().mean()
            if phase == "waited for" and rank == 1:
                time.sleep(LAG)
            loss.backward()
            if phase == "found complete" and rank == 0:
                time.sleep(LAG)
            optimizer.step()
            optimizer.zero_grad()
        phases[phase] = (list(taken), sync.executor.ops[0].completes_unwatched)
    sync.detach()
    return phases


def test_an_op_is_timed_by_the_wait_for_it_or_by_a_callback_once_found_complete():
    phases = run_local(busy_times_waited_for_and_found_complete, 2, timeout=120)[0]
    waited, unwatched_then = phases["waited for"]
    assert not unwatched_then  # the thread's wait saw every completion
    assert len(waited) >= 3 and all(seconds > 0.6 * LAG for seconds in waited)  # rank 1's lag is in flight
    found, unwatched_now = phases["found complete"]
    assert unwatched_now
    # the first completed during the pause unseen (recorded at the wait, late); a callback times the others
    assert found[1] > LAG and all(seconds < LAG / 2 for seconds in found[2:]), found


def test_the_benchmark_counts_the_iterations_until_the_time_stays_near_the_fresh_runs():
    from benchmarks.replanning import SMOOTHING, settled_after
    # a drop at 10: two slow re-planning iterations, then at the fresh run's 2.0 s (noise inside 5%)
    seconds = [1.0] * 10 + [3.0] * 12 + [2.0, 2.05, 1.97] * 6
    after = settled_after(seconds, 10, len(seconds), 2.0)
    first_inside = next(i for i in range(10 + SMOOTHING - 1, len(seconds))
                        if all(sorted(seconds[j - SMOOTHING + 1:j + 1])[SMOOTHING // 2] <= 1.05 * 2.0
                               for j in range(i, len(seconds))))
    assert after == first_inside - 10 and 12 <= after <= 12 + SMOOTHING
    assert settled_after([1.0] * 10 + [3.0] * 20, 10, 30, 2.0) is None
    assert settled_after([1.0] * 30, 10, 30, 2.0) == SMOOTHING - 1  # faster than the fresh run: within


def time_communication_on_nccl(rank: int, world_size: int) -> list[float]:
    """gradsync on NCCL with its ops' timing on: the busy times the runtime took from its executors."""
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"  # read when wrap makes its process groups
    taken = record_busy_times()
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).cuda()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01), "mg_wfbp", timeout=120)
    for _ in range(24):
        model(torch.randn(32, 256, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    gradsync.runtime.attached(model).detach()
    return taken


@pytest.mark.gpu
def test_the_communication_is_timed_on_nccl(record_property):
    busy, = run_local(time_communication_on_nccl, 1, backend="nccl", timeout=300)
    record_property("busy_ms", [round(seconds * 1e3, 3) for seconds in busy[:8]])
    assert busy and all(0 < seconds < 1 for seconds in busy)
