"""The head-to-head's workloads: the models each row trains, one rank's synthetic batch and the
loss; the real-compute models (a small CNN and a transformer) and the zoo's models on emulated
accelerators."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.emulated import EmulatedModel
from gradsync.profile.model_zoo import zoo

from benchmarks.overhead import small_cnn

LEARNING_RATE = 0.01  # plain SGD for every row


def class_labels(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 10, (batch,), generator=generator)


@dataclass(frozen=True)
class Workload:
    """A model, one rank's synthetic batch of `batch` samples (inputs and targets) and its loss."""

    description: str
    batch: int
    samples: str  # what one sample is, for the report
    build_model: Callable[[], nn.Module]
    make_inputs: Callable[[int, torch.Generator], torch.Tensor]
    make_targets: Callable[[int, torch.Generator], torch.Tensor] = class_labels
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy


class Block(nn.Module):
    """A pre-norm encoder block whose four attention projections and two MLP matrices are
    nn.Linear modules of their own (as in BERT or GPT-2 code): every parameter's module runs."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.query, self.key, self.value, self.out = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = (self.split(projection(h)) for projection in (self.query, self.key, self.value))
        attention = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + self.out(attention)
        return x + self.down(F.gelu(self.up(self.norm2(x))))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)


class Transformer(nn.Module):
    """3 blocks of width 512 over 256 token ids, mean-pooled into 10 classes: large matrices
    (38 MB of gradients in 51 tensors)."""

    def __init__(self, width: int = 512, layers: int = 3, heads: int = 8, vocab: int = 256, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).mean(dim=1))


def images(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=generator)


def tokens(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 32), generator=generator)


# overhead.py's CNN has 26 small tensors (4.7 MB). The batches set each model's balance of
# computation and communication at 1 Gbit/s on CPU ranks (about 100× slower than the papers'
# GPUs): the CNN's backward pass about as long as its gradients' transfer with 2 ranks, where the
# order and merging of the all-reduces decide the step (with 4 images the transfer took about
# twice the computation and no schedule could hide it); torch DDP's transformer step 3.5-5.2× its
# computation (4 and 2 ranks), as for BERT-Base on 10GbE in acp-sgd Table III (S-SGD 805 ms,
# ACP-SGD 193 ms: at least 4.17×; with 4 sequences 2.4-4.8× depending on the host's speed).
WORKLOADS = {"cnn": Workload("CNN (small tensors)", 8, "images of 3×32×32", small_cnn, images),
             "transformer": Workload("transformer (large matrices)", 2, "sequences of 32 tokens", Transformer, tokens)}

# Emulated accelerators (gradsync.emulated): the zoo's models with each layer's forward and backward
# time on EMULATED_DEVICE, waited without occupying a core, and every tensor EMULATED_SIZE_SCALE times
# its size, so that 4 and 8 ranks' transfers, reductions and gradient writes stay within 2 cores: a
# link of R Gbit/s then carries what one of R / EMULATED_SIZE_SCALE Gbit/s carries for the full model.
# --time-scale k runs them in slow motion: every layer's time ×k, so a link of R Gbit/s stands for
# R × k / EMULATED_SIZE_SCALE Gbit/s at the device's speed, while the host's own cost per op stays.
EMULATED_DEVICE = "V100"
EMULATED_SIZE_SCALE = 0.05
EMULATED_MODELS = {"emulated_resnet50": ("resnet50", "ResNet-50"), "emulated_bert_base": ("bert_base", "BERT-Base"),
                   "emulated_mobilenet_v2": ("mobilenet_v2", "MobileNet-V2 (small tensors)")}


def emulated_inputs(batch: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, 1, generator=generator)


def weighted_mean(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """An EmulatedModel's loss: its output weighed by the targets (every gradient is its parameter's
    pattern times a scalar of the batch: gradsync.emulated)."""
    return (output * targets).mean()


def emulated_workload(zoo_name: str, description: str) -> Workload:
    """The zoo's `zoo_name` as an EmulatedModel: its times are those of the zoo's batch on the
    device; the batch it is given only weighs the gradients."""
    def build(time_scale: float = 1.0) -> nn.Module:
        return EmulatedModel(zoo(zoo_name, device=EMULATED_DEVICE).scaled(time_scale), EMULATED_SIZE_SCALE)

    return Workload(f"{description} emulated on a {EMULATED_DEVICE}, tensors ×{EMULATED_SIZE_SCALE:g}", 8,
                    "weights (an emulated model's times are its profile's)", build, emulated_inputs,
                    make_targets=emulated_inputs, loss=weighted_mean)


REAL_MODELS = tuple(WORKLOADS)
WORKLOADS.update({key: emulated_workload(*names) for key, names in EMULATED_MODELS.items()})
# ≙ 10 and 40 Gbit/s for the full-size models: the papers' 10GbE, and a faster network
EMULATED_RATES = ("0.5", "2")
