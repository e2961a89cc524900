"""Data sets that need no download: scikit-learn's digits, and synthetic images and tokens.

Every loader gives each rank its own shard of the training set (a DistributedSampler-style split:
the same number of samples on every rank) and the whole test set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, TensorDataset

from ..errors import ConfigError, unknown_name


@dataclass
class Split:
    train: DataLoader
    test: DataLoader
    classes: int
    features: int  # values per sample
    vocab: int | None = None  # token data: every token is below it


def _loaders(x_train, y_train, x_test, y_test, rank: int, world_size: int, batch_size: int, seed: int,
             classes: int, vocab: int | None = None) -> Split:
    if len(y_train) < world_size or not len(y_test):
        raise ConfigError(f"{len(y_train)} training and {len(y_test)} test samples: each of the {world_size} "
                          "ranks needs a training sample, and the test set one sample")
    # the training set trimmed to a multiple of the world size (DistributedSampler's drop_last): every
    # rank gets as many batches, so none waits at the end of an epoch for a step the others never take
    shard = slice(rank, len(y_train) // world_size * world_size, world_size)
    generator = torch.Generator().manual_seed(seed + rank)
    train = DataLoader(TensorDataset(x_train[shard], y_train[shard]), batch_size=batch_size, shuffle=True,
                       generator=generator, drop_last=True)
    test = DataLoader(TensorDataset(x_test, y_test), batch_size=256)
    return Split(train, test, classes, x_train.shape[1:].numel(), vocab)


def digits(rank: int = 0, world_size: int = 1, batch_size: int = 32, seed: int = 0, test_fraction: float = 0.2) -> Split:
    """scikit-learn's 1797 8×8 digit images (scaled to [0, 1]), a fixed shuffled train/test split.

    Args:
        rank, world_size: this rank and the number of ranks: rank takes every world_size-th training
            sample from the rank-th (the set trimmed to a multiple of world_size).
        batch_size: training samples per batch on each rank (the last partial batch is dropped).
        seed: shuffles this rank's shard (with seed + rank); the data and the train/test split do
            not depend on it.
        test_fraction: the share of the images held out as the test set, in (0, 1).
    """
    from sklearn.datasets import load_digits

    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise ConfigError(f"digits: 'test_fraction' must be a number in (0, 1), got {test_fraction!r}")
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    x, y = x[order], y[order]
    cut = int(len(y) * (1 - test_fraction))
    return _loaders(x[:cut], y[:cut], x[cut:], y[cut:], rank, world_size, batch_size, seed, 10)


def synthetic_images(rank: int = 0, world_size: int = 1, batch_size: int = 32, seed: int = 0, samples: int = 2048,
                     size: int = 16, classes: int = 10) -> Split:
    """Gaussian images whose class shifts the mean of one channel stripe: learnable, not trivial.

    Args:
        rank, world_size, batch_size, seed: as ``digits``.
        samples: images in all; four fifths train, the rest test.
        size: the side of the square one-channel images, in pixels.
        classes: the number of classes; class c raises row ``c * size // classes`` (at most `size`
            classes have a row of their own).
    """
    generator = torch.Generator().manual_seed(99)
    y = torch.randint(0, classes, (samples,), generator=generator)
    x = torch.randn(samples, 1, size, size, generator=generator)
    rows = (y * size // classes).view(-1, 1)
    x[torch.arange(samples).view(-1, 1), 0, rows] += 1.5
    cut = samples * 4 // 5
    return _loaders(x[:cut], y[:cut], x[cut:], y[cut:], rank, world_size, batch_size, seed, classes)


def synthetic_tokens(rank: int = 0, world_size: int = 1, batch_size: int = 32, seed: int = 0, samples: int = 2048,
                     length: int = 32, vocab: int = 256, classes: int = 10) -> Split:
    """Token sequences whose class is the most frequent of `classes` marker tokens.

    Args:
        rank, world_size, batch_size, seed: as ``digits``.
        samples: sequences in all; four fifths train, the rest test.
        length: tokens per sequence.
        vocab: every token is below it; tokens below `classes` are the class markers (about 30% of a
            sequence), the others fill it. Must exceed `classes`.
        classes: the number of classes.
    """
    if vocab <= classes:
        raise ConfigError(f"synthetic_tokens: 'vocab' must be greater than 'classes' ({classes}): the tokens "
                          f"below it mark the class, the others fill the sequence; got {vocab!r}")
    generator = torch.Generator().manual_seed(98)
    x = torch.randint(classes, vocab, (samples, length), generator=generator)
    y = torch.randint(0, classes, (samples,), generator=generator)
    marks = torch.rand(samples, length, generator=generator) < 0.3
    x = torch.where(marks, y.view(-1, 1).expand(-1, length), x)
    cut = samples * 4 // 5
    return _loaders(x[:cut], y[:cut], x[cut:], y[cut:], rank, world_size, batch_size, seed, classes, vocab)


DATASETS = {"digits": digits, "synthetic_images": synthetic_images, "synthetic_tokens": synthetic_tokens}


def load(name: str, **options) -> Split:
    if name not in DATASETS:
        raise unknown_name("data set", name, DATASETS)
    return DATASETS[name](**options)
