"""The emulated accelerator: a profile's layers with real parameters and the profile's times, spent
waiting (no core taken), and deterministic gradients; gradsync, torch DDP and the PowerSGD hook run
on it unchanged."""
import copy
import math
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

import gradsync
from gradsync.emulated import EmulatedModel, emulated_batch, scaled_shape
from gradsync.errors import ConfigError
from gradsync.launch import run_local
from gradsync.profile import zoo
from gradsync.runtime import attached

SIZE_SCALE = 1 / 64


def small_profile(time_scale: float = 0.25):
    """ResNet-50 on the V100 preset, its times scaled by `time_scale`."""
    return zoo("resnet50", device="V100").scaled(time_scale)


def step(model, rank: int, index: int) -> None:
    inputs, targets = emulated_batch(rank, index)
    (model(inputs) * targets).mean().backward()


def test_a_step_takes_the_profiles_time_without_occupying_a_core():
    torch.set_num_threads(1)
    profile = small_profile(time_scale=1.0)  # the preset's own times: 173 ms a step
    model = EmulatedModel(profile, SIZE_SCALE)
    step(model, 0, 0)  # allocations
    walls, cpus = [], []
    for index in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        step(model, 0, index)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    emulated = profile.forward_time + profile.backward_time
    assert min(walls) == pytest.approx(emulated, rel=0.1)
    assert min(cpus) < 0.3 * emulated


def test_parameters_follow_the_profile_scaled_and_gradients_are_deterministic():
    profile = small_profile()
    model, again = EmulatedModel(profile, SIZE_SCALE, seed=5), EmulatedModel(profile, SIZE_SCALE, seed=5)
    shapes = [tuple(p.shape) for p in model.parameters()]
    expected = [scaled_shape(t.shape or (t.numel,), SIZE_SCALE) for layer in profile.layers for t in layer.tensors]
    assert shapes == expected
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(
        sum(layer.numel for layer in profile.layers) * SIZE_SCALE, rel=0.05)
    assert [t.shape for layer in model.emulated_profile.layers for t in layer.tensors] == expected
    assert [layer.backward_time for layer in model.emulated_profile.layers] == [
        layer.backward_time for layer in profile.layers]
    step(model, 1, 3)
    step(again, 1, 3)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), again.parameters()))
    other = EmulatedModel(profile, SIZE_SCALE, seed=5)
    step(other, 0, 3)  # another rank's batch: the same patterns, another weight
    ratios = {round((p.grad / q.grad).flatten()[0].item(), 5) for p, q in zip(model.parameters(), other.parameters())}
    assert len(ratios) == 1 and ratios != {1.0}


@pytest.mark.parametrize("shape, scale, scaled", [((1000,), 0.01, (10,)), ((64, 3, 7, 7), 0.25, (32, 2, 7, 7)),
                                                  ((768, 3072), 1 / 64, (96, 384)), ((5,), 0.01, (1,))])
def test_scaled_shapes_keep_a_matrix_a_matrix(shape, scale, scaled):
    assert scaled_shape(shape, scale) == scaled


def test_a_size_scale_outside_zero_to_one_is_refused():
    with pytest.raises(ConfigError, match="size_scale"):
        EmulatedModel(small_profile(), 1.5)


def beside_ddp(rank, world_size, steps: int):
    """gradsync (measured profile) and torch DDP, then DDP with the PowerSGD hook, on the emulated
    model: their distance, gradsync's measured backward time, the hook replicas' spread, and the
    seconds of the device's waits the cost probes ran beside their ops."""
    profile = small_profile()
    model = EmulatedModel(profile, SIZE_SCALE)
    probe_waits, run_waits = [], model.probe_work.run
    model.probe_work.run = lambda count: probe_waits.append(run_waits(count)) or probe_waits[-1]
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model, optimizer = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="mg_wfbp",
                                     warmup_iterations=1, measure_iterations=2)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for index in range(steps):
        for network, stepper in ((model, optimizer), (reference, ref_optimizer)):
            stepper.zero_grad()
            step(network, rank, index)
            stepper.step()
    optimizer.synchronize()
    distance = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    measured = attached(model).installed.profile.backward_time
    attached(model).detach()
    # one bucket: on gloo the hook's second all-reduce, launched from a callback thread, would race
    # with the next bucket's first
    hooked = torch.nn.parallel.DistributedDataParallel(EmulatedModel(profile, SIZE_SCALE), bucket_cap_mb=1024)
    hooked.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2,
                                                          start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
    hook_optimizer = torch.optim.SGD(hooked.parameters(), lr=0.1)
    for index in range(4):
        hook_optimizer.zero_grad()
        step(hooked, rank, index)
        hook_optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in hooked.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    spread = max((g - flat).abs().max().item() for g in gathered)
    return distance, measured, profile.backward_time, spread, math.isfinite(flat.sum().item()), sum(probe_waits)


def test_gradsync_ddp_and_the_powersgd_hook_run_on_it_and_profiling_measures_it():
    for distance, measured, emulated, spread, finite, probe_waits in run_local(beside_ddp, 2, 8, timeout=300):
        assert probe_waits > 0.1  # the slowdown probes alone wait 40 ms, 11 times
        assert distance < 1e-6
        assert measured == pytest.approx(emulated, rel=0.25)
        assert spread == 0.0 and finite
