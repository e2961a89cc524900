"""The recipes' structured configs (types checked by Hydra) and the value checks types cannot express.

`Config` is registered in Hydra's ConfigStore as ``gradsync_schema``; the primary config
(recipes/conf/config.yaml) lists it first in its defaults, so every config group file and every
command-line override is merged into typed fields. `check` then rejects values of the right type
that gradsync or Lightning would refuse later (inside the ranks), naming the key and the choices;
it builds the data set and the model as a rank would, to check that they fit each other.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from .. import compress, planners
from ..errors import ConfigError, unknown_name
from ..runtime.arguments import check_wrap_arguments
from ..strategies.strategy import FOREST, codec_entry, planner_entry
from ..topology.allreduce import check_group_size
from . import data, models

ACCELERATORS = ("cpu", "gpu")
BACKENDS = {"cpu": ("gloo",), "gpu": ("gloo", "nccl")}  # the process-group backends of each accelerator
LOGGERS = ("wandb", "csv", "none")
OBJECTIVES = ("final_accuracy", "throughput", "iteration_ms")  # what a job returns to a sweeper
MODEL_INPUTS = {"cnn": "images", "mlp": "images", "transformer": "tokens"}  # what each model reads
DATA_KINDS = {"digits": "images", "synthetic_images": "images", "synthetic_tokens": "tokens"}
# the options of the data sets and models that count something: integers >= 1
COUNTS = ("samples", "size", "length", "vocab", "classes", "inputs", "hidden", "channels", "width", "layers", "heads")
MODEL_FROM_DATA = {"classes": "classes", "inputs": "features", "vocab": "vocab"}  # model option: data value it reads
RECIPE_SET = ("rank", "world_size", "batch_size", "seed")  # data set arguments the recipe sets, not options
MAX_SEED = 2**32 - 1  # Lightning's seed_everything (numpy's seeds)


@dataclass
class StrategyConfig:
    """A Lightning strategy: ``ddp`` (Lightning's own) or one of gradsync's registered names; the
    fields left None keep the registered strategy's own choice."""

    name: str = MISSING
    scheduler: Optional[str] = None  # a gradsync planner name
    # {"type": name, **codec options}; typed Any (checked in `check`) because OmegaConf cannot merge
    # `strategy.compressor.type=...` or `+strategy.compressor={...}` into an Optional[Dict] that is None
    compressor: Optional[Any] = None
    options: Dict[str, Any] = field(default_factory=dict)  # planner options (partition_bytes, channels, ...)


@dataclass
class ModelConfig:
    name: str = MISSING  # gradsync.recipes.models name
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    name: str = MISSING  # gradsync.recipes.data name
    # what the data set gives (checked; the models' options read them, the synthetic sets' options too)
    classes: int = 10
    features: int = MISSING  # values per sample (pixels or tokens)
    vocab: Optional[int] = None  # token data only
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    epochs: int = 6
    max_steps: int = -1  # -1: no limit beyond epochs
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 32  # per rank
    seed: int = 0
    devices: int = II("cluster.devices")  # ranks on this node
    log_every_n_steps: int = 5
    # any other pl.Trainer argument (precision, accumulate_grad_batches, gradient_clip_val, ...)
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterConfig:
    accelerator: str = "cpu"
    backend: str = "gloo"
    devices: int = 2
    threads: int = 1  # torch threads per rank
    timeout: float = 600.0  # seconds a rank may take before the job is killed


@dataclass
class LoggerConfig:
    kind: str = "none"  # wandb, csv or none
    project: str = "gradsync"
    offline: bool = True  # W&B: write locally, upload later with `wandb sync`
    tags: List[str] = field(default_factory=list)


@dataclass
class Config:
    strategy: StrategyConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    trainer: TrainerConfig = MISSING
    cluster: ClusterConfig = MISSING
    logger: LoggerConfig = MISSING
    timeline: bool = True  # write the simulated timeline of the plan as a PNG
    objectives: List[str] = field(default_factory=lambda: ["final_accuracy"])  # returned to the sweeper


ConfigStore.instance().store(name="gradsync_schema", node=Config)


def codec_config(codec: compress.CodecSpec) -> dict:
    """``strategy.compressor`` for `codec`: its type and every option with its default (each can be
    overridden without Hydra's ``+``)."""
    return {"type": codec.name, **codec.defaults()}


def store_strategy(name: str, codec: compress.CodecSpec | None = None) -> None:
    """The strategy config group's option `name`: a strategy registered with Lightning (a
    compressor's with its codec's config)."""
    compressor = None if codec is None else codec_config(codec)
    ConfigStore.instance().store(group="strategy", name=name, node=StrategyConfig(name=name, compressor=compressor))


def store_codec(codec: compress.CodecSpec) -> None:
    """A compressor that has a strategy: that strategy's option, and the option `codec.name` of the
    group ``strategy/compressor``, a compressor for any strategy (``strategy=us_byte
    +strategy/compressor=acp_sgd``)."""
    entry = codec_entry(codec)
    if entry is None:
        return
    store_strategy(entry[0], codec)
    ConfigStore.instance().store(group="strategy/compressor", name=codec.name, node=codec_config(codec),
                                 package="strategy.compressor")


# the strategy group (Lightning's own ddp, then every gradsync strategy) and the compressor group,
# now and as planners and compressors are registered
ConfigStore.instance().store(group="strategy", name="ddp", node=StrategyConfig(name="ddp"))
store_strategy(FOREST[0])
planners.registry.subscribe(lambda spec: store_strategy(planner_entry(spec)[0]))
compress.registry.subscribe(store_codec)


def strategy_names() -> list[str]:
    """``ddp`` and every strategy gradsync registers with Lightning (registered when gradsync
    is imported)."""
    from pytorch_lightning.strategies import StrategyRegistry

    from ..strategies import GradSyncStrategy

    return ["ddp", *(name for name, entry in StrategyRegistry.items() if issubclass(entry["strategy"], GradSyncStrategy))]


def _choice(key: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{key}: {unknown_name(key.rsplit('.', 1)[-1], value, valid)}")


def _at_least(key: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"{key} must be >= {low}, got {value!r}")


def check(cfg: DictConfig, directions: Optional[List[str]] = None) -> None:
    """Raise ConfigError (naming the key and the valid choices) for any value the job would refuse;
    `directions`: those of the sweeper optimising the job's objectives (one per objective), if any.
    Builds the data set (rank 0's shard) and the model here, as a rank would."""
    _check_known_keys(cfg, Config)
    _check_strategy(cfg.strategy, cfg.trainer.devices)
    _choice("model.name", cfg.model.name, models.MODELS)
    _choice("data.name", cfg.data.name, data.DATASETS)
    reads, gives = MODEL_INPUTS[cfg.model.name], DATA_KINDS[cfg.data.name]
    if reads != gives:
        fitting = sorted(name for name, kind in DATA_KINDS.items() if kind == reads)
        raise ConfigError(f"data: model {cfg.model.name!r} reads {reads} but data {cfg.data.name!r} gives {gives}; "
                          f"valid data for it: {', '.join(fitting)}")
    _check_trainer(cfg.trainer)
    _check_cluster(cfg.cluster, cfg.trainer.devices)
    _choice("logger.kind", cfg.logger.kind, LOGGERS)
    _check_objectives(list(cfg.objectives), directions)
    _check_model(cfg.model, cfg.data.name, _check_data(cfg))


def _check_known_keys(cfg: DictConfig, schema: type, path: str = "") -> None:
    """A key that no field of `schema` (a dataclass of this module) declares would be read by
    nothing: Hydra's `+` adds any key, so `+trainer.num_nodes=2` would run a one-node job. The
    free-form mappings (`options`, `strategy.compressor`) are checked by what reads them."""
    fields = typing.get_type_hints(schema)
    for key in cfg.keys():
        if not path and key == "hydra":  # Hydra's own settings, where the config carries them
            continue
        if key not in fields:
            where = f" of {path.rstrip('.')}" if path else ""
            raise ConfigError(f"{path}{key}: gradsync-train reads no such key; the keys{where} are "
                              f"{', '.join(sorted(fields))}")
        if dataclasses.is_dataclass(fields[key]) and cfg[key] is not None:
            _check_known_keys(cfg[key], fields[key], f"{path}{key}.")


def _check_strategy(strategy: DictConfig, ranks: int) -> None:
    from pytorch_lightning.strategies import StrategyRegistry

    _choice("strategy.name", strategy.name, strategy_names())
    if strategy.name == "ddp":
        chosen = [key for key in ("scheduler", "compressor") if strategy[key] is not None]
        if chosen or strategy.options:
            raise ConfigError(f"strategy.{(chosen or ['options'])[0]}: Lightning's 'ddp' takes no gradsync "
                              "scheduler, compressor or options; choose a gradsync strategy for those")
        return
    if strategy.scheduler is not None:
        _choice("strategy.scheduler", strategy.scheduler, planners.names())
    if strategy.compressor is not None:
        _check_compressor(strategy.compressor)
    if "process_group_backend" in strategy.options:  # the recipe sets it from cluster.backend
        raise ConfigError("strategy.options.process_group_backend: the ranks' backend is chosen by cluster.backend "
                          f"(valid: {', '.join(BACKENDS['gpu'])}); set cluster.backend instead")
    merged = {**StrategyRegistry[strategy.name]["init_params"], **strategy.options}
    if merged.get("transport") == "forest":
        if ranks < 2:
            raise ConfigError(f"trainer.devices: strategy {strategy.name!r} packs reduce/broadcast trees (transport "
                              f"'forest'), which needs 2 or more ranks, got {ranks}")
        topology = check_wrap_arguments(transport="forest", topology=merged.get("topology")).topology
        if topology is not None:
            try:
                check_group_size(topology, ranks)
            except ConfigError as exc:
                raise ConfigError(f"trainer.devices: {exc}") from exc


def _check_compressor(compressor) -> None:
    """``strategy.compressor``: a mapping ``{type: name, **codec options}`` that builds its codec."""
    if not OmegaConf.is_dict(compressor):
        raise ConfigError(f"strategy.compressor must be a mapping {{type: name, ...codec options}}, got "
                          f"{compressor!r}; valid types: {', '.join(compress.names())}")
    codec = OmegaConf.to_container(compressor)
    if "type" not in codec:
        raise ConfigError(f"strategy.compressor needs a 'type' key; valid: {', '.join(compress.names())}")
    name = codec.pop("type")
    _choice("strategy.compressor.type", name, compress.names())
    bad = [key for key in codec if not isinstance(key, str)]
    if bad:
        raise ConfigError(f"strategy.compressor: option names must be strings, got {bad[0]!r}")
    try:
        compress.get(name, **codec)
    except ConfigError as exc:
        raise ConfigError(f"strategy.compressor: {exc}") from exc


def _check_trainer(trainer: DictConfig) -> None:
    if trainer.max_steps != -1:
        _at_least("trainer.max_steps", trainer.max_steps, 1)
    _at_least("trainer.epochs", trainer.epochs, 1)
    _at_least("trainer.batch_size", trainer.batch_size, 1)
    _at_least("trainer.devices", trainer.devices, 1)
    _at_least("trainer.log_every_n_steps", trainer.log_every_n_steps, 1)
    if not 0 < trainer.lr < math.inf:
        raise ConfigError(f"trainer.lr must be a finite number > 0, got {trainer.lr!r}")
    if not 0 <= trainer.seed <= MAX_SEED:
        raise ConfigError(f"trainer.seed must be in 0..{MAX_SEED}, got {trainer.seed!r}")
    if not 0 <= trainer.momentum < 1:
        raise ConfigError(f"trainer.momentum must be in [0, 1), got {trainer.momentum!r}")
    _check_trainer_options(dict(trainer.options))


# pl.Trainer arguments the recipe sets itself (from its own keys, or fixed by how it runs a job)
RECIPE_TRAINER_ARGUMENTS = ("accelerator", "devices", "num_nodes", "strategy", "max_epochs", "max_steps",
                            "use_distributed_sampler", "logger", "callbacks", "log_every_n_steps", "default_root_dir",
                            "enable_checkpointing", "enable_progress_bar", "enable_model_summary",
                            "num_sanity_val_steps")


def _check_trainer_options(options: dict) -> None:
    """`trainer.options` holds pl.Trainer arguments the recipe does not set itself."""
    import pytorch_lightning as pl

    accepted = set(inspect.signature(pl.Trainer).parameters) - set(RECIPE_TRAINER_ARGUMENTS)
    for name in options:
        if name == "num_nodes":
            raise ConfigError("trainer.options.num_nodes: gradsync-train starts every rank of a job on this node "
                              "(trainer.devices ranks); it has no launcher for several nodes yet")
        if name in RECIPE_TRAINER_ARGUMENTS:
            raise ConfigError(f"trainer.options.{name}: the recipe sets this Trainer argument itself; use its own "
                              "keys (trainer.epochs, trainer.max_steps, trainer.devices, cluster.*, logger.*)")
        if name not in accepted:
            raise unknown_name("Trainer argument in trainer.options", name, accepted)


def _check_cluster(cluster: DictConfig, ranks: int) -> None:
    _choice("cluster.accelerator", cluster.accelerator, ACCELERATORS)
    _choice("cluster.backend", cluster.backend, BACKENDS[cluster.accelerator])
    _at_least("cluster.threads", cluster.threads, 1)
    if not 0 < cluster.timeout < math.inf:
        raise ConfigError(f"cluster.timeout must be a finite number of seconds > 0, got {cluster.timeout!r}")
    if cluster.accelerator == "gpu":
        import torch

        available = torch.cuda.device_count()
        if available < ranks:
            raise ConfigError(f"trainer.devices: {ranks} GPU rank(s) asked for, {available} visible; "
                              f"valid: 1..{available}" if available else
                              "cluster.accelerator: 'gpu' but no CUDA device is visible; valid here: cpu")


def _check_data(cfg: DictConfig) -> data.Split:
    """Rank 0's shard of the data set, built as the ranks will build theirs: its options checked,
    what it gives against cfg.data, a rank's share against the batch size."""
    name = cfg.data.name
    _at_least("data.classes", cfg.data.classes, 1)
    options = _options("data.options", name, data.DATASETS[name],
                       OmegaConf.to_container(cfg.data.options, resolve=True))
    try:
        split = data.load(name, rank=0, world_size=cfg.trainer.devices, batch_size=cfg.trainer.batch_size,
                          seed=cfg.trainer.seed, **options)
    except ConfigError as exc:
        raise ConfigError(f"data.options: {exc}") from exc
    for key in ("classes", "features", "vocab"):
        value = getattr(split, key)
        if cfg.data[key] != value:
            raise ConfigError(f"data.{key}: data {name!r} has {key} {value}, got {cfg.data[key]!r}")
    if not len(split.train):
        raise ConfigError(f"trainer.batch_size: {cfg.trainer.batch_size} is more than the {len(split.train.dataset)} "
                          f"training samples each of the {cfg.trainer.devices} ranks gets from data {name!r}")
    return split


def _check_model(model: DictConfig, data_name: str, split: data.Split) -> None:
    """The model's options checked, those that describe the data against what `split` gives; the
    model built and run on one test sample."""
    options = _options("model.options", model.name, models.MODELS[model.name],
                       OmegaConf.to_container(model.options, resolve=True))
    arguments = {**_defaults(models.MODELS[model.name]), **options}
    for option, key in MODEL_FROM_DATA.items():
        if option in arguments and arguments[option] != getattr(split, key):
            raise ConfigError(f"model.options.{option}: data {data_name!r} has {key} {getattr(split, key)}, "
                              f"got {arguments[option]!r}")
    try:
        network = models.build(model.name, **options)
    except ConfigError as exc:
        raise ConfigError(f"model.options: {exc}") from exc
    sample = split.test.dataset.tensors[0][:1]
    try:
        network(sample)
    except RuntimeError as exc:  # a shape the explicit checks above do not cover (e.g. image channels)
        raise ConfigError(f"model.options: model {model.name!r} cannot read a sample of data {data_name!r} "
                          f"(shape {list(sample.shape[1:])}): {exc}") from exc


def _defaults(function) -> dict:
    """`function`'s parameters and their defaults, less those the recipe sets."""
    return {name: parameter.default for name, parameter in inspect.signature(function).parameters.items()
            if name not in RECIPE_SET}


def _options(key: str, name: str, function, options: dict) -> dict:
    """`options` (the value of `key`) of data set or model `name`, checked: the names of `function`'s
    parameters, counts integers >= 1."""
    valid = _defaults(function)
    for option, value in options.items():
        if option not in valid:
            raise ConfigError(f"{key}: {unknown_name(f'{name} option', option, valid)}")
        if option in COUNTS and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}.{option} must be an integer >= 1, got {value!r}")
    return options


def _check_objectives(objectives: list, directions: Optional[list]) -> None:
    if not objectives:
        raise ConfigError(f"objectives: give one or more; valid: {', '.join(OBJECTIVES)}")
    for objective in objectives:
        _choice("objectives", objective, OBJECTIVES)
    if directions is not None and len(directions) != len(objectives):
        raise ConfigError(f"objectives: {len(objectives)} given ({', '.join(objectives)}) but the sweeper optimises "
                          f"{len(directions)} ({', '.join(map(str, directions))}): give one objective per direction")
