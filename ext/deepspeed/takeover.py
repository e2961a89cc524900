"""DeepSpeed's own optimizer kept as the engine's, its step routed through gradsync.

Where DeepSpeed wraps the user's optimizer in its own (ZeRO's at stages 1 and 2, the fp16 and bf16
optimizers at stage 0), that optimizer stays the engine's, so the engine's ``isinstance`` checks,
loss scaling, clipping and checkpoints hold. gradsync's runtime is attached with an ``OwnStep``
over the module's parameters, and the wrapper's class is extended (``extended``) with
``GradSyncOptimizer``: the ``step()`` the engine calls waits for the plan's ops, then runs the
wrapper's own step on the averaged gradients.
"""
from __future__ import annotations

from functools import cache

import torch

from ..runtime import SyncedOptimizer


class GradSyncOptimizer:
    """Overrides mixed into the class of DeepSpeed's own optimizer (``take_over``)."""

    gradsync: SyncedOptimizer  # the runtime's view: its step waits for the ops, then ``OwnStep``

    def step(self, closure=None):
        """gradsync's step: wait for the plan's ops, then the optimizer's own step; a step gradsync
        skipped for non-finite gradients is DeepSpeed's ``overflow``. When DeepSpeed's dynamic loss
        scaler changes the scale, the compressor's error feedback follows."""
        scale = self.loss_scale
        self.gradsync.step()
        if self.gradsync.sync.last_step_skipped:
            self.overflow = True
        if self.loss_scale != scale:
            self.gradsync.sync.loss_scale_changed(self.loss_scale / scale)

    def own_step(self):
        """DeepSpeed's step of this optimizer, on the gradients as they are."""
        return super().step()

    def zero_grad(self, set_to_none: bool = True):
        self.gradsync.zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    def synchronize(self) -> None:
        """Finish every outstanding op (as gradsync's SyncedOptimizer's)."""
        self.gradsync.synchronize()

    def state_dict(self):
        """The optimizer's own state and gradsync's (a collective where the codec keeps per-rank
        state: DeepSpeed asks every rank for it)."""
        return {**super().state_dict(), "gradsync": self.gradsync.sync.state_dict()}

    def load_state_dict(self, state_dict, *args, **kwargs):
        """gradsync's state, then the optimizer's own from the rest."""
        state_dict = dict(state_dict)
        if "gradsync" in state_dict:
            self.gradsync.sync.load_state_dict(state_dict.pop("gradsync"))
        return super().load_state_dict(state_dict, *args, **kwargs)


class OwnStep(torch.optim.Optimizer):
    """What gradsync's runtime steps: the module's parameters, whose ``step`` runs the taken-over
    optimizer's own step."""

    def __init__(self, owner, parameters):
        super().__init__(parameters, {})
        self.owner = owner

    def step(self, closure=None):
        return self.owner.own_step()


def take_over(optimizer, synced: SyncedOptimizer, overrides: type = GradSyncOptimizer) -> None:
    """Route `optimizer`'s step through gradsync: its class extended with `overrides`. Its step
    updates every parameter at once, so the ops are waited for as the backward pass ends.

    Args:
        optimizer: DeepSpeed's own optimizer, the engine's.
        synced: gradsync's view of the runtime, attached to the module with an ``OwnStep`` of it.
        overrides: ``GradSyncOptimizer`` or a subclass (ZeRO's).
    """
    synced.sync.wait_at_backward_end = True
    optimizer.gradsync = synced
    optimizer.__class__ = extended(overrides, type(optimizer))


@cache
def extended(overrides: type, base: type) -> type:
    """`base` with the methods of `overrides` first, named "GradSync<base>" (one class per pair),
    for an object of `base` that DeepSpeed built to become gradsync's in place."""
    return type(f"GradSync{base.__name__}", (overrides, base), {})
