"""Pure-torch references: the same signatures and results as the Triton kernels, on any device."""
from __future__ import annotations

import torch

from . import common

# Row b: the 8 bits of byte value b, least significant first.
_BITS_OF_BYTE = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1


def error_feedback_update(M, E, P, Q, out=None):
    """E_new = M + E − P·Qᵀ (ACP-SGD Algorithm 2, lines 6 and 11), computed in float32, written
    into `out` (E by default) and returned.

    Args:
        M, E, P, Q, out: as ``gradsync.triton_kernels.error_feedback_update``.
    """
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
    per_byte = bits.view(-1, 8)
    packed = per_byte[:, 0].clone()
    for bit in range(1, 8):  # one strided pass per bit position
        packed |= per_byte[:, bit] << bit
    # torch's cascaded sum stays accurate on large tensors (a float32 vector_norm lost 4% at 23M elements)
    scale = flat.abs().sum(dtype=torch.float32) / flat.numel()
    return packed, scale


def _byte_table(packed: torch.Tensor, if_set: torch.Tensor, if_clear: torch.Tensor) -> torch.Tensor:
    """Row b: `if_set` where bit i of byte b is 1, else `if_clear` (a 256 × 8 lookup table)."""
    bits = _BITS_OF_BYTE.to(packed.device).bool()
    return torch.where(bits, if_set, if_clear)


def _lookup(table: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Each byte of the last dimension of `packed` replaced by its table row, cut to `numel`."""
    rows = table.index_select(0, packed.reshape(-1).long())
    return rows.view(*packed.shape[:-1], -1)[..., :numel]


def sign_unpack(packed, scale, numel, dtype=torch.float32):
    """`numel` elements of +scale where the bit is 1 and −scale where it is 0, as `dtype`.

    Args:
        packed, scale, numel, dtype: as ``gradsync.triton_kernels.sign_unpack``.
    """
    packed = common.packed_args("sign_unpack", packed, numel, ranks=False)
    dtype = common.output_dtype("sign_unpack", dtype)
    scale = common.scalar("sign_unpack", "scale", scale, packed.device)
    return _lookup(_byte_table(packed, scale, -scale).to(dtype), packed, numel)


def sign_majority_unpack(packed_all_ranks, numel):
    """Majority vote over ranks: sign(Σ_ranks ±1) per element as float32, 0 where the vote ties."""
    packed = common.packed_args("sign_majority_unpack", packed_all_ranks, numel, ranks=True)
    table = _byte_table(packed, torch.tensor(1, dtype=torch.int32), torch.tensor(-1, dtype=torch.int32))
    votes = torch.zeros(numel, dtype=torch.int32, device=packed.device)
    for row in packed:
        votes += _lookup(table, row, numel)
    return torch.sign(votes).to(torch.float32)


def _gather_abs(flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return flat[indices].abs().float()


def topk_threshold(x, k, samples=None, seed=0):
    """Sampled estimate of t with about k elements |x| >= t (see common.estimate_threshold).

    Args:
        x, k, samples, seed: as ``gradsync.triton_kernels.topk_threshold``.
    """
    x = common.topk_args("topk_threshold", x, k, samples, seed)
    return common.estimate_threshold(x, k, samples, seed, _gather_abs)


def count_above(x, t):
    """The number of elements with |x| >= t, as a 0-d int64 tensor."""
    x = common.floating("count_above", "x", x)
    t = common.scalar("count_above", "t", t, x.device)
    return (x.abs().float() >= t).sum()


def topk_by_threshold(x, k, samples=None, seed=0):
    """The exact top k through the torch threshold estimate (common.select_topk).

    Args:
        x, k, samples, seed: as ``gradsync.triton_kernels.topk_by_threshold``.
    """
    x = common.topk_args("topk_by_threshold", x, k, samples, seed)
    return common.select_topk(x, k, samples, seed, topk_threshold)
