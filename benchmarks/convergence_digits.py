"""Convergence on real data: scikit-learn's digits, a small CNN, 2 CPU ranks, SGD with momentum.

Uncompressed training against ACP-SGD (rank 4) and its ablations without error feedback and
without reuse (acp-sgd Fig. 7), and the baselines that are registered. Writes
benchmarks/results/convergence_digits.md and prints it.

Run: `.venv/bin/python benchmarks/convergence_digits.py [--epochs 8]`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from gradsync import compress
from gradsync.launch import run_local
from gradsync.recipes.classification import fit

RUNS = [
    ("uncompressed", None),
    ("acp_sgd rank 4", {"type": "acp_sgd", "rank": 4}),
    ("acp_sgd rank 4, no error feedback", {"type": "acp_sgd", "rank": 4, "error_feedback": False}),
    ("acp_sgd rank 4, no reuse", {"type": "acp_sgd", "rank": 4, "reuse": False}),
    ("powersgd rank 4", {"type": "powersgd", "rank": 4}),
    ("signsgd", {"type": "signsgd"}),
    ("topk density 0.05", {"type": "topk", "density": 0.05}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    lines = [
        "# Convergence on scikit-learn's digits",
        "",
        f"`benchmarks/convergence_digits.py --epochs {args.epochs}`: small CNN, 2 CPU ranks (gloo), batch 32 per "
        "rank, SGD lr 0.05 momentum 0.9, scheduler `optimal_merge`, 1437 training and 360 test images.",
        "",
        "| method | test accuracy per epoch (%) | final | bytes per step | iteration ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, compressor in RUNS:
        if compressor is not None and compressor["type"] not in compress.names():
            continue
        result = run_local(fit, 2, "cnn", "digits", args.epochs, "optimal_merge", compressor)[0]
        curve = ", ".join(f"{a:.1f}" for a in result["accuracy"])
        lines.append(f"| {label} | {curve} | **{result['accuracy'][-1]:.1f}** | {result['wire_bytes']:,} | "
                     f"{result['iteration_ms']:.1f} |")
    report = "\n".join(lines) + "\n"
    out = Path(__file__).parent / "results" / "convergence_digits.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
