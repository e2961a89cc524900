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
    """One backward pass, then the plan's reduce-scatters: (owned spans equal torch's averaged
    gradient, spans owned by others keep this rank's own gradient, bytes sent, outcome)."""
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
    owned = others = True
    for name, parameter in model.named_parameters():
        grad = parameter.grad.reshape(-1)
        for start, end, owner in partition.spans[name]:
            expected = (averaged if owner == rank else local)[name].reshape(-1)[start:end]
            if owner == rank:
                owned &= torch.allclose(grad[start:end], expected, atol=1e-6)
            else:
                others &= torch.equal(grad[start:end], expected)
    return owned, others, len(plan.ops), executor.skip_step


PLANNERS = ("wfbp", "ddp", "mg_wfbp", "us_byte")


def each_planner(rank, world_size):
    return {planner: reduce_scattered(rank, world_size, planner) for planner in PLANNERS}


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_receives_its_partition_of_the_average(world_size):
    for results in run_local(each_planner, world_size):
        assert set(results) == set(PLANNERS)
        for owned, others, ops, skipped in results.values():
            assert owned and others and not skipped and ops >= 1


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
    fitted cost, plans of reduce-scatters, and each rank's partition of torch's averaged gradient."""
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
    model(inputs).square().sum().backward()
    reference(inputs).square().sum().backward()
    optimizer.synchronize()
    runtime = attached(model)
    owned = all(torch.allclose(parameter.grad.reshape(-1)[start:end],
                               dict(reference.module.named_parameters())[name].grad.reshape(-1)[start:end], atol=1e-6)
                for name, parameter in model.named_parameters()
                for start, end, owner in partition.spans[name] if owner == rank)
    cost = runtime.installed.cost
    return owned, {op.collective for op in runtime.plan.ops}, cost.reduce_scatter_a is not None


def test_the_runtime_probes_the_reduce_scatter_and_plans_reduce_scatters_for_a_partition():
    for owned, collectives, fitted in run_local(attached_with_partition, 2):
        assert owned and collectives == {"reduce_scatter"} and fitted
