"""Runtime behaviour beyond plain equivalence: accumulation, checkpoints, measurement, faults."""
import copy
import json
import time

import pytest
import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroupGloo

import gradsync
from gradsync import ConfigError, CostModel
from gradsync.launch import run_local
from gradsync.runtime import attached, statistics
from gradsync.runtime.measure.trials import PlanTrials
from launches import side_by_side
from runtime_models import COST, TiedNet, batch, refusal_and_change, synthetic_profile


def _loss(model, rank, step):
    tokens, targets = batch(rank, step)
    return F.cross_entropy(model(tokens, use_rank0_branch=rank == 0), targets)


def no_sync_matches_ddp(rank, world_size):
    torch.manual_seed(0)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="us_byte",
                                     profile=synthetic_profile(model), cost=COST, partition_bytes=256)
    with gradsync.no_sync(model):
        _loss(model, rank, 0).backward()
    _loss(model, rank, 1).backward()
    optimizer.synchronize()
    with reference.no_sync():
        _loss(reference, rank, 0).backward()
    _loss(reference, rank, 1).backward()
    return max((p.grad - q.grad).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None)


def test_no_sync_accumulation_matches_ddp():
    assert max(run_local(no_sync_matches_ddp, 2)) < 1e-6


def ready_hooks_and_gradients(rank, world_size, scheduler):
    """A no_sync pass, then a synchronised one, with a parameter no rank uses and one that rank 1
    uses in the first pass alone and rank 0 in the second alone: the parameters with a ready hook,
    those the plans in force launch early, the parameters, the plan's channels, the largest
    difference from torch DDP's gradients, and whether the same gradients are None."""
    torch.manual_seed(0)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=scheduler,
                                     profile=synthetic_profile(model), cost=COST)
    def loss(network, step):
        tokens, targets = batch(rank, step)
        return F.cross_entropy(network(tokens, use_rank0_branch=rank == 1 - step), targets)

    for network, unsynced in ((model, gradsync.no_sync(model)), (reference, reference.no_sync())):
        with unsynced:
            loss(network, 0).backward()
        loss(network, 1).backward()
    optimizer.synchronize()
    sync = attached(model)
    early = set().union(*(plan.tensors_launching_early() for plan in sync.installed.plans.values()))
    pairs = list(zip(model.parameters(), reference.parameters()))
    difference = max((p.grad - q.grad).abs().max().item() for p, q in pairs if q.grad is not None)
    return (set(sync.gradient_hooks), early, len(sync.table.parameters), sync.plan.channels, difference,
            [p.grad is None for p, _ in pairs] == [q.grad is None for _, q in pairs])


@pytest.mark.parametrize("scheduler", ["ddp", "wfbp", "asc_wfbp"])
def test_only_gradients_that_can_launch_an_op_early_have_a_ready_hook_and_the_rest_still_count(scheduler):
    """The others are marked as they arrive and sent once the backward pass ends: unused ones stay
    untouched and no_sync ones count, as torch DDP's."""
    for hooked, early, parameters, channels, difference, same_nones in run_local(
            ready_hooks_and_gradients, 2, scheduler):
        assert hooked == early
        assert len(hooked) < parameters if channels == 1 else len(hooked) == parameters
        assert difference < 1e-6 and same_nones


def steps_with_gradients_kept_in_buffers(rank, world_size, scheduler):
    """Four steps, each after optimizer.zero_grad() (set to None), with a parameter no rank uses and
    one that rank 0 alone uses in even steps: per step, the tensors zero_grad zeroed in place, the
    largest difference from torch DDP's averaged gradients and whether the same gradients are None;
    then the largest difference of the parameters."""
    torch.manual_seed(0)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     scheduler=scheduler, profile=synthetic_profile(model), cost=COST)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    steps = []
    for step in range(4):
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        zeroed = set(attached(model).zeroed_in_place)
        tokens, targets = batch(rank, step)
        for network in (model, reference):
            F.cross_entropy(network(tokens, use_rank0_branch=rank == 0 and step % 2 == 0), targets).backward()
        optimizer.synchronize()
        pairs = list(zip(model.parameters(), reference.parameters()))
        steps.append((zeroed, max((p.grad - q.grad).abs().max().item() for p, q in pairs if q.grad is not None),
                      [p.grad is None for p, _ in pairs] == [q.grad is None for _, q in pairs]))
        optimizer.step()
        reference_optimizer.step()
    return steps, max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("scheduler", ["ddp", "wfbp"])
def test_gradients_kept_in_their_buffers_train_as_torch_ddp(scheduler):
    """zero_grad zeroes the gradients that are spans of a fused op's buffer in place; one that no
    rank then uses is None after the step's communication, as set_to_none leaves it."""
    for steps, parameter_difference in run_local(steps_with_gradients_kept_in_buffers, 2, scheduler):
        assert parameter_difference < 1e-6
        for _, gradient_difference, same_nones in steps:
            assert gradient_difference < 1e-6 and same_nones
        zeroed = [zeroed for zeroed, _, _ in steps]
        assert not zeroed[0]  # no gradient before the first step
        if scheduler == "wfbp":  # an op a tensor: every used one's op holds it alone
            assert "rank0_only.weight" in zeroed[1] and "rank0_only.weight" not in zeroed[2]
            assert "mix.weight" in zeroed[1] and "mix.weight" in zeroed[3]


def no_sync_pass_after_a_synchronised_one(rank, world_size):
    """A synchronised backward, then one inside no_sync, which adds local gradients to the averaged
    ones: the step refuses them (the replicas would diverge) before any update; a third,
    synchronised, pass averages what the two added, and the step then trains as torch DDP does on
    the same passes. The refusal, whether the refused step changed a parameter, and the distance
    to DDP's parameters."""
    torch.manual_seed(0)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                     profile=synthetic_profile(model), cost=COST)
    for network, no_sync in ((model, gradsync.no_sync(model)), (reference, reference.no_sync())):
        _loss(network, rank, 0).backward()
        with no_sync:
            _loss(network, rank, 1).backward()
    refused, changed = refusal_and_change(optimizer.step, model)
    for network, stepper in ((model, optimizer), (reference, reference_optimizer)):
        _loss(network, rank, 2).backward()
        stepper.step()
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return str(refused), changed, difference


def test_a_no_sync_pass_after_a_synchronised_one_is_averaged_by_the_next_and_refused_at_a_step_before():
    for refused, changed, difference in run_local(no_sync_pass_after_a_synchronised_one, 2):
        assert "without a synchronised backward pass" in refused and not changed
        assert difference < 1e-6


def wrapped_twice(rank, world_size):
    """A second wrap of a wrapped model is refused; after detach, wrapping again works."""
    model = TiedNet()
    gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                  profile=synthetic_profile(model), cost=COST)
    with pytest.raises(ConfigError, match="already wrapped by gradsync"):
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                      profile=synthetic_profile(model), cost=COST)
    attached(model).detach()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                     profile=synthetic_profile(model), cost=COST)
    _loss(model, rank, 0).backward()
    optimizer.step()
    return attached(model).clock.iteration


def test_a_model_takes_one_runtime_at_a_time():
    assert run_local(wrapped_twice, 2) == [1, 1]


def skipped_step_then_zero_grad(rank, world_size):
    """A step skipped on purpose (as a GradScaler does on overflow), zero_grad, then a full step: as
    torch DDP does the same."""
    torch.manual_seed(0)
    model = TiedNet()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     scheduler="wfbp", profile=synthetic_profile(model), cost=COST)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for network, stepper in ((model, optimizer), (reference, reference_optimizer)):
        for step in range(3):
            stepper.zero_grad()
            _loss(network, rank, step).backward()
            if step != 1:  # step 1 is skipped
                stepper.step()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


def test_a_backward_after_a_skipped_step_and_zero_grad_is_a_new_step():
    assert max(run_local(skipped_step_then_zero_grad, 2)) < 1e-6


def checkpoint_resume(rank, world_size, path):
    """10 steps straight vs 5 steps, checkpoint, fresh model and optimizer, load, 5 more steps."""
    def train(model, optimizer, steps):
        for step in steps:
            optimizer.zero_grad()
            _loss(model, rank, step).backward()
            optimizer.step()

    def fresh():
        torch.manual_seed(3)
        model = TiedNet()
        return gradsync.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), scheduler="bytescheduler",
                             profile=synthetic_profile(model), cost=COST, partition_bytes=256)

    model, optimizer = fresh()
    train(model, optimizer, range(10))
    optimizer.synchronize()
    straight = [p.detach().clone() for p in model.parameters()]
    attached(model).detach()

    model, optimizer = fresh()
    train(model, optimizer, range(5))
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if rank == 0:
        torch.save(checkpoint, path)
    attached(model).detach()
    torch.distributed.barrier()
    model, optimizer = fresh()
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    train(model, optimizer, range(5, 10))
    optimizer.synchronize()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), straight))


def test_checkpoint_mid_run_resumes_exactly(tmp_path):
    assert max(run_local(checkpoint_resume, 2, str(tmp_path / "ckpt.pt"))) == 0.0


def trained_with_measurement(rank, optimizer_of, after_step=lambda: None):
    """TiedNet under mg_wfbp with a measured profile (1 warm-up and 2 timed iterations), 4 steps."""
    torch.manual_seed(0)
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, optimizer_of(model.parameters()), scheduler="mg_wfbp",
                                     warmup_iterations=1, measure_iterations=2)
    for step in range(4):
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        optimizer.step()
        after_step()
    return attached(model)


def measured_plan(rank, world_size):
    sync = trained_with_measurement(rank, lambda parameters: torch.optim.SGD(parameters, lr=0.1))
    profile = sync.installed.profile
    result = {
        "planner": sync.plan.planner, "hash": sync.plan.hash, "a": sync.installed.cost.a, "b": sync.installed.cost.b,
        "gamma": sync.installed.cost.gamma, "host": sync.installed.cost.host, "ops_per_channel": sync.installed.cost.ops_per_channel,
        "layers": [layer.name for layer in profile.layers],
        "forward": [layer.forward_time for layer in profile.layers],
        "backward": [layer.backward_time for layer in profile.layers],
        "iterations": len(sync.clock.history),
    }
    sync.detach()
    return result


def test_measured_profile_and_cost_are_sane_and_agree():
    results = run_local(measured_plan, 2)
    first = results[0]
    assert first["planner"] == "mg_wfbp"
    assert all(r["hash"] == first["hash"] and r["layers"] == first["layers"] for r in results)
    # layers in forward execution order; the never-used branch keeps registration order after them
    assert first["layers"][:6] == ["embed", "conv", "norm", "rank0_only", "mix", "head"]
    assert first["layers"][-1] == "unused"
    assert 0 < first["a"] < 0.1 and 0 < first["b"] < 1e-6 and first["gamma"] >= 1 and 0 <= first["host"] < 0.1
    assert all(r["host"] == first["host"] and r["a"] == first["a"] for r in results)
    assert 1 <= first["ops_per_channel"] <= ProcessGroupGloo._Options()._threads == 2  # at most a worker thread each
    assert all(r["ops_per_channel"] == first["ops_per_channel"] for r in results)
    assert all(t > 0 for t in first["forward"][:6]) and all(t >= 0 for t in first["backward"])
    assert first["iterations"] == 4


def probe_with_launch_delay(rank, world_size, delay, probe="host"):
    """measure_host (`probe` "host") or empty_op_seconds ("empty") on two channels whose all-reduces
    first block the launching thread for `delay` s."""
    from gradsync.runtime.channels import Channels
    from gradsync.runtime.measure.probes import empty_op_seconds, measure_host

    channels = Channels(2)
    launch = channels.all_reduce

    def delayed(channel, tensor):
        time.sleep(delay)
        return launch(channel, tensor)

    channels.all_reduce = delayed
    try:
        return measure_host(channels, CostModel(1e-3, 1e-9)) if probe == "host" else empty_op_seconds(channels)
    finally:
        channels.destroy()


LAUNCH_DELAY = 0.02  # s: far above what a busy host's scheduling adds to a slice of computation


def test_host_time_per_op_counts_what_launching_costs_the_computing_thread():
    plain = min(run_local(probe_with_launch_delay, 2, 0.0)[0] for _ in range(2))
    delayed = min(run_local(probe_with_launch_delay, 2, LAUNCH_DELAY)[0] for _ in range(2))
    assert 0 <= plain < LAUNCH_DELAY / 4
    assert delayed - plain == pytest.approx(LAUNCH_DELAY, rel=0.25)


def cost_with_empty_op_seconds(rank, world_size, seconds):
    """measure_cost on one channel where an op carrying nothing is taken to cost `seconds`."""
    from gradsync.runtime.channels import Channels
    from gradsync.runtime.measure import probes

    probes.empty_op_seconds = lambda *args: seconds
    channels = Channels(1)
    try:
        cost = probes.measure_cost(channels, 1 << 16, repeats=2)
        return {"a": cost.a, "ops_per_channel": cost.ops_per_channel}
    finally:
        channels.destroy()


def test_the_measured_a_is_at_least_an_empty_ops_time_on_the_channels_ops_at_once():
    measured = run_local(cost_with_empty_op_seconds, 2, 0.005)[0]
    assert measured["a"] == pytest.approx(0.005 * measured["ops_per_channel"])  # far above loopback's intercept


def test_an_empty_op_costs_what_a_stream_of_them_takes_per_op():
    plain, delayed = (ranks[0] for ranks in side_by_side(probe_with_launch_delay, (0.0, "empty"),
                                                          (LAUNCH_DELAY, "empty")))
    assert 0 < plain < LAUNCH_DELAY / 4
    # each launch holds the next back by the delay: the stream's time per op grows by it
    assert delayed - plain == pytest.approx(LAUNCH_DELAY, rel=0.25)


class FakeTransfer:
    """An all-reduce stand-in run by a thread: `sleep` seconds of waiting, or `loops` iterations of
    Python (the interpreter's lock is shared with the computing thread's launches, as a transfer's
    processor time is on a shared core)."""

    def __init__(self, sleep: float = 0.0, loops: int = 0):
        import threading

        def body():
            time.sleep(sleep)
            total = 0
            for i in range(loops):
                total += i
        self.thread = threading.Thread(target=body)
        self.thread.start()

    def wait(self):
        self.thread.join()


def slowdowns_beside(rank, world_size, kind, emulated_device: bool = False):
    """measure_slowdowns with the all-reduce replaced by a FakeTransfer three times as long as the
    probe's computation, as the real one; the computation an emulated accelerator's waits (which
    leave the core and the interpreter free) where `emulated_device`."""
    from gradsync.emulated import DeviceWork
    from gradsync.runtime.channels import Channels
    from gradsync.runtime.measure.probes import SLOWDOWN_PROBE_SECONDS, measure_slowdowns

    channels = Channels(1)
    transfer_seconds = 3 * SLOWDOWN_PROBE_SECONDS
    loops = 0
    if kind == "busy":  # calibrate the loop to that long alone
        started, count = time.perf_counter(), 200_000
        FakeTransfer(loops=count).wait()
        loops = int(count * transfer_seconds / (time.perf_counter() - started))
    channels.all_reduce = lambda channel, tensor: FakeTransfer(sleep=transfer_seconds if kind == "idle" else 0.0,
                                                               loops=loops)
    try:
        return measure_slowdowns(channels, CostModel(1e-3, 1e-9), work=DeviceWork() if emulated_device else None)
    finally:
        channels.destroy()


def test_slowdowns_are_measured_from_computation_and_transfer_alone_and_together():
    # other work on the host moves a slowdown either way (it lengthens the probe timed alone, or the
    # one timed together): of two probes, the smaller is the closer where none is expected, the
    # larger where one is
    idle_a, idle_b, busy_a, busy_b, device_a, device_b = (ranks[0] for ranks in side_by_side(
        slowdowns_beside, ("idle",), ("idle",), ("busy",), ("busy",), ("busy", True), ("busy", True)))
    idle = {key: min(run[key] for run in (idle_a, idle_b)) for key in ("compute_slowdown", "transfer_slowdown")}
    assert idle["compute_slowdown"] < 1.3 and idle["transfer_slowdown"] < 1.3  # a transfer that only waits
    # one that takes the interpreter from the computation
    assert max(busy_a["compute_slowdown"], busy_b["compute_slowdown"]) > 1.5
    # beside an emulated accelerator's computation, which waits off the core, that transfer runs
    # at its own pace and leaves the waits on time
    beside_device = min((device_a, device_b), key=lambda run: run["transfer_slowdown"])
    assert beside_device["compute_slowdown"] < 1.3 and beside_device["transfer_slowdown"] < 1.3


def test_slowdowns_of_one_probe():
    from gradsync.runtime.measure.probes import slowdowns_of

    # computation 10 ms alone, 15 together: σ = 1.5; transfer 30 ms alone, 35 together: 5 ms
    # extra over the 15 ms beside the computation, which it crossed at 10/15 of its rate: τ = 1.5
    assert slowdowns_of(0.010, 0.030, 0.015, 0.035) == pytest.approx((1.5, 1.5))
    assert slowdowns_of(0.010, 0.030, 0.010, 0.030) == pytest.approx((1.0, 1.0))
    assert slowdowns_of(0.010, 0.030, 0.010, 0.045)[1] == 20.0  # no progress beside it: capped


def probe_sweep(largest_bytes: int, seconds) -> list[int]:
    """The sizes measure_cost times for a model of `largest_bytes`, each taking `seconds(size)`."""
    from gradsync.runtime.measure.probes import SMALLEST_PROBE_BYTES, next_probe_size

    sizes, times = [SMALLEST_PROBE_BYTES], []
    while True:
        times.append(seconds(sizes[-1]))
        following = next_probe_size(sizes, times, largest_bytes)
        if following is None:
            return sizes
        sizes.append(following)


def test_the_cost_probes_stop_at_the_plans_largest_op_once_b_is_resolved():
    from gradsync.cost import CostModel
    from gradsync.runtime.measure.probes import LARGEST_PROBE_BYTES

    def slow_link(size):  # a = 20 ms, b = 0.5 µs/byte, and 30% more per byte past 1 MiB
        return 0.020 + 5e-7 * size + 1.5e-7 * max(0, size - (1 << 20))

    # a model of 0.7 MB: its gradients already take 18 times the smallest probe's time
    sizes = probe_sweep(700_000, slow_link)
    assert sizes == [4096, 16384, 65536, 262144, 700_000]
    fitted = CostModel.fit(sizes, [slow_link(s) for s in sizes], clamp=True)
    assert (fitted.a, fitted.b) == pytest.approx((0.020, 5e-7))
    # the sweep to 4 MiB that every model used to get: the bend past its ops takes a to its floor
    swept = [4096 << 2 * i for i in range(6)]
    assert CostModel.fit(swept, [slow_link(s) for s in swept], clamp=True).a < 0.002
    # a tiny model on a fast link goes on until b is resolved, never past the cap
    assert probe_sweep(10_000, lambda size: 50e-6 + size / 1e9) == [4096, 10_000, 40_000, 160_000, 640_000]
    assert probe_sweep(10_000, lambda size: 50e-6)[-1] == LARGEST_PROBE_BYTES
    assert probe_sweep(100 << 20, slow_link)[-1] == LARGEST_PROBE_BYTES


def test_a_channel_runs_as_many_ops_at_once_as_their_time_shows():
    from gradsync.runtime.measure.probes import ops_at_once

    assert ops_at_once(2, 0.010, 0.010) == 2  # two together in one's time: side by side
    assert ops_at_once(2, 0.010, 0.020) == 1  # in twice its time: one after the other
    assert ops_at_once(2, 0.0217, 0.0380) == 1  # measured on 2 netbed ranks: 1.75 times one's time
    assert ops_at_once(2, 0.010, 0.005) == 2  # never more than the channel's threads
    assert ops_at_once(1, 0.010, 0.010) == 1


def test_host_time_of_the_timed_plan_leaves_the_profile_in_proportion():
    from gradsync.plan import FORWARD, Op, Plan, Slice
    from gradsync.runtime.measure.layers import without_host

    profile = synthetic_profile(TiedNet())
    layers = [layer for layer in profile.layers if layer.tensors]
    ops = [Op((Slice(spec.name, 0, spec.numel),)) for layer in layers for spec in layer.tensors]
    plan = Plan((*ops, Op(ops[0].slices, phase=FORWARD)))  # the forward-phase op launches after the backward
    host = 0.25 * profile.backward_time / len(ops)
    lighter = without_host(profile, plan, host)
    assert lighter.backward_time == pytest.approx(0.75 * profile.backward_time)
    for before, after in zip(profile.layers, lighter.layers):
        assert after.backward_time == pytest.approx(0.75 * before.backward_time)
        assert (after.forward_time, after.update_time) == (before.forward_time, before.update_time)
    assert without_host(profile, plan, 0.0) == profile
    assert without_host(profile, plan, 10 * host).backward_time == 0.0


def different_profiles(rank, world_size):
    model = TiedNet()
    profile = synthetic_profile(model).scaled(1e-3 if rank else 1.0)  # rank 1 merges everything, rank 0 not
    gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="mg_wfbp", profile=profile,
                  cost=COST)
    return "wrapped"


def test_plan_hash_mismatch_names_the_ranks():
    outcomes = run_local(different_profiles, 2, return_errors=True)
    assert len(outcomes) == 2, outcomes
    assert all(status == "error" and "ranks [1]" in text and "plan hash" in text for status, text in outcomes)


def dies_after_wrap(rank, world_size):
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                     profile=synthetic_profile(model), cost=COST, timeout=20)
    if rank == 1:
        raise RuntimeError("rank 1 crashed")
    started = time.monotonic()
    try:
        _loss(model, rank, 0).backward()
        optimizer.step()
    except Exception as exc:  # the collective must fail, not hang
        return f"failed after {time.monotonic() - started:.1f}s: {type(exc).__name__}"
    return "finished"


def test_a_dying_rank_makes_the_others_fail_not_hang():
    outcomes = run_local(dies_after_wrap, 2, return_errors=True, timeout=120)
    assert outcomes[1][0] == "error" and "rank 1 crashed" in outcomes[1][1]
    assert outcomes[0][0] == "ok" and outcomes[0][1].startswith("failed after"), outcomes[0]


def non_finite(rank, world_size, mode, scale=float("inf"), on_ranks=(1,)):
    torch.manual_seed(0)
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="mg_wfbp",
                                     profile=synthetic_profile(model), cost=COST, nonfinite=mode)
    before = [p.detach().clone() for p in model.parameters()]
    loss = _loss(model, rank, 0)
    if rank in on_ranks:
        loss = loss + model.mix.bias.sum() * scale
    loss.backward()
    try:
        optimizer.step()
    except gradsync.NonFiniteGradient as exc:
        return f"raised: {exc}"
    return "unchanged" if all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) else "updated"


def test_non_finite_gradient_raises_naming_the_parameter_on_every_rank():
    for result in run_local(non_finite, 2, "raise"):
        assert result.startswith("raised") and "mix.bias" in result


def test_non_finite_gradient_skips_the_step_on_every_rank():
    assert run_local(non_finite, 2, "skip") == ["unchanged", "unchanged"]


def test_finite_gradients_whose_sum_overflows_are_not_taken_for_non_finite():
    """The check sums each rank's share of an op first; 16 shares of 1.5e38 overflow that sum, yet
    every element is finite, so the step goes ahead."""
    assert run_local(non_finite, 2, "raise", 3e38) == ["updated", "updated"]


def test_gradients_whose_sum_over_ranks_overflows_average_to_finite_values():
    """3e38 on both ranks: their sum overflows fp32, their mean does not (each rank sends its share)."""
    assert run_local(non_finite, 2, "raise", 3e38, (0, 1)) == ["updated", "updated"]


def traced(rank, world_size, path):
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="bytescheduler",
                                     profile=synthetic_profile(model), cost=COST, trace=path, partition_bytes=256)
    for step in range(2):
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        optimizer.step()
    stats = attached(model).clock.history[-1]
    attached(model).detach()
    return stats.bytes_sent, stats.iteration_time, stats.predicted_time


def test_trace_and_stats(tmp_path):
    results = run_local(traced, 2, str(tmp_path / "trace.json"))
    for rank, (sent, iteration_time, predicted) in enumerate(results):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())["traceEvents"]
        spans = [e["name"] for e in events if e["ph"] == "X"]
        assert any(s.startswith("forward embed") for s in spans)
        assert any(s.startswith("backward head") for s in spans)
        ops = [e for e in events if e["ph"] == "X" and e["name"].startswith("op ")]
        assert {e["tid"] for e in ops} == {1, 2} and all(e["args"]["bytes"] > 0 for e in ops)
        assert sent > 0 and iteration_time > 0 and predicted > 0


class SlowIdentity(gradsync.compress.Codec):
    """The identity codec, `pause` seconds slower per encode and per finish; it sums its pauses
    per step."""

    def __init__(self, pause):
        self.pause, self.paused = pause, []

    def encode(self, name, grad, step):
        self._sleep(step)
        return super().encode(name, grad, step)

    def finish(self, name, parameter, step):
        self._sleep(step)

    def _sleep(self, step):
        started = time.perf_counter()
        time.sleep(self.pause)
        self.paused += [0.0] * (step + 1 - len(self.paused))
        self.paused[step] += time.perf_counter() - started  # as slept: a busy host oversleeps


def codec_time_of_a_slow_codec(rank, world_size, pause, scheduler):
    model = TiedNet()
    codec = SlowIdentity(pause)
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=scheduler,
                                     compressor=codec, profile=synthetic_profile(model), cost=COST)
    for step in range(3):
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        optimizer.step()
    optimizer.synchronize()  # the last step's deferred decoding is the next iteration's
    history = attached(model).clock.history
    attached(model).detach()
    return [(s.codec_time, s.comm_wait, s.iteration_time) for s in history], codec.paused


@pytest.mark.parametrize("scheduler", ["mg_wfbp", "us_byte"])
def test_iteration_stats_hold_the_codecs_encoding_and_decoding_time(scheduler):
    # us_byte defers the input layers' decoding to the next forward: counted in that iteration
    pause = 0.004
    for stats, paused in run_local(codec_time_of_a_slow_codec, 2, pause, scheduler):
        codec_times = [codec_time for codec_time, _, _ in stats]
        assert sum(codec_times) >= sum(paused[:2]) and sum(codec_times) < sum(paused) + 0.02
        for codec_time, comm_wait, iteration_time in stats:
            assert codec_time >= 4 * pause and codec_time + comm_wait <= iteration_time


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scheduler": "fastest"}, "mg_wfbp"),
        ({"channels": 0}, "'channels'"),
        ({"nonfinite": "hope"}, "'nonfinite'"),
        ({"grad_scaler": torch.amp.GradScaler("cpu"), "nonfinite": "raise"}, "'raise' with a 'grad_scaler'"),
        ({"grad_scaler": 2.0**16}, "'grad_scaler' must be a torch.amp.GradScaler"),
        ({"scheduler": "us_byte", "partition_bytes": -1}, "partition_bytes"),
        ({"scheduler": "wfbp", "bucket": 3}, "unknown option"),
        ({"compressor": "zip"}, "compressor"),
        ({"profile": "/nonexistent.json"}, "no such file"),
        ({"plan_trials": -1}, "'plan_trials' must be an integer >= 0"),
        ({"plan_trials": 2.5}, "'plan_trials' must be an integer >= 0"),
        ({"timeout": 0}, "'timeout' must be a finite number"),
        ({"timeout": float("nan")}, "'timeout' must be a finite number"),
        ({"timeout": float("inf")}, "'timeout' must be a finite number"),
        ({"timeout": 1e-9}, "'timeout' must be a finite number of seconds >= 0.001"),  # 0 ms: no timeout
        ({"timeout": 86400000000000.0}, "'timeout' must be a finite number"),  # timedelta.max, rounded up
        ({"broadcast_buffers": "yes"}, "'broadcast_buffers' must be true or false"),
        ({"trace": "/nonexistent-folder/trace.json"}, "no such folder '/nonexistent-folder'"),
        ({"trace": "/"}, "is a folder"),
        ({"scheduler": "bytescheduler", "credit": 5, "channels": 1}, "raise 'channels' to 5"),
        ({"scheduler": ["wfbp"]}, "unknown scheduler"),
        ({"compressor": ""}, "unknown compressor ''"),
        ({"compressor": {"type": None}}, "unknown compressor None"),
    ],
)
def test_bad_arguments_fail_before_any_collective(kwargs, message):
    model = TiedNet()  # torch.distributed is not initialised here: any collective would fail differently
    with pytest.raises(ConfigError, match=message):
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_foreign_optimizer_parameters_and_frozen_models_are_refused():
    model = TiedNet()
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not trainable parameters of the model"):
        gradsync.wrap(model, torch.optim.SGD(other.parameters(), lr=0.1))
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        gradsync.wrap(frozen, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def test_modules_with_sparse_gradients_are_refused():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"modules \['0'\] make sparse gradients"):
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))


def evaluation_on_the_first_rank_alone(rank, world_size):
    """Rank 0 evaluates alone (no_grad), then both train a step: the buffers (BatchNorm's running
    statistics) travel only with training forwards, as with DDP. Returns the buffers after it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                     profile=synthetic_profile(model), cost=COST, timeout=20)
    model[1].running_mean.fill_(rank)  # different per rank until the next training forward
    inputs = torch.randn(6, 4)
    if rank == 0:
        with torch.no_grad():
            model.eval()(inputs)
        model.train()
    model(inputs).sum().backward()
    optimizer.step()
    buffers = [b.tolist() for b in model[1].buffers()]
    attached(model).detach()
    return buffers


def test_an_evaluation_forward_on_one_rank_runs_no_collective():
    first, second = run_local(evaluation_on_the_first_rank_alone, 2, timeout=120)
    assert first == second  # the training forward gave every rank rank 0's buffers (same inputs)


def buffers_sent_before_the_plans_ops(rank, world_size):
    """A synchronised backward pass of a plan whose ops overlap the next forward (their waits
    deferred), on a model whose BatchNorm statistics differ per rank: the order in which the
    buffers' broadcast and the plan's ops start, the buffers after the backward pass, and rank 0's
    buffers as its forward left them."""
    import torch.distributed as dist
    from gradsync.runtime.channels import Channels

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="mg_wfbp",
                                     overlap_forward=True, profile=synthetic_profile(model), cost=COST, timeout=20)
    started = []
    broadcast, all_reduce = dist.broadcast, Channels.all_reduce
    dist.broadcast = lambda *args, **kwargs: started.append("broadcast") or broadcast(*args, **kwargs)
    Channels.all_reduce = lambda *args, **kwargs: started.append("op") or all_reduce(*args, **kwargs)
    try:
        outputs = model(torch.randn(6, 4, generator=torch.Generator().manual_seed(rank)))
        after_forward = [b.tolist() for b in model[1].buffers()]
        outputs.sum().backward()
    finally:
        dist.broadcast, Channels.all_reduce = broadcast, all_reduce
    after_backward = [b.tolist() for b in model[1].buffers()]
    deferred = sum(op.gates_forward for op in attached(model).plan.ops)
    optimizer.step()
    attached(model).detach()
    return started, after_forward, after_backward, deferred


def test_the_buffers_broadcast_goes_before_the_plans_ops():
    """Sent once the forward is done and before any op of the plan, the buffers never wait on a
    shared link behind gradients whose waits the plan defers to the next forward; after the
    backward pass every rank holds rank 0's buffers as its forward left them."""
    results = run_local(buffers_sent_before_the_plans_ops, 2, timeout=120)
    for started, _, after_backward, deferred in results:
        assert deferred > 0 and "op" in started
        assert started[0] == "broadcast" and started.count("broadcast") == 1
        assert after_backward == results[0][1]
    assert results[1][1] != results[0][1]  # the ranks' own statistics differed before the broadcast


def buffers_replaced_after_wrap(rank, world_size):
    """A BatchNorm whose running mean is replaced by a new tensor after the wrap (another on each
    rank), then two iterations: what each rank's new tensor holds after each backward pass."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="ddp",
                                     profile=synthetic_profile(model), cost=COST, timeout=20)
    generator = torch.Generator().manual_seed(rank)
    held = []
    for step in range(2):
        if step == 1:
            model[1].running_mean = torch.full((8,), 10.0 * (rank + 1))
        model(torch.randn(6, 4, generator=generator)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        held.append(model[1].running_mean.tolist())
    attached(model).detach()
    return held


def test_a_buffer_replaced_after_the_wrap_still_gets_rank_0s_values():
    first, second = run_local(buffers_replaced_after_wrap, 2, timeout=120)
    assert first == second
    assert first[1] != first[0] and min(first[1]) > 5  # rank 0's replacement (10), moved by one forward


def forward_hooks_by_plan(rank, world_size):
    """The owner modules with a pre-forward hook after two iterations, per scheduler: none where the
    plan defers nothing, the deferred gradients' owners where it does, every owner while the layers
    are timed, and none while auto's trials time plans that defer nothing (on a cost of next to no
    latency, which predicts wfbp within TRIAL_PREDICTION_LIMIT of DDP's buckets: worth timing)."""
    hooked = {}
    for name in ("ddp", "us_byte", "measuring", "trials"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 2))
        measured = name in ("measuring", "trials")
        options = {"scheduler": "auto", "candidates": ("ddp", "wfbp"), "plan_trials": 2, "warmup_iterations": 1,
                   "measure_iterations": 2} if name == "trials" else {"scheduler": "ddp" if measured else name,
                                                                      "warmup_iterations": 5}
        model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         profile="measure" if measured else synthetic_profile(model),
                                         cost=CostModel(1e-6, 1e-10) if name == "trials" else COST, timeout=20,
                                         **options)
        sync = attached(model)
        for iteration in range(20):
            timing_plans = isinstance(sync.measurement, PlanTrials)  # this forward runs under the trials
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if iteration >= 1 and (name != "trials" or timing_plans):
                break
        deferring = sorted({sync.module_of[t] for op in sync.plan.ops if op.gates_forward for t in op.tensors()})
        hooked[name] = (sorted(sync.forward_hooks), deferring, sync.measurement is not None)
        sync.detach()
    return hooked


def test_pre_forward_hooks_sit_only_where_updates_may_wait():
    for hooked in run_local(forward_hooks_by_plan, 2, timeout=120):
        assert hooked["ddp"] == ([], [], False)
        us_byte, deferring, _ = hooked["us_byte"]
        assert us_byte == deferring and deferring
        assert hooked["measuring"] == (["0", "2", "4"], [], True)
        assert hooked["trials"] == ([], [], True)


def test_profile_that_does_not_match_the_model_is_refused():
    model = TiedNet()
    wrong = synthetic_profile(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    with pytest.raises(ConfigError, match="does not match the model"):
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), profile=wrong, cost=COST)


def broadcast_mixed_dtypes(rank, world_size):
    from gradsync.runtime.first_rank import broadcast_from_first

    values = [torch.full((3,), rank + 0.5), torch.full((2, 5), rank + 7, dtype=torch.int64),
              torch.tensor([rank == 0, rank == 1, True]), torch.full((7,), rank + 0.25, dtype=torch.float16),
              torch.full((4, 3), rank + 1.0, dtype=torch.float64).t(),  # odd byte sizes, a transposed view
              torch.full((2,), complex(rank, 1), dtype=torch.complex128)]
    broadcast_from_first(values, None)
    return [t.tolist() for t in values]


def test_one_broadcast_gives_every_dtype_rank_0s_values():
    results = run_local(broadcast_mixed_dtypes, 3)
    assert results[0] == results[1] == results[2]
    assert results[1] == [[0.5] * 3, [[7] * 5] * 2, [True, False, True], [0.25] * 7, [[1.0] * 4] * 3, [1j] * 2]


def broadcast_again(rank, world_size):
    """One FirstRankValues given the same tensors with new values, then a list with one replaced,
    then one whose tensor changed shape in place: every round delivers rank 0's values as they are."""
    from gradsync.runtime.first_rank import FirstRankValues

    sender = FirstRankValues(None)
    values = [torch.full((2,), rank + 0.5), torch.full((3,), rank, dtype=torch.int64)]
    rounds = []
    for round_index in range(4):
        if round_index == 2:
            values[1] = torch.full((4,), rank * 10, dtype=torch.int32)
        if round_index == 3:
            values[0].data = torch.full((5,), rank - 0.5)
        for tensor in values:
            tensor.add_(round_index)
        complete = sender.start(values)
        for tensor in values:  # changed after the start: the first rank's values as they were win
            tensor.add_(100)
        complete()
        rounds.append([t.tolist() for t in values])
    return rounds


def test_a_reused_broadcast_follows_new_values_and_replaced_tensors():
    results = run_local(broadcast_again, 2)
    assert results[0] == results[1]
    assert results[0] == [[[0.5] * 2, [0] * 3], [[1.5] * 2, [1] * 3], [[3.5] * 2, [2] * 4], [[2.5] * 5, [5] * 4]]


def broadcast_at_wrap(rank, world_size, profile_path, cost_path):
    torch.manual_seed(rank)  # every rank starts from different weights and statistics
    model = TiedNet()
    model.norm.running_mean.fill_(float(rank))
    model, _ = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="optimal_merge",
                             profile=profile_path, cost=cost_path)
    flat = torch.cat([t.detach().reshape(-1) for t in list(model.parameters()) + list(model.buffers())])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, flat)
    attached(model).detach()
    return all(torch.equal(g, gathered[0]) for g in gathered), float(model.norm.running_mean[0])


def test_parameters_and_buffers_come_from_rank_0_and_inputs_load_from_json(tmp_path):
    profile_path, cost_path = tmp_path / "profile.json", tmp_path / "cost.json"
    synthetic_profile(TiedNet()).save(profile_path)
    cost_path.write_text(json.dumps(COST.to_dict()))
    results = run_local(broadcast_at_wrap, 3, str(profile_path), str(cost_path))
    assert results == [(True, 0.0)] * 3


class _FakeChannels:
    world_size = 2
    transport = "allreduce"

    def __len__(self):
        return 2


def _executor_for(model, plan):
    from gradsync.runtime.executor import PlanExecutor

    return PlanExecutor(plan, dict(model.named_parameters()), _FakeChannels())


def test_an_op_never_mixes_gradient_dtypes():
    """The executor's own guard (wrap refuses such models earlier: test_runtime_guards)."""
    from gradsync import Op, Plan, Slice

    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
    model[0].half()
    model[1].bfloat16()
    plan = Plan((Op((Slice("1.weight", 0, 4), Slice("0.weight", 0, 4))),))
    with pytest.raises(ConfigError, match="mixes gradient dtypes"):
        _executor_for(model, plan)


@pytest.mark.parametrize("field, value", [("transport", "forest"), ("codec", "acp_sgd")])
def test_transports_and_codecs_the_runtime_does_not_run_are_refused(field, value):
    from gradsync import Op, Plan, Slice

    model = torch.nn.Linear(2, 2, bias=False)
    plan = Plan((Op((Slice("weight", 0, 4),), **{field: value}),))
    with pytest.raises(ConfigError, match=value):
        _executor_for(model, plan)


def measured_with_planner_options(rank, world_size):
    torch.manual_seed(0)
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="asc_wfbp",
                                     channels=3, warmup_iterations=0, measure_iterations=1)
    sync = attached(model)
    calibration = (sync.plan.planner, [op.phase for op in sync.plan.ops])
    for step in range(2):
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        optimizer.step()
    planner = sync.plan.planner
    sync.detach()
    return calibration, planner


def test_measurement_runs_one_bucket_without_the_planners_options_then_the_planner_with_them():
    # layers are timed with every gradient in one backward-phase all-reduce: none in flight beside them
    assert run_local(measured_with_planner_options, 2) == [(("ddp", ["backward"]), "asc_wfbp")] * 2


def calibration_through_codec_warmup(rank, world_size, start_iter):
    """ACP-SGD with `start_iter` uncompressed steps; 1 warm-up and 2 timed iterations."""
    torch.manual_seed(0)
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="mg_wfbp",
                                     compressor={"type": "acp_sgd", "rank": 2, "start_iter": start_iter,
                                                 "min_compression_rate": 1.0},
                                     warmup_iterations=1, measure_iterations=2)
    sync = attached(model)
    seen = []
    for step in range(9):
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        optimizer.step()
        seen.append((sync.plan.planner, sync.measurement is not None, id(sync.installed.profile)))
    sync.detach()
    return seen


def test_layers_timed_during_the_codecs_warmup_are_timed_again_on_steady_iterations():
    # steps 0-1 uncompressed: step 0 warms up, steps 1-2 are timed (1 is not steady), steps 3-4
    # are timed again under the calibration plan (ddp, one bucket), then mg_wfbp's plan
    for seen in run_local(calibration_through_codec_warmup, 2, 2):
        planners_, measuring, _ = zip(*seen)
        assert planners_ == ("ddp",) * 4 + ("mg_wfbp",) * 5
        assert measuring == (True,) * 4 + (False,) * 5


def test_a_long_codec_warmup_runs_a_plan_made_on_it_and_is_timed_again_once_steady():
    # steps 0-4 uncompressed: steps 1-2 timed, mg_wfbp's plan on their profile runs steps 3-4;
    # the calibration plan comes back for steps 5-6, timed, then mg_wfbp on the steady profile
    for seen in run_local(calibration_through_codec_warmup, 2, 5):
        planners_, measuring, profiles = zip(*seen)
        assert planners_ == ("ddp", "ddp", "mg_wfbp", "mg_wfbp", "ddp", "ddp", "mg_wfbp", "mg_wfbp", "mg_wfbp")
        assert measuring == (True,) * 6 + (False,) * 3
        assert profiles[2] != profiles[6] and profiles[6] == profiles[8]


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes `pause` seconds more (a costly update)."""

    def __init__(self, params, pause, **options):
        super().__init__(params, **options)
        self.pause = pause

    def step(self, closure=None):
        time.sleep(self.pause)
        return super().step(closure)


def measured_with_a_slow_update(rank, world_size, pause):
    # the training loop's own work (the sleep after the step) is not the engine's: not in the update time
    sync = trained_with_measurement(rank, lambda parameters: SlowSGD(parameters, pause, lr=0.1),
                                    after_step=lambda: time.sleep(pause))
    from gradsync.runtime.measure.layers import slowest_times

    layers = max(max(layer.forward_time, layer.backward_time) for layer in sync.installed.profile.layers)
    last = sync.clock.history[-1]
    result = sync.installed.profile.update_time, layers, last.predicted_time, last.update_time, last.comm_wait
    ranks = [profile.to_dict() for profile in sync.installed.rank_profiles]
    combined = slowest_times(sync.installed.rank_profiles) == sync.installed.profile
    sync.detach()
    return result, ranks, combined


def test_the_update_time_holds_the_optimizer_step_and_enters_the_prediction():
    pause = 0.05
    results = run_local(measured_with_a_slow_update, 2, pause)
    for (update_time, slowest_layer, predicted, last_update, comm_wait), _, _ in results:
        assert pause <= update_time < 1.5 * pause and pause <= last_update < 1.5 * pause
        assert slowest_layer < pause / 2 and comm_wait < pause
        assert pause <= predicted < 2 * pause
    # every rank keeps both ranks' own profiles, the same on each, and plans on their per-layer maxima
    ranks, combined = results[0][1], results[0][2]
    assert len(ranks) == 2 and ranks[0] != ranks[1] and results[1][1] == ranks and combined and results[1][2]


def test_layer_timer_leaves_excluded_time_out_of_the_layer_and_takes_medians():
    from gradsync.runtime.parameter_table import ParameterTable
    from gradsync.runtime.measure.layers import LayerTimer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    table = ParameterTable.of(model)
    timer = LayerTimer(table)
    stall = 0.05

    def stalled_update(_module, _inputs):  # a deferred update applied before layer 1's forward
        time.sleep(stall)
        timer.exclude(stall)

    model[1].register_forward_pre_hook(stalled_update)
    names = {m: n for m, n in table.owners.items()}
    for _ in range(3):
        timer.forward_start()
        output = model(torch.ones(2, 4))
        for name in names["1"] + names["0"]:
            timer.gradient_ready(name)
        timer.count_iteration()
    profile = timer.profile("two layers")
    assert max(layer.forward_time for layer in profile.layers) < stall / 2
    assert max(layer.backward_time for layer in profile.layers) < stall / 2
    timer.remove()
    assert output.shape == (2, 4)


def test_every_rank_plans_with_each_layers_slowest_times_scaled_to_the_slowest_ranks_totals():
    from gradsync.profile import LayerProfile, ModelProfile
    from gradsync.runtime.measure.layers import slowest_times

    tensors = [layer.tensors for layer in synthetic_profile(TiedNet()).layers[:3]]

    def ranks_profile(order, forward, backward, update):
        layers = [LayerProfile(name, tensors[i], forward[i], backward[i], update[i]) for i, name in enumerate("abc")]
        return ModelProfile("net", tuple(layers[i] for i in order))

    # rank 0 is slow at layer a, rank 1 (its layers listed in reverse) at layer c
    first = ranks_profile([0, 1, 2], [4.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.0, 0.0, 1.0])
    second = ranks_profile([2, 1, 0], [1.0, 1.0, 3.0], [1.0, 1.0, 1.0], [0.0, 0.0, 3.0])
    merged = slowest_times([first, second])
    assert [layer.name for layer in merged.layers] == ["a", "b", "c"]  # rank 0's order
    # forward maxima 4, 1, 3 (sum 8) scaled to the slowest rank's 6; backward maxima are rank 0's
    # own; update maxima 0, 0, 3 already sum to the slowest rank's 3
    assert [layer.forward_time for layer in merged.layers] == pytest.approx([3.0, 0.75, 2.25])
    assert [layer.backward_time for layer in merged.layers] == pytest.approx([2.0, 2.0, 2.0])
    assert [layer.update_time for layer in merged.layers] == pytest.approx([0.0, 0.0, 3.0])
    assert slowest_times([first]) == first


def bounded_history(rank, world_size):
    statistics.HISTORY_LENGTH = 3  # in this rank's process only
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="ddp",
                                     profile=synthetic_profile(model), cost=COST)
    for step in range(5):
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        optimizer.step()
    sync = attached(model)
    kept, counted = [stats.iteration for stats in sync.clock.history], sync.clock.iteration
    sync.detach()
    return kept, counted


def test_history_keeps_only_the_most_recent_iterations():
    assert run_local(bounded_history, 2) == [([2, 3, 4], 5)] * 2


def profiler_ranges(rank, world_size):
    """The names of gradsync's ranges in a torch.profiler trace of two iterations (ACP-SGD, wfbp)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = TiedNet()
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="wfbp",
                                     compressor="acp_sgd", profile=synthetic_profile(model), cost=COST)
    ops = len(attached(model).plan.ops)

    def step(index):
        optimizer.zero_grad()
        tokens, targets = batch(rank, index)
        F.cross_entropy(model(tokens), targets).backward()
        optimizer.step()

    step(0)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for index in (1, 2):
            step(index)
    return ops, sorted({event.name for event in profiler.events() if event.name.startswith("gradsync::")})


def test_ops_and_codec_stages_are_ranges_in_torch_profiler_traces():
    for ops, names in run_local(profiler_ranges, 2):
        assert ops > 1
        stages = ("encode", "launch", "wait", "unpack")
        assert set(names) == {f"gradsync::{stage} op{i}" for stage in stages for i in range(ops)} | {"gradsync::decode"}
