"""Orthonormal columns for the low-rank factors (Power-SGD and ACP-SGD's Orthogonalize)."""
from __future__ import annotations

import torch


def orthogonalize(matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """A matrix with orthonormal columns spanning those of `matrix` (n × r, r ≤ n).

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
        return (q * signs).contiguous()
    return gram_schmidt(matrix, eps)


def gram_schmidt(matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Classical Gram–Schmidt on the columns, accumulated in fp32."""
    columns = matrix.float().clone()
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
