"""Triton kernels with the signatures of `reference`: one pass over memory each, float32 arithmetic.

Importing this module imports triton; with TRITON_INTERPRET=1 set before the import the kernels run
on CPU tensors (the tests do that in a subprocess).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import common

# Error feedback: tiles of 1024 elements, 512 contiguous bytes a row: 8 × 128 in float32, 4 × 256 in
# float16 (32 × 128 left float16 at 73% of copy bandwidth on an H200). In a sweep on an H200 over tiles
# of 512-4096 elements and 2-8 warps (benchmarks/results/triton_kernels_tiles.md), 1024 with Triton's
# default 4 warps was fastest or within 0.2 µs of it in every row. In the acceptance runs 4096 left
# 30522 × 768 at 87-92% of copy bandwidth and 768 × 768 float32 (144 programs on 132 SMs) at 73-88%;
# 1024 took them to 96-98% and 79-94%.
EF_TILE_ELEMENTS = 1024
EF_ROW_BYTES = 512
# Ranks up to this loop over r with outer products; larger ones use tl.dot with r padded to a
# power of two >= 16 (the smallest inner dimension tl.dot takes).
EF_LOOP_MAX_RANK = 8
DOT_MIN_INNER = 16
PACK_BLOCK_BYTES = 512
ELEMENT_BLOCK = 4096


def _on_device(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the current device); nothing to select on CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@triton.jit
def _error_feedback_kernel(m_ptr, e_ptr, p_ptr, q_ptr, out_ptr, n, m, r,
                           BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                           USE_DOT: tl.constexpr, IEEE_DOT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    col_ok = cols < m
    if USE_DOT:
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < r
        p = tl.load(p_ptr + rows[:, None] * r + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        q_t = tl.load(q_ptr + cols[None, :] * r + ranks[:, None], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE_DOT:
            low_rank = tl.dot(p, q_t, input_precision="ieee")
        else:
            low_rank = tl.dot(p, q_t)
    else:
        low_rank = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in tl.static_range(BLOCK_R):
            p_k = tl.load(p_ptr + rows * r + k, mask=row_ok, other=0.0).to(tl.float32)
            q_k = tl.load(q_ptr + cols * r + k, mask=col_ok, other=0.0).to(tl.float32)
            low_rank += p_k[:, None] * q_k[None, :]
    offsets = rows[:, None] * m + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    gradient = tl.load(m_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    error = tl.load(e_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (gradient + error - low_rank).to(out_ptr.dtype.element_ty), mask=mask)


def error_feedback_update(M, E, P, Q, out=None, tile_elements: int = EF_TILE_ELEMENTS, num_warps: int = 4):
    """E_new = M + E − P·Qᵀ without materialising P·Qᵀ: each program holds a BLOCK_N × BLOCK_M tile,
    its rows of P and columns of Qᵀ, and forms the rank-r product in registers.

    Args:
        M, E, P, Q, out: as ``gradsync.triton_kernels.error_feedback_update``.
        tile_elements: elements per tile, a power of two of at least EF_ROW_BYTES / element size
            (other values are for the tile sweep of benchmarks/triton_kernels.py).
        num_warps: warps per program.
    """
    out = common.error_feedback_args(M, E, P, Q, out)
    (n, m), r = M.shape, P.shape[1]
    use_dot = r > EF_LOOP_MAX_RANK
    block_r = max(DOT_MIN_INNER, triton.next_power_of_2(r)) if use_dot else r
    block_m = EF_ROW_BYTES // M.element_size()
    block_n = tile_elements // block_m
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    with _on_device(M):
        _error_feedback_kernel[grid](M, E, P, Q, out, n, m, r, BLOCK_N=block_n, BLOCK_M=block_m,
                                     BLOCK_R=block_r, USE_DOT=use_dot, IEEE_DOT=M.dtype == torch.float32,
                                     num_warps=num_warps)
    return out


@triton.jit
def _sign_pack_kernel(x_ptr, packed_ptr, abs_sum_ptr, numel, n_bytes, BLOCK_BYTES: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    bit = tl.arange(0, 8)
    offsets = byte[:, None] * 8 + bit[None, :]
    in_range = offsets < numel
    x = tl.load(x_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
    bits = ((x >= 0) & in_range).to(tl.int32) << bit[None, :]
    tl.store(packed_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte < n_bytes)
    tl.store(abs_sum_ptr + tl.program_id(0), tl.sum(tl.sum(tl.abs(x), axis=1), axis=0))


def sign_pack(x):
    """Packed sign bits and scale = ‖x‖₁ / numel from one read of x (per-program partial sums)."""
    x = common.floating("sign_pack", "x", x)
    numel = x.numel()
    n_bytes = common.packed_length(numel)
    grid = (triton.cdiv(n_bytes, PACK_BLOCK_BYTES),)
    packed = torch.empty(n_bytes, dtype=torch.uint8, device=x.device)
    abs_sums = torch.empty(grid[0], dtype=torch.float32, device=x.device)
    with _on_device(x):
        _sign_pack_kernel[grid](x, packed, abs_sums, numel, n_bytes, BLOCK_BYTES=PACK_BLOCK_BYTES)
    return packed, abs_sums.sum() / numel


@triton.jit
def _sign_unpack_kernel(packed_ptr, scale_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    byte = tl.load(packed_ptr + (offsets >> 3), mask=ok, other=0).to(tl.int32)
    bit = (byte >> (offsets & 7).to(tl.int32)) & 1
    scale = tl.load(scale_ptr)
    tl.store(out_ptr + offsets, tl.where(bit == 1, scale, -scale).to(out_ptr.dtype.element_ty), mask=ok)


def sign_unpack(packed, scale, numel, dtype=torch.float32):
    """±scale per sign bit, written by a Triton kernel (one program per ELEMENT_BLOCK elements).

    Args:
        packed, scale, numel, dtype: as ``gradsync.triton_kernels.sign_unpack``.
    """
    packed = common.packed_args("sign_unpack", packed, numel, ranks=False)
    dtype = common.output_dtype("sign_unpack", dtype)
    scale = common.scalar("sign_unpack", "scale", scale, packed.device)
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    with _on_device(packed):
        _sign_unpack_kernel[(triton.cdiv(numel, ELEMENT_BLOCK),)](packed, scale, out, numel, BLOCK=ELEMENT_BLOCK)
    return out


@triton.jit
def _sign_majority_kernel(packed_ptr, out_ptr, numel, n_bytes, world, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    shift = (offsets & 7).to(tl.int32)
    votes = tl.zeros((BLOCK,), dtype=tl.int32)
    for rank in range(world):
        byte = tl.load(packed_ptr + rank * n_bytes + (offsets >> 3), mask=ok, other=0).to(tl.int32)
        votes += 2 * ((byte >> shift) & 1) - 1
    sign = tl.where(votes > 0, 1.0, tl.where(votes < 0, -1.0, 0.0))
    tl.store(out_ptr + offsets, sign, mask=ok)


def sign_majority_unpack(packed_all_ranks, numel):
    packed = common.packed_args("sign_majority_unpack", packed_all_ranks, numel, ranks=True)
    world, n_bytes = packed.shape
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    with _on_device(packed):
        _sign_majority_kernel[(triton.cdiv(numel, ELEMENT_BLOCK),)](packed, out, numel, n_bytes, world,
                                                                     BLOCK=ELEMENT_BLOCK)
    return out


@triton.jit
def _gather_abs_kernel(x_ptr, indices_ptr, out_ptr, count, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < count
    index = tl.load(indices_ptr + offsets, mask=ok, other=0)
    value = tl.load(x_ptr + index, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, tl.abs(value), mask=ok)


def _gather_abs(flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    out = torch.empty(indices.numel(), dtype=torch.float32, device=flat.device)
    with _on_device(flat):
        _gather_abs_kernel[(triton.cdiv(indices.numel(), ELEMENT_BLOCK),)](flat, indices, out, indices.numel(),
                                                                            BLOCK=ELEMENT_BLOCK)
    return out


def topk_threshold(x, k, samples=None, seed=0):
    """Sampled threshold estimate (common.estimate_threshold) with the sample gathered by a Triton kernel.

    Args:
        x, k, samples, seed: as ``gradsync.triton_kernels.topk_threshold``.
    """
    x = common.topk_args("topk_threshold", x, k, samples, seed)
    return common.estimate_threshold(x, k, samples, seed, _gather_abs)


@triton.jit
def _count_above_kernel(x_ptr, threshold_ptr, counts_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    above = (tl.abs(x) >= tl.load(threshold_ptr)) & ok
    tl.store(counts_ptr + tl.program_id(0), tl.sum(above.to(tl.int32), axis=0))


def count_above(x, t):
    x = common.floating("count_above", "x", x)
    t = common.scalar("count_above", "t", t, x.device)
    grid = (triton.cdiv(x.numel(), ELEMENT_BLOCK),)
    counts = torch.empty(grid[0], dtype=torch.int32, device=x.device)
    with _on_device(x):
        _count_above_kernel[grid](x, t, counts, x.numel(), BLOCK=ELEMENT_BLOCK)
    return counts.sum(dtype=torch.int64)


def topk_by_threshold(x, k, samples=None, seed=0):
    """The exact top k through the Triton threshold estimate (common.select_topk).

    Args:
        x, k, samples, seed: as ``gradsync.triton_kernels.topk_by_threshold``.
    """
    x = common.topk_args("topk_by_threshold", x, k, samples, seed)
    return common.select_topk(x, k, samples, seed, topk_threshold)
