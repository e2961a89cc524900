"""CostModel: the time of one all-reduce, a + b·bytes, and of one reduce-scatter, its contention
factor γ, and the compute time each op costs the rank that launches it.

Equation references: asc-wfbp eq. 3 (a + b·m) and eqs. 9–11 (γ for simultaneous all-reduces);
mg-wfbp eq. 9 and Table II (a and b from the network's α, β and summation time per algorithm);
us-byte eq. 1 (an empty all-reduce costs nothing) and eq. 14 (ring).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields as dataclass_fields, replace
from typing import Sequence

import numpy as np

from .errors import ConfigError, unknown_name
from .plan import ALLREDUCE, COLLECTIVES, REDUCE_SCATTER


@dataclass(frozen=True)
class FitReport:
    """Quality of a least-squares fit of a and b: coefficient of determination and residuals."""

    samples: int
    r_squared: float
    rmse: float
    max_relative_error: float


@dataclass(frozen=True)
class CostModel:
    """All-reduce time ``a + b·bytes`` in seconds (asc-wfbp eq. 3), contention γ (eq. 9), and how
    communication and computation slow each other where they share the ranks' processors:
    `host`, the seconds of the computing thread each op takes (launching it, handling its result);
    `compute_slowdown`, how many times slower the computation runs while an op transmits;
    `transfer_slowdown`, how many times slower an op progresses while the computation runs;
    `ops_per_channel`, how many ops one channel runs at once (an NCCL communicator runs one, a gloo
    process group at most one per worker thread, two by default, as many as measured). The papers'
    model has host = 0 and both slowdowns 1 (their ops and computation never meet) and one op per
    channel.
    `reduce_scatter_a` and `reduce_scatter_b`: a reduce-scatter's ``a + b·bytes`` (the whole
    buffer's bytes; each rank receives its partition), fitted on its own; None: half the
    all-reduce's (a ring all-reduce is a reduce-scatter and an all-gather of equal cost)."""

    a: float
    b: float
    gamma: float = 1.0
    name: str = "custom"
    host: float = 0.0
    compute_slowdown: float = 1.0
    transfer_slowdown: float = 1.0
    ops_per_channel: int = 1
    reduce_scatter_a: float | None = None
    reduce_scatter_b: float | None = None
    fit_report: FitReport | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for attr in ("a", "b"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"cost model: '{attr}' must be a finite number > 0, got {value!r}")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not math.isfinite(self.gamma) \
                or self.gamma < 1:
            raise ConfigError(f"cost model: 'gamma' must be a finite number >= 1, got {self.gamma!r}")
        if isinstance(self.host, bool) or not isinstance(self.host, (int, float)) or not math.isfinite(self.host) \
                or self.host < 0:
            raise ConfigError(f"cost model: 'host' must be a finite number >= 0, got {self.host!r}")
        for attr in ("compute_slowdown", "transfer_slowdown"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
                raise ConfigError(f"cost model: '{attr}' must be a finite number >= 1, got {value!r}")
        if isinstance(self.ops_per_channel, bool) or not isinstance(self.ops_per_channel, int) or self.ops_per_channel < 1:
            raise ConfigError(f"cost model: 'ops_per_channel' must be an integer >= 1, got {self.ops_per_channel!r}")
        given = [attr for attr in ("reduce_scatter_a", "reduce_scatter_b") if getattr(self, attr) is not None]
        if len(given) == 1:
            raise ConfigError(f"cost model: {given[0]!r} needs its pair: give both 'reduce_scatter_a' and "
                              "'reduce_scatter_b', or neither (half the all-reduce's)")
        for attr in given:
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"cost model: {attr!r} must be a finite number > 0, got {value!r}")

    def allreduce_time(self, nbytes: float) -> float:
        """T_ar(m) = a + b·m, and 0 for an empty message (us-byte eq. 1)."""
        return 0.0 if nbytes <= 0 else self.a + self.b * nbytes

    def terms(self, collective: str = ALLREDUCE) -> tuple[float, float]:
        """(a, b) of `collective` over a buffer of m bytes: the all-reduce's (asc-wfbp eq. 3), or the
        reduce-scatter's, fitted or half the all-reduce's."""
        if collective == ALLREDUCE:
            return self.a, self.b
        if collective != REDUCE_SCATTER:
            raise unknown_name("collective", collective, COLLECTIVES)
        if self.reduce_scatter_a is None:
            return self.a / 2, self.b / 2
        return self.reduce_scatter_a, self.reduce_scatter_b

    def for_collective(self, collective: str) -> "CostModel":
        """This model with `collective`'s a and b as its all-reduce terms. Planners plan every op
        with a + b·m, so a plan of reduce-scatters is planned as any other, on this model."""
        if collective == ALLREDUCE:
            return self
        a, b = self.terms(collective)
        return replace(self, a=a, b=b, reduce_scatter_a=None, reduce_scatter_b=None, name=f"{self.name} ({collective})",
                       fit_report=None)

    def with_reduce_scatter_fit(self, sizes: Sequence[float], times: Sequence[float], clamp: bool = False) -> "CostModel":
        """This model with a reduce-scatter's a and b fitted by least squares on (bytes, seconds)
        samples, as `fit` fits the all-reduce's (same refusals).

        Args:
            sizes, times: one reduce-scatter's buffer size (bytes, the whole buffer's) and measured
                time (seconds) per sample; at least two distinct sizes.
            clamp: as `fit`'s.
        """
        a, b, _ = _least_squares(sizes, times, clamp)
        return replace(self, reduce_scatter_a=a, reduce_scatter_b=b)

    def rescaled_b(self, factor: float) -> "CostModel":
        """This model with every collective's b multiplied by `factor` (a link whose rate changed;
        its latency, contention and host terms kept)."""
        fitted = {} if self.reduce_scatter_b is None else {"reduce_scatter_b": self.reduce_scatter_b * factor}
        return replace(self, b=self.b * factor, name=self.name.removesuffix(" (re-fitted)") + " (re-fitted)",
                       fit_report=None, **fitted)

    def penalty(self, overlapped_bytes: float) -> float:
        """Extra time of an all-reduce whose `overlapped_bytes` travel beside another (asc-wfbp eq. 11)."""
        return (self.gamma - 1.0) * self.b * overlapped_bytes

    def to_dict(self) -> dict:
        fitted = {} if self.reduce_scatter_a is None else {"reduce_scatter_a": self.reduce_scatter_a,
                                                           "reduce_scatter_b": self.reduce_scatter_b}
        return {"name": self.name, "a": self.a, "b": self.b, "gamma": self.gamma, "host": self.host,
                "compute_slowdown": self.compute_slowdown, "transfer_slowdown": self.transfer_slowdown,
                "ops_per_channel": self.ops_per_channel, **fitted}

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data) -> "CostModel":
        """The inverse of `to_dict` ('a' and 'b' required), refusing what is not such a mapping."""
        if not isinstance(data, dict):
            raise ConfigError(f"cost model JSON must be an object with 'a' and 'b', got {type(data).__name__}")
        keys = [f.name for f in dataclass_fields(cls) if f.name != "fit_report"]
        problems = [f"{what} {names}" for what, names in (("unknown key(s)", sorted(set(data) - set(keys))),
                                                          ("missing", [key for key in ("a", "b") if key not in data]))
                    if names]
        if problems:
            raise ConfigError(f"cost model JSON: {'; '.join(problems)} (keys: {', '.join(keys)})")
        return cls(**data)

    @classmethod
    def from_network(
        cls,
        alpha: float,
        beta: float,
        workers: int,
        sum_time: float = 0.0,
        algorithm: str = "ring",
        gamma: float = 1.0,
        name: str | None = None,
    ) -> "CostModel":
        """a and b of an N-worker all-reduce from point-to-point α + β·M (mg-wfbp Table II), and
        for "ring" and "halving_doubling" those of the reduce-scatter that is their first half
        ((N−1)α or α·log₂N, and (N−1)/N·(β + sum_time): every summation happens in it).

        `sum_time` is the time to add two numbers per byte (Table II's γ; not the contention γ).

        Args:
            alpha: point-to-point start-up time α (seconds).
            beta: point-to-point transfer time per byte β (seconds/byte).
            workers: N, the number of workers (an integer >= 2).
            sum_time: summation time per byte (seconds/byte); 0 leaves it out.
            algorithm: the all-reduce's row of Table II: "ring", "binary_tree", "recursive_doubling"
                or "halving_doubling".
            gamma: the contention factor γ of the model (>= 1).
            name: the model's name (None: "<algorithm>-<N>").
        """
        check_workers(workers)
        n = workers
        log_n = math.log2(n)
        formulas = {
            "binary_tree": (2 * alpha * log_n, (2 * beta + sum_time) * log_n),
            "recursive_doubling": (alpha * log_n, (beta + sum_time) * log_n),
            "halving_doubling": (2 * alpha * log_n, 2 * beta - (2 * beta + sum_time) / n + sum_time),
            "ring": (2 * (n - 1) * alpha, 2 * (n - 1) / n * beta + (n - 1) / n * sum_time),
        }
        if algorithm not in formulas:
            raise unknown_name("all-reduce algorithm", algorithm, formulas)
        a, b = formulas[algorithm]
        reduce_scatter = {"ring": ((n - 1) * alpha, (n - 1) / n * (beta + sum_time)),
                          "halving_doubling": (alpha * log_n, (n - 1) / n * (beta + sum_time))}
        rs_a, rs_b = reduce_scatter.get(algorithm, (None, None))
        return cls(a, b, gamma, name or f"{algorithm}-{n}", reduce_scatter_a=rs_a, reduce_scatter_b=rs_b)

    @classmethod
    def preset(cls, name: str, workers: int | None = None) -> "CostModel":
        """A cluster from the papers, scaled to `workers` with the ring formula (mg-wfbp Table II).

        Without `workers`, the paper's own worker count is used, which reproduces its a and b.
        """
        if name not in PRESETS:
            raise unknown_name("cluster preset", name, PRESETS)
        preset = PRESETS[name]
        return cls.from_network(
            preset.alpha, preset.beta, preset.workers if workers is None else workers, gamma=preset.gamma, name=name
        )

    @classmethod
    def fit(
        cls,
        sizes: Sequence[float],
        times: Sequence[float],
        concurrent_sizes: Sequence[float] = (),
        concurrent_times: Sequence[float] = (),
        name: str = "fitted",
        clamp: bool = False,
        least_start_up: float = 0.0,
    ) -> "CostModel":
        """Least-squares a and b from (bytes, seconds) samples, subject to a ≥ `least_start_up`;
        γ from the times of two simultaneous all-reduces of each size in `concurrent_sizes`
        (asc-wfbp eq. 9: a + γ·b·m).

        A fit with a ≤ 0 or b ≤ 0 raises, unless `clamp` (for live measurements, where such a fit
        means the term is below what the samples resolve): then it is set to its smallest value
        consistent with the samples (a: 1% of the fastest sample; b: 1e-15 s/byte).

        Args:
            sizes, times: one all-reduce's message size (bytes, >= 0) and measured time (seconds, > 0)
                per sample; at least two distinct sizes.
            concurrent_sizes, concurrent_times: a size (bytes, > 0) and the time (seconds) two all-reduces
                of that size started together take until both end, a + γ·b·m; one time per size; empty: γ = 1.
            name: the model's name.
            clamp: raise the fitted a and b to at least those smallest values instead of refusing a ≤ 0 or b ≤ 0.
            least_start_up: seconds a is at least, measured directly (``probes.measure_cost``: what an
                op carrying nothing costs where the least-squares intercept falls below it).
        """
        a, b, report = _least_squares(sizes, times, clamp, least_start_up)
        gamma = 1.0
        if len(concurrent_sizes):
            cx = np.asarray(concurrent_sizes, dtype=float)
            cy = np.asarray(concurrent_times, dtype=float)
            if cx.shape != cy.shape or np.any(cx <= 0):
                raise ConfigError("cost fit: concurrent sizes must be > 0, one time each")
            excess = cy - a
            gamma = max(1.0, float(np.dot(excess, b * cx) / np.dot(b * cx, b * cx)))
        return cls(float(a), float(b), gamma, name, fit_report=report)


def _least_squares(sizes: Sequence[float], times: Sequence[float], clamp: bool,
                   least_a: float = 0.0) -> tuple[float, float, FitReport]:
    """a and b of a + b·m fitted to (bytes, seconds) samples with a ≥ `least_a`, and the fit's
    quality (`CostModel.fit`). Where the unconstrained intercept lies below `least_a`, the
    constrained least squares holds a there and fits the slope alone: b = Σm(t − a) / Σm²."""
    x = np.asarray(sizes, dtype=float)
    y = np.asarray(times, dtype=float)
    if x.shape != y.shape or x.size < 2 or np.unique(x).size < 2:
        raise ConfigError("cost fit: needs at least two distinct sizes with one time each")
    if np.any(x < 0) or np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise ConfigError("cost fit: sizes must be >= 0 and times finite and > 0")
    if not (math.isfinite(least_a) and least_a >= 0):
        raise ConfigError(f"cost fit: the least start-up must be finite and >= 0, got {least_a!r}")
    design = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    if a < least_a:
        a, b = least_a, float(np.dot(x, y - least_a) / np.dot(x, x))
    if clamp:
        a, b = max(a, 0.01 * float(y.min())), max(b, 1e-15)
    if a <= 0 or b <= 0:
        raise ConfigError(
            f"cost fit: the samples give a={a:.3g}, b={b:.3g}; both must be > 0 "
            "(measure more sizes, larger ones for b, smaller ones for a)"
        )
    residual = y - (a + b * x)
    total = float(np.sum((y - y.mean()) ** 2))
    report = FitReport(
        samples=int(x.size),
        r_squared=1.0 - float(np.sum(residual**2)) / total if total > 0 else 1.0,
        rmse=float(np.sqrt(np.mean(residual**2))),
        max_relative_error=float(np.max(np.abs(residual) / y)),
    )
    return float(a), float(b), report


@dataclass(frozen=True)
class ClusterPreset:
    """A paper's cluster as point-to-point α, β (seconds, seconds/byte) and its own worker count."""

    alpha: float
    beta: float
    workers: int
    gamma: float
    source: str


def _ring_preset(a: float, b: float, workers: int, gamma: float, source: str) -> ClusterPreset:
    """Invert the ring row of mg-wfbp Table II (summation time folded into β)."""
    return ClusterPreset(a / (2 * (workers - 1)), b * workers / (2 * (workers - 1)), workers, gamma, source)


PRESETS: dict[str, ClusterPreset] = {
    "asc-wfbp-10gbe": _ring_preset(1.4e-3, 1.7e-9, 32, 1.5, "asc-wfbp §VI-B: 8 nodes × 4 GPUs, 10GbE"),
    "us-byte-cluster1": _ring_preset(910.5e-6, 0.352e-10, 8, 1.0, "us-byte Fig. 9a: 8 × V100, 10GbE"),
    "us-byte-cluster2": _ring_preset(1318.6e-6, 2.406e-10, 8, 1.0, "us-byte Fig. 9b: 8 × RTX3090, 100 Gb/s"),
    "mg-wfbp-10gbe": ClusterPreset(45.26e-6, 8e-10, 8, 1.0, "mg-wfbp §V-A: 2(N-1)α = 90.52/271.56/633.64 µs; "
                                   "β = 1/(10 Gbit/s)"),
}


def check_workers(workers) -> None:
    """A worker count an all-reduce can have: an integer >= 2."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
        raise ConfigError(f"cost model: 'workers' must be an integer >= 2, got {workers!r}")
