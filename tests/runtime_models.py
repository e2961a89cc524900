"""A small model with everything the runtime must handle: a convolution, batch norm, an embedding
whose weight is tied to the output layer, a frozen layer, a branch no rank uses and a branch only
rank 0 uses."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradsync import CostModel
from gradsync.runtime.parameter_table import ParameterTable

VOCAB, WIDTH, LENGTH, BATCH = 24, 16, 10, 6


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(WIDTH, WIDTH)
        self.rank0_only = nn.Linear(WIDTH, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, tokens, use_rank0_branch: bool = False):
        x = self.embed(tokens).transpose(1, 2)
        x = torch.relu(self.norm(self.conv(x))).mean(-1)
        x = self.frozen(x)
        if use_rank0_branch:
            x = x + self.rank0_only(x)
        return self.head(torch.tanh(self.mix(x)))


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH,), generator=generator)
    return tokens, targets


def train_side_by_side(pairs, rank: int, steps: int | range) -> None:
    """`steps` steps (or those of a range) of every (model, optimizer) pair on the same batches
    (gradsync's and torch DDP's)."""
    for step in range(steps) if isinstance(steps, int) else steps:
        tokens, targets = batch(rank, step)
        for network, stepper in pairs:
            stepper.zero_grad()
            F.cross_entropy(network(tokens), targets).backward()
            stepper.step()


def distance(model: nn.Module, reference: nn.Module) -> float:
    """The largest difference between the two models' parameters."""
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


def refusal_and_change(action, model: nn.Module) -> tuple[Exception | None, bool]:
    """The error `action()` raised (None where it ran), and whether it changed a parameter of `model`."""
    before = [p.detach().clone() for p in model.parameters()]
    try:
        action()
        refusal = None
    except Exception as error:  # noqa: BLE001 - the caller judges it
        refusal = error
    return refusal, any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def synthetic_profile(model: nn.Module):
    """Forward order of TiedNet with made-up times (ms scale), so planners build varied plans."""
    table = ParameterTable.of(model)
    order = ["embed", "conv", "norm", "rank0_only", "mix", "head", "unused"]
    forward = {m: 1e-3 for m in table.owners}
    backward = {m: 2e-3 * (1 + i % 3) for i, m in enumerate(order)}
    return table.profile("tiednet", order, forward, backward)


COST = CostModel(1e-3, 1e-7, gamma=1.3)


class AttentionNet(nn.Module):
    """Self-attention whose output projection's own forward never runs: nn.MultiheadAttention reads
    `out_proj.weight` directly, so a deferred update gated on out_proj's forward would come late."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        x, _ = self.attention(x, x, x, need_weights=False)
        return self.head(x.mean(1))


class GAN(nn.Module):
    """A generator and a discriminator; the forward is the discriminator's pass (on real samples
    and detached fakes) or, without `real`, the generator's."""

    def __init__(self):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, noise, real=None):
        fake = self.generator(noise)
        if real is None:
            return self.discriminator(fake)
        return self.discriminator(real), self.discriminator(fake.detach())


def gan_optimizers(gan: GAN) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(gan.generator.parameters(), lr=1e-2),
            torch.optim.SGD(gan.discriminator.parameters(), lr=0.05, momentum=0.9)]


def gan_rounds(model, gan: GAN, g_optimizer, d_optimizer, numbers: torch.Generator, rounds: int,
               freeze: bool) -> None:
    """A GAN's alternating steps: the discriminator's, then the generator's (the discriminator
    frozen for it where `freeze`, as Lightning's toggle_optimizer does; else its gradients are
    averaged and cleared unused)."""
    for _ in range(rounds):
        real, noise = torch.randn(6, 8, generator=numbers), torch.randn(6, 4, generator=numbers)
        d_optimizer.zero_grad()
        on_real, on_fake = model(noise, real)
        (F.softplus(-on_real).mean() + F.softplus(on_fake).mean()).backward()
        d_optimizer.step()
        g_optimizer.zero_grad()
        gan.discriminator.requires_grad_(not freeze)
        F.softplus(-model(noise)).mean().backward()
        g_optimizer.step()
        gan.discriminator.requires_grad_(True)


BACKBONE_WIDTH = 32  # a low-rank codec compresses the 32×32 weights at rank 4


class Backbone(nn.Module):
    """Three layers of a backbone and a head (the loss takes 4 of its outputs as classes): a backbone
    frozen at wrap and unfrozen later."""

    def __init__(self):
        super().__init__()
        width = BACKBONE_WIDTH
        self.backbone = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                      nn.Linear(width, width))
        self.head = nn.Linear(width, width)  # its weight compressed too: it has state when the backbone joins

    def forward(self, x):
        return self.head(torch.tanh(self.backbone(x)))


def backbone_loss(model, rank: int, step: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + step)
    inputs = torch.randn(6, BACKBONE_WIDTH, generator=generator).to(device)
    targets = torch.randint(0, 4, (6,), generator=generator).to(device)
    return F.cross_entropy(model(inputs)[:, :4], targets)


def backbone_optimizer(model: nn.Module, everything: bool) -> torch.optim.Optimizer:
    """Momentum SGD over every parameter, or over the head alone (the backbone added at its unfreezing)."""
    parameters = model.parameters() if everything else model.head.parameters()
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def unfreeze_backbone(model: nn.Module, optimizer, everything: bool) -> None:
    """The backbone trains from now on; added to `optimizer` as a group unless it held it already."""
    model.backbone.requires_grad_(True)
    if not everything:
        optimizer.add_param_group({"params": list(model.backbone.parameters()), "lr": 0.05})
