"""How fast the computation runs now, against the profile the plans were made on.

A profile is measured once, over a few iterations, but the machine's speed can change later (other
work on a shared host, clock changes, a batch that grows). After every steady iteration the runtime
compares the computing thread's measured busy time (``IterationStats.busy_time``) with the
simulator's prediction of it; every `window` iterations the window's median ratio is taken on each
rank and the largest over the ranks (the slowest rank sets the pace of a synchronised step), read
an iteration later (``runtime.over_ranks``), scales the profile's times for the predictions from
then on, when it is more than `tolerance` from 1 on the same side in `PERSIST` windows running (as
the cost watch re-fits): on a busy host the slowest rank's ratio moves by more than the tolerance
from one window to the next, back and forth (on 8 ranks sharing 2 cores, ±7% around its level),
and each move would simulate the step again.
The plans themselves stay: every rank must execute the same ones, and a plan made on the scaled
profile would only be made if all ranks agreed on the scale at the same iteration.
"""
from __future__ import annotations

import math
import statistics

from ..errors import ConfigError
from .over_ranks import PendingReduction, StartReduction, on_this_rank

WINDOW = 8  # iterations per comparison, reduced with the other watchers' and read at the next iteration
TOLERANCE = 0.03  # a smaller change of speed keeps the current scale
PERSIST = 2  # ...as does a larger one in fewer windows running, on the same side
SCALE_STEP = 0.02  # scales within a step of each other (relative) share their predictions (`bin`)


class ComputeSpeed:
    """The factor the profile's times are scaled by (`scale`), kept from measured busy times.

    Args:
        window: iterations per comparison.
        tolerance: a smaller change of speed keeps the scale.
        persist: windows running beyond the tolerance on the same side before the scale moves.
        start: starts the reduction of a window's ratio to the largest over the ranks (a MAX
            reduction of the installed plans' ``over_ranks.CombinedReductions``; the default: one
            rank alone).
    """

    def __init__(self, window: int = WINDOW, tolerance: float = TOLERANCE, start: StartReduction = on_this_rank,
                 persist: int = PERSIST):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"compute speed 'window' must be an integer >= 1, got {window!r}")
        if not 0 <= tolerance < 1:
            raise ConfigError(f"compute speed 'tolerance' must be in [0, 1), got {tolerance!r}")
        if isinstance(persist, bool) or not isinstance(persist, int) or persist < 1:
            raise ConfigError(f"compute speed 'persist' must be an integer >= 1, got {persist!r}")
        self.window = window
        self.tolerance = tolerance
        self.persist = persist
        self.drifting = 0  # windows running beyond the tolerance: > 0 slower than predicted, < 0 faster
        self.scale = 1.0
        self.ratios: list[float] = []
        self.counted = 0  # iterations in the window under way
        self.slowest = PendingReduction(start)

    def observe(self, measured_busy: float, predicted_busy: float) -> bool:
        """Record one iteration (predicted with the current scale); True when the scale changed
        (`rescale`) by the last full window's median ratio, the largest over the ranks (reduced from
        the iteration that closed the window, read at this one). This iteration, predicted at the
        scale that changed, is then left out of the window's ratios; the window still closes after
        `window` iterations, with the other watchers' (``over_ranks.CombinedReductions``)."""
        slowest = self.slowest.take()
        rescaled = slowest is not None and self.rescale(slowest[0])
        if not rescaled:
            self.ratios.append(measured_busy / predicted_busy if predicted_busy > 0 else 1.0)
        self.counted += 1
        if self.counted >= self.window:
            if self.ratios:  # else (a window of one, rescaled) every rank starts nothing alike
                self.slowest.start([statistics.median(self.ratios)])
            self.ratios.clear()
            self.counted = 0
        return rescaled

    def bin(self) -> int:
        """The scale's step on a geometric grid of `SCALE_STEP`: the cache key of the predictions made
        at it. A busy host's scale moves to and fro between windows (on 2 loopback ranks of the
        emulated MobileNet-V2: 48 moves of 3% or more within 0.72-1.12 in 600 iterations), and
        each move to a step not seen before runs the simulator; a prediction made at another scale
        of the same step is less than a step from this scale's, within the `tolerance` that
        rescales."""
        return round(math.log(self.scale) / math.log1p(SCALE_STEP))

    def rescale(self, ratio: float) -> bool:
        """Scale by `ratio` (the ranks' combined window ratio) when it and the ratios of the
        `persist` - 1 windows before it were all more than `tolerance` from 1 on the same side;
        True if the scale changed."""
        if not ratio > 0 or abs(ratio - 1.0) <= self.tolerance:
            self.drifting = 0
            return False
        side = 1 if ratio > 1 else -1
        self.drifting = self.drifting + side if self.drifting * side > 0 else side
        if abs(self.drifting) < self.persist:
            return False
        self.scale *= ratio
        self.drifting = 0
        return True
