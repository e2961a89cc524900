"""`gradsync-train`: Hydra recipes that train a small model with a Lightning strategy.

    gradsync-train                                    # acp_sgd, cnn on digits, 2 CPU ranks, offline W&B
    gradsync-train strategy=us_byte model=cnn data=digits trainer.devices=2
    gradsync-train -m strategy=ddp,mg_wfbp,asc_wfbp,us_byte,acp_sgd   # a sweep, summarised at the end

The Trainer, the strategy, the Lightning module and the data module are built from the config
with Hydra's instantiate (each group's ``_target_``), so any of their arguments can be set.

How ranks are launched (``cluster.launcher``):
- ``local`` (the default): every Hydra job launches its own ranks with gradsync.launch.run_local
  (fresh spawned processes, process group initialised, destroyed when they exit). Each rank sets
  LOCAL_RANK and builds a Trainer with devices = world size: Lightning's LightningEnvironment then
  reports the processes as created externally (its launcher starts no children), the strategy
  takes global rank = LOCAL_RANK, and Lightning reuses the process group it finds initialised.
  Nothing of a job (process group, rank variables, W&B run) survives into the next job of a sweep,
  which Lightning's own launcher could not ensure: it re-runs sys.argv, i.e. a whole new sweep.
- ``external``: torchrun, or SLURM (or local tasks) through submitit, started every rank, on one or
  more nodes; each process runs the job as its rank (gradsync.launch.external_rank), and rank 0
  writes the job's files.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from ..launch import RankFailed, external_rank, run_local
from . import schema, wandb_logging


def train(cfg: DictConfig, output_dir: Path, overrides: tuple[str, ...] = (), directions: list | None = None) -> dict:
    """Check `cfg` (with the `directions` of the sweeper optimising its objectives, if any), run the
    job on its ranks, and on rank 0 write `result.json` in `output_dir` (with the job's command-line
    `overrides`, which label it in a sweep summary) and print the report. Returns this process's
    result: rank 0's when the recipe starts the ranks, this rank's when a launcher started them.

    Args:
        cfg: the composed job config (the structure of gradsync.recipes.schema.Config).
        output_dir: the job's directory (created if missing): result.json, the timeline PNG and the
            logger's files go there.
        overrides: the job's command-line overrides (``"strategy=us_byte"``, ...), stored in the result.
        directions: the directions of the sweeper optimising the job's objectives, which must number
            one per objective of ``cfg.objectives``; None when the sweeper does not optimise.

    Raises:
        ConfigError: for a bad config, or ranks a launcher started that do not match it; RankFailed or
            TimeoutError when a rank fails or does not report within ``cfg.cluster.timeout`` seconds.
    """
    schema.check(cfg, directions)
    job = OmegaConf.to_container(cfg, resolve=True)
    build_strategy(job)  # the strategy checks its own arguments here, before any rank starts
    output_dir.mkdir(parents=True, exist_ok=True)
    cluster = cfg.cluster
    if cluster.launcher == "local":
        results = run_local(run_rank, cfg.trainer.devices, job, str(output_dir), backend=cluster.backend,
                            threads=cluster.threads, timeout=cluster.timeout)
        rank, result = 0, results[0]
    else:
        rank, result = _run_external(job, output_dir)
    result = {**result, "overrides": list(overrides)}
    if rank == 0:
        (output_dir / "result.json").write_text(json.dumps(result, indent=1))
        print(report(result))
    return result


def _run_external(job: dict, output_dir: Path) -> tuple[int, dict]:
    """This process as the rank a launcher started: (its rank, its result)."""
    import torch
    import torch.distributed as dist

    place = external_rank()
    trainer, cluster = job["trainer"], job["cluster"]
    expected = trainer["devices"] * trainer["num_nodes"]
    if place.world_size != expected:
        raise ConfigError(f"trainer.devices x trainer.num_nodes: {trainer['devices']} x {trainer['num_nodes']} = "
                          f"{expected} ranks, but the launcher started {place.world_size}")
    torch.set_num_threads(cluster["threads"])
    dist.init_process_group(cluster["backend"], rank=place.rank, world_size=place.world_size,
                            timeout=timedelta(seconds=cluster["timeout"]))
    try:
        return place.rank, run_rank(place.rank, place.world_size, job, str(output_dir), place.local_rank,
                                    place.node_rank)
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, world_size: int, job: dict, output_dir: str, local_rank: int | None = None,
             node_rank: int = 0) -> dict:
    """One rank of a job, inside an initialised process group: fit, then on rank 0 write the
    timeline and finish the W&B run. Returns plain values only.

    Args:
        rank, world_size: this rank and the number of ranks (run_local passes them).
        job: the resolved job config, as plain dicts and lists (``OmegaConf.to_container``).
        output_dir: the job's directory, as a string.
        local_rank, node_rank: this rank's place on its node and its node's (the rank itself and 0
            when the recipe starts the ranks on one node).
    """
    import pytorch_lightning as pl
    from pytorch_lightning.utilities import rank_zero_only

    from .lightning_module import EpochReport, IterationTimer

    os.environ.update(LOCAL_RANK=str(rank if local_rank is None else local_rank), NODE_RANK=str(node_rank))
    rank_zero_only.rank = rank  # read from the environment at import, before it was set
    _quiet_lightning()
    labels, output = schema.job_labels(job), Path(output_dir)
    pl.seed_everything(job["seed"], verbose=False)
    datamodule = schema.instantiate(job["data"], "data", rank=rank, world_size=world_size, seed=job["seed"])
    module = schema.instantiate(job["model"], "model")
    timer, epochs = IterationTimer(_runtime_of), EpochReport()
    logger = wandb_logging.make_logger(job["logger"], output, labels["strategy"], job)  # acts on rank 0 only
    trainer = schema.instantiate(job["trainer"], "trainer", accelerator=job["cluster"]["accelerator"],
                                 strategy=build_strategy(job), logger=logger, callbacks=[timer, epochs],
                                 use_distributed_sampler=False, default_root_dir=output_dir)
    trainer.fit(module, datamodule=datamodule)
    if epochs.validated_step != trainer.global_step:  # max_steps ended the fit inside an epoch
        trainer.validate(module, datamodule=datamodule, verbose=False)
    samples_per_step = job["data"]["batch_size"] * world_size
    result = {**labels, "ranks": world_size, "rank": rank, "accuracy": epochs.accuracy,
              # what the Trainer holds for each of its arguments in the config (those it exposes by name)
              "trainer_arguments": {name: _plain(getattr(trainer, name)) for name in job["trainer"]
                                    if not name.startswith("_") and hasattr(trainer, name)},
              "breakdown": timer.breakdown(samples_per_step)}
    if rank == 0:
        result.update(_finish_job(job, labels, output, timer.runtime, logger, result["breakdown"]))
    return result


def _plain(value):
    """`value` if JSON can hold it, else its text."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def build_strategy(job: dict):
    """The Lightning strategy of `job["strategy"]` (its ``_target_`` with its arguments), on the
    process-group backend of ``job["cluster"]``."""
    return schema.instantiate(job["strategy"], "strategy", process_group_backend=job["cluster"]["backend"])


def _runtime_of(trainer):
    """gradsync's runtime of the fitting strategy (None for Lightning's DDP)."""
    return getattr(trainer.strategy, "runtime", None)


def _finish_job(job: dict, labels: dict, output: Path, runtime, logger, breakdown: dict) -> dict:
    """Rank 0: the plan's summary and timeline PNG, the W&B additions, and the run closed."""
    extra = {"timeline": None, "wandb_run": None, "plans": None}
    rows = timeline_png = None
    if runtime is not None:
        report = runtime.report()
        extra["plans"] = {layout: {key: entry.summary()[key] for key in ("planner", "ops", "channels", "hash")}
                          for layout, entry in report.layouts.items()}
        rows = wandb_logging.plan_rows(report)
        if job["timeline"]:
            timeline_png = _plot(labels, output, report)
            extra["timeline"] = str(timeline_png)
    if job["logger"]["kind"] == "wandb":
        wandb_logging.log_job(logger, breakdown, rows, timeline_png)
        extra["wandb_run"] = wandb_logging.run_directory(logger)
        wandb_logging.finish()
    return extra


def _plot(labels: dict, output: Path, report) -> Path:
    """The timeline of the first layout a steady step sends (ACP-SGD: the P step)."""
    from ..timeline_plot import plot_timeline

    steady = report.steady
    label = "" if steady.layout == "plain" else f", {steady.layout} layout"
    title = f"{labels['model']} on {labels['data']}: {labels['strategy']} ({steady.plan.planner}{label})"
    return plot_timeline(steady.timeline, output / "timeline.png", title)


def _quiet_lightning() -> None:
    """Keep a rank's output to the recipe's report: Lightning's info lines and the warnings it
    gives for these small in-memory data sets (few batches, no loader workers) are noise here."""
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*number of training batches.*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")
    warnings.filterwarnings("ignore", message=".*but have no logger configured.*")  # logger=none


def report(result: dict) -> str:
    """The job's report: accuracy per epoch, the iteration breakdown, and where its files are."""
    b = result["breakdown"]
    lines = [f"{result['strategy']}: {result['model']} on {result['data']}, {result['ranks']} ranks",
             "  test accuracy per epoch: " + ", ".join(f"{a:.2f}%" for a in result["accuracy"]),
             f"  iteration time {b['iteration_ms']:.2f} ms (median of {b['steps']} steps), "
             f"throughput {b['throughput']:.0f} samples/s"]
    if b["measured_ms"] is not None:
        lines += [f"  non-overlapped communication {b['comm_wait_ms']:.2f} ms per iteration",
                  f"  compression (encoding and decoding) {b['codec_ms']:.2f} ms per iteration",
                  f"  compression ratio {b['compression_ratio']:.3f} (bytes sent / gradient bytes)",
                  f"  predicted {b['predicted_ms']:.2f} ms vs measured {b['measured_ms']:.2f} ms per iteration "
                  "(first forward to the end of the step)"]
    else:
        lines.append("  (Lightning's DDP: no gradsync plan, breakdown or timeline)")
    if result["timeline"]:
        lines.append(f"  timeline of the plan: {result['timeline']}")
    if result["wandb_run"]:
        lines.append(f"  W&B run (offline): {result['wandb_run']}  (upload: wandb sync {result['wandb_run']})")
    return "\n".join(lines)


def objective_values(result: dict, names) -> float | list[float]:
    """The job's values of `names` (cfg.objectives), for a sweeper: one number or a list."""
    breakdown = result["breakdown"]
    values = {"final_accuracy": result["accuracy"][-1], "throughput": breakdown["throughput"],
              "iteration_ms": breakdown["iteration_ms"]}
    chosen = [values[name] for name in names]
    return chosen[0] if len(chosen) == 1 else chosen


def sweeper_directions(sweeper: DictConfig) -> list | None:
    """The directions of an optimising sweeper (Optuna's: one per objective); None for others."""
    direction = sweeper.get("direction")
    if direction is None:
        return None
    return list(direction) if OmegaConf.is_list(direction) else [direction]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | list[float]:
    """One Hydra job; returns its objectives (what an Optuna sweeper optimises)."""
    hydra_cfg = HydraConfig.get()
    try:
        result = train(cfg, Path(hydra_cfg.runtime.output_dir), tuple(hydra_cfg.overrides.task),
                       sweeper_directions(hydra_cfg.sweeper))
    except (ConfigError, RankFailed, TimeoutError) as exc:
        print(f"gradsync-train: error: {exc}", file=sys.stderr)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise  # Hydra records the failed job and runs the others
        raise SystemExit(2) from None
    return objective_values(result, cfg.objectives)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
