"""Gradients changed while their ops are in flight: read as the backward pass ends, compared
before the step.

An op reads its gradients as it launches, and its average overwrites them as it lands. A gradient
changed between the backward pass's end and the step would be lost without a word: clipped in
place, or unscaled by a GradScaler not given to ``wrap``, before ``optimizer.synchronize()``;
replaced; or accumulated into by a pass that bypassed the model's outputs (``output_start``, step 3).
So (``PlanExecutor.refuse_changed_in_flight``):

1. once the backward pass is over and every op launched, `GradientVersions` holds each op's buffer's
   version counter where the op's gradients are its buffer's spans, else each gradient and its
   counter. Not before: gradients that are views of one buffer (a fused op's, as the executor lands
   them) share its counter, which each of them accumulating moves;
2. at the step, or at ``optimizer.synchronize()``, before any op is collected, each op in flight is
   compared with them; the first that changed is refused, so that a refused step lands nothing and
   applies no update, deferred ones included.

The backends write the buffers without moving their counters. Not watched: plans of reduce-scatters,
which release each gradient once it is copied in, and the forest transport, which writes the
buffers with torch's own ops (those move the counters of the buffers and of the gradients that are
their views).
"""
from __future__ import annotations

import torch


class GradientVersions:
    """The version counters of an iteration's op buffers and gradients, as its backward pass ended."""

    def __init__(self):
        self.buffers: dict[int, int] = {}  # per op whose gradients are its buffer's spans: the buffer's counter
        self.gradients: dict[str, tuple[torch.Tensor | None, int]] = {}  # per other tensor: its gradient, counter

    def hold_buffer(self, index: int, buffer: torch.Tensor) -> None:
        """Op `index`'s gradients are the spans of its `buffer`: its counter stands for them all."""
        self.buffers[index] = buffer._version

    def hold_gradients(self, tensors: list[str], parameters: list[torch.nn.Parameter]) -> None:
        """Each of `parameters`' gradient (None where unused) and its counter, under its tensor's name."""
        for name, parameter in zip(tensors, parameters):
            grad = parameter.grad
            self.gradients[name] = (grad, grad._version if grad is not None else 0)

    def changed(self, index: int, op) -> bool:
        """Whether op `index` (an executor's op state: its buffer, tensors and parameters) was written
        since: its buffer's counter moved, or a gradient held was replaced or written in place."""
        if index in self.buffers:
            return op.buffer._version != self.buffers[index]
        held = self.gradients
        return any(_changed_since(parameter.grad, *held[name]) for name, parameter in zip(op.tensors, op.parameters)
                   if name in held)


def _changed_since(grad: torch.Tensor | None, held: torch.Tensor | None, version: int) -> bool:
    """Whether a parameter's gradient `grad` replaced the one `held`, or was written since its
    version counter read `version`."""
    return grad is not held or (grad is not None and grad._version != version)
