"""ResNet-50 and ResNet-152 (He et al., CVPR 2016) with torchvision's layout and parameter names:
bottleneck blocks with the stride on the 3x3 convolution (ResNet v1.5)."""
from __future__ import annotations

from torch import Tensor, nn


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), each followed by batch norm; identity or projected shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """7x7 stem, four stages of bottlenecks (widths 64..512), global pool, classifier."""

    def __init__(self, blocks_per_stage: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_channels = 64
        for stage, (blocks, width) in enumerate(zip(blocks_per_stage, (64, 128, 256, 512)), start=1):
            first_stride = 1 if stage == 1 else 2
            layers = []
            for index in range(blocks):
                layers.append(Bottleneck(in_channels, width, first_stride if index == 0 else 1))
                in_channels = width * Bottleneck.expansion
            setattr(self, f"layer{stage}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet50() -> ResNet:
    return ResNet((3, 4, 6, 3))


def resnet152() -> ResNet:
    return ResNet((3, 8, 36, 3))
