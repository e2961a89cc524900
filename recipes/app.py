"""`gradsync-train`: Hydra recipes that train a small model on local ranks with a Lightning strategy.

    gradsync-train                                    # acp_sgd, cnn on digits, 2 CPU ranks, offline W&B
    gradsync-train strategy=us_byte model=cnn data=digits trainer.devices=2
    gradsync-train -m strategy=ddp,mg_wfbp,asc_wfbp,us_byte,acp_sgd   # a sweep, summarised at the end

How ranks are launched: every Hydra job launches its own ranks with gradsync.launch.run_local
(fresh spawned processes, process group initialised, destroyed when they exit). Each rank sets
LOCAL_RANK and builds a Trainer with devices = world size: Lightning's LightningEnvironment then
reports the processes as created externally (its launcher starts no children), the strategy
takes global rank = LOCAL_RANK, and Lightning reuses the process group it finds initialised.
Nothing of a job (process group, rank variables, W&B run) survives into the next job of a sweep,
which Lightning's own launcher could not ensure: it re-runs sys.argv, i.e. a whole new sweep.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from ..launch import RankFailed, run_local
from . import schema, wandb_logging


def train(cfg: DictConfig, output_dir: Path, overrides: tuple[str, ...] = (), directions: list | None = None) -> dict:
    """Check `cfg` (with the `directions` of the sweeper optimising its objectives, if any), run the
    job on `cfg.trainer.devices` local ranks, write `result.json` in `output_dir` (with the job's
    command-line `overrides`, which label it in a sweep summary), print the report and return rank
    0's result.

    Args:
        cfg: the composed job config (the structure of gradsync.recipes.schema.Config).
        output_dir: the job's directory (created if missing): result.json, the timeline PNG and the
            logger's files go there.
        overrides: the job's command-line overrides (``"strategy=us_byte"``, ...), stored in the result.
        directions: the directions of the sweeper optimising the job's objectives, which must number
            one per objective of ``cfg.objectives``; None when the sweeper does not optimise.

    Raises:
        ConfigError: for a bad config; RankFailed or TimeoutError when a rank fails or does not
            report within ``cfg.cluster.timeout`` seconds.
    """
    schema.check(cfg, directions)
    job = OmegaConf.to_container(cfg, resolve=True)
    build_strategy(job)  # the strategy checks its own arguments here, before any rank starts
    output_dir.mkdir(parents=True, exist_ok=True)
    results = run_local(run_rank, cfg.trainer.devices, job, str(output_dir), backend=cfg.cluster.backend,
                        threads=cfg.cluster.threads, timeout=cfg.cluster.timeout)
    result = {**results[0], "overrides": list(overrides)}
    (output_dir / "result.json").write_text(json.dumps(result, indent=1))
    print(report(result))
    return result


def run_rank(rank: int, world_size: int, job: dict, output_dir: str) -> dict:
    """One rank of a job (runs in a process of gradsync.launch.run_local): fit, then on rank 0
    write the timeline and finish the W&B run. Returns plain values only.

    Args:
        rank, world_size: this rank and the number of ranks, as run_local passes them.
        job: the resolved job config, as plain dicts and lists (``OmegaConf.to_container``).
        output_dir: the job's directory, as a string.
    """
    import pytorch_lightning as pl
    from pytorch_lightning.utilities import rank_zero_only

    from .lightning_module import Classifier, EpochReport, IterationTimer, ShardedData

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    rank_zero_only.rank = rank  # read from the environment at import, before it was set
    _quiet_lightning()
    trainer_cfg, output = job["trainer"], Path(output_dir)
    pl.seed_everything(trainer_cfg["seed"], verbose=False)
    datamodule = ShardedData(job["data"]["name"], rank, world_size, trainer_cfg["batch_size"], trainer_cfg["seed"],
                             job["data"]["options"])
    module = Classifier(job["model"]["name"], job["model"]["options"], trainer_cfg["lr"], trainer_cfg["momentum"])
    timer, epochs = IterationTimer(_runtime_of), EpochReport()
    logger = wandb_logging.make_logger(job["logger"], output, job["strategy"]["name"], job)  # acts on rank 0 only
    trainer = pl.Trainer(
        accelerator=job["cluster"]["accelerator"], devices=world_size, num_nodes=1, strategy=build_strategy(job),
        max_epochs=trainer_cfg["epochs"], max_steps=trainer_cfg["max_steps"], use_distributed_sampler=False,
        logger=logger, callbacks=[timer, epochs], log_every_n_steps=trainer_cfg["log_every_n_steps"],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=output_dir, **trainer_cfg["options"])
    trainer.fit(module, datamodule=datamodule)
    if epochs.validated_step != trainer.global_step:  # max_steps ended the fit inside an epoch
        trainer.validate(module, datamodule=datamodule, verbose=False)
    result = {"strategy": job["strategy"]["name"], "model": job["model"]["name"], "data": job["data"]["name"],
              "ranks": world_size, "accuracy": epochs.accuracy,
              # what the Trainer holds for each of trainer.options (those it exposes under their name)
              "trainer_options": {name: _plain(getattr(trainer, name, None)) for name in trainer_cfg["options"]},
              "breakdown": timer.breakdown(trainer_cfg["batch_size"] * world_size)}
    if rank == 0:
        result.update(_finish_job(job, output, timer.runtime, logger, result["breakdown"]))
    return result


def _plain(value):
    """`value` if JSON can hold it, else its text."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def build_strategy(job: dict):
    """The Lightning strategy of `job["strategy"]`: Lightning's DDP for ``ddp``, else the registered
    gradsync strategy with the config's scheduler, compressor and options over its own."""
    from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

    strategy, backend = job["strategy"], job["cluster"]["backend"]
    if strategy["name"] == "ddp":
        return DDPStrategy(process_group_backend=backend)
    entry = StrategyRegistry[strategy["name"]]
    chosen = {key: strategy[key] for key in ("scheduler", "compressor") if strategy[key] is not None}
    return entry["strategy"](**{**entry["init_params"], **chosen, **strategy["options"],
                                "process_group_backend": backend})  # schema.check refuses it in options


def _runtime_of(trainer):
    """gradsync's runtime of the fitting strategy (None for Lightning's DDP)."""
    return getattr(trainer.strategy, "runtime", None)


def _finish_job(job: dict, output: Path, runtime, logger, breakdown: dict) -> dict:
    """Rank 0: the plan's summary and timeline PNG, the W&B additions, and the run closed."""
    extra = {"timeline": None, "wandb_run": None, "plans": None}
    rows = timeline_png = None
    if runtime is not None:
        report = runtime.report()
        extra["plans"] = {layout: {key: entry.summary()[key] for key in ("planner", "ops", "channels", "hash")}
                          for layout, entry in report.layouts.items()}
        rows = wandb_logging.plan_rows(report)
        if job["timeline"]:
            timeline_png = _plot(job, output, report)
            extra["timeline"] = str(timeline_png)
    if job["logger"]["kind"] == "wandb":
        wandb_logging.log_job(logger, breakdown, rows, timeline_png)
        extra["wandb_run"] = wandb_logging.run_directory(logger)
        wandb_logging.finish()
    return extra


def _plot(job: dict, output: Path, report) -> Path:
    """The timeline of the first layout a steady step sends (ACP-SGD: the P step)."""
    from ..timeline_plot import plot_timeline

    steady = report.steady
    label = "" if steady.layout == "plain" else f", {steady.layout} layout"
    title = f"{job['model']['name']} on {job['data']['name']}: {job['strategy']['name']} ({steady.plan.planner}{label})"
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
