"""DenseNet-201 (Huang et al., CVPR 2017) with torchvision's layout and names: growth rate 32,
blocks of (6, 12, 48, 32) layers, bottleneck width 4 x growth, transitions halving the channels."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv to 4k channels, BN-ReLU-3x3 conv to k new channels."""

    def __init__(self, in_channels: int, growth_rate: int, bottleneck_factor: int) -> None:
        super().__init__()
        width = bottleneck_factor * growth_rate
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, growth_rate, 3, padding=1, bias=False)

    def forward(self, features: list[Tensor]) -> Tensor:
        bottleneck = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class DenseBlock(nn.ModuleDict):
    """Each layer sees the concatenation of the block input and all earlier layers' outputs."""

    def __init__(self, num_layers: int, in_channels: int, growth_rate: int, bottleneck_factor: int) -> None:
        super().__init__()
        for index in range(num_layers):
            layer = DenseLayer(in_channels + index * growth_rate, growth_rate, bottleneck_factor)
            self.add_module(f"denselayer{index + 1}", layer)

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    """BN-ReLU-1x1 conv to `out_channels`, then 2x2 average pool."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(in_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.pool = nn.AvgPool2d(2, stride=2)


class DenseNet(nn.Module):
    """Stem (7x7 conv, BN, ReLU, max pool), dense blocks with transitions, final BN, classifier."""

    def __init__(
        self,
        block_config: tuple[int, ...],
        growth_rate: int = 32,
        init_features: int = 64,
        bottleneck_factor: int = 4,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, init_features, 7, stride=2, padding=3, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(init_features))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(3, stride=2, padding=1))
        channels = init_features
        for index, num_layers in enumerate(block_config, start=1):
            block = DenseBlock(num_layers, channels, growth_rate, bottleneck_factor)
            self.features.add_module(f"denseblock{index}", block)
            channels += num_layers * growth_rate
            if index != len(block_config):
                self.features.add_module(f"transition{index}", Transition(channels, channels // 2))
                channels //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(channels))
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        features = F.relu(self.features(x))
        return self.classifier(F.adaptive_avg_pool2d(features, 1).flatten(1))


def densenet201() -> DenseNet:
    return DenseNet((6, 12, 48, 32))
