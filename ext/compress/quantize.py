"""8-bit min-max quantisation per chunk, with error feedback (Bagua's ByteGrad quantiser).

p = M + E is cut into chunks of `chunk` elements; chunk c travels as one byte per element,
q = round((p − min_c) / s_c) with s_c = (max_c − min_c) / 255, followed by the chunks' (min_c, s_c)
as float32 pairs: numel + 8·ceil(numel / chunk) bytes, about a quarter of float32. Bytes cannot be
summed, so every rank's wire is all-gathered and each rank decodes the mean of the ranks'
dequantised values min_c + q·s_c (in float32). With error feedback E ← p − dequantised(p), the
rounding this rank did not send. A non-finite p makes its chunk's min or scale non-finite, so the
decoded gradient is non-finite on every rank, and it never enters E.
"""
from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ..profile import TensorSpec
from .gathered import GatheredWithFeedback
from .spec import CodecSpec

LEVELS = 255  # the largest byte
HEADER_BYTES = 8  # a chunk's minimum and scale, two float32


class MinMax8Bit(GatheredWithFeedback):
    """Options: `chunk` (elements per minimum and scale, default 1024) and `error_feedback`."""

    name = "minmax8"

    def __init__(self, chunk: int = 1024, error_feedback: bool = True):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"compressor 'minmax8': 'chunk' must be an integer >= 1, got {chunk!r}")
        super().__init__(error_feedback)
        self.chunk = chunk

    def _options(self) -> dict:
        return {"chunk": self.chunk, "error_feedback": self.error_feedback}

    # -- planning ----------------------------------------------------------------------------------
    def wire_spec(self, spec: TensorSpec, layout: str) -> TensorSpec:
        numel = spec.numel + HEADER_BYTES * math.ceil(spec.numel / self.chunk)
        return TensorSpec(spec.name, numel, 1, (numel,))

    def wire_dtype(self, layout: str, gradient_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def compute_seconds(self, spec: TensorSpec, layout: str, flops_per_second: float) -> tuple[float, float]:
        """Element-wise passes: encode adds E, finds the chunks' ranges, quantises (and
        dequantises and subtracts for the error); decode dequantises and adds each rank's."""
        encode = (6 if self.error_feedback else 4) * spec.numel
        return encode / flops_per_second, 2 * self.world_size * spec.numel / flops_per_second

    # -- execution ---------------------------------------------------------------------------------
    def encode(self, name: str, grad: torch.Tensor | None, step: int) -> torch.Tensor | None:
        corrected = self._corrected(name, grad)
        if corrected is None:
            return None
        values = corrected.float()
        chunks = _chunked(values, self.chunk)
        low, high = chunks.amin(dim=1), chunks.amax(dim=1)
        scale = (high - low) / LEVELS
        step_size = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant chunk is all zeros
        levels = ((chunks - low[:, None]) / step_size[:, None]).round_().clamp_(0, LEVELS)
        header = torch.stack([low, scale], dim=1)
        if self.error_feedback and bool(torch.isfinite(header).all()):
            sent = (low[:, None] + levels * scale[:, None]).reshape(-1)[:values.numel()]
            self.pending[name] = corrected.sub_(sent.to(corrected.dtype))  # E ← p − dequantised(p)
        payload = levels.to(torch.uint8).reshape(-1)[:values.numel()]
        return torch.cat([payload, header.reshape(-1).view(torch.uint8)])

    def _decode(self, name: str, gathered: torch.Tensor, gradient: torch.Tensor) -> None:
        numel = gradient.numel()
        chunks = math.ceil(numel / self.chunk)
        headers = gathered[:, numel:].clone(memory_format=torch.contiguous_format)  # aligned for the view
        low_scale = headers.view(torch.float32).view(self.world_size, chunks, 2)
        total = torch.zeros(numel, device=gradient.device)
        for rank in range(self.world_size):
            low, scale = (column.repeat_interleave(self.chunk)[:numel] for column in low_scale[rank].unbind(dim=1))
            total.add_(low + gathered[rank, :numel].float() * scale)
        gradient.copy_(total.div_(self.world_size))


def _chunked(values: torch.Tensor, chunk: int) -> torch.Tensor:
    """`values` (1-D) as rows of `chunk`, the last row padded with its own last value (which
    leaves that chunk's minimum and maximum as they are)."""
    padding = -values.numel() % chunk
    if padding:
        values = torch.cat([values, values[-1:].expand(padding)])
    return values.view(-1, chunk)


SPEC = CodecSpec(MinMax8Bit, "8-bit min-max quantisation per chunk with error feedback", source="Bagua ByteGrad")
