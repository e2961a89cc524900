"""Lightning Fabric with gradsync's strategies: ``Fabric(strategy=<name>)`` on 2 gloo ranks, against
Fabric's own DDP (with gradient accumulation through ``fabric.no_backward_sync`` and clipping through
``fabric.clip_gradients``; and a GAN's two optimizers), and a backbone unfrozen after fabric.setup
against torch DDP made again at the unfreezing."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from lightning_fabric.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

import gradsync  # noqa: F401  (registers the strategy names)
from gradsync import ConfigError
from gradsync.launch import run_local
from gradsync.strategies import GradSyncFabricStrategy
from runtime_models import (GAN, Backbone, backbone_loss, backbone_optimizer, gan_optimizers, gan_rounds,
                            unfreeze_backbone)

STEPS = 8  # every other step accumulates: 4 optimizer steps


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 32, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def train(fabric: Fabric, rank: int) -> torch.Tensor:
    """STEPS backward passes, every other one under no_backward_sync, the gradients clipped before each
    step (by norm, then by value, in turn); the final parameters."""
    module = model()
    module, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for step in range(STEPS):
        inputs, targets = batch(rank, step)
        accumulating = step % 2 == 0
        with fabric.no_backward_sync(module, enabled=accumulating):
            fabric.backward(torch.nn.functional.cross_entropy(module(inputs), targets))
        if not accumulating:
            if step % 4 == 1:
                fabric.clip_gradients(module, optimizer, max_norm=0.5)
            else:
                fabric.clip_gradients(module, optimizer, clip_val=0.02)
            optimizer.step()
            optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def unfrozen_beside_ddp_made_again(rank: int, world_size: int) -> float:
    """A backbone frozen at fabric.setup and unfrozen after two steps (its group added to Fabric's
    optimizer), trained under gradsync's wfbp and under torch DDP made again at the unfreezing: the
    largest difference of their parameters."""
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy="wfbp")
    fabric.launch()
    torch.manual_seed(0)
    net = Backbone()
    net.backbone.requires_grad_(False)
    reference = copy.deepcopy(net)
    module, optimizer = fabric.setup(net, backbone_optimizer(net, everything=False))
    reference_optimizer = backbone_optimizer(reference, everything=False)
    for step in range(10):
        if step == 2:
            unfreeze_backbone(net, optimizer, everything=False)
            unfreeze_backbone(reference, reference_optimizer, everything=False)
        if step in (0, 2):
            ddp = DistributedDataParallel(reference)
        for model, stepper, backward in ((module, optimizer, fabric.backward),
                                         (ddp, reference_optimizer, torch.Tensor.backward)):
            stepper.zero_grad()
            backward(backbone_loss(model, rank, step))
            stepper.step()
    return max((a - b).abs().max().item() for a, b in zip(net.parameters(), reference.parameters()))


def fabric_runs(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)  # processes created outside Fabric: it launches none
    results = {}
    for name in ("ddp", "wfbp", "acp_sgd", GradSyncFabricStrategy("us_byte", options={"partition_bytes": 256})):
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=name)
        fabric.launch()
        params = train(fabric, rank)
        gathered = [torch.empty_like(params) for _ in range(world_size)]
        dist.all_gather(gathered, params)
        label = name if isinstance(name, str) else "us_byte"
        results[label] = {"params": params.tolist(), "same_on_ranks": all(torch.equal(gathered[0], g) for g in gathered),
                          "strategy": type(fabric.strategy).__name__}
    for label, name in (("gan/ddp", DDPStrategy(find_unused_parameters=True)), ("gan/wfbp", "wfbp")):
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=name)
        fabric.launch()
        torch.manual_seed(0)
        gan = GAN()
        module, g_optimizer, d_optimizer = fabric.setup(gan, *gan_optimizers(gan))
        gan_rounds(module, gan, g_optimizer, d_optimizer, torch.Generator().manual_seed(rank), 4, freeze=True)
        results[label] = {"params": torch.cat([p.detach().reshape(-1) for p in gan.parameters()]).tolist()}
    results["unfrozen/wfbp"] = unfrozen_beside_ddp_made_again(rank, world_size)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy="wfbp")
    fabric.launch()
    try:
        fabric.setup(model())
    except ConfigError as error:
        results["model_alone"] = str(error)
    return results


def test_fabric_strategies_train_like_fabrics_ddp_with_accumulation():
    for results in run_local(fabric_runs, 2):
        reference = torch.tensor(results["ddp"]["params"])
        for name in ("wfbp", "us_byte", "acp_sgd"):
            assert results[name]["strategy"] == "GradSyncFabricStrategy" and results[name]["same_on_ranks"], name
        for name in ("wfbp", "us_byte"):
            assert (torch.tensor(results[name]["params"]) - reference).abs().max() < 1e-6, name
        compressed = torch.tensor(results["acp_sgd"]["params"])
        assert 0 < (compressed - reference).abs().max() < 0.1  # the 64 × 32 weight at rank 4: close, not equal
        assert "fabric.setup(model, optimizer)" in results["model_alone"]
        # a GAN's two optimizers in one fabric.setup, as under Fabric's DDP
        gan, gan_reference = (torch.tensor(results[f"gan/{name}"]["params"]) for name in ("wfbp", "ddp"))
        assert (gan - gan_reference).abs().max() < 1e-6
        # a backbone frozen at fabric.setup and unfrozen later joins the plans
        assert results["unfrozen/wfbp"] < 1e-6


def test_bad_fabric_strategy_arguments_are_refused_before_launch():
    with pytest.raises(ConfigError, match="takes no 'find_unused_parameters'"):
        GradSyncFabricStrategy("wfbp", find_unused_parameters=True)
    with pytest.raises(ConfigError, match="unknown scheduler"):
        GradSyncFabricStrategy("fastest")
