"""Checks and dtype helpers shared by the codecs."""
from __future__ import annotations

from typing import Mapping

import torch

from ..errors import ConfigError
from ..profile import TensorSpec
from ..triton_kernels.common import FLOAT_DTYPES

FLOAT_SIZES = (2, 4, 8)


def refuse_non_float(codec: str, specs: Mapping[str, TensorSpec]) -> None:
    """Gradients are floating point: 2-, 4- or 8-byte elements (fp16/bf16, fp32, fp64)."""
    bad = sorted(name for name, spec in specs.items() if spec.bytes_per_element not in FLOAT_SIZES)
    if bad:
        sizes = sorted({specs[name].bytes_per_element for name in bad})
        raise ConfigError(f"compressor {codec!r}: gradients must be floating point with {FLOAT_SIZES} bytes per "
                          f"element; {bad[:5]} have {sizes}")


def checksum(*tensors: torch.Tensor) -> torch.Tensor:
    """One fp32 (fp64 for fp64) sum of every element, on the tensors' device: an inf or NaN makes
    it inf or NaN. A sum can only overflow to inf past 3.4e38 (1.8e308), far beyond any gradient
    of a run that has not already diverged; torch.isfinite(x).all() costs several times more on
    the CPU."""
    sums = [t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32) for t in tensors]
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no element is inf or NaN, from one `checksum`."""
    return bool(torch.isfinite(checksum(*tensors)))


def every_element_finite(tensor: torch.Tensor) -> bool:
    """Whether no element is inf or NaN, exactly: `all_finite`'s one sum, then, only if that sum
    is not finite (an inf or NaN, or finite elements whose sum overflows), the element-wise check."""
    return all_finite(tensor) or bool(torch.isfinite(tensor).all())


def decoded_may_overflow(wire_dtype: torch.dtype, gradient_dtype: torch.dtype) -> bool:
    """Whether a gradient decoded from a `wire_dtype` wire may hold inf where the wire held none:
    packed bits, or a wider range than the gradient's (fp32 low-rank factors of an fp16 gradient,
    whose product can exceed 65504)."""
    return not wire_dtype.is_floating_point or torch.finfo(wire_dtype).max > torch.finfo(gradient_dtype).max


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels work in fp16 and fp32; bf16 and fp64 tensors go through fp32."""
    return dtype if dtype in FLOAT_DTYPES else torch.float32


def kernel_input(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype in FLOAT_DTYPES else tensor.float()
