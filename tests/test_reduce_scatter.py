"""Plans of reduce-scatters: each rank receives its partition of the averaged gradients (as ZeRO's
sharded optimizers need), checked against torch's all-reduce on 2 and 3 gloo ranks."""
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync import ConfigError, CostModel, planners
from gradsync.launch import run_local
from gradsync.runtime.channels import Channels
from gradsync.runtime.executor import NonFiniteGradient, PlanExecutor
from gradsync.runtime.parameter_table import ParameterTable
from gradsync.runtime.partition import Partition


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))


def flat_partition(model: nn.Module, world_size: int) -> Partition:
    """ZeRO's partition: the parameters flattened in order and cut into equal contiguous parts."""
    numels = {name: p.numel() for name, p in model.named_parameters()}
    size = -(-sum(numels.values()) // world_size)
    spans, position = {}, 0
    for name, numel in numels.items():
        cuts = sorted({position, position + numel, *(k * size for k in range(world_size)
                                                      if position < k * size < position + numel)})
        spans[name] = tuple((start - position, end - position, start // size) for start, end in zip(cuts, cuts[1:]))
        position += numel
    return Partition(spans, world_size)


def reduce_scattered(rank, world_size, planner, nonfinite="raise", poison=None):
    """One backward pass, then the plan's reduce-scatters: (this rank received exactly its owned
    elements, each equal to torch's averaged gradient; every gradient released once packed; the
    plan's op count; whether the step was skipped)."""
    model = mlp()
    inputs = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    model(inputs).square().sum().backward()
    if poison is not None and rank == 1:
        model[0].weight.grad[0, 0] = float(poison)
    local = {name: p.grad.clone() for name, p in model.named_parameters()}
    averaged = {name: g.clone() for name, g in local.items()}
    for gradient in averaged.values():
        dist.all_reduce(gradient)
        gradient /= world_size
    partition = flat_partition(model, world_size)
    table = ParameterTable.of(model)
    profile = table.profile("mlp", list(table.owners), {m: 1e-3 for m in table.owners},
                            {m: 2e-3 for m in table.owners})
    cost = CostModel(1e-3, 1e-7)
    plan = planners.bind(planner)(profile, cost.for_collective("reduce_scatter")).with_collective("reduce_scatter")
    executor = PlanExecutor(plan, dict(model.named_parameters()), Channels(2), nonfinite=nonfinite,
                            partition=partition)
    executor.start_iteration(0, ready=set(local))
    try:
        executor.end_backward()
        executor.wait_all()
    except NonFiniteGradient as error:
        return "raised", str(error)
    owned = True
    for name, gradient in averaged.items():
        mine = torch.zeros(gradient.numel(), dtype=torch.bool)
        for start, end, owner in partition.spans[name]:
            mine[start:end] = owner == rank
        received = torch.zeros_like(mine)
        for tensor, start, values in executor.reduced_partition():
            if tensor == name:
                owned &= not bool(received[start:start + values.numel()].any())  # each element once
                received[start:start + values.numel()] = True
                owned &= torch.allclose(values, gradient.reshape(-1)[start:start + values.numel()], atol=1e-6)
        owned &= torch.equal(received, mine)
    released = all(parameter.grad is None for parameter in model.parameters())
    return owned, released, len(plan.ops), executor.skip_step


PLANNERS = ("wfbp", "ddp", "mg_wfbp", "us_byte")


def each_planner(rank, world_size):
    return {planner: reduce_scattered(rank, world_size, planner) for planner in PLANNERS}


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_receives_its_partition_of_the_average(world_size):
    for results in run_local(each_planner, world_size):
        assert set(results) == set(PLANNERS)
        for owned, released, ops, skipped in results.values():
            assert owned and released and not skipped and ops >= 1


def test_a_non_finite_gradient_outside_a_ranks_partition_skips_the_step_on_every_rank():
    """Rank 1's inf lies in rank 0's partition (the first weight's first element): rank 1 never
    receives it, yet both ranks skip (the flag travels with every segment) or raise."""
    assert [result[3] for result in run_local(reduced_scattered_poisoned, 2, "skip")] == [True, True]
    for status, message in run_local(reduced_scattered_poisoned, 2, "raise"):
        assert status == "raised" and "0.weight" in message


def reduced_scattered_poisoned(rank, world_size, nonfinite):
    return reduce_scattered(rank, world_size, "wfbp", nonfinite, poison="inf")


def test_a_partition_must_cover_every_tensor_once():
    numels = {"a": 4, "b": 2}
    assert Partition({"a": ((0, 3, 0), (3, 4, 1)), "b": ((0, 2, 1),)}, 2).check(numels, 2).split("a", 2, 2) == [
        (0, 2, 1), (1, 3, 1)]
    for spans, needle in [({"a": ((0, 4, 0),)}, "without owners ['b']"),
                          ({"a": ((0, 3, 0), (2, 4, 1)), "b": ((0, 2, 1),)}, "does not continue"),
                          ({"a": ((0, 4, 2),), "b": ((0, 2, 1),)}, "rank below 2"),
                          ({"a": ((0, 3, 0),), "b": ((0, 2, 1),)}, "end at 3 of 4")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            Partition(spans, 2).check(numels, 2)
    with pytest.raises(ConfigError, match="made for 3 ranks"):
        Partition({"a": ((0, 4, 0),), "b": ((0, 2, 1),)}, 3).check(numels, 2)


def attached_with_partition(rank, world_size):
    """gradsync's runtime attached with a partition and its network probed: the reduce-scatter's own
    fitted cost, plans of reduce-scatters, each rank's partition of torch's averaged gradient, and
    every gradient released."""
    from gradsync.runtime import attach, attached, check_wrap_arguments

    model = mlp()
    reference = nn.parallel.DistributedDataParallel(mlp())
    table = ParameterTable.of(model)
    profile = table.profile("mlp", list(table.owners), {m: 1e-3 for m in table.owners},
                            {m: 2e-3 for m in table.owners})
    partition = flat_partition(model, world_size)
    model, optimizer = attach(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              check_wrap_arguments("mg_wfbp", profile=profile), partition=partition)
    inputs = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    held = []  # the last layer's gradients, seen while the first layer's are computed
    model[0].register_full_backward_pre_hook(lambda *_: held.append([p.grad for p in model[4].parameters()]))
    model(inputs).square().sum().backward()
    reference(inputs).square().sum().backward()
    optimizer.synchronize()
    runtime = attached(model)
    expected = {name: parameter.grad.reshape(-1) for name, parameter in reference.module.named_parameters()}
    received = list(runtime.executor.reduced_partition())
    owned = sum(values.numel() for _, _, values in received) == sum(
        end - start for spans in partition.spans.values() for start, end, owner in spans if owner == rank)
    owned &= all(torch.allclose(values, expected[name][start:start + values.numel()], atol=1e-6)
                 for name, start, values in received)
    cost = runtime.installed.cost
    # each gradient was copied into its ops' buffers from its hook and released, as ZeRO-2 frees them:
    # the last layer's already while the first layer's were computed (before any op could launch)
    released = all(parameter.grad is None for parameter in model.parameters()) and runtime.executor.released == set(
        name for name, _ in model.named_parameters()) and held == [[None, None]]
    # other plans installed one after another (as auto's trials do): their op buffers are carved from one
    # allocation, grown for the largest (wfbp's: more ops, more flags) and then reused
    # (the allocation given back after each delivery, as the ZeRO step does, and held again by the next plan)
    runtime.executor.release_buffers()
    runtime.installed.install(profile, cost, planners.bind("wfbp"))
    storage = runtime.installed.shared_buffers.storage.untyped_storage()._cdata
    runtime.installed.install(profile, cost, planners.bind("mg_wfbp"))
    runtime.installed.install(profile, cost, planners.bind("wfbp"))
    runtime.executor.release_buffers()
    optimizer.zero_grad()
    model(inputs).square().sum().backward()
    optimizer.synchronize()
    shared = {state.buffer.untyped_storage()._cdata for state in runtime.executor.ops} == {storage}
    again = list(runtime.executor.reduced_partition())
    owned &= runtime.plan.planner == "wfbp" and sum(v.numel() for _, _, v in again) == sum(
        v.numel() for _, _, v in received) and all(
        torch.allclose(values, expected[name][start:start + values.numel()], atol=1e-6) for name, start, values in again)
    return owned, released, {op.collective for op in runtime.plan.ops}, cost.reduce_scatter_a is not None, shared


def test_the_runtime_probes_the_reduce_scatter_and_plans_reduce_scatters_for_a_partition():
    """... and the plans installed one after another share one allocation of op buffers."""
    for owned, released, collectives, fitted, shared in run_local(attached_with_partition, 2):
        assert owned and released and collectives == {"reduce_scatter"} and fitted and shared


def test_shared_op_buffers_are_aligned_views_of_one_allocation_that_grows_when_needed():
    from gradsync.runtime.op_buffers import ALIGN_BYTES, SharedOpBuffers

    shared = SharedOpBuffers()
    first = shared.carve([(3, torch.float32), (5, torch.bfloat16), (2, torch.float64)], torch.device("cpu"))
    assert [(b.numel(), b.dtype) for b in first] == [(3, torch.float32), (5, torch.bfloat16), (2, torch.float64)]
    base = shared.storage.data_ptr()
    assert [b.data_ptr() - base for b in first] == [0, ALIGN_BYTES, 2 * ALIGN_BYTES]
    smaller = shared.carve([(4, torch.float32)], torch.device("cpu"))
    assert shared.storage.data_ptr() == base == smaller[0].data_ptr()  # reused
    larger = shared.carve([(1000, torch.float32)], torch.device("cpu"))
    assert shared.storage.numel() == 4000 and larger[0].data_ptr() == shared.storage.data_ptr() != base


def test_shared_op_buffers_give_their_memory_back_between_steps_and_hold_it_again():
    """Released (as the ZeRO step does once the partitions are delivered), the allocation holds no
    memory; held again, its views are usable; an allocation outgrown while released is held for
    good, for the executors carved from it."""
    from gradsync.runtime.op_buffers import SharedOpBuffers

    shared = SharedOpBuffers()
    views = shared.carve([(6, torch.float32), (2, torch.float64)], torch.device("cpu"))
    shared.release()
    assert shared.storage.untyped_storage().nbytes() == 0
    shared.hold()
    assert shared.storage.untyped_storage().nbytes() == shared.storage.numel()
    views[0].copy_(torch.arange(6.0))
    views[1].fill_(2.5)
    assert views[0].tolist() == [0, 1, 2, 3, 4, 5] and views[1].tolist() == [2.5, 2.5]
    shared.release()
    outgrown = shared.storage
    larger = shared.carve([(1000, torch.float32)], torch.device("cpu"))
    assert outgrown.untyped_storage().nbytes() == outgrown.numel()
    views[0].fill_(1.0)
    larger[0].fill_(3.0)
    assert views[0].sum() == 6 and larger[0].sum() == 3000
