"""A plain training loop with gradsync on local ranks: the convergence checks and examples use it."""
from __future__ import annotations

import random
import statistics

import torch
import torch.nn.functional as F

from .. import wrap
from ..runtime import attached
from . import data, models


def accuracy(model, loader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(dim=1) == y).sum())
            total += len(y)
    model.train()
    return 100.0 * correct / total


def fit(rank: int, world_size: int, model: str = "cnn", dataset: str = "digits", epochs: int = 8,
        scheduler: str = "wfbp", compressor=None, lr: float = 0.05, momentum: float = 0.9, batch_size: int = 32,
        seed: int = 0, **wrap_options) -> dict:
    """Train on this rank's shard with SGD and a cosine learning-rate schedule; every rank returns
    the test accuracy after each epoch, the median iteration time and communication wait (an
    iteration that spans an evaluation between epochs does not move them) and the last step's wire
    bytes (run it with gradsync.launch.run_local).

    Args:
        rank, world_size: this rank and the number of ranks (run_local passes them).
        model: a gradsync.recipes.models name, built with its default options (which must suit the
            data set: e.g. ``mlp`` takes 64 inputs, the digits' 8×8 pixels).
        dataset: a gradsync.recipes.data name, loaded with its default options.
        epochs: training epochs; the learning rate anneals (cosine) to zero over them.
        scheduler, compressor: gradsync.wrap's scheduler name and compressor (None, a name, a
            ``{"type": name, ...}`` dict or a Codec).
        lr, momentum: SGD's initial learning rate and momentum.
        batch_size: samples per step on each rank.
        seed: seeds the model's initialisation, the shuffling of the shards and Python's `random`
            (from which rank 0 draws the compressor's seed).
        **wrap_options: passed on to gradsync.wrap (channels, profile, cost, planner options, ...).
    """
    split = data.load(dataset, rank=rank, world_size=world_size, batch_size=batch_size, seed=seed)
    torch.manual_seed(seed)
    random.seed(seed)  # rank 0 draws the compressor's seed from `random`: reproducible runs
    network = models.build(model)
    network, optimizer = wrap(network, torch.optim.SGD(network.parameters(), lr=lr, momentum=momentum),
                              scheduler=scheduler, compressor=compressor, **wrap_options)
    # cosine annealing to zero: the final accuracy is a settled value, not one noisy epoch's
    annealing = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(split.train))
    accuracies = []
    for _ in range(epochs):
        for x, y in split.train:
            optimizer.zero_grad()
            F.cross_entropy(network(x), y).backward()
            optimizer.step()
            annealing.step()
        optimizer.synchronize()
        accuracies.append(accuracy(network, split.test))
    sync = attached(network)
    history = sync.report().history
    result = {
        "accuracy": accuracies,
        "iteration_ms": 1e3 * statistics.median(s.iteration_time for s in history),
        "comm_wait_ms": 1e3 * statistics.median(s.comm_wait for s in history),
        "wire_bytes": history[-1].bytes_sent,
    }
    sync.detach()
    return result
