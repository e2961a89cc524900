"""Several optimizers over one model (a GAN's generator and discriminator in one module), each
updating its own parameters: ``gradsync.wrap(model, [g_optimizer, d_optimizer])``."""
import pytest
import torch
from torch import nn

import gradsync
from gradsync.errors import ConfigError
from gradsync.runtime import attached
from launches import side_by_side
from runtime_models import COST, GAN, gan_optimizers, gan_rounds

ROUNDS = 8


def trained(rank, world_size, front: str, freeze: bool):
    """The GAN's parameters after ROUNDS under gradsync's `front` scheduler with both optimizers,
    or under torch DDP (which finds the generator unused in the discriminator's pass)."""
    torch.manual_seed(0)
    gan = GAN()
    g_optimizer, d_optimizer = gan_optimizers(gan)
    if front == "torch":
        model = nn.parallel.DistributedDataParallel(gan, find_unused_parameters=True)
    else:
        model, (g_optimizer, d_optimizer) = gradsync.wrap(gan, [g_optimizer, d_optimizer], scheduler=front, cost=COST)
    gan_rounds(model, gan, g_optimizer, d_optimizer, torch.Generator().manual_seed(rank), ROUNDS, freeze)
    if front != "torch":
        attached(gan).detach()
    return torch.cat([p.detach().reshape(-1) for p in gan.parameters()])


FRONTS = ("ddp", "wfbp", "bytescheduler", "us_byte")


def test_a_gans_optimizers_on_one_module_train_as_under_torch_ddp():
    """Every pass is averaged whichever optimizer steps next: DDP's buckets (iterations begun at the
    outputs), per-tensor ops, partitioned blocks, and us_byte (whose updates are then not deferred);
    with the discriminator frozen for the generator's step or not."""
    variants = [(front, freeze) for freeze in (False, True) for front in ("torch", *FRONTS)]
    results = dict(zip(variants, side_by_side(trained, *variants)))
    for (front, freeze), ranks in results.items():
        reference = results["torch", freeze]
        assert max((ours - theirs).abs().max().item() for ours, theirs in zip(ranks, reference)) < 1e-6, front
    assert (results["torch", False][0] - results["torch", False][1]).abs().max() == 0  # replicas agree


def resumed(rank, world_size, compressor: str):
    """ACP-SGD over both optimizers: ROUNDS straight, and half of them, both optimizers' state
    saved, then a fresh wrap that loads it and runs the rest; both final parameters."""
    numbers = torch.Generator().manual_seed(rank)

    def attach():
        torch.manual_seed(0)
        gan = GAN()
        model, synced = gradsync.wrap(gan, gan_optimizers(gan), scheduler="wfbp", compressor=compressor, cost=COST)
        return gan, model, synced

    gan, model, synced = attach()
    gan_rounds(model, gan, *synced, numbers, ROUNDS, freeze=True)
    straight = torch.cat([p.detach().reshape(-1) for p in gan.parameters()])
    attached(gan).detach()
    numbers = torch.Generator().manual_seed(rank)
    gan, model, synced = attach()
    gan_rounds(model, gan, *synced, numbers, ROUNDS // 2, freeze=True)
    weights, states = gan.state_dict(), [optimizer.state_dict() for optimizer in synced]
    attached(gan).detach()
    gan, model, synced = attach()
    gan.load_state_dict(weights)
    for optimizer, state in zip(synced, states):
        optimizer.load_state_dict(state)
    gan_rounds(model, gan, *synced, numbers, ROUNDS - ROUNDS // 2, freeze=True)
    attached(gan).detach()
    return straight, torch.cat([p.detach().reshape(-1) for p in gan.parameters()])


def test_every_optimizers_state_carries_the_compressors_and_resumes_exactly():
    for straight, after_resume in side_by_side(resumed, ("acp_sgd",))[0]:
        assert (straight - after_resume).abs().max().item() == 0


@pytest.mark.parametrize("given, message", [
    ([], "'optimizer' is an empty list"),
    (["sgd"], "must be a torch.optim.Optimizer, got ['str']"),
    ("both", "updated by two optimizers"),
])
def test_bad_optimizer_lists_are_refused_before_any_collective(given, message):
    gan = GAN()
    if given == "both":
        given = [torch.optim.SGD(gan.parameters(), lr=0.1), torch.optim.SGD(gan.discriminator.parameters(), lr=0.1)]
    with pytest.raises(ConfigError) as error:
        gradsync.wrap(gan, given, scheduler="wfbp", cost=COST)
    assert message in str(error.value)


def added_twice(rank, world_size):
    """A parameter group added to the generator's optimizer with the discriminator's parameters:
    the error, and the generator's optimizer's groups after it."""
    gan = GAN()
    _, (g_optimizer, _) = gradsync.wrap(gan, gan_optimizers(gan), scheduler="wfbp", cost=COST)
    try:
        g_optimizer.add_param_group({"params": list(gan.discriminator.parameters())})
    except ConfigError as error:
        return str(error), len(g_optimizer.param_groups)
    finally:
        attached(gan).detach()
    return None, len(g_optimizer.param_groups)


def test_a_parameter_group_that_another_optimizer_updates_is_refused_and_taken_out_again():
    for message, groups in side_by_side(added_twice, ())[0]:
        assert message is not None and "updated by two optimizers" in message and "discriminator.0.weight" in message
        assert groups == 1
