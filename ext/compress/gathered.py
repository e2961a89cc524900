"""The base of the all-gather codecs with error feedback (Sign-SGD, Top-k)."""
from __future__ import annotations

from typing import Mapping

import torch

from ..errors import ConfigError
from ..profile import TensorSpec
from .codec import Codec
from .gradients import refuse_non_float


class GatheredWithFeedback(Codec):
    """What the all-gather codecs share: every tensor compressed from p = M + E with a local error
    E, every rank's wire staged as (world size, wire numel), the errors as per-rank state.

    encode leaves the new error in `pending`; finish writes the decoded gradient and marks the
    tensor's new error `finished`; settle makes the finished errors current if the step is
    applied. A tensor whose gradient is not applied (no rank used it, or the step is skipped)
    keeps its E instead of losing what was sent.
    Subclasses define `_decode(name, gathered, gradient)`, which writes the rank-averaged gradient
    decoded from `gathered` (world size, wire numel) into `gradient` (parameter.grad, flat), and
    `_options()`, the options that shape the state."""

    collective = "allgather"

    def __init__(self, error_feedback: bool = True):
        """Args:
            error_feedback: whether E carries what a step did not send into the next one.
        """
        if not isinstance(error_feedback, bool):
            raise ConfigError(f"compressor {self.name!r}: 'error_feedback' must be true or false, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.per_rank_state = error_feedback

    def setup(self, specs: Mapping[str, TensorSpec], world_size: int, seed: int) -> None:
        refuse_non_float(self.name, specs)
        super().setup(specs, world_size, seed)
        self.errors: dict[str, torch.Tensor] = {}
        self.pending: dict[str, torch.Tensor] = {}
        self.finished: dict[str, torch.Tensor] = {}
        self.staging: dict[str, torch.Tensor] = {}

    def _corrected(self, name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
        """p = M + E as a fresh flat tensor (it becomes the next E), or M itself without feedback;
        None when this rank has neither (it contributes zeros)."""
        error = self.errors.get(name) if self.error_feedback else None
        if grad is None:
            return None if error is None else error.clone()
        flat = grad.reshape(-1)
        if not self.error_feedback:
            return flat
        if error is None:
            return flat.clone()
        return flat + error.to(device=flat.device, dtype=flat.dtype)  # moved once after a checkpoint load

    def reduced_target(self, name: str, parameter: torch.nn.Parameter, step: int) -> torch.Tensor:
        shape = (self.world_size, self.wire_spec(self.specs[name], "plain").numel)
        staging = self.staging.get(name)
        if staging is None or staging.shape != shape:
            dtype = self.wire_dtype("plain", parameter.dtype)
            staging = self.staging[name] = torch.empty(shape, dtype=dtype, device=parameter.device)
        return staging

    def finish(self, name: str, parameter: torch.nn.Parameter, step: int) -> None:
        self._decode(name, self.staging[name], Codec.reduced_target(self, name, parameter, step))
        if name in self.pending:
            self.finished[name] = self.pending.pop(name)

    def settle(self, applied: bool) -> None:
        if applied:
            self.errors.update(self.finished)
        self.finished, self.pending = {}, {}

    def rescale_errors(self, factor: float) -> None:
        for error in self.errors.values():
            error.mul_(factor)

    def state_dict(self) -> tuple[dict, dict]:
        """Shared: the options; per rank: the error-feedback vectors."""
        return ({"options": self._options()},
                {"errors": {k: v.detach().cpu().clone() for k, v in self.errors.items()}})

    def load_state_dict(self, shared: dict, per_rank: dict | None) -> None:
        if shared["options"] != self._options():
            raise ConfigError(f"{self.name} state was saved with options {shared['options']}, "
                              f"this run uses {self._options()}")
        errors = (per_rank or {}).get("errors", {})
        unknown = sorted(set(errors) - set(self.specs))
        if unknown:
            raise ConfigError(f"{self.name} state holds errors of tensors this model does not have: {unknown[:5]}")
        self.errors = {k: v.clone() for k, v in errors.items()}
        self.finished, self.pending = {}, {}
