"""Small models for the recipes, the examples and the convergence checks."""
from __future__ import annotations

from torch import nn

from ..errors import ConfigError, unknown_name


def small_cnn(classes: int = 10, channels: int = 1) -> nn.Module:
    """Two 3×3 convolutions and two linear layers, for 8×8 (digits) or larger square images."""
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(4), nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
        nn.Linear(64, classes),
    )


def mlp(inputs: int = 64, classes: int = 10, hidden: int = 128) -> nn.Module:
    """Three linear layers with ReLUs over the flattened sample.

    Args:
        inputs: values per sample (64 for the digits' 8×8 pixels).
        classes: outputs, one per class.
        hidden: the width of the two hidden layers.
    """
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


class SmallTransformer(nn.Module):
    """A two-layer encoder over token sequences with a classification head on the mean token."""

    def __init__(self, vocab: int = 256, classes: int = 10, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        if width % heads:
            raise ConfigError(f"transformer: 'width' ({width}) must be a multiple of 'heads', got {heads!r}")
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


MODELS = {"cnn": small_cnn, "mlp": mlp, "transformer": SmallTransformer}


def build(name: str, **options) -> nn.Module:
    if name not in MODELS:
        raise unknown_name("model", name, MODELS)
    return MODELS[name](**options)
