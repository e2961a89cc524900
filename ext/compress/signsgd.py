"""EF-SignSGD with scale (Karimireddy et al. 2019, Algorithm 1), optionally with majority vote.

Every gradient tensor travels as 1 bit per element and its scale: p = M + E, wire = the sign bits
of p (bit 1 for p ≥ 0, sign_pack) followed by s = ‖p‖₁/numel as 4 bytes (float32 viewed as
uint8), ceil(numel/8) + 4 bytes in all; E ← p − s·sign(p), the part of p this rank did not send.
Signs cannot be summed by an all-reduce, so every rank's wire is all-gathered (acp-sgd §III) and
decoded on every rank:

- mean (default): g = (1/W)·Σ_r s_r·sign(p_r), the average of what the ranks sent;
- majority vote: g = sign(Σ_{r: s_r > 0} sign(p_r))·(1/W)·Σ_r s_r, signSGD's majority vote
  (Bernstein et al. 2018, acp-sgd ref. [17], the variant acp-sgd §III measures), 0 where the vote
  ties, scaled by the mean scale so that the step size matches the mean rule's. Ranks with s_r = 0 (no gradient: the runtime sends zeros, or
  p = 0) abstain instead of voting −1. The error stays the local one, E ← p − s·sign(p).

A non-finite p gives a non-finite scale, so its decoded gradient is non-finite on every rank (the
runtime checks decoded gradients, the wire being bytes); it never enters E.
"""
from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ..profile import TensorSpec
from ..triton_kernels import sign_majority_unpack, sign_pack, sign_unpack
from .gathered import GatheredWithFeedback
from .gradients import kernel_dtype, kernel_input
from .spec import CodecSpec

SCALE_BYTES = 4  # the float32 scale travels as 4 uint8


class SignSGD(GatheredWithFeedback):
    """Options: `error_feedback` (default true) and `majority_vote` (default false)."""

    name = "signsgd"

    def __init__(self, error_feedback: bool = True, majority_vote: bool = False):
        if not isinstance(majority_vote, bool):
            raise ConfigError(f"compressor 'signsgd': 'majority_vote' must be true or false, got {majority_vote!r}")
        super().__init__(error_feedback)
        self.majority_vote = majority_vote

    def _options(self) -> dict:
        return {"error_feedback": self.error_feedback, "majority_vote": self.majority_vote}

    # -- planning ----------------------------------------------------------------------------------
    def wire_spec(self, spec: TensorSpec, layout: str) -> TensorSpec:
        numel = math.ceil(spec.numel / 8) + SCALE_BYTES
        return TensorSpec(spec.name, numel, 1, (numel,))

    def wire_dtype(self, layout: str, gradient_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def compute_seconds(self, spec: TensorSpec, layout: str, flops_per_second: float) -> tuple[float, float]:
        """Element-wise passes, one operation per element each: encode adds E, sums |p| and packs
        (and unpacks and subtracts for the error); decode unpacks and adds each rank's signs."""
        encode = (5 if self.error_feedback else 2) * spec.numel
        decode = 2 * self.world_size * spec.numel
        return encode / flops_per_second, decode / flops_per_second

    # -- execution ---------------------------------------------------------------------------------
    def encode(self, name: str, grad: torch.Tensor | None, step: int) -> torch.Tensor | None:
        corrected = self._corrected(name, grad)
        if corrected is None:
            return None
        packed, scale = sign_pack(kernel_input(corrected))
        if self.error_feedback and bool(torch.isfinite(scale)):  # an inf or NaN in p makes ‖p‖₁ one
            sent = sign_unpack(packed, scale, corrected.numel(), kernel_dtype(corrected.dtype))
            self.pending[name] = corrected.sub_(sent)  # E ← p − s·sign(p)
        return torch.cat([packed, scale.reshape(1).view(torch.uint8)])

    def _decode(self, name: str, gathered: torch.Tensor, gradient: torch.Tensor) -> None:
        numel = gradient.numel()
        packed = gathered[:, :-SCALE_BYTES].contiguous()
        scale_bytes = gathered[:, -SCALE_BYTES:].clone(memory_format=torch.contiguous_format)  # aligned for the view
        scales = scale_bytes.view(torch.float32).view(-1)
        if self.majority_vote:
            voters = scales > 0  # a rank without a gradient sends zeros (scale 0): it abstains
            votes = sign_majority_unpack(packed[voters], numel) if bool(voters.any()) else \
                torch.zeros(numel, device=packed.device)
            gradient.copy_(votes * scales.mean())
            return
        # (1/W)·Σ_r s_r·sign(p_r), summed in float32 one rank at a time
        total = gradient if gradient.dtype == torch.float32 else torch.empty(numel, device=gradient.device)
        for rank in range(self.world_size):
            sent = sign_unpack(packed[rank], scales[rank] / self.world_size, numel)
            if rank == 0:
                total.copy_(sent)
            else:
                total.add_(sent)
        if total is not gradient:
            gradient.copy_(total)


SPEC = CodecSpec(SignSGD, "EF-SignSGD: one bit per element with a scale and error feedback", source="EF-SignSGD")
