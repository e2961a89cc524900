"""How fast the computation runs now, against the profile the plans were made on.

A profile is measured once, over a few iterations, but the machine's speed can change later (other
work on a shared host, clock changes, a batch that grows). After every steady iteration the runtime
compares the computing thread's measured busy time (``IterationStats.busy_time``) with the
simulator's prediction of it; every `window` iterations the window's median ratio is taken on each
rank and the largest over the ranks (the slowest rank sets the pace of a synchronised step) scales
the profile's times for the predictions from then on, when it is more than `tolerance` from 1.
The plans themselves stay: every rank must execute the same ones, and a plan made on the scaled
profile would only be made if all ranks agreed on the scale at the same iteration.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ..errors import ConfigError

WINDOW = 8  # iterations per comparison: one small all-reduce each
TOLERANCE = 0.03  # a smaller change of speed keeps the current scale (and the cached predictions)


class ComputeSpeed:
    """The factor the profile's times are scaled by (`scale`), kept from measured busy times."""

    def __init__(self, window: int = WINDOW, tolerance: float = TOLERANCE):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"compute speed 'window' must be an integer >= 1, got {window!r}")
        if not 0 <= tolerance < 1:
            raise ConfigError(f"compute speed 'tolerance' must be in [0, 1), got {tolerance!r}")
        self.window = window
        self.tolerance = tolerance
        self.scale = 1.0
        self.ratios: list[float] = []

    def observe(self, measured_busy: float, predicted_busy: float) -> bool:
        """Record one iteration (predicted with the current scale); True when the window is full:
        then combine `window_ratio()` over the ranks and pass the result to `rescale`."""
        self.ratios.append(measured_busy / predicted_busy if predicted_busy > 0 else 1.0)
        return len(self.ratios) >= self.window

    def window_ratio(self) -> float:
        """The median measured/predicted ratio of the full window, which starts anew."""
        ratio = statistics.median(self.ratios)
        self.ratios.clear()
        return ratio

    def rescale(self, ratio: float) -> bool:
        """Scale by `ratio` (the ranks' combined window ratio) unless it is within `tolerance` of 1;
        True if the scale changed."""
        if not ratio > 0 or abs(ratio - 1.0) <= self.tolerance:
            return False
        self.scale *= ratio
        return True


def slowest_over_ranks(value: float, process_group, device: torch.device) -> float:
    """The largest of the ranks' `value`: a collective.

    Args:
        value: this rank's number.
        process_group: the ranks.
        device: where the backend takes its tensors (CUDA for NCCL).
    """
    return _reduced_over_ranks([value], dist.ReduceOp.MAX, process_group, device)[0]


def least_over_ranks(values: list[float], process_group, device: torch.device) -> list[float]:
    """The smallest over the ranks of each of `values`: a collective.

    Args:
        values: this rank's numbers.
        process_group: the ranks.
        device: where the backend takes its tensors (CUDA for NCCL).
    """
    return _reduced_over_ranks(values, dist.ReduceOp.MIN, process_group, device)


def _reduced_over_ranks(values: list[float], op, process_group, device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=process_group)
    return tensor.tolist()
