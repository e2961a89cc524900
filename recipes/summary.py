"""Sweep summary: one row per job of a `gradsync-train -m` sweep, as CSV, a markdown table and a PNG.

Each job writes ``result.json`` in its own directory; the Hydra callback `SweepSummary` rewrites
``summary.csv``, ``summary.md`` and ``summary.png`` (bar charts of iteration time, throughput and
final accuracy per job) in the sweep directory after every job, so a job that fails later (Hydra
then stops before on_multirun_end) leaves the summary of those that finished.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

COLUMNS = ["job", "label", "strategy", "model", "data", "ranks", "iteration_ms", "throughput", "final_accuracy",
           "comm_wait_ms", "codec_ms", "predicted_ms", "measured_ms", "compression_ratio"]


class SweepSummary(Callback):
    """Keeps the summary of a multirun's sweep directory up to date, and prints it at the end.
    The jobs may run in other processes (a submitit launcher): the sweep directory is read from
    the config each time."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or os.environ.get("RANK", "0") != "0":
            return  # a launcher's rank other than 0 (each runs the job) leaves the files to rank 0
        sweep_dir = Path(config.hydra.runtime.output_dir).parent  # the job's directory is one level down
        rows = collect(sweep_dir)
        if rows:
            write_summary(rows, sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect(sweep_dir)
        if rows:
            print(markdown(rows))
            print(f"sweep summary: {sweep_dir}/summary.csv, summary.md, summary.png")


def collect(sweep_dir: Path) -> list[dict]:
    """One row per job directory of `sweep_dir` holding a result.json, in job order, labelled by
    the overrides that differ between the jobs (the strategy name when none do)."""
    paths = sorted(sweep_dir.glob("*/result.json"), key=lambda p: _job_order(p.parent.name))
    results = [json.loads(path.read_text()) for path in paths]
    shared = set.intersection(*(set(r["overrides"]) for r in results)) if results else set()
    rows = []
    for path, result in zip(paths, results):
        breakdown = result["breakdown"]
        label = ",".join(o for o in result["overrides"] if o not in shared) or result["strategy"]
        rows.append({"job": path.parent.name, "label": label, "strategy": result["strategy"],
                     "model": result["model"], "data": result["data"], "ranks": result["ranks"],
                     "final_accuracy": result["accuracy"][-1] if result["accuracy"] else None,
                     **{key: breakdown[key] for key in COLUMNS if key in breakdown}})
    return rows


def _job_order(name: str):
    return (0, int(name)) if name.isdigit() else (1, name)


def write_summary(rows: list[dict], directory: Path) -> list[Path]:
    """summary.csv, summary.md and summary.png in `directory`."""
    table = directory / "summary.csv"
    with table.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({key: _blank(row.get(key)) for key in COLUMNS} for row in rows)
    text = directory / "summary.md"
    text.write_text(markdown(rows) + "\n")
    return [table, text, chart(rows, directory / "summary.png")]


def _blank(value):
    return "" if value is None else value


def markdown(rows: list[dict]) -> str:
    header = ["job", "setting", "iteration (ms)", "throughput (samples/s)", "final accuracy (%)",
              "non-overlapped comm (ms)", "compression (ms)", "predicted / measured (ms)", "compression ratio"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        predicted = (f"{row['predicted_ms']:.2f} / {row['measured_ms']:.2f}"
                     if row.get("predicted_ms") is not None else "n/a")
        cells = [row["job"], row["label"], f"{row['iteration_ms']:.2f}", f"{row['throughput']:.0f}",
                 _number(row["final_accuracy"], ".2f"), _number(row.get("comm_wait_ms"), ".2f"),
                 _number(row.get("codec_ms"), ".2f"), predicted,
                 _number(row.get("compression_ratio"), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _number(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def chart(rows: list[dict], path: Path) -> Path:
    """Three bar charts side by side: iteration time, throughput, final accuracy per job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row["label"] for row in rows]
    panels = [("iteration_ms", "iteration time (ms)", ".2f"), ("throughput", "throughput (samples/s)", ",.0f"),
              ("final_accuracy", "final test accuracy (%)", ".1f")]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 1.5 + 0.45 * len(rows)))
    for axis, (key, title, spec) in zip(axes, panels):
        values = [row[key] or 0.0 for row in rows]
        axis.barh(range(len(rows)), values, color="#4C72B0")
        axis.set_yticks(range(len(rows)))
        axis.set_yticklabels(labels if axis is axes[0] else [""] * len(rows))
        axis.invert_yaxis()
        axis.set_title(title)
        for position, value in enumerate(values):
            axis.text(value, position, " " + format(value, spec), va="center", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
