"""MobileNet-v2 (Sandler et al., CVPR 2018) with torchvision's layout and names, width 1.0."""
from __future__ import annotations

from torch import Tensor, nn

# (expansion t, output channels c, repeats n, first stride s), the paper's Table 2.
INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def conv_bn_relu6(
    in_channels: int, out_channels: int, kernel: int = 3, stride: int = 1, groups: int = 1
) -> nn.Sequential:
    """Convolution without bias, batch norm, ReLU6 (torchvision's Conv2dNormActivation).

    Args:
        in_channels, out_channels: the convolution's input and output channels.
        kernel: the square kernel's side; padded by (kernel − 1) // 2, so stride 1 keeps the size.
        stride: the convolution's stride.
        groups: the convolution's groups (``in_channels`` for a depthwise convolution).
    """
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """1x1 expansion (omitted when t = 1), 3x3 depthwise, linear 1x1 projection; residual when shapes match."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = in_channels * expansion
        self.use_residual = stride == 1 and in_channels == out_channels
        layers = [conv_bn_relu6(in_channels, hidden, kernel=1)] if expansion != 1 else []
        layers += [
            conv_bn_relu6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        return x + out if self.use_residual else out


class MobileNetV2(nn.Module):
    """32-channel stem, 17 inverted residual blocks, 1x1 conv to 1280, dropout and classifier."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers = [conv_bn_relu6(3, 32, stride=2)]
        in_channels = 32
        for expansion, out_channels, repeats, first_stride in INVERTED_RESIDUAL_SETTING:
            for index in range(repeats):
                stride = first_stride if index == 0 else 1
                layers.append(InvertedResidual(in_channels, out_channels, stride, expansion))
                in_channels = out_channels
        layers.append(conv_bn_relu6(in_channels, 1280, kernel=1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        return self.classifier(x)


def mobilenet_v2() -> MobileNetV2:
    return MobileNetV2()
