"""What the low-rank codecs (ACP-SGD, Power-SGD) share: their options, which tensors they
compress, and the error-feedback update."""
from __future__ import annotations

import math
import warnings
from typing import Mapping

import torch

from ..errors import ConfigError
from ..profile import TensorSpec
from ..triton_kernels import error_feedback_update
from ..triton_kernels.common import FLOAT_DTYPES, MAX_RANK


def check_options(codec: str, rank, min_compression_rate, start_iter, **switches) -> None:
    """The options both take: rank >= 1, min_compression_rate >= 0, start_iter >= 0, and boolean
    switches (error_feedback, reuse / warm_start)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"compressor {codec!r}: 'rank' must be an integer >= 1, got {rank!r}")
    if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
            or not math.isfinite(min_compression_rate) or min_compression_rate < 0:
        raise ConfigError(f"compressor {codec!r}: 'min_compression_rate' must be a number >= 0, "
                          f"got {min_compression_rate!r}")
    if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
        raise ConfigError(f"compressor {codec!r}: 'start_iter' must be an integer >= 0, got {start_iter!r}")
    for field, value in switches.items():
        if not isinstance(value, bool):
            raise ConfigError(f"compressor {codec!r}: {field!r} must be true or false, got {value!r}")


def select_matrices(codec: str, specs: Mapping[str, TensorSpec], rank: int,
                    min_compression_rate: float) -> dict[str, tuple[int, int, int]]:
    """(n, m, r) of every tensor worth compressing: viewed as (shape[0], −1), compressed iff
    (n + m)·r·min_compression_rate < n·m (the torch PowerSGD hook's rule), r = min(rank, n, m)
    with one warning for all the tensors clipped."""
    shapes, clipped = {}, []
    for name in sorted(specs):
        matrix = specs[name].matrix_shape()
        if matrix is None:
            continue
        n, m = matrix
        r = min(rank, n, m)
        if r < rank:
            clipped.append(name)
        if (n + m) * r * min_compression_rate < n * m:
            shapes[name] = (n, m, r)
    if clipped:
        warnings.warn(f"{codec}: rank {rank} exceeds min(n, m) of {len(clipped)} tensor(s) "
                      f"(e.g. {clipped[0]!r}); clipped to min(n, m) for those", stacklevel=3)
    return shapes


def error_buffer(errors: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """The error-feedback matrix of `name`: zeros at first, moved to `like`'s device and dtype once
    after a checkpoint load."""
    error = errors.get(name)
    if error is None:
        error = torch.zeros_like(like)
    elif error.device != like.device or error.dtype != like.dtype:
        error = error.to(device=like.device, dtype=like.dtype)
    errors[name] = error
    return error


def cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies, for checkpoints."""
    return {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}


def check_saved_state(codec: str, saved_options: dict, options: dict, saved_names, compressed) -> None:
    """A checkpoint's state fits this codec: same options, factors only of compressed tensors."""
    if saved_options != options:
        raise ConfigError(f"{codec} state was saved with options {saved_options}, this run uses {options}")
    unknown = sorted(set(saved_names) - set(compressed))
    if unknown:
        raise ConfigError(f"{codec} state holds factors of tensors this model does not compress: {unknown[:5]}")


def subtract_low_rank(matrix: torch.Tensor, error: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """E ← M + E − P·Qᵀ in place: the fused Triton kernel on CUDA (fp16/fp32, r ≤ 32), which never
    materialises P·Qᵀ; elsewhere two in-place torch operations (BLAS accumulates P·Qᵀ into E)."""
    if error.is_cuda and error.dtype in FLOAT_DTYPES and p.shape[1] <= MAX_RANK:
        error_feedback_update(matrix, error, p, q)
    else:
        error.add_(matrix).addmm_(p, q.T, alpha=-1)

