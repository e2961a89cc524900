"""Compression + decompression time per step on the CPU: ACP-SGD against Power-SGD (acp-sgd §IV-A).

ACP-SGD computes one low-rank factor per step where Power-SGD computes both (Algorithm 1), so its
per-step compression cost should be about half (both still pay the error-feedback update and the
approximation P·Qᵀ every step): target ACP-SGD ≤ 0.55× Power-SGD. Tensors are one
BERT-base encoder layer's weight matrices (768×768 ×4, 768×3072, 3072×768) and the 30522×768 word
embedding, rank 4, error feedback on. World size 1: every round is encode, the wire copied into the
codec's reduced target, finish; no communication. A step's time is the mean of two consecutive
steps (ACP-SGD's P step and Q step); the median over repeats is reported. Sign-SGD and Top-k
(density 0.01) rows are for reference.

Run: `.venv/bin/python benchmarks/compression_speed.py` (about a minute on 2 cores). It prints the
table and writes it, with the machine's load average and the command, to
benchmarks/results/compression_speed.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from gradsync import compress
from gradsync.profile import TensorSpec

GROUPS = {
    "768×768 ×4": [(768, 768)] * 4,
    "768×3072": [(768, 3072)],
    "3072×768": [(3072, 768)],
    "30522×768": [(30522, 768)],
}
CODECS = {
    "ACP-SGD": ("acp_sgd", {"rank": 4}),
    "Power-SGD": ("powersgd", {"rank": 4}),
    "Sign-SGD": ("signsgd", {}),
    "Top-k 1%": ("topk", {"density": 0.01}),
}
TARGET = 0.55
WHERE_THE_TIME_GOES = (
    "Where the time goes (30522×768, 2 threads, idle machine, each operation timed alone): every "
    "method reads M and E and writes the new error state once per step (8.4 ms as a bare element-wise "
    "pass) and writes the decompressed P·Qᵀ into the gradient (8 ms); Power-SGD adds its second "
    "product and a second pass for the error update. ACP-SGD makes one pass per step: each row block "
    "of M + E is formed with the previous step's P·Qᵀ subtracted (the error update of Algorithm 2, "
    "deferred by one step because a Q step needs all of Q first) and multiplied while in cache "
    "(P step 14.3 ms, Q step 17.7 ms; Pᵀ·(M + E) runs at half the speed of (M + E)·Q in MKL). The "
    "two passes every method must make keep the ratio above about 0.5 on a memory-bound CPU.")
REPORT = Path(__file__).parent / "results" / "compression_speed.md"


def synchronized_clock(device: torch.device) -> float:
    """perf_counter once the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def step_seconds(codec, parameters: dict, gradients: dict, step: int) -> float:
    """One step of every round of `codec` over `parameters` on one worker; the gradients are reset
    first, outside the timing (finish overwrites them)."""
    for name, parameter in parameters.items():
        parameter.grad.copy_(gradients[name])
    device = next(iter(gradients.values())).device
    started = synchronized_clock(device)
    for _ in codec.rounds(step):
        for name, parameter in parameters.items():
            wire = codec.encode(name, parameter.grad, step)
            target = codec.reduced_target(name, parameter, step)
            target.copy_(wire if codec.collective == "allreduce" else wire.unsqueeze(0))
            codec.finish(name, parameter, step)
    codec.settle(applied=True)
    return synchronized_clock(device) - started


def prepared(codec_name: str, options: dict, gradients: dict) -> tuple:
    """A codec set up for `gradients` on one worker, and parameters holding gradient buffers."""
    parameters = {name: torch.nn.Parameter(torch.zeros_like(g)) for name, g in gradients.items()}
    for parameter in parameters.values():
        parameter.grad = torch.zeros_like(parameter)
    codec = compress.get(codec_name, **options)
    codec.may_skip_steps = False  # as under wrap's default nonfinite="raise"
    codec.setup({name: TensorSpec(name, g.numel(), 4, tuple(g.shape)) for name, g in gradients.items()}, 1, seed=0)
    return codec, parameters


def median_steps(shapes: list[tuple[int, int]], repeats: int, device: str = "cpu",
                 codecs: dict = CODECS) -> dict[str, float]:
    """Per codec of `codecs` (label: (name, options)): the median over `repeats` pairs of
    consecutive steps of the mean step time on `device`, after one warm-up pair. The codecs take
    turns within each repeat, so that load from other processes falls on all of them alike."""
    generator = torch.Generator().manual_seed(0)
    gradients = {f"w{i}": torch.randn(shape, generator=generator).to(device) for i, shape in enumerate(shapes)}
    codecs = {label: prepared(name, options, gradients) for label, (name, options) in codecs.items()}
    samples: dict[str, list[float]] = {label: [] for label in codecs}
    for pair in range(repeats + 1):
        for label, (codec, parameters) in codecs.items():
            seconds = sum(step_seconds(codec, parameters, gradients, 2 * pair + half) for half in (0, 1)) / 2
            if pair:
                samples[label].append(seconds)
    return {label: statistics.median(values) for label, values in samples.items()}


def table(times: dict[str, dict[str, float]], repeats: int) -> list[str]:
    """The markdown table of per-step times and the ACP-SGD / Power-SGD ratios, and the verdict."""
    lines = [f"per-step compression + decompression, ms (CPU, {torch.get_num_threads()} threads, rank 4, "
             f"median of {repeats})", "", f"| tensors | {' | '.join(CODECS)} | ACP / Power |",
             "|---" * (len(CODECS) + 2) + "|"]
    for group, row in times.items():
        ratio = row["ACP-SGD"] / row["Power-SGD"]
        lines.append(f"| {group} | {' | '.join(f'{row[label] * 1e3:.1f}' for label in CODECS)} | {ratio:.2f} |")
    total = times["total"]["ACP-SGD"] / times["total"]["Power-SGD"]
    lines += ["", f"ACP-SGD / Power-SGD = {total:.2f} (target ≤ {TARGET}): {'met' if total <= TARGET else 'NOT met'}"]
    return lines


def write_report(lines: list[str], load_before: tuple, load_after: tuple) -> None:
    """The table, the load average around the run (other processes inflate and scatter the times)
    and the command, as benchmarks/results/compression_speed.md."""
    load = f"{' / '.join(f'{v:.2f}' for v in load_before)} before, {' / '.join(f'{v:.2f}' for v in load_after)} after"
    command = " ".join([".venv/bin/python", "benchmarks/compression_speed.py", *sys.argv[1:]])
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text("\n".join([
        "# Compression speed on the CPU: ACP-SGD against Power-SGD", "",
        f"Command: `{command}`. Machine: {os.cpu_count()} CPUs, load average (1 / 5 / 15 min) {load}.", "",
        *lines, "", WHERE_THE_TIME_GOES, ""]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="measured pairs of steps (default 3)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    times = {group: median_steps(shapes, args.repeats) for group, shapes in GROUPS.items()}
    times["total"] = {label: sum(times[group][label] for group in GROUPS) for label in CODECS}
    lines = table(times, args.repeats)
    print("\n".join(lines))
    write_report(lines, load_before, os.getloadavg())


if __name__ == "__main__":
    main()
