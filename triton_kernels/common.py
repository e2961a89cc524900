"""Input checks and the sampling threshold estimator, shared by the torch references and the kernels.

Both implementations call the same checks, so a bad argument raises the same ConfigError on CPU and
on CUDA. ConfigError is a ValueError.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import ConfigError

FLOAT_DTYPES = {torch.float16: "float16", torch.float32: "float32"}
MAX_RANK = 32
# The threshold estimator aims for this many sample points above the threshold: the count of
# elements above the estimate then has a relative standard deviation of about 1/sqrt(256) = 6%.
TARGET_SAMPLE_HITS = 256
MIN_SAMPLES = 1024
# topk_by_threshold aims the threshold this many standard deviations below the k-th magnitude, so
# that at least k candidates survive with high probability.
CANDIDATE_MARGIN_SIGMAS = 3.0


def _fail(function: str, message: str) -> ConfigError:
    return ConfigError(f"{function}: {message}")


def tensor(function: str, field: str, value) -> torch.Tensor:
    """`value` itself when it is a torch.Tensor; anything else raises ConfigError.

    Args:
        function: the public function checked, named at the start of the error message.
        field: the argument's name, as the message quotes it.
        value: the argument.
    """
    if not isinstance(value, torch.Tensor):
        raise _fail(function, f"{field!r} must be a torch.Tensor, got {type(value).__name__}")
    return value


def floating(function: str, field: str, value) -> torch.Tensor:
    """A contiguous, non-empty float16 or float32 tensor.

    Args:
        function, field, value: as for ``tensor``.
    """
    value = contiguous(function, field, value)
    if value.dtype not in FLOAT_DTYPES:
        raise _fail(function, f"{field!r} dtype must be one of {', '.join(FLOAT_DTYPES.values())}, got {value.dtype}")
    if value.numel() == 0:
        raise _fail(function, f"{field!r} must have at least one element")
    return value


def contiguous(function: str, field: str, value) -> torch.Tensor:
    """The kernels index memory directly: a strided view would be read wrongly, so it is refused.

    Args:
        function, field, value: as for ``tensor``.
    """
    value = tensor(function, field, value)
    if not value.is_contiguous():
        raise _fail(function, f"{field!r} must be contiguous (strides {tuple(value.stride())}); "
                              "pass tensor.contiguous()")
    return value


def same_device(function: str, named: dict[str, torch.Tensor]) -> None:
    devices = {str(t.device) for t in named.values()}
    if len(devices) > 1:
        found = ", ".join(f"{name} on {t.device}" for name, t in named.items())
        raise _fail(function, f"all tensors must be on one device, got {found}")


def error_feedback_args(M, E, P, Q, out) -> torch.Tensor:
    """Check the shapes (n, m), (n, m), (n, r), (m, r) and return the output tensor (E by default).

    Args:
        M, E, P, Q, out: the arguments of ``gradsync.triton_kernels.error_feedback_update``; each
            tensor must also be contiguous, non-empty, of M's dtype (float16 or float32) and on
            M's device.
    """
    function = "error_feedback_update"
    M, E, P, Q = (floating(function, name, t) for name, t in zip("MEPQ", (M, E, P, Q)))
    out = E if out is None else floating(function, "out", out)
    named = {"M": M, "E": E, "P": P, "Q": Q, "out": out}
    for name, t in named.items():
        if t.dtype != M.dtype:
            raise _fail(function, f"{name!r} must have M's dtype {M.dtype}, got {t.dtype}")
    same_device(function, named)
    if M.dim() != 2:
        raise _fail(function, f"'M' must be a matrix (n, m), got shape {tuple(M.shape)}")
    n, m = M.shape
    for name in ("E", "out"):
        if named[name].shape != M.shape:
            raise _fail(function, f"{name!r} must have M's shape {(n, m)}, got {tuple(named[name].shape)}")
    if P.dim() != 2 or P.shape[0] != n or not 1 <= P.shape[1] <= MAX_RANK:
        raise _fail(function, f"'P' must have shape (n, r) = ({n}, r) with 1 <= r <= {MAX_RANK}, "
                              f"got {tuple(P.shape)}")
    if Q.shape != (m, P.shape[1]):
        raise _fail(function, f"'Q' must have shape (m, r) = {(m, P.shape[1])}, got {tuple(Q.shape)}")
    return out


def packed_length(numel: int) -> int:
    """Bytes holding `numel` sign bits, 8 a byte."""
    return (numel + 7) // 8


def positive_count(function: str, field: str, value) -> int:
    """`value` when it is an integer >= 1 (a bool is refused); else ConfigError.

    Args:
        function, field, value: as for ``tensor``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(function, f"{field!r} must be an integer >= 1, got {value!r}")
    return value


def packed_args(function: str, packed, numel, ranks: bool) -> torch.Tensor:
    """Packed signs: uint8 of shape (bytes,), or (world, bytes) when `ranks`, for `numel` elements.

    Args:
        function: the public function checked, named in the error message.
        packed: the tensor of sign bits, contiguous, bytes = ceil(numel / 8).
        numel: the number of elements packed, an integer >= 1.
        ranks: True for sign_majority_unpack's one row per rank (world >= 1), False for
            sign_unpack's single row.
    """
    numel = positive_count(function, "numel", numel)
    packed = contiguous(function, "packed", packed)
    expected = "(world, bytes)" if ranks else "(bytes,)"
    if packed.dtype != torch.uint8 or packed.dim() != (2 if ranks else 1) or packed.shape[-1] != packed_length(numel):
        raise _fail(function, f"'packed' must be uint8 of shape {expected} with bytes = ceil(numel / 8) = "
                              f"{packed_length(numel)}, got {packed.dtype} {tuple(packed.shape)}")
    if ranks and packed.shape[0] == 0:
        raise _fail(function, "'packed' must hold at least one rank")
    return packed


def output_dtype(function: str, dtype) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise _fail(function, f"'dtype' must be one of {', '.join(FLOAT_DTYPES.values())}, got {dtype}")
    return dtype


def scalar(function: str, field: str, value, device: torch.device) -> torch.Tensor:
    """A Python number or one-element tensor as a 0-d float32 tensor on `device` (no host sync).

    Args:
        function, field: as for ``tensor``.
        value: a finite int or float (not a bool), or a one-element tensor of any dtype and device
            (its value is not checked, so as not to synchronise).
        device: where the result is placed (that of the tensor it is applied to).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise _fail(function, f"{field!r} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return value.reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(function, f"{field!r} must be a finite number or a one-element tensor, got {value!r}")
    return torch.tensor(float(value), device=device)


def topk_args(function: str, x, k, samples, seed) -> torch.Tensor:
    """`x` once the arguments of topk_threshold or topk_by_threshold are checked.

    Args:
        function: the public function checked, named in the error message.
        x, k, samples, seed: its arguments (see ``gradsync.triton_kernels.topk_threshold``): x a
            contiguous non-empty float16 or float32 tensor, 1 <= k <= x.numel(), samples None or an
            integer >= 1, seed an integer.
    """
    x = floating(function, "x", x)
    k = positive_count(function, "k", k)
    if k > x.numel():
        raise _fail(function, f"'k' must be at most numel = {x.numel()}, got {k}")
    if samples is not None:
        positive_count(function, "samples", samples)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _fail(function, f"'seed' must be an integer, got {seed!r}")
    return x


def sample_size(numel: int, k: int, samples: int | None) -> int:
    """s = `samples`, or by default enough that about TARGET_SAMPLE_HITS sample points exceed the
    threshold (s = 256·N/k, at least 1024); never more than N (then the whole tensor is used).

    Args:
        numel: N, the element count of the tensor.
        k: the number of elements the threshold aims at, 1 <= k <= N.
        samples: the requested sample size (>= 1), or None for the default.
    """
    if samples is None:
        samples = max(MIN_SAMPLES, math.ceil(TARGET_SAMPLE_HITS * numel / k))
    return min(samples, numel)


def candidate_k(numel: int, k: int, samples: int) -> int:
    """The k the candidate threshold aims at: k plus CANDIDATE_MARGIN_SIGMAS standard deviations of
    the count above an estimated threshold, sqrt(k·N/s); k itself when the whole tensor is used.

    Args:
        numel: N, the element count of the tensor.
        k: the number of elements to select, 1 <= k <= N.
        samples: s, the sample size actually drawn (sample_size's result, at most N).
    """
    if samples >= numel:
        return k
    return min(numel, math.ceil(k + CANDIDATE_MARGIN_SIGMAS * math.sqrt(k * numel / samples)))


def estimate_threshold(x: torch.Tensor, k: int, samples: int | None, seed: int,
                       gather_abs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The empirical (1 − k/N)-quantile of |x| from s points drawn uniformly with replacement.

    The threshold is the j-th largest sampled magnitude, j = round(s·k/N) clamped to [1, s], so about
    k of the N elements satisfy |x| >= threshold. `gather_abs(flat_x, indices)` returns
    |flat_x[indices]| as float32 (a Triton gather or torch indexing); the indices come from a torch
    generator seeded with `seed` on x's device, so both implementations sample the same points.

    Args:
        x: the tensor, already checked by topk_args; N = x.numel().
        k: the number of elements the threshold aims at, 1 <= k <= N.
        samples: the requested sample size, or None (s is then chosen by sample_size).
        seed: the integer seed of the index generator.
        gather_abs: the gather described above.
    """
    flat, numel = x.reshape(-1), x.numel()
    size = sample_size(numel, k, samples)
    if size == numel:
        sample = flat.abs().float()
    else:
        generator = torch.Generator(device=x.device).manual_seed(seed)
        indices = torch.randint(numel, (size,), generator=generator, device=x.device)
        sample = gather_abs(flat, indices)
    hits = min(size, max(1, round(size * k / numel)))
    return torch.kthvalue(sample, size - hits + 1).values


def select_topk(x: torch.Tensor, k: int, samples: int | None, seed: int,
                threshold: Callable[[torch.Tensor, int, int, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of exactly the k largest |x|, largest first, through a sampled threshold.

    `threshold(x, k', s, seed)` (the implementation's topk_threshold) is aimed at k' = candidate_k
    elements, a little below the estimated k-th magnitude; the exact top k of the elements with
    |x| >= t is the top k of x whenever at least k survive, and when fewer do (a low-probability
    miss of the estimate) the top k of the whole tensor is taken.

    Args:
        x: the tensor, already checked by topk_args; indices point into x.reshape(-1).
        k: the number of elements to select, 1 <= k <= x.numel().
        samples, seed: the requested sample size (None: sample_size's default) and the seed,
            passed on to `threshold`.
        threshold: the implementation's topk_threshold, as described above.
    """
    flat = x.reshape(-1)
    size = sample_size(flat.numel(), k, samples)
    cut = threshold(x, candidate_k(flat.numel(), k, size), size, seed)
    candidates = torch.nonzero(flat.abs().float() >= cut).squeeze(1)
    if candidates.numel() < k:
        candidates = torch.arange(flat.numel(), device=x.device)
    indices = candidates[torch.topk(flat[candidates].abs(), k).indices]
    return flat[indices], indices
