"""Top-k SGD with error feedback (acp-sgd §III and refs. [19], [21]; Karimireddy et al. 2019).

Every gradient tensor travels as its k = max(1, ceil(density·numel)) largest-magnitude entries:
p = M + E, (values, indices) = the k largest |p| (topk_by_threshold), E ← p − p restricted to those
indices (the entries not sent). Sparse vectors with different indices cannot be summed by an
all-reduce, so every rank's wire is all-gathered (acp-sgd §III) and every rank decodes
g = (1/W)·Σ_r scatter(values_r at indices_r).

Wire, in the gradient's dtype: the k values, then the k indices bit-cast into gradient words. An
index must read as a finite float, since the runtime checks float wires for inf/NaN:
- fp32: one word, the int32 bit pattern (finite below 0x7F800000, so tensors up to 2 139 095 040
  elements);
- fp64: one word, the int64 bit pattern;
- fp16/bf16: two words of 14 bits each (low, then high), every 14-bit pattern being a finite fp16
  and bf16 number; tensors up to 2^28 elements, larger ones are refused in setup.
A non-finite p sends NaN values, so the decoded gradient is non-finite on every rank; it never
enters E.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from ..errors import ConfigError
from ..profile import TensorSpec
from ..triton_kernels import topk_by_threshold
from .gathered import GatheredWithFeedback
from .gradients import all_finite, kernel_input
from .spec import CodecSpec

HALF_WORD_BITS = 14  # bits of an index per 2-byte word: every 14-bit pattern is a finite fp16/bf16
INDEX_WORDS = {2: 2, 4: 1, 8: 1}  # gradient words per index, by bytes per element
MAX_NUMEL = {2: 1 << (2 * HALF_WORD_BITS), 4: 0x7F800000, 8: 1 << 62}
INDEX_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class TopK(GatheredWithFeedback):
    """Options: `density` (fraction of entries sent, in (0, 1]; default 0.01) and `error_feedback`."""

    name = "topk"

    def __init__(self, density: float = 0.01, error_feedback: bool = True):
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ConfigError(f"compressor 'topk': 'density' must be a number in (0, 1], got {density!r}")
        super().__init__(error_feedback)
        self.density = density

    def setup(self, specs: Mapping[str, TensorSpec], world_size: int, seed: int) -> None:
        super().setup(specs, world_size, seed)  # refuses non-floating tensors first
        too_large = sorted(name for name, spec in specs.items() if spec.numel > MAX_NUMEL[spec.bytes_per_element])
        if too_large:
            raise ConfigError(f"compressor 'topk': tensors {too_large[:5]} have more elements than their indices "
                              f"can address in the wire (fp16/bf16: {MAX_NUMEL[2]}, fp32: {MAX_NUMEL[4]})")

    def k(self, name: str) -> int:
        """max(1, ceil(density·numel)); the product is rounded to 6 decimals first so that binary
        representation error cannot add one (0.07·100 is 7.000000000000001 in floating point)."""
        numel = self.specs[name].numel
        return min(numel, max(1, math.ceil(round(self.density * numel, 6))))

    # -- planning ----------------------------------------------------------------------------------
    def wire_spec(self, spec: TensorSpec, layout: str) -> TensorSpec:
        numel = self.k(spec.name) * (1 + INDEX_WORDS[spec.bytes_per_element])
        return TensorSpec(spec.name, numel, spec.bytes_per_element, (numel,))

    def compute_seconds(self, spec: TensorSpec, layout: str, flops_per_second: float) -> tuple[float, float]:
        """Encode: adding E, the selection (a few passes over |p|) and the error's zeroing; decode:
        clearing the gradient, W·k scattered adds and the division."""
        encode = 4 * spec.numel
        decode = 2 * spec.numel + self.world_size * self.k(spec.name)
        return encode / flops_per_second, decode / flops_per_second

    # -- execution ---------------------------------------------------------------------------------
    def encode(self, name: str, grad: torch.Tensor | None, step: int) -> torch.Tensor | None:
        corrected = self._corrected(name, grad)
        if corrected is None:
            return None
        values, indices = topk_by_threshold(kernel_input(corrected), self.k(name))
        if values.dtype != corrected.dtype:  # selected in fp32: take bf16/fp64 values as they are
            values = corrected[indices]
        if not all_finite(corrected):
            values.fill_(float("nan"))
        elif self.error_feedback:
            corrected[indices] = 0  # E ← p − (the sent entries of p)
            self.pending[name] = corrected
        return torch.cat([values, index_words(indices, corrected.dtype)])

    def _decode(self, name: str, gathered: torch.Tensor, gradient: torch.Tensor) -> None:
        k = self.k(name)
        indices = indices_from_words(gathered[:, k:])
        gradient.zero_()
        gradient.index_add_(0, indices.reshape(-1), gathered[:, :k].reshape(-1))
        gradient.div_(self.world_size)

    def _options(self) -> dict:
        return {"density": self.density, "error_feedback": self.error_feedback}


def index_words(indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int64 `indices` as words of `dtype` (see the module docstring for the coding)."""
    size = dtype.itemsize
    if size == 2:
        mask = (1 << HALF_WORD_BITS) - 1
        indices = torch.cat([indices & mask, indices >> HALF_WORD_BITS])
    return indices.to(INDEX_INTS[size]).view(dtype)


def indices_from_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of index_words for each row of `words` (ranks × index words): int64 (ranks, k)."""
    size = words.dtype.itemsize
    ints = words.contiguous().view(INDEX_INTS[size]).long()
    if size == 2:
        low, high = ints.chunk(2, dim=1)
        return low + (high << HALF_WORD_BITS)
    return ints


SPEC = CodecSpec(TopK, "top-k sparsification with error feedback", source="Top-k SGD")
