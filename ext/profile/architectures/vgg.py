"""VGG16 (Simonyan and Zisserman, ICLR 2015, configuration D) with torchvision's layout and names."""
from __future__ import annotations

from torch import Tensor, nn

# Output channels of each 3x3 convolution; "M" is a 2x2 max pool.
VGG16_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    """Convolutions with bias and ReLU, a 7x7 adaptive pool and three fully connected layers."""

    def __init__(self, config=VGG16_CONFIG, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for entry in config:
            if entry == "M":
                layers.append(nn.MaxPool2d(2, stride=2))
            else:
                layers += [nn.Conv2d(in_channels, entry, 3, padding=1), nn.ReLU(inplace=True)]
                in_channels = entry
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(
            nn.Linear(in_channels * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def vgg16() -> VGG:
    return VGG()
