"""Beginning an iteration at the first gradient of the model's outputs instead of at the first
gradient of a parameter.

A hook before each parameter's gradient accumulates costs the backward pass one Python call per
parameter (about 1 µs each: MobileNet-V2's 158 took 2-3% of an iteration on 8 emulated ranks
sharing 2 cores). Those hooks begin the iteration, refuse a second backward pass before the step,
and tell which parameters produce a gradient. Where every op of the plans in force carries whole
gradients as they are (``PlanExecutor.watchable``), hooks on the tensors the model's forward
returns do the three (``GradSync._begin_at_outputs``); the ready hooks of gradients that let an op
launch before the pass ends stay:
1. the first gradient of an output begins the iteration, or refuses the pass, before any gradient
   of a parameter the forward used accumulates;
2. the parameters that produce a gradient are read from the autograd graph as the pass starts
   (``torch._C._will_engine_execute_node`` on each parameter's gradient accumulator,
   `used_in_graph`). The outputs begin only while that names every parameter: a parameter the
   graph cannot see (one a reentrant checkpoint's inner backward pass reaches) then cannot be left
   out, and where one is missing the per-parameter hooks are back at once, for the rest of the pass.
   A pass whose graph names no parameter (``torch.autograd.grad`` over the inputs, as a gradient
   penalty takes) begins nothing there: the hooks are back and begin the iteration if a parameter's
   gradient comes;
3. a later backward pass that bypasses the outputs (a loss on a submodule's output or on the
   parameters alone) writes the gradients of ops launched: into an op's buffer where a gradient is
   its span (a fused op's, after ``zero_gradients_in_place``), which moves the buffer's version
   counter, else into the gradient it held when the pass ended, which moves that one's counter or
   replaces it. The step (or a read of the gradients: ``optimizer.synchronize()``) finding either
   on an op not yet collected refuses (``runtime.in_flight``: the same watch
   refuses gradients changed in place, in every mode), and so does a step after such a pass alone;
   either returns the runtime to the hooks for good.
The outputs begin only after a synchronised pass in which the outputs' first gradient came before
any parameter's and the graph named the parameters whose hooks then ran, every one of them; and
not where the gradients are read before the step (``GradSync.flush``, a front-end's
``wait_at_backward_end``): a pass that bypassed the outputs after that would add to averaged
gradients that no op watches any more.
"""
from __future__ import annotations

from itertools import compress

import torch


class OutputStart:
    """The parameters' gradient accumulators, asked about by the graph query."""

    def __init__(self, parameters: dict[str, torch.nn.Parameter]):
        self.parameters = parameters
        self.names = list(parameters)
        self.accumulators: list | None = None  # built once, outside a backward pass (`prepare`)
        self.refused = False  # a pass bypassed the outputs: the per-parameter hooks from then on

    def prepare(self) -> bool:
        """Hold each parameter's gradient accumulator (the node the graph query asks about); False
        where none can be reached now (`can_prepare`): the iterations then begin at the parameters'
        hooks."""
        if self.accumulators is None:
            if not self.can_prepare():
                return False
            with torch.enable_grad():
                self.accumulators = [parameter.view_as(parameter).grad_fn.next_functions[0][0]
                                     for parameter in self.parameters.values()]
        return True

    def can_prepare(self) -> bool:
        """Whether the accumulators can be reached now: not under ``torch.inference_mode`` (an
        evaluation's forward, where even enable_grad records no graph), and every parameter requires
        its gradient (a parameter frozen for now, as a GAN's discriminator during the generator's
        step, has no accumulator)."""
        return not torch.is_inference_mode_enabled() and all(
            parameter.requires_grad for parameter in self.parameters.values())

    def accumulates(self, name: str) -> bool:
        """Whether the backward pass under way accumulates parameter `name`'s gradient: not under
        ``torch.autograd.grad`` over the parameters (a penalty on their gradients), whose gradients
        their hooks see all the same."""
        parameter = self.parameters[name]
        with torch.enable_grad():
            accumulator = parameter.view_as(parameter).grad_fn.next_functions[0][0]
        try:
            return torch._C._will_engine_execute_node(accumulator)
        except RuntimeError:  # "A leaf node was passed to _will_engine_execute_node ... autograd.grad()"
            return False

    def used_in_graph(self) -> set[str] | None:
        """The parameters the backward pass under way produces a gradient for (step 2); None under
        ``torch.autograd.grad`` over them, which accumulates no gradient."""
        try:
            return set(compress(self.names, map(torch._C._will_engine_execute_node, self.accumulators)))
        except RuntimeError:  # "A leaf node was passed to _will_engine_execute_node ... autograd.grad()"
            return None

