"""Error feedback under a dynamic loss scale (a GradScaler, DeepSpeed's fp16 scaler).

A codec keeps its error feedback in the units of the gradients it encodes: the scaled ones. When the
scale changes between steps (a back-off after an overflow, a growth after a run of finite steps),
the next step's M + E must add like to like, so E is multiplied by the same factor first.
"""
from __future__ import annotations

from typing import Callable

from .codec import Codec


class LossScaleFollower:
    """Reads the loss scale at each step's start and rescales a codec's error feedback by its
    change since the last read (``Codec.rescale_errors``).

    Args:
        read_scale: returns the current loss scale (a GradScaler's ``get_scale``).
    """

    def __init__(self, read_scale: Callable[[], float]):
        self.read_scale = read_scale
        self.seen: float | None = None  # the scale at the last read

    def follow(self, codec: Codec) -> None:
        """Call at a step's start, before any gradient is encoded and after the last step settled.
        Reads the scale only for a codec with error feedback (the read may wait for the device)."""
        if not codec.per_rank_state:
            return
        scale = self.read_scale()
        if self.seen is not None and scale != self.seen:
            codec.rescale_errors(scale / self.seen)
        self.seen = scale
