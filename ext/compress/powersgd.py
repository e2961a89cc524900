"""Power-SGD with error feedback (acp-sgd Algorithm 1, left; Vogels et al. 2019), as the torch hook.

Each matrix-shaped gradient M (viewed as (shape[0], -1)) with (n + m)·r·min_compression_rate < n·m
travels as two low-rank factors per step, in two rounds, each a full plan: round "P" sends
P = (M + E)·Orth(Q_prev) and, once every rank's P is averaged, P̂ = Orth(P̄); round "Q" sends
Q = (M + E)ᵀ·P̂, and once Q is averaged the gradient is P̂·Q̄ᵀ and E ← M + E − P̂·Q̄ᵀ: the error is
taken against the aggregated approximation, as torch's PowerSGD hook does; it and the warm start
become current when the step settles (``Codec.settle``), so a step skipped for an inf anywhere
leaves them as they were. Q_prev is last step's Q̄ (warm start) or a fresh Gaussian from the seed
shared by every rank; like the torch hook, it is orthogonalised before use. Orth is QR for rank > 2
in fp32/fp64 and on a GPU, Gram–Schmidt otherwise (gradsync.compress.orthogonalize).

Vectors and small matrices travel uncompressed: whole, averaged, in round "P"; round "Q" must cover
them too (every plan covers every tensor once), so there they are one element, 0 when their round P
was applied and NaN when it was not: a step skipped for non-finite values in round P (nonfinite =
"skip") is then skipped by round Q's check as well. A compressed tensor whose round P was not
applied sends NaN in round Q for the same reason.

Scheduling is the planner's, not an option here: Power-SGD "after backward" is the plan with one
op, launched once the backward pass is over (scheduler "ddp" with bucket_cap_bytes and
first_bucket_bytes above the model's size); the overlapped Power-SGD is any WFBP or fusion planner
(wfbp, mg_wfbp, optimal_merge, ...).
"""
from __future__ import annotations

import zlib
from typing import Mapping

import torch

from ..profile import TensorSpec
from .codec import Codec
from .gradients import refuse_non_float
from .orthogonalize import orthogonalize
from .low_rank import (check_options, check_saved_state, check_wire_dtype, compute_dtype, cpu_copies, error_buffer,
                       layout_wire_dtype, on_the_wire, select_matrices, subtract_low_rank, write_low_rank)
from .spec import CodecSpec

PLAIN, P_ROUND, Q_ROUND = "plain", "P", "Q"


class PowerSGD(Codec):
    """Options: `rank` r (default 4), `min_compression_rate` (compress only when it pays by this
    factor), `start_iter` (uncompressed warm-up steps), `error_feedback`, `warm_start` and
    `wire_dtype` ("float16" or "bfloat16": what travels, cast, as under torch's
    fp16_compress_wrapper; default the gradients' type)."""

    name = "powersgd"

    def __init__(self, rank: int = 4, min_compression_rate: float = 2.0, start_iter: int = 0,
                 error_feedback: bool = True, warm_start: bool = True, wire_dtype: str | None = None):
        check_options(self.name, rank, min_compression_rate, start_iter, error_feedback=error_feedback,
                      warm_start=warm_start)
        check_wire_dtype(self.name, wire_dtype)
        self.wire_precision = wire_dtype
        self.rank = rank
        self.min_compression_rate = min_compression_rate
        self.start_iter = start_iter
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.per_rank_state = error_feedback

    # -- setup and planning ------------------------------------------------------------------------
    def setup(self, specs: Mapping[str, TensorSpec], world_size: int, seed: int) -> None:
        refuse_non_float("powersgd", specs)
        super().setup(specs, world_size, seed)
        self.seed = seed
        self.shapes = select_matrices(self.name, specs, self.rank, self.min_compression_rate)  # (n, m, r)
        generator = torch.Generator().manual_seed(seed)
        self.q_prev = {name: torch.randn(m, r, generator=generator) for name, (n, m, r) in self.shapes.items()}
        self.errors: dict[str, torch.Tensor] = {}
        self._reset_step_state()

    def _reset_step_state(self) -> None:
        """What lives only within one step: the round each tensor is in, its bases, staging, and
        the new error and warm start of its finished tensors."""
        self.round_of: dict[str, tuple[int, str]] = {}  # tensor -> (step, round) of its last wire
        self.p_applied: dict[str, int] = {}  # tensor -> last step whose round P was applied
        self.basis: dict[str, torch.Tensor] = {}  # P̂ of the current step
        self.staging: dict[str, torch.Tensor] = {}
        self.finished: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}  # (new E, Q̄), for `settle`

    def rounds(self, step: int) -> tuple[str, ...]:
        """Uncompressed before `start_iter`, then P and Q in sequence (Algorithm 1, lines 3–7)."""
        return (PLAIN,) if step < self.start_iter else (P_ROUND, Q_ROUND)

    def layouts(self) -> tuple[str, ...]:
        return (PLAIN, P_ROUND, Q_ROUND) if self.start_iter else (P_ROUND, Q_ROUND)

    def wire_spec(self, spec: TensorSpec, layout: str) -> TensorSpec:
        if layout == PLAIN or (layout == P_ROUND and spec.name not in self.shapes):
            wire = spec
        elif spec.name not in self.shapes:  # round Q of an uncompressed tensor: its one marker element
            wire = TensorSpec(spec.name, 1, spec.bytes_per_element, (1,))
        else:
            n, m, r = self.shapes[spec.name]
            rows = n if layout == P_ROUND else m
            wire = TensorSpec(spec.name, rows * r, spec.bytes_per_element, (rows, r))
        return on_the_wire(wire, self.wire_precision, layout != PLAIN)

    def wire_dtype(self, layout: str, gradient_dtype: torch.dtype) -> torch.dtype:
        return layout_wire_dtype(self.wire_precision, layout != PLAIN, gradient_dtype)

    def compute_seconds(self, spec: TensorSpec, layout: str, flops_per_second: float) -> tuple[float, float]:
        """Round P: encode (M + E)·Q (two n×m×r products with error feedback, one without) and
        Orth(Q_prev), decode Orth(P̄); round Q: encode (M + E)ᵀ·P̂, decode P̂·Q̄ᵀ and the error update
        (one more product). Orthogonalisation is O(rows·r²)."""
        if layout == PLAIN or spec.name not in self.shapes:
            return 0.0, 0.0
        n, m, r = self.shapes[spec.name]
        product = 2.0 * n * m * r
        encode = product * (2 if self.error_feedback else 1)
        if layout == P_ROUND:
            return (encode + 2.0 * m * r * r) / flops_per_second, 2.0 * n * r * r / flops_per_second
        decode = product * (2 if self.error_feedback else 1)
        return encode / flops_per_second, decode / flops_per_second

    # -- execution ---------------------------------------------------------------------------------
    def encode(self, name: str, grad: torch.Tensor | None, step: int) -> torch.Tensor | None:
        """Round P on a tensor's first encode of a step, round Q on its second."""
        if step < self.start_iter:
            return super().encode(name, grad, step)
        in_q = self.round_of.get(name) == (step, P_ROUND)
        self.round_of[name] = (step, Q_ROUND if in_q else P_ROUND)
        if in_q and self.p_applied.get(name) != step:  # round P was skipped: make round Q skip too
            return None if grad is None else torch.full((self._wire_numel(name, Q_ROUND),), float("nan"),
                                                        dtype=grad.dtype, device=grad.device)
        if name not in self.shapes:
            if not in_q:
                return super().encode(name, grad, step)
            return None if grad is None else grad.new_zeros(1)
        like = grad if grad is not None else self.errors.get(name)
        if like is None:
            return None  # no gradient and no error: this rank's M + E is zero
        matrix = self._matrix(name, grad, like)
        error = self._error(name, matrix)
        if in_q:  # Q = (M + E)ᵀ·P̂ (line 6), as (P̂ᵀ·(M + E))ᵀ: on the CPU 3× faster than Mᵀ·P̂
            basis = self.basis[name].T
            factor = (basis @ matrix if error is None else torch.addmm(basis @ error, basis, matrix)).T
        else:  # P = (M + E)·Orth(Q_prev) (line 3)
            query = orthogonalize(self._query(name, step).to(device=matrix.device, dtype=matrix.dtype))
            factor = matrix @ query if error is None else torch.addmm(error @ query, matrix, query)
        return factor.reshape(-1)

    def _wire_numel(self, name: str, layout: str) -> int:
        return self.wire_spec(self.specs[name], layout).numel

    def _matrix(self, name: str, grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        n, m, _ = self.shapes[name]
        dtype = compute_dtype(like.dtype)
        if grad is None:
            return torch.zeros(n, m, dtype=dtype, device=like.device)
        return grad.reshape(n, m).to(dtype)

    def _error(self, name: str, matrix: torch.Tensor) -> torch.Tensor | None:
        return error_buffer(self.errors, name, matrix) if self.error_feedback else None

    def _query(self, name: str, step: int) -> torch.Tensor:
        """Q_prev: last step's Q̄ with warm start, else a Gaussian drawn from the shared seed."""
        if self.warm_start:
            return self.q_prev[name]
        generator = torch.Generator().manual_seed(self.seed + 7919 * step + zlib.crc32(name.encode()))
        return torch.randn(self.q_prev[name].shape, generator=generator)

    def reduced_target(self, name: str, parameter: torch.nn.Parameter, step: int) -> torch.Tensor:
        if step < self.start_iter or (name not in self.shapes and self.round_of[name][1] == P_ROUND):
            return super().reduced_target(name, parameter, step)
        size = self._wire_numel(name, self.round_of[name][1])
        staging = self.staging.get(name)
        if staging is None or staging.numel() != size:
            staging = self.staging[name] = torch.empty(size, dtype=compute_dtype(parameter.dtype),
                                                       device=parameter.device)
        return staging

    def finish(self, name: str, parameter: torch.nn.Parameter, step: int) -> None:
        if step < self.start_iter:
            return
        if self.round_of[name][1] == P_ROUND:
            self.p_applied[name] = step
            if name in self.shapes:  # P̂ = Orth(P̄) (line 5)
                n, _, r = self.shapes[name]
                self.basis[name] = orthogonalize(self.staging[name].view(n, r))
        elif name in self.shapes:
            self._finish_q(name, parameter, step)

    def _finish_q(self, name: str, parameter: torch.nn.Parameter, step: int) -> None:
        """Gradient P̂·Q̄ᵀ (line 8), written over M once the new E = M + E − P̂·Q̄ᵀ is formed beside
        the current one (in its place where steps are never skipped); it and the warm start Q̄
        become current when the step settles."""
        n, m, r = self.shapes[name]
        basis, q_mean = self.basis.pop(name), self.staging[name].view(m, r)
        new_error = None
        if self.error_feedback:
            matrix = self._matrix(name, parameter.grad, basis)  # M in the factors' dtype: a copy if that widens
            error = self._error(name, matrix)
            new_error = torch.empty_like(error) if self.may_skip_steps else error  # else formed in place
            subtract_low_rank(matrix, error, basis, q_mean, out=new_error)
        write_low_rank(super().reduced_target(name, parameter, step).view(n, m), basis, q_mean)
        self.finished[name] = (new_error, q_mean.clone())

    def settle(self, applied: bool) -> None:
        if applied:
            for name, (new_error, q_mean) in self.finished.items():
                if new_error is not None:
                    self.errors[name] = new_error
                self.q_prev[name] = q_mean
        self.finished = {}

    def rescale_errors(self, factor: float) -> None:
        for error in self.errors.values():
            error.mul_(factor)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict, dict]:
        """Shared: the options, the seed and the warm-start factors Q̄ (equal on every rank); per
        rank: the error-feedback matrices."""
        shared = {"options": self._options(), "seed": self.seed, "q": cpu_copies(self.q_prev)}
        return shared, {"errors": cpu_copies(self.errors)}

    def load_state_dict(self, shared: dict, per_rank: dict | None) -> None:
        check_saved_state(self.name, shared["options"], self._options(), shared["q"], self.shapes)
        self.seed = shared["seed"]
        self.q_prev = {k: v.clone() for k, v in shared["q"].items()}
        self.errors = {k: v.clone() for k, v in (per_rank or {}).get("errors", {}).items()}
        self._reset_step_state()

    def settings(self) -> dict:
        return {**self._options(), "wire_dtype": self.wire_precision}

    def _options(self) -> dict:
        return {"rank": self.rank, "min_compression_rate": self.min_compression_rate, "start_iter": self.start_iter,
                "error_feedback": self.error_feedback, "warm_start": self.warm_start}


SPEC = CodecSpec(PowerSGD, "Power-SGD low-rank compression (P then Q every step) with error feedback",
                 source="acp-sgd Algorithm 1",
                 aliases={"matrix_approximation_rank": "rank", "start_powerSGD_iter": "start_iter",
                          "use_error_feedback": "error_feedback"})  # torch's PowerSGDState names
