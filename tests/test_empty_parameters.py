"""A trainable parameter without elements has nothing to average: gradsync leaves it out of its
plans, as torch DDP's buckets hold none of its elements, and trains the rest as torch DDP does."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from gradsync.comm_hooks import CompressionState, compression_hook
from gradsync.errors import ConfigError
from gradsync.launch import run_local
from gradsync.runtime import attached
from gradsync.runtime.parameter_table import ParameterTable
from runtime_models import COST

STEPS = 4


class WithEmpty(nn.Module):
    """An empty parameter between two layers (as a pruned or optional component leaves one)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.gate = nn.Module()
        self.gate.bias = nn.Parameter(torch.zeros(0))
        self.last = nn.Linear(8, 3)

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)) + self.gate.bias.sum())


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 3, generator=generator)


def trained(module, optimizer, rank: int) -> None:
    for step in range(STEPS):
        inputs, targets = batch(rank, step)
        optimizer.zero_grad()
        F.mse_loss(module(inputs), targets).backward()
        optimizer.step()


def apart(module: nn.Module, reference: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(module.parameters(), reference.parameters()) if p.numel())


def beside_ddp(rank, world_size, front: str, scheduler: str | None):
    """The largest parameter difference from torch DDP after STEPS steps under `front` ("wrap" with
    `scheduler`, or DDP with gradsync's comm "hook"), and the number of ops the plan has."""
    torch.manual_seed(0)
    base = WithEmpty()
    reference = DDP(copy.deepcopy(base))
    trained(reference, torch.optim.SGD(reference.parameters(), lr=0.1), rank)
    if front == "wrap":
        module = copy.deepcopy(base)
        module, optimizer = gradsync.wrap(module, torch.optim.SGD(module.parameters(), lr=0.1), scheduler=scheduler,
                                          cost=COST)
        trained(module, optimizer, rank)
        optimizer.synchronize()  # us_byte's input-side ops update their layers at the next forward
        carried = {s.tensor for op in attached(module).plan.ops for s in op.slices}
        attached(module).detach()
        return apart(module, reference.module), carried
    module = DDP(copy.deepcopy(base))
    module.register_comm_hook(CompressionState(module.module, None), compression_hook)
    trained(module, torch.optim.SGD(module.parameters(), lr=0.1), rank)
    return apart(module.module, reference.module), None


@pytest.mark.parametrize("front, scheduler", [("wrap", "ddp"), ("wrap", "us_byte"), ("hook", None)])
def test_an_empty_parameter_is_left_out_and_the_rest_trains_as_torch_ddp(front, scheduler):
    for distance, carried in run_local(beside_ddp, 2, front, scheduler):
        assert distance < 1e-6
        if carried is not None:
            assert carried == {"first.weight", "first.bias", "last.weight", "last.bias"}


def test_a_table_sets_empty_parameters_aside_and_its_optimizer_may_hold_them():
    model = WithEmpty()
    table = ParameterTable.of(model)
    assert list(table.parameters) == ["first.weight", "first.bias", "last.weight", "last.bias"]
    assert table.empty == (model.gate.bias,)
    table.check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # no error


def test_a_model_whose_trainable_parameters_are_all_empty_is_refused_before_any_collective():
    """torch.distributed is not initialised here: the error comes before wrap would need it."""
    model = nn.Module()
    model.bias = nn.Parameter(torch.zeros(0))
    with pytest.raises(ConfigError, match="no trainable parameters with elements"):
        gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler="ddp")


def zero_partition_of_a_model_with_an_empty_parameter(rank, world_size):
    """zero_partition on the layout DeepSpeed's ZeRO gives the model's parameters (the empty one
    among them, at the offset after the first weight), checked against gradsync's table."""
    from gradsync.deepspeed.zero import zero_partition

    model = WithEmpty()
    table = ParameterTable.of(model)
    parameters = list(model.parameters())
    offsets = [sum(p.numel() for p in parameters[:index]) for index in range(len(parameters))]
    total = sum(p.numel() for p in parameters)
    zero = SimpleNamespace(round_robin_bit16_groups=[parameters], round_robin_bit16_offsets=[offsets],
                           partition_size=[-(-total // world_size)], real_dp_process_group=[None])
    partition = zero_partition(zero, table)
    partition.check({name: p.numel() for name, p in table.parameters.items()}, world_size)
    return sorted(partition.spans)


def test_a_zero_partition_leaves_an_empty_parameter_out():
    for names in run_local(zero_partition_of_a_model_with_an_empty_parameter, 2):
        assert names == ["first.bias", "first.weight", "last.bias", "last.weight"]
