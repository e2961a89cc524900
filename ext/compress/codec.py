"""The codec interface: what travels for each gradient tensor, and how it is made and undone.

The runtime calls a codec for every tensor of every op, so no-compression is a codec too:
``Codec`` itself is the identity. A codec may change what travels from step to step; each distinct
wire layout has a key (``rounds(step)`` lists those sent at a step), and the runtime plans each
layout once, on the wire sizes (``wire_spec``), so any planner composes with any codec.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..profile import TensorSpec
from .spec import CodecSpec


class Codec:
    """Identity: every gradient travels as it is and is averaged by a sum all-reduce."""

    name = "identity"
    collective = "allreduce"  # or "allgather": the wire of every rank reaches every rank
    per_rank_state = False  # True when state differs between ranks (error feedback)
    # False where a non-finite gradient raises rather than skipping its step (wrap's nonfinite="raise"):
    # `settle` is then never asked to drop a step, and `encode` and `finish` may change the state in place
    may_skip_steps = True

    def setup(self, specs: Mapping[str, TensorSpec], world_size: int, seed: int) -> None:
        """Called once on every rank with the same tensors and seed (chosen by rank 0).

        Args:
            specs: every gradient tensor the codec will see, by parameter name (with its shape
                where known: only matrix-shaped tensors can be compressed as matrices).
            world_size: the number of ranks whose gradients are averaged.
            seed: an integer equal on every rank, for state that the ranks must share (e.g. the
                initial low-rank factors).
        """
        self.specs = dict(specs)
        self.world_size = world_size
        self.seed = seed

    def take_in(self, specs: Mapping[str, TensorSpec]) -> None:
        """Set up for `specs`: the tensors set up so far and more (parameters unfrozen since). Each
        earlier tensor keeps its state; each new one starts as `setup` starts it, from the same seed
        (alike on every rank), without error feedback yet."""
        shared, per_rank = self.state_dict()
        self.setup(specs, self.world_size, self.seed)
        fresh, _ = self.state_dict()
        self.load_state_dict(_kept_over(fresh, shared), per_rank)

    def settings(self) -> dict:
        """Every option it was built with: the ranks' codecs must agree on all of them (wrap
        compares them before the first collective)."""
        return self._options()

    def _options(self) -> dict:
        """The options that shape its state (checked again when a checkpoint is loaded)."""
        return {}

    # -- planning --------------------------------------------------------------------------------
    def rounds(self, step: int) -> tuple[str, ...]:
        """The wire layouts sent at `step` (0-based count of synchronised iterations), in order:
        usually one; a codec whose second message depends on the first reduced one (Power-SGD's
        P then Q) has two, and the second round starts once the first is reduced."""
        return ("plain",)

    def layouts(self) -> tuple[str, ...]:
        """Every layout `rounds` can return."""
        return ("plain",)

    def steady_rounds(self) -> list[tuple[str, ...]]:
        """The rounds of one cycle of steps after any warm-up (for predictions)."""
        late = 1 << 40
        return list(dict.fromkeys(self.rounds(step) for step in (late, late + 1)))

    def wire_spec(self, spec: TensorSpec, layout: str) -> TensorSpec:
        """What travels for `spec` under `layout` (same name; numel and element size may change)."""
        return spec

    def wire_dtype(self, layout: str, gradient_dtype: torch.dtype) -> torch.dtype:
        """Element type of the op buffers under `layout` (e.g. uint8 for packed signs). Codecs
        with non-floating wires must decode non-finite gradients to non-finite values: the
        runtime then checks the decoded gradients instead of the wire."""
        return gradient_dtype

    def compute_seconds(self, spec: TensorSpec, layout: str, flops_per_second: float) -> tuple[float, float]:
        """(encode, decode) compute time of `spec` under `layout` at the given device speed.

        Args:
            spec: the uncompressed gradient tensor (not its wire spec).
            layout: one of ``layouts()``.
            flops_per_second: the device's speed in floating-point operations a second, > 0;
                the times returned are in seconds.
        """
        return 0.0, 0.0

    # -- execution --------------------------------------------------------------------------------
    def encode(self, name: str, grad: torch.Tensor | None, step: int) -> torch.Tensor | None:
        """The 1-D wire tensor of this rank for `name`, or None when this rank contributes zeros
        (`grad` is None when the backward pass did not produce the gradient).

        Args:
            name: the tensor's name, a key of the specs given to ``setup``.
            grad: this rank's gradient, of the parameter's shape and dtype (summed over the
                no_sync backward passes before this one), or None.
            step: the 0-based count of synchronised iterations, as in ``rounds``.
        """
        return None if grad is None else grad.reshape(-1)

    def reduced_target(self, name: str, parameter: torch.nn.Parameter, step: int) -> torch.Tensor:
        """Where the reduced wire of `name` lands: shape (wire numel,) for all-reduce codecs, the
        rank-averaged values; (world size, wire numel) for all-gather codecs, every rank's wire.

        Args:
            name, step: as in ``encode``.
            parameter: the parameter whose gradient `name` is; the identity codec lands the
                average in parameter.grad itself (created as zeros, or made contiguous, first).
        """
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        elif not parameter.grad.is_contiguous():
            parameter.grad = parameter.grad.contiguous()
        return parameter.grad.view(-1)

    def finish(self, name: str, parameter: torch.nn.Parameter, step: int) -> None:
        """Once all of `name`'s wire is reduced: write the averaged gradient into parameter.grad.
        State the step changes (error feedback, the next step's factors) waits for ``settle``.

        Args:
            name, step: as in ``encode``.
            parameter: the parameter whose .grad receives the decoded gradient.
        """

    def settle(self, applied: bool) -> None:
        """Every gradient of the step is decoded: make the state its encodes and finishes left
        current if the step is `applied` (every averaged gradient finite), else drop it, so that a
        skipped step (an fp16 overflow in any tensor, found after others were decoded) leaves the
        state as it was. Nothing here: the identity keeps no state."""

    def rescale_errors(self, factor: float) -> None:
        """The loss scale became `factor` times what it was (a dynamic loss scaler's growth or
        back-off): error feedback, kept in the scaled gradients' units, is multiplied by `factor`
        so that the next step's M + E adds like to like. Nothing here: the identity keeps no error."""

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict, dict]:
        """(state equal on every rank, this rank's own state), tensors on the CPU."""
        return {}, {}

    def load_state_dict(self, shared: dict, per_rank: dict | None) -> None:
        """Restore what `state_dict` returned; `per_rank` is this rank's part (None if none)."""


def _kept_over(fresh: dict, saved: dict) -> dict:
    """`saved` over `fresh`: within each mapping by tensor name (a low-rank codec's factors), the
    saved tensors' entries over the fresh ones, which the new tensors alone keep."""
    kept = {**fresh, **saved}
    for key, entries in saved.items():
        if isinstance(entries, dict) and isinstance(fresh.get(key), dict):
            kept[key] = {**fresh[key], **entries}
    return kept


SPEC = CodecSpec(Codec, "no compression: gradients travel as they are", strategy=False)
