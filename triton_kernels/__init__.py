"""Triton kernels for compression and error feedback, each beside its torch reference.

Every function here dispatches: the Triton kernel (`kernels`) when all its tensors are on a CUDA
device and triton imports, else the pure-torch reference (`reference`) with the same signature and
results. Tensors must be contiguous (a strided view raises ConfigError, a ValueError) and float16 or
float32; arithmetic is float32.

- error_feedback_update: ACP-SGD's error update E_t = M_t + E_{t−1} − P_t·Q_tᵀ (Algorithm 2, lines 6
  and 11), fused so that P·Qᵀ is never stored.
- sign_pack / sign_unpack / sign_majority_unpack: EF-SignSGD with scale ‖x‖₁/numel (Karimireddy et
  al.) at 1 bit per element, and signSGD's majority vote over ranks (Bernstein et al.).
- topk_threshold / count_above / topk_by_threshold: Top-k selection through a sampled threshold.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from . import reference


@functools.cache
def triton_available() -> bool:
    """Whether the triton package is installed (it is imported only when a kernel runs)."""
    return importlib.util.find_spec("triton") is not None


def backend(*tensors: torch.Tensor) -> str:
    """'triton' when every tensor is on a CUDA device and triton is installed, else 'torch'."""
    on_cuda = bool(tensors) and all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)
    return "triton" if on_cuda and triton_available() else "torch"


def _implementation(*tensors):
    if backend(*tensors) == "triton":
        from . import kernels
        return kernels
    return reference


def error_feedback_update(M, E, P, Q, out=None):
    """E_new = M + E − P·Qᵀ for M, E (n, m), P (n, r), Q (m, r), 1 <= r <= 32, all one dtype.

    Written into `out` (E, in place, by default; `out` may also be M or a fresh tensor) and
    returned. The kernel reads M and E once and writes the result once; float16 inputs are
    accumulated in float32 and rounded once.

    Args:
        M: the gradient matrix (n, m), float16 or float32, contiguous.
        E: the error-feedback matrix (n, m), M's dtype, contiguous.
        P, Q: the low-rank factors (n, r) and (m, r), 1 <= r <= 32, M's dtype, contiguous.
        out: the (n, m) tensor written, M's dtype; None writes into E. All five tensors share one
            device (CUDA for the Triton kernel).
    """
    return _implementation(M, E, P, Q).error_feedback_update(M, E, P, Q, out)


def sign_pack(x):
    """(packed, scale): packed is uint8 of ceil(numel / 8) bytes, bit i (value 1 << i) of byte j is
    1 when x.reshape(-1)[8j + i] >= 0 (little-endian bit order; padding bits are 0); scale is
    ‖x‖₁ / numel as a 0-d float32 tensor on x's device."""
    return _implementation(x).sign_pack(x)


def sign_unpack(packed, scale, numel, dtype=torch.float32):
    """The 1-D tensor of `numel` values +scale (bit 1) or −scale (bit 0) as `dtype`: the inverse of
    sign_pack up to magnitude, sign_unpack(*sign_pack(x), x.numel()) = scale·sign(x), sign(0) = +1.

    Args:
        packed: the sign bits, uint8 of shape (ceil(numel / 8),), contiguous, as sign_pack returns.
        scale: the magnitude written, a finite number or a one-element tensor (sign_pack's scale).
        numel: the number of elements to unpack, >= 1 (the length of the tensor that was packed).
        dtype: the result's dtype, torch.float16 or torch.float32.
    """
    return _implementation(packed).sign_unpack(packed, scale, numel, dtype)


def sign_majority_unpack(packed_all_ranks, numel):
    """Majority vote over the rows of `packed_all_ranks` (world, ceil(numel / 8)) uint8, one row of
    sign_pack bits per rank: float32 sign(Σ_ranks ±1) per element, 0 where the vote ties."""
    return _implementation(packed_all_ranks).sign_majority_unpack(packed_all_ranks, numel)


def topk_threshold(x, k, samples=None, seed=0):
    """A threshold t (0-d float32 tensor) with about k elements |x| >= t, without sorting x.

    Estimator: draw s indices uniformly with replacement (torch generator seeded with `seed` on x's
    device), gather |x| there and take the j-th largest sample, j = round(s·k/N): the empirical
    (1 − k/N)-quantile. Accuracy: the count of elements above t is about N·j/s with a relative
    standard deviation of about 1/sqrt(j) = sqrt(N / (s·k)) (binomial sampling of the quantile
    level). The default s = max(1024, 256·N/k) gives j ≈ 256, about ±6%; s >= N uses the whole
    tensor and gives the exact k-th largest magnitude.

    Args:
        x: the tensor, of any shape, float16 or float32, contiguous, non-empty; N = x.numel().
        k: the number of elements the threshold aims at, 1 <= k <= N.
        samples: the sample size s, >= 1; None for the default above; s >= N uses the whole tensor.
        seed: an integer seeding the sample's indices: on one device, the same seed draws the same
            points with either implementation.
    """
    return _implementation(x).topk_threshold(x, k, samples, seed)


def count_above(x, t):
    """The number of elements with |x| >= t (t a number or one-element tensor), 0-d int64."""
    return _implementation(x).count_above(x, t)


def topk_by_threshold(x, k, samples=None, seed=0):
    """(values, indices) of exactly the k largest |x| over x.reshape(-1), largest first; values keep
    their sign. Threshold about three standard deviations below the estimated k-th magnitude, exact
    top k of the survivors (and of the whole tensor if fewer than k survive).

    Args:
        x: the tensor, of any shape, float16 or float32, contiguous; indices point into x.reshape(-1).
        k: the number of elements returned, 1 <= k <= x.numel().
        samples, seed: the sample size (None: the default) and seed of the threshold estimate, as in
            topk_threshold; the result is exact whatever they are, only its speed depends on them.
    """
    return _implementation(x).topk_by_threshold(x, k, samples, seed)


__all__ = [
    "backend",
    "count_above",
    "error_feedback_update",
    "sign_majority_unpack",
    "sign_pack",
    "sign_unpack",
    "topk_by_threshold",
    "topk_threshold",
    "triton_available",
]
