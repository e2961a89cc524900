"""What the low-rank codecs' per-matrix operations cost on a CUDA device: host time per call, device
time per call, and whether the call waits for the device.

The GPU acceptance run found ACP-SGD and Power-SGD bound by the host at BERT-Base's sizes (a step's
time far above its device time). This benchmark times, per operation, what the host spends to issue
it and what the device spends to run it, so that the codecs' CUDA path can be chosen on numbers:

- orthogonalising an n × r factor (r = 4): gradsync's ``orthogonalize`` (reduced QR, signs fixed,
  column-major), the same on BATCH factors stacked (as ACP-SGD orthogonalises a step's queries of
  one shape: the row is per call, for all of them), ``torch.linalg.qr`` alone, gradsync's
  ``gram_schmidt`` (its fallback), and Cholesky-QR applied twice (Gram matrix, ``cholesky_ex``,
  ``solve_triangular``; no QR);
- the error-feedback update E ← M + E − P·Qᵀ: the fused Triton kernel and eager torch
  (``add`` then ``addmm_``).

Method: a `torch.cuda._sleep` keeps the device busy while the host issues `CALLS` calls back to
back; the host time per call is the time to issue them. A call that waits for the device (a
synchronisation inside it) makes the host wait for the sleep: it is reported as synchronising, and
its device time is not read. Otherwise CUDA events around the calls, queued behind the sleep, give
the device time per call. Medians over `REPEATS` such runs.

Run on a CUDA machine: `python3 benchmarks/codec_launch_costs.py` (with gradsync installed); it
writes benchmarks/results/codec_launch_costs.md. Elsewhere it says that a GPU is needed and exits 0.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

RANK = 4
BATCH = 4  # BERT-Base's attention projections: four 768 × 768 matrices a layer
FACTOR_ROWS = (768, 3072, 30522)
MATRICES = ((768, 768), (3072, 768), (30522, 768))
CALLS, REPEATS, WARMUP = 20, 7, 5
SLEEP_CYCLES = 50_000_000  # tens of milliseconds on current GPUs: longer than issuing CALLS calls
RESULTS = Path(__file__).parent / "results" / "codec_launch_costs.md"


def cholesky_qr2(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning `matrix`'s (full column rank): A·R⁻¹ with RᵀR = AᵀA, twice."""
    for _ in range(2):
        lower = torch.linalg.cholesky_ex(matrix.T @ matrix).L
        matrix = torch.linalg.solve_triangular(lower.T, matrix, upper=True, left=False)
    return matrix


def timed(function) -> dict:
    """Host µs per call, device µs per call (None when the call synchronises), and whether it does."""
    for _ in range(WARMUP):
        function()
    torch.cuda.synchronize()
    sleep = _sleep_seconds()
    host, device, waits = [], [], False
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        began = time.perf_counter()
        for _ in range(CALLS):
            function()
        issued = time.perf_counter() - began
        end.record()
        torch.cuda.synchronize()
        waits = waits or issued > 0.5 * sleep
        host.append(issued / CALLS)
        device.append(start.elapsed_time(end) * 1e-3 / CALLS)
    return {"host_us": statistics.median(host) * 1e6,
            "device_us": None if waits else statistics.median(device) * 1e6, "synchronises": waits}


def _sleep_seconds() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3


def orthogonalisation_rows() -> list[tuple[str, str, dict]]:
    from gradsync.compress.orthogonalize import gram_schmidt, orthogonalize

    rows = []
    for n in FACTOR_ROWS:
        factor = torch.randn(n, RANK, device="cuda")
        factors = list(torch.randn(BATCH, n, RANK, device="cuda"))
        for label, function in (("orthogonalize (QR)", orthogonalize), ("torch.linalg.qr", torch.linalg.qr),
                                ("gram_schmidt", gram_schmidt), ("Cholesky-QR twice", cholesky_qr2)):
            rows.append((f"{n}×{RANK}", label, timed(lambda: function(factor))))
        rows.append((f"{BATCH} × {n}×{RANK}", "orthogonalize (QR) of the stacked batch",
                     timed(lambda: orthogonalize(torch.stack(factors)).unbind(0))))
    return rows


def error_feedback_rows() -> list[tuple[str, str, dict]]:
    from gradsync.triton_kernels import error_feedback_update

    rows = []
    for n, m in MATRICES:
        M, E, F = (torch.randn(n, m, device="cuda") for _ in range(3))
        P, Q = torch.randn(n, RANK, device="cuda"), torch.randn(m, RANK, device="cuda")
        for label, function in (("fused (Triton)", lambda: error_feedback_update(M, E, P, Q, out=F)),
                                ("eager add + addmm_", lambda: torch.add(E, M, out=F).addmm_(P, Q.T, alpha=-1))):
            rows.append((f"{n}×{m}", label, timed(function)))
    return rows


def measured() -> dict[str, list[tuple[str, str, dict]]]:
    """Every row, by section title: (shape, way, timed's numbers)."""
    return {"Orthogonalising a factor": orthogonalisation_rows(), "Error-feedback update": error_feedback_rows()}


def table(title: str, rows: list[tuple[str, str, dict]]) -> list[str]:
    lines = [f"## {title}", "", "| shape | way | host µs per call | device µs per call | waits for the device |",
             "|---|---|---:|---:|---|"]
    for shape, label, row in rows:
        device = "—" if row["device_us"] is None else f"{row['device_us']:.1f}"
        lines.append(f"| {shape} | {label} | {row['host_us']:.1f} | {device} | "
                     f"{'yes' if row['synchronises'] else 'no'} |")
    return lines + [""]


def main() -> int:
    if not torch.cuda.is_available():
        print("benchmarks/codec_launch_costs.py needs a CUDA GPU; nothing was measured.")
        return 0
    lines = ["# Low-rank codec operations on CUDA: host and device time per call", "",
             f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}. Command: "
             "`python3 benchmarks/codec_launch_costs.py`. Medians of "
             f"{REPEATS} runs of {CALLS} calls, float32, r = {RANK}.", ""]
    for title, rows in measured().items():
        lines += table(title, rows)
    print("\n".join(lines))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
