"""The zoo's architectures in plain PyTorch, each with its input shape and default batch size.

Default per-GPU batch sizes follow the papers: ResNet-50 64, ResNet-152 32, BERT-Base 32 and
BERT-Large 8 at sequence length 64 (acp-sgd §V-A; asc-wfbp Table III uses sequence length 64
too); DenseNet-201 32 (asc-wfbp Table III); GoogLeNet 64 (mg-wfbp §V). VGG16, MobileNet-v2 and
Inception-v3 use 64. Images are 3x224x224, 3x299x299 for Inception-v3.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .bert import bert_base, bert_large
from .densenet import densenet201
from .googlenet import googlenet
from .inception import inception_v3
from .mobilenet import mobilenet_v2
from .resnet import resnet152, resnet50
from .vgg import vgg16

BERT_SEQUENCE_LENGTH = 64


@dataclass(frozen=True)
class Architecture:
    """How to build a model and a batch of its inputs on the meta device."""

    build: Callable[[], nn.Module]
    make_inputs: Callable[[int], tuple[torch.Tensor, ...]]
    default_batch_size: int
    input_shape: str


def _image_inputs(size: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    return lambda batch_size: (torch.empty(batch_size, 3, size, size, device="meta"),)


def _token_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    """Token ids and token-type ids of `batch_size` sequences."""
    shape = (batch_size, BERT_SEQUENCE_LENGTH)
    return (
        torch.empty(shape, dtype=torch.long, device="meta"),
        torch.empty(shape, dtype=torch.long, device="meta"),
    )


_IMAGE = "3x224x224"
_TOKENS = f"{BERT_SEQUENCE_LENGTH} tokens"

ARCHITECTURES: dict[str, Architecture] = {
    "resnet50": Architecture(resnet50, _image_inputs(224), 64, _IMAGE),
    "resnet152": Architecture(resnet152, _image_inputs(224), 32, _IMAGE),
    "vgg16": Architecture(vgg16, _image_inputs(224), 64, _IMAGE),
    "densenet201": Architecture(densenet201, _image_inputs(224), 32, _IMAGE),
    "mobilenet_v2": Architecture(mobilenet_v2, _image_inputs(224), 64, _IMAGE),
    "googlenet": Architecture(googlenet, _image_inputs(224), 64, _IMAGE),
    "inception_v3": Architecture(inception_v3, _image_inputs(299), 64, "3x299x299"),
    "bert_base": Architecture(bert_base, _token_inputs, 32, _TOKENS),
    "bert_large": Architecture(bert_large, _token_inputs, 8, _TOKENS),
}
