"""Orthonormal columns for the low-rank factors (Power-SGD and ACP-SGD's Orthogonalize).

The result is column-major (each column contiguous), as LAPACK's QR returns it: the large product
(M + E)·Q then runs as BLAS's A·Bᵀ with Bᵀ row-major, which on the CPU is about 2.5× faster for
r ≪ m than A·B with a row-major B, and Q's transpose for P·Qᵀ is row-major without a copy.
"""
from __future__ import annotations

import torch


def orthogonalize(matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """A column-major matrix with orthonormal columns spanning those of `matrix` (n × r, r ≤ n).

    Reduced QR in fp32 for rank > 2 in fp32/fp64; Gram–Schmidt for rank ≤ 2 and for fp16/bf16,
    where QR is unavailable or costlier than r² column operations. A zero column stays zero
    instead of dividing by zero.
    """
    rank = matrix.shape[1]
    if rank > 2 and matrix.dtype in (torch.float32, torch.float64):
        q, r = torch.linalg.qr(matrix, mode="reduced")
        # QR's sign convention may flip columns; fix them so the result is the Gram–Schmidt one
        signs = torch.sign(torch.diagonal(r))
        signs[signs == 0] = 1
        return column_major(q).mul_(signs)
    return gram_schmidt(matrix, eps)


def gram_schmidt(matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Classical Gram–Schmidt on the columns, accumulated in fp32."""
    columns = column_major(matrix.new_empty(matrix.shape, dtype=torch.float32)).copy_(matrix)
    for i in range(columns.shape[1]):
        column = columns[:, i]
        if i:
            previous = columns[:, :i]
            column -= previous @ (previous.T @ column)
        norm = column.norm()
        column /= norm if norm > eps else 1.0
        if norm <= eps:
            column.zero_()
    return columns.to(matrix.dtype)


def column_major(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix` itself when its columns are contiguous, else a column-major copy."""
    return matrix.T.contiguous().T
