"""Orthonormal columns for the low-rank factors (Power-SGD and ACP-SGD's Orthogonalize).

The result is column-major (each column contiguous), as LAPACK's QR returns it: the large product
(M + E)·Q then runs as BLAS's A·Bᵀ with Bᵀ row-major, which on the CPU is about 2.5× faster for
r ≪ m than A·B with a row-major B, and Q's transpose for P·Qᵀ is row-major without a copy.
"""
from __future__ import annotations

import torch

DEPENDENT = 1e-5  # relative norm left after projection below which a column counts as dependent (fp32)


def orthogonalize(matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """A column-major matrix with orthonormal columns spanning those of `matrix` (n × r, r ≤ n),
    or of each matrix of a batch (b × n × r) alike, the batch's QR in one call.

    Reduced QR in fp32/fp64 (in that dtype) for rank > 2 and on a GPU for every rank; Gram–Schmidt
    for rank ≤ 2 on the CPU, where r² column operations cost less than QR, and for fp16/bf16, where
    QR is unavailable. On a GPU Gram–Schmidt's test for a vanished column waits for the device, once
    per column: 1.8–1.9 ms of host time per call on an H200, against 0.11–0.12 ms for QR
    (benchmarks/results/codec_launch_costs.md). Columns are always orthonormal, also where `matrix`
    is rank-deficient (an all-zero gradient's factor): a zero query would make every later factor
    zero.
    """
    rank = matrix.shape[-1]
    if (rank > 2 or matrix.device.type != "cpu") and matrix.dtype in (torch.float32, torch.float64):
        q, r = torch.linalg.qr(matrix, mode="reduced")
        # QR's sign convention may flip columns; fix them so the result is the Gram–Schmidt one
        # (R's diagonal positive), with no masked write or host-side test: no device sync
        diagonal = torch.diagonal(r, dim1=-2, dim2=-1)
        return column_major(q).mul_(torch.ones_like(diagonal).copysign_(diagonal).unsqueeze(-2))
    if matrix.dim() == 3:
        return column_major(torch.stack([gram_schmidt(one, eps) for one in matrix]))
    return gram_schmidt(matrix, eps)


def gram_schmidt(matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram–Schmidt on the columns, accumulated in fp32, each projection done twice (one leaves
    roundoff of the earlier columns where a column nearly lies in their span). A column that
    vanishes (norm ≤ eps + DEPENDENT·its norm before) is replaced by a fixed pseudo-random one,
    the same on every rank, projected likewise."""
    columns = column_major(matrix.new_empty(matrix.shape, dtype=torch.float32)).copy_(matrix)
    for i in range(columns.shape[1]):
        column = columns[:, i]
        before = column.norm()
        norm = _project_out_earlier(columns, i)
        if norm <= eps + DEPENDENT * before:
            generator = torch.Generator().manual_seed(i)
            column.copy_(torch.randn(column.shape[0], generator=generator))
            norm = _project_out_earlier(columns, i)
        column /= norm
    return columns.to(matrix.dtype)


def _project_out_earlier(columns: torch.Tensor, i: int) -> torch.Tensor:
    """Column i less its projection on columns 0 … i − 1 (orthonormal), twice, in place; its norm."""
    column = columns[:, i]
    if i:
        previous = columns[:, :i]
        for _ in range(2):
            column -= previous @ (previous.T @ column)
    return column.norm()


def column_major(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix` itself when its columns are contiguous, else a column-major copy (each matrix's, of
    a batch)."""
    return matrix.mT.contiguous().mT
