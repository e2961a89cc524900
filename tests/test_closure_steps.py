"""Optimizers that evaluate the loss within their step (LBFGS): each evaluation of the closure is
a synchronised iteration, its gradients and its loss averaged over the ranks before the optimizer
reads them, so that every rank takes the same decisions and the result is torch DDP's."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from gradsync.launch import run_local
from gradsync.runtime import attached
from runtime_models import COST

STEPS = 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def data(rank: int):
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(16, 8, generator=generator), torch.randn(16, 3, generator=generator)


def mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    """The reference's loss: what gradsync returns to LBFGS (the objective of the averaged gradients)."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def lbfgs_beside_ddp(rank, world_size, scheduler):
    """STEPS LBFGS steps under gradsync and under torch DDP (its closure returning the loss averaged
    over the ranks): the parameters' largest difference, the losses the steps returned, and how many
    closure evaluations gradsync's steps ran."""
    inputs, targets = data(rank)
    reference = DDP(model())
    reference_optimizer = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=4)

    def reference_closure():
        reference_optimizer.zero_grad()
        loss = F.mse_loss(reference(inputs), targets)
        loss.backward()
        return mean_over_ranks(loss)

    for _ in range(STEPS):
        reference_optimizer.step(reference_closure)
    module = model()
    module, optimizer = gradsync.wrap(module, torch.optim.LBFGS(module.parameters(), lr=0.5, max_iter=4),
                                      scheduler=scheduler, cost=COST)
    evaluations, losses = [0], []

    def closure():
        evaluations[0] += 1
        optimizer.zero_grad()
        loss = F.mse_loss(module(inputs), targets)
        loss.backward()
        return loss

    for _ in range(STEPS):
        losses.append(float(optimizer.step(closure)))
    apart = max((p - q).abs().max().item() for p, q in zip(module.parameters(), reference.module.parameters()))
    attached(module).detach()
    return apart, losses, evaluations[0]


@pytest.mark.parametrize("scheduler", ["ddp", "us_byte"])
def test_lbfgs_steps_as_under_torch_ddp_with_every_evaluation_averaged(scheduler):
    results = run_local(lbfgs_beside_ddp, 2, scheduler)
    for apart, _, evaluations in results:
        assert apart < 1e-6
        assert evaluations > STEPS  # LBFGS evaluated the closure several times within a step
    assert results[0][1] == results[1][1]  # each step returned the loss averaged over the ranks


def evaluations_when_one_ranks_loss_barely_moves(rank, world_size):
    """Rank 0's loss scaled down a million times: its own change alone would fall below LBFGS's
    tolerance_change after the first iteration while rank 1's would not, and the ranks would
    evaluate different numbers of times (their collectives would not match). Averaged, the loss
    is the same on both, and so are their evaluations."""
    inputs, targets = data(rank)
    scale = 1e-6 if rank == 0 else 1.0
    module = model()
    module, optimizer = gradsync.wrap(module, torch.optim.LBFGS(module.parameters(), lr=0.5, max_iter=8,
                                                                tolerance_change=1e-7),
                                      scheduler="ddp", cost=COST, timeout=30)
    evaluations = [0]

    def closure():
        evaluations[0] += 1
        optimizer.zero_grad()
        loss = F.mse_loss(module(inputs), targets) * scale
        loss.backward()
        return loss

    optimizer.step(closure)
    attached(module).detach()
    return evaluations[0]


def test_every_rank_evaluates_the_closure_alike_whatever_its_own_loss():
    counts = run_local(evaluations_when_one_ranks_loss_barely_moves, 2, timeout=120)
    assert counts[0] == counts[1] > 2


def closure_without_backward(rank, world_size):
    module = model()
    module, optimizer = gradsync.wrap(module, torch.optim.LBFGS(module.parameters()), scheduler="ddp", cost=COST)
    before = [p.detach().clone() for p in module.parameters()]
    try:
        optimizer.step(lambda: F.mse_loss(module(data(rank)[0]), data(rank)[1]))
        error = None
    except RuntimeError as refused:
        error = str(refused)
    unchanged = all(torch.equal(p, q) for p, q in zip(module.parameters(), before))
    attached(module).detach()
    return error, unchanged


def test_a_closure_that_runs_no_backward_pass_is_refused_before_any_update():
    for error, unchanged in run_local(closure_without_backward, 2):
        assert error is not None and "the closure given to optimizer.step() without a synchronised backward" in error
        assert unchanged
