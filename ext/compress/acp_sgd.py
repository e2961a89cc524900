"""ACP-SGD: alternate compressed Power-SGD with error feedback (acp-sgd Algorithm 2, §IV).

Each matrix-shaped gradient M (viewed as (shape[0], -1)) travels as one low-rank factor per step,
alternating: on P steps Q = Orth(Q_prev), P = (M + E)·Q, E ← M + E − P·Qᵀ with the local P, then
P is all-reduced and the gradient is P̄·Qᵀ; on Q steps P = Orth(P_prev), Q = (M + E)ᵀ·P,
E ← M + E − P·Qᵀ, then Q is all-reduced and the gradient is P·Q̄ᵀ. The averaged factor becomes the
next step's query ("reuse"); the new error and query become current when the step settles
(``Codec.settle``), so a step skipped for an inf anywhere leaves them as they were; where no step
is skipped (``may_skip_steps`` false) the new error is formed over the old, one buffer instead of
two. Vectors, and matrices where (n + m)·r·min_compression_rate ≥ n·m, travel uncompressed in the
same ops. One all-reduce per step, so WFBP and tensor fusion apply as for plain gradients (§IV-B):
the runtime plans the P and Q layouts separately on their own sizes.
"""
from __future__ import annotations

import zlib
from typing import Mapping

import torch

from ..errors import ConfigError
from ..profile import TensorSpec
from .codec import Codec
from .gradients import refuse_non_float
from .low_rank import (check_options, check_saved_state, check_wire_dtype, compute_dtype, cpu_copies, error_buffer,
                       fused_update_available, keep_error, layout_wire_dtype, on_the_wire, row_blocks, select_matrices,
                       spare_buffer, subtract_low_rank, write_low_rank)
from .orthogonalize import orthogonalize
from .spec import CodecSpec

PLAIN, P_STEP, Q_STEP = "plain", "P", "Q"
SEED_LIMIT = 2**63  # torch.Generator's seeds are 64-bit signed


class ACPSGD(Codec):
    """Options: `rank` r (default 4), `min_compression_rate` (compress only when it pays by this
    factor), `start_iter` (uncompressed warm-up steps), `error_feedback` and `reuse` (ablations),
    `seed` for the initial factors (default: drawn by rank 0 and shared, so no user seeding is
    needed), `wire_dtype` ("float16" or "bfloat16": what travels, cast, as under torch's
    fp16_compress_wrapper; default the gradients' type)."""

    name = "acp_sgd"

    def __init__(self, rank: int = 4, min_compression_rate: float = 2.0, start_iter: int = 0,
                 error_feedback: bool = True, reuse: bool = True, seed: int | None = None, wire_dtype: str | None = None):
        check_options(self.name, rank, min_compression_rate, start_iter, error_feedback=error_feedback, reuse=reuse)
        check_wire_dtype(self.name, wire_dtype)
        self.wire_precision = wire_dtype
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT):
            raise ConfigError(f"compressor 'acp_sgd': 'seed' must be an integer from 0 to 2**63 - 1, got {seed!r}")
        self.fixed_seed = seed
        self.rank = rank
        self.min_compression_rate = min_compression_rate
        self.start_iter = start_iter
        self.error_feedback = error_feedback
        self.reuse = reuse
        self.per_rank_state = error_feedback

    # -- setup and planning ------------------------------------------------------------------------
    def setup(self, specs: Mapping[str, TensorSpec], world_size: int, seed: int) -> None:
        refuse_non_float(self.name, specs)
        super().setup(specs, world_size, seed)
        self.seed = seed = seed if self.fixed_seed is None else self.fixed_seed
        self.shapes = select_matrices(self.name, specs, self.rank, self.min_compression_rate)  # (n, m, r)
        generator = torch.Generator().manual_seed(seed)
        self.p_prev: dict[str, torch.Tensor] = {}
        self.q_prev: dict[str, torch.Tensor] = {}
        for name, (n, m, r) in self.shapes.items():
            self.p_prev[name] = torch.randn(n, r, generator=generator)
            self.q_prev[name] = torch.randn(m, r, generator=generator)
        # E = sums − L·Rᵀ: the sum M + E_prev of the last step, and its local factors (L, R), whose
        # subtraction (Algorithm 2, lines 6 and 11) is folded into the next step's pass over the rows
        self.sums: dict[str, torch.Tensor] = {}
        self.deferred: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # the new (sums, factors) of this step's encode, and the averaged factors (P, Q) of its finish,
        # made current by `settle`: a step whose gradient is not applied leaves the state as it was
        self.pending: dict[str, tuple[torch.Tensor, tuple | None]] = {}
        self.finished: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.spares: dict[tuple, list[torch.Tensor]] = {}  # free error-sized buffers per shape
        self.query: dict[str, torch.Tensor] = {}  # the orthonormal factor of the current step
        # the step's queries orthogonalised at once, not yet taken, by (layout, device, dtype)
        self.batched: dict[tuple, dict[str, torch.Tensor]] = {}
        self.staging: dict[str, torch.Tensor] = {}

    @property
    def errors(self) -> dict[str, torch.Tensor]:
        """The error-feedback matrices E of this rank, materialised (for inspection and tests)."""
        return {name: total - self.deferred[name][0] @ self.deferred[name][1].T if name in self.deferred else total
                for name, total in self.sums.items()}

    def rounds(self, step: int) -> tuple[str]:
        return (self.layout(step),)

    def layout(self, step: int) -> str:
        """Uncompressed before `start_iter`, then P and Q steps alternately (Algorithm 2, line 3)."""
        if step < self.start_iter:
            return PLAIN
        return P_STEP if (step - self.start_iter) % 2 == 0 else Q_STEP

    def layouts(self) -> tuple[str, ...]:
        return (PLAIN, P_STEP, Q_STEP) if self.start_iter else (P_STEP, Q_STEP)

    def wire_spec(self, spec: TensorSpec, layout: str) -> TensorSpec:
        compressed = layout != PLAIN
        if not compressed or spec.name not in self.shapes:
            return on_the_wire(spec, self.wire_precision, compressed)
        n, m, r = self.shapes[spec.name]
        rows = n if layout == P_STEP else m
        return on_the_wire(TensorSpec(spec.name, rows * r, spec.bytes_per_element, (rows, r)), self.wire_precision,
                           compressed)

    def wire_dtype(self, layout: str, gradient_dtype: torch.dtype) -> torch.dtype:
        return layout_wire_dtype(self.wire_precision, layout != PLAIN, gradient_dtype)

    def compute_seconds(self, spec: TensorSpec, layout: str, flops_per_second: float) -> tuple[float, float]:
        """Encode: one (n × m)·(m × r) product on M + E, formed once, and with error feedback the
        update's P·Qᵀ; decode: one product; plus the orthogonalisation, O((n + m)·r²) (acp-sgd
        §IV-A)."""
        if layout == PLAIN or spec.name not in self.shapes:
            return 0.0, 0.0
        n, m, r = self.shapes[spec.name]
        product = 2.0 * n * m * r
        orthogonal = 2.0 * (n if layout == Q_STEP else m) * r * r
        encode = product * (2 if self.error_feedback else 1)
        return (encode + orthogonal) / flops_per_second, product / flops_per_second

    # -- execution ---------------------------------------------------------------------------------
    def encode(self, name: str, grad: torch.Tensor | None, step: int) -> torch.Tensor | None:
        layout = self.layout(step)
        if layout == PLAIN or name not in self.shapes:
            return super().encode(name, grad, step)
        n, m, r = self.shapes[name]
        like = grad if grad is not None else self.sums.get(name)
        if like is None:
            return None  # no gradient and no error yet: this rank contributes nothing
        dtype = compute_dtype(like.dtype)
        matrix = grad.reshape(n, m).to(dtype) if grad is not None else torch.zeros(n, m, dtype=dtype, device=like.device)
        query = self.query[name] = self._query(name, layout, step, matrix)
        if not self.error_feedback:
            factor = matrix @ query if layout == P_STEP else (query.T @ matrix).T.contiguous()
            return factor.reshape(-1)
        stored = error_buffer(self.sums, name, matrix)
        deferred = self._deferred_on(name, matrix)
        # the new sum over the stored one where the step will settle as applied (no step is dropped,
        # and this rank's gradient means a finish); else beside it, for `settle` to choose
        in_place = not self.may_skip_steps and grad is not None
        total = stored if in_place else spare_buffer(self.spares, matrix)
        if fused_update_available(stored, r):  # two products, then the Triton kernel writes the new E
            if deferred is not None:  # state from a CPU run: make the stored sum E itself first
                stored.addmm_(deferred[0], deferred[1].T, alpha=-1)
                del self.deferred[name]
            if layout == P_STEP:
                factor = left = torch.addmm(stored @ query, matrix, query)
                right = query
            else:
                factor = right = torch.addmm(stored.T @ query, matrix.T, query)  # (m, r), rows contiguous
                left = query
            subtract_low_rank(matrix, stored, left, right, out=total)
            factors = None  # `total` is the new E itself
        else:
            compress = compress_p_with_error if layout == P_STEP else compress_q_with_error
            factor = compress(matrix, stored, deferred, query, total)
            factors = (factor, query) if layout == P_STEP else (query, factor)
        self.pending[name] = (total, factors)
        return factor.reshape(-1)

    def settle(self, applied: bool) -> None:
        """An applied step: the averaged factors of each finished tensor become the next step's
        queries (Algorithm 2, lines 7 and 12) and its new error E ← M + E − P·Qᵀ (lines 6 and 11)
        the current one. Otherwise, and for a tensor no rank used, the state stays as before."""
        for name, (total, factors) in self.pending.items():
            accepted = applied and name in self.finished
            keep_error(self.sums, self.spares, name, total, accepted)
            if accepted and factors is None:
                self.deferred.pop(name, None)
            elif accepted:
                self.deferred[name] = factors
        if not self.may_skip_steps:  # errors are formed in place: a spare (a tensor no rank used) is not kept
            self.spares = {}
        if applied:
            for name, (left, right) in self.finished.items():
                self.p_prev[name], self.q_prev[name] = left, right
        self.pending, self.finished, self.batched = {}, {}, {}

    def _deferred_on(self, name: str, like: torch.Tensor):
        """The deferred factors of `name` on `like`'s device and dtype (moved once after a load)."""
        pair = self.deferred.get(name)
        if pair is not None and (pair[0].device != like.device or pair[0].dtype != like.dtype):
            pair = self.deferred[name] = tuple(t.to(device=like.device, dtype=like.dtype) for t in pair)
        return pair

    def _query(self, name: str, layout: str, step: int, like: torch.Tensor) -> torch.Tensor:
        """Orth(Q_prev) on P steps, Orth(P_prev) on Q steps; fresh Gaussian ones without reuse.
        With reuse no gradient enters a step's queries: the first one asked for orthogonalises
        those of every tensor whose previous factor lies on `like`'s device in its dtype, with one
        QR per factor shape (a GPU's host time is mostly per call: 0.19 ms per QR on an H200)."""
        previous = self.q_prev[name] if layout == P_STEP else self.p_prev[name]
        if self.reuse:
            alike = (layout, like.device, like.dtype)
            if alike not in self.batched:
                self.batched[alike] = self._orthogonalise_alike(layout, like)
            query = self.batched[alike].pop(name, None)
            if query is not None:
                return query
        else:
            generator = torch.Generator().manual_seed((self.seed + 7919 * step + zlib.crc32(name.encode())) % SEED_LIMIT)
            previous = torch.randn(previous.shape, generator=generator)
        return orthogonalize(previous.to(device=like.device, dtype=like.dtype))

    def _orthogonalise_alike(self, layout: str, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Orth of the previous factors (Q_prev on P steps, P_prev on Q steps) that lie on `like`'s
        device in its dtype, those of a shape stacked for one batched orthogonalisation."""
        previous = self.q_prev if layout == P_STEP else self.p_prev
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for name, factor in previous.items():
            if factor.device == like.device and factor.dtype == like.dtype:
                by_shape.setdefault(tuple(factor.shape), []).append(name)
        queries = {}
        for names in by_shape.values():
            if len(names) == 1:
                queries[names[0]] = orthogonalize(previous[names[0]])
            else:
                queries.update(zip(names, orthogonalize(torch.stack([previous[name] for name in names])).unbind(0)))
        return queries

    def reduced_target(self, name: str, parameter: torch.nn.Parameter, step: int) -> torch.Tensor:
        layout = self.layout(step)
        if layout == PLAIN or name not in self.shapes:
            return super().reduced_target(name, parameter, step)
        n, m, r = self.shapes[name]
        size = (n if layout == P_STEP else m) * r
        staging = self.staging.get(name)
        if staging is None or staging.numel() != size:
            staging = self.staging[name] = torch.empty(size, dtype=compute_dtype(parameter.dtype),
                                                       device=parameter.device)
        return staging

    def finish(self, name: str, parameter: torch.nn.Parameter, step: int) -> None:
        layout = self.layout(step)
        if layout == PLAIN or name not in self.shapes:
            return
        n, m, r = self.shapes[name]
        averaged = self.staging[name]
        query = self.query.pop(name, None)
        if query is None:  # this rank had neither gradient nor error and sent zeros; the factors stay shared
            query = self._query(name, layout, step, averaged)
        if layout == P_STEP:
            left, right = averaged.view(n, r), query
        else:
            left, right = query, averaged.view(m, r)
        gradient = super().reduced_target(name, parameter, step).view(n, m)
        write_low_rank(gradient, left, right)  # the averaged P̄·Qᵀ or P·Q̄ᵀ, written in place
        # the averaged factor leaves the staging buffer the next step reuses; the query is this step's own
        self.finished[name] = (left.clone(), right) if layout == P_STEP else (left, right.clone())

    def rescale_errors(self, factor: float) -> None:
        """E = sums − L·Rᵀ: the sums and the left factors are multiplied."""
        for total in self.sums.values():
            total.mul_(factor)
        self.deferred = {name: (left * factor, right) for name, (left, right) in self.deferred.items()}

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict, dict]:
        """Shared: the options that shaped the state, the seed and the factors (equal on every
        rank); per rank: the error feedback as it is held, E = errors − L·Rᵀ with (L, R) in
        `deferred` (so a resumed run computes exactly what the uninterrupted one would)."""
        shared = {"options": self._options(), "seed": self.seed, "p": cpu_copies(self.p_prev),
                  "q": cpu_copies(self.q_prev)}
        deferred = {name: (left.detach().cpu().clone(), right.detach().cpu().clone())
                    for name, (left, right) in self.deferred.items()}
        return shared, {"errors": cpu_copies(self.sums), "deferred": deferred}

    def load_state_dict(self, shared: dict, per_rank: dict | None) -> None:
        check_saved_state(self.name, shared["options"], self._options(), shared["p"], self.shapes)
        self.seed = shared["seed"]
        self.p_prev = {k: v.clone() for k, v in shared["p"].items()}
        self.q_prev = {k: v.clone() for k, v in shared["q"].items()}
        self.sums = {k: v.clone() for k, v in (per_rank or {}).get("errors", {}).items()}
        self.deferred = {k: (left.clone(), right.clone()) for k, (left, right) in (per_rank or {}).get("deferred", {}).items()}
        self.pending, self.finished, self.batched = {}, {}, {}

    def settings(self) -> dict:
        return {**self._options(), "seed": self.fixed_seed, "wire_dtype": self.wire_precision}

    def _options(self) -> dict:
        return {"rank": self.rank, "min_compression_rate": self.min_compression_rate,
                "start_iter": self.start_iter, "error_feedback": self.error_feedback, "reuse": self.reuse}


def combined_blocks(matrix: torch.Tensor, total: torch.Tensor, deferred, out: torch.Tensor):
    """Row blocks of M + E = M + total − L·Rᵀ, each formed once into `out` and yielded while it is
    in cache (one pass over M and the stored sum). Yields (rows, block): a row slice and
    out[rows].

    Args:
        matrix: the gradient M (n, m).
        total: the stored sum of the last step (n, m), so that E = total − L·Rᵀ.
        deferred: the last step's local factors (L (n, r), R (m, r)), or None when `total` is E.
        out: the (n, m) buffer that receives M + E (it becomes the stored sum), M's dtype and device.
    """
    for rows in row_blocks(matrix):
        combined = torch.add(matrix[rows], total[rows], out=out[rows])
        if deferred is not None:
            combined.addmm_(deferred[0][rows], deferred[1].T, alpha=-1)
        yield rows, combined


def compress_p_with_error(matrix: torch.Tensor, total: torch.Tensor, deferred, query: torch.Tensor,
                          out: torch.Tensor) -> torch.Tensor:
    """P = (M + E)·Q (Algorithm 2, line 5), with `out` ← M + E; the caller keeps (P, Q) so that
    E ← out − P·Qᵀ (line 6) is applied in the next step's pass. The query is column-major, so the
    product is BLAS's fast A·Bᵀ form.

    Args:
        matrix, total, deferred, out: as in combined_blocks.
        query: Q = Orth(Q_prev) (m, r), M's dtype and device.
    """
    factor = matrix.new_empty(matrix.shape[0], query.shape[1])
    for rows, combined in combined_blocks(matrix, total, deferred, out):
        torch.mm(combined, query, out=factor[rows])
    return factor


def compress_q_with_error(matrix: torch.Tensor, total: torch.Tensor, deferred, query: torch.Tensor,
                          out: torch.Tensor) -> torch.Tensor:
    """Q = (M + E)ᵀ·P (Algorithm 2, line 10), summed as Pᵀ·(M + E) over row blocks, with `out` ←
    M + E; the caller keeps (P, Q) so that E ← out − P·Qᵀ (line 11) is applied in the next step's
    pass: the update needs the whole Q, which a single pass cannot have.

    Args:
        matrix, total, deferred, out: as in combined_blocks.
        query: P = Orth(P_prev) (n, r), M's dtype and device.
    """
    transposed = matrix.new_zeros(query.shape[1], matrix.shape[1])
    for rows, combined in combined_blocks(matrix, total, deferred, out):
        transposed.addmm_(query[rows].T, combined)
    return transposed.T.contiguous()


SPEC = CodecSpec(ACPSGD, "ACP-SGD: alternate low-rank P/Q compression with error feedback and reuse",
                 source="acp-sgd Algorithm 2")
