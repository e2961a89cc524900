"""Loggers for the recipes, and what a job adds to its Weights & Biases run at the end.

W&B runs offline by default: the run is written under the job's directory and uploaded later with
``wandb sync <job dir>/wandb/offline-run-*``. Lightning's WandbLogger logs the config and the
per-step metrics (the loss, and gradsync's per-iteration time, non-overlapped communication,
compression time, bytes sent and compression ratio); `log_job` adds the iteration breakdown to the run's summary,
every plan as a ``wandb.Table`` and the timeline image, and `finish` closes the run, which
WandbLogger never does (each job must end its own run).
"""
from __future__ import annotations

from pathlib import Path

PLAN_COLUMNS = ["layout", "op", "channel", "phase", "bytes", "tensors", "first_tensor", "last_tensor",
                "predicted_start_ms", "predicted_end_ms"]


def make_logger(logger_cfg: dict, output_dir: Path, run_name: str, config: dict):
    """The Lightning logger of `logger_cfg["kind"]` writing under `output_dir` (False for none).

    Args:
        logger_cfg: the job's logger section: ``kind`` (``"wandb"``, ``"csv"`` or ``"none"``) and,
            for W&B, ``project``, ``offline`` and ``tags``.
        output_dir: the job's directory: the W&B run is written under it, the CSV logs under ``csv/``.
        run_name: the W&B run's name (the recipes give the strategy name); W&B only.
        config: logged as the W&B run's hyperparameters (the recipes give the whole job config); W&B only.
    """
    kind = logger_cfg["kind"]
    if kind == "wandb":
        import wandb
        from pytorch_lightning.loggers import WandbLogger

        # silent: the job's report prints where the run is and how to sync it
        logger = WandbLogger(project=logger_cfg["project"], name=run_name, save_dir=str(output_dir),
                             offline=logger_cfg["offline"], tags=list(logger_cfg["tags"]),
                             settings=wandb.Settings(silent=True))
        logger.log_hyperparams(config)
        return logger
    if kind == "csv":
        from pytorch_lightning.loggers import CSVLogger

        return CSVLogger(save_dir=str(output_dir), name="csv")
    return False


def plan_rows(report) -> list[list]:
    """One row per op of every layout's plan (a SyncReport's), with the simulator's predicted start
    and end."""
    rows = []
    for layout, entry in report.layouts.items():
        spans = {span.op: span for span in entry.timeline.ops}
        for index, op in enumerate(entry.plan.ops):
            tensors = op.tensors()
            span = spans[index]
            rows.append([layout, index, op.channel, op.phase, entry.plan.op_bytes(op, entry.wire), len(tensors),
                         tensors[0], tensors[-1], span.start * 1e3, span.end * 1e3])
    return rows


def log_job(logger, breakdown: dict, rows: list[list] | None, timeline_png: Path | None) -> None:
    """Add the breakdown (summary), the plan table and the timeline image to the W&B run.

    Args:
        logger: the WandbLogger of `make_logger`.
        breakdown: IterationTimer.breakdown's values; each one not None goes into the run's summary
            as ``breakdown/<key>``.
        rows: the plan table's rows (`plan_rows`), or None (no gradsync plan: Lightning's DDP).
        timeline_png: the timeline image to log, or None.
    """
    import wandb

    run = logger.experiment
    run.summary.update({f"breakdown/{key}": value for key, value in breakdown.items() if value is not None})
    media = {}
    if rows:
        media["plan"] = wandb.Table(columns=PLAN_COLUMNS, data=rows)
    if timeline_png is not None:
        media["timeline"] = wandb.Image(str(timeline_png))
    if media:
        run.log(media)


def run_directory(logger) -> str:
    """The local directory of the W&B run (what `wandb sync` takes)."""
    return str(Path(logger.experiment.dir).parent)


def finish() -> None:
    import wandb

    wandb.finish()
