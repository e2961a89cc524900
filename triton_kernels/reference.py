"""Pure-torch references: the same signatures and results as the Triton kernels, on any device."""
from __future__ import annotations

import torch

from . import common

BIT_WEIGHTS = tuple(1 << bit for bit in range(8))


def error_feedback_update(M, E, P, Q, out=None):
    """E_new = M + E − P·Qᵀ (ACP-SGD Algorithm 2, lines 6 and 11), computed in float32, written
    into `out` (E by default) and returned."""
    out = common.error_feedback_args(M, E, P, Q, out)
    low_rank = P.float() @ Q.float().T
    return out.copy_(M.float() + E.float() - low_rank)


def sign_pack(x):
    """(packed uint8 signs, scale = ‖x‖₁ / numel as a 0-d float32 tensor); bit i of byte j is
    x[8j + i] >= 0, so element 8j is the least significant bit; padding bits are 0."""
    x = common.floating("sign_pack", "x", x)
    flat = x.reshape(-1)
    bits = torch.zeros(8 * common.packed_length(flat.numel()), dtype=torch.uint8, device=x.device)
    bits[: flat.numel()] = flat >= 0
    weights = torch.tensor(BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    packed = (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)
    scale = flat.abs().sum(dtype=torch.float32) / flat.numel()
    return packed, scale


def _bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The sign bits (0 or 1, uint8) of the last dimension of `packed`, cut to `numel`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :numel]


def sign_unpack(packed, scale, numel, dtype=torch.float32):
    """`numel` elements of +scale where the bit is 1 and −scale where it is 0, as `dtype`."""
    packed = common.packed_args("sign_unpack", packed, numel, ranks=False)
    dtype = common.output_dtype("sign_unpack", dtype)
    scale = common.scalar("sign_unpack", "scale", scale, packed.device)
    values = torch.where(_bits(packed, numel).bool(), scale, -scale)
    return values.to(dtype)


def sign_majority_unpack(packed_all_ranks, numel):
    """Majority vote over ranks: sign(Σ_ranks ±1) per element as float32, 0 where the vote ties."""
    packed = common.packed_args("sign_majority_unpack", packed_all_ranks, numel, ranks=True)
    votes = (2 * _bits(packed, numel).to(torch.int32) - 1).sum(dim=0)
    return torch.sign(votes).to(torch.float32)


def _gather_abs(flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return flat[indices].abs().float()


def topk_threshold(x, k, samples=None, seed=0):
    """Sampled estimate of t with about k elements |x| >= t (see common.estimate_threshold)."""
    x = common.topk_args("topk_threshold", x, k, samples, seed)
    return common.estimate_threshold(x, k, samples, seed, _gather_abs)


def count_above(x, t):
    """The number of elements with |x| >= t, as a 0-d int64 tensor."""
    x = common.floating("count_above", "x", x)
    t = common.scalar("count_above", "t", t, x.device)
    return (x.abs().float() >= t).sum()


def topk_by_threshold(x, k, samples=None, seed=0):
    """(values, indices) of the k largest |x| over x.reshape(-1), largest first: exact torch.topk
    (`samples` and `seed` are accepted for the kernels' signature and not needed)."""
    x = common.topk_args("topk_by_threshold", x, k, samples, seed)
    flat = x.reshape(-1)
    indices = torch.topk(flat.abs(), k).indices
    return flat[indices], indices
