"""The recipes' structured configs (types checked by Hydra) and the value checks types cannot express.

`Config` is registered in Hydra's ConfigStore as ``gradsync_schema``; the primary config
(recipes/conf/config.yaml) lists it first in its defaults, so every config group file and every
command-line override is merged into typed fields. The Trainer, strategy, model and data nodes name
a ``_target_`` that `instantiate` calls with their keys. `check` then rejects keys no target takes
and values of the right type that gradsync or Lightning would refuse later (inside the ranks),
naming the key and the choices; it builds the data module and the network as a rank would, to check
that they fit each other.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from .. import compress, planners
from ..errors import ConfigError, unknown_name
from ..runtime.arguments import check_wrap_arguments
from ..strategies.strategy import FOREST, codec_entry, planner_entry, strategy_entries
from ..topology.allreduce import check_group_size
from . import data, models

ACCELERATORS = ("cpu", "gpu")
BACKENDS = {"cpu": ("gloo",), "gpu": ("gloo", "nccl")}  # the process-group backends of each accelerator
LOGGERS = ("wandb", "csv", "none")
LAUNCHERS = ("local", "external")  # who starts the ranks: the recipe, or torchrun / submitit
OBJECTIVES = ("final_accuracy", "throughput", "iteration_ms")  # what a job returns to a sweeper
MODEL_INPUTS = {"cnn": "images", "mlp": "images", "transformer": "tokens"}  # what each model reads
DATA_KINDS = {"digits": "images", "synthetic_images": "images", "synthetic_tokens": "tokens"}
# the options of the data sets and models that count something: integers >= 1
COUNTS = ("samples", "size", "length", "vocab", "classes", "inputs", "hidden", "channels", "width", "layers", "heads")
MODEL_FROM_DATA = {"classes": "classes", "inputs": "features", "vocab": "vocab"}  # model option: data value it reads
MAX_SEED = 2**32 - 1  # Lightning's seed_everything (numpy's seeds)


@dataclass
class ModelConfig:
    """The Lightning module (built with Hydra's instantiate): its arguments, `network` a node of
    its own that builds the module it trains."""

    _target_: str = "gradsync.recipes.lightning_module.Classifier"
    network: Any = MISSING  # {_target_: a model of gradsync.recipes.models, **its arguments}
    lr: float = 0.05
    momentum: float = 0.9


@dataclass
class DataConfig:
    """The Lightning data module (built with Hydra's instantiate); the recipe adds the rank's place
    and the seed. `classes`, `features` and `vocab` say what the data set gives (checked); the
    model's arguments read them."""

    _target_: str = "gradsync.recipes.lightning_module.ShardedData"
    dataset: Any = MISSING  # {_target_: a loader of gradsync.recipes.data, _partial_: true, **its options}
    batch_size: int = 32  # per rank
    classes: int = 10
    features: int = MISSING  # values per sample (pixels or tokens)
    vocab: Optional[int] = None  # token data only


@dataclass
class TrainerConfig:
    """Lightning's Trainer (built with Hydra's instantiate): any other of its arguments can be added
    (``+trainer.precision=bf16-mixed``); the recipe passes the strategy, logger, callbacks and
    accelerator itself."""

    _target_: str = "pytorch_lightning.Trainer"
    devices: int = II("cluster.devices")  # ranks per node
    num_nodes: int = 1
    max_epochs: int = 6
    max_steps: int = -1  # -1: no limit beyond max_epochs
    log_every_n_steps: int = 5
    enable_checkpointing: bool = False
    enable_progress_bar: bool = False
    enable_model_summary: bool = False
    num_sanity_val_steps: int = 0


@dataclass
class ClusterConfig:
    accelerator: str = "cpu"
    backend: str = "gloo"
    devices: int = 2
    threads: int = 1  # torch threads per rank
    timeout: float = 600.0  # seconds a rank may take before the job is killed
    # local: the recipe starts trainer.devices ranks on this node; external: a launcher (torchrun,
    # submitit) started this process as one rank of trainer.devices x trainer.num_nodes
    launcher: str = "local"


@dataclass
class LoggerConfig:
    kind: str = "none"  # wandb, csv or none
    project: str = "gradsync"
    offline: bool = True  # W&B: write locally, upload later with `wandb sync`
    tags: List[str] = field(default_factory=list)


@dataclass
class Config:
    strategy: Any = MISSING  # {_target_: a Lightning strategy class, **its arguments}
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    trainer: TrainerConfig = MISSING
    cluster: ClusterConfig = MISSING
    logger: LoggerConfig = MISSING
    seed: int = 0  # the weights' initialisation, each rank's shuffling
    timeline: bool = True  # write the simulated timeline of the plan as a PNG
    objectives: List[str] = field(default_factory=lambda: ["final_accuracy"])  # returned to the sweeper


ConfigStore.instance().store(name="gradsync_schema", node=Config)


GRADSYNC_STRATEGY = "gradsync.strategies.GradSyncStrategy"
LIGHTNING_DDP = "pytorch_lightning.strategies.DDPStrategy"


def codec_config(codec: compress.CodecSpec) -> dict:
    """``strategy.compressor`` for `codec`: its type and every option with its default (each can be
    overridden without Hydra's ``+``)."""
    return {"type": codec.name, **codec.defaults()}


def store_strategy(name: str, init_params: dict, codec: compress.CodecSpec | None = None) -> None:
    """Store the strategy config group's option `name`: GradSyncStrategy with the arguments of the
    Lightning strategy name it stands for.

    Args:
        name: the option's name, the Lightning strategy name.
        init_params: that name's registered arguments (scheduler, compressor name, transport).
        codec: the compressor's spec, for a compressor's strategy: its config (type and every
            option's default) replaces the compressor's name.
    """
    compressor = None if codec is None else codec_config(codec)
    node = {"_target_": GRADSYNC_STRATEGY, **init_params, "compressor": compressor, "options": {}}
    ConfigStore.instance().store(group="strategy", name=name, node=node)


def store_codec(codec: compress.CodecSpec) -> None:
    """A compressor that has a strategy: that strategy's option, and the option `codec.name` of the
    group ``strategy/compressor``, a compressor for any strategy (``strategy=us_byte
    +strategy/compressor=acp_sgd``)."""
    entry = codec_entry(codec)
    if entry is None:
        return
    store_strategy(entry[0], entry[1], codec)
    ConfigStore.instance().store(group="strategy/compressor", name=codec.name, node=codec_config(codec),
                                 package="strategy.compressor")


# the strategy group (Lightning's own ddp, then every gradsync strategy) and the compressor group,
# now and as planners and compressors are registered
ConfigStore.instance().store(group="strategy", name="ddp", node={"_target_": LIGHTNING_DDP})
store_strategy(FOREST[0], FOREST[1])
planners.registry.subscribe(lambda spec: store_strategy(*planner_entry(spec)[:2]))
compress.registry.subscribe(store_codec)


def job_labels(cfg) -> dict:
    """The names a report gives the job's strategy, model and data: the Lightning strategy name
    of its scheduler, compressor and transport (``scheduler+compressor`` where none is registered);
    the model and data set names of gradsync.recipes (else their targets' names)."""
    return {"strategy": _strategy_label(cfg["strategy"]), "model": _name_of(cfg["model"]["network"], models.MODELS),
            "data": _name_of(cfg["data"]["dataset"], data.DATASETS)}


def _strategy_label(strategy) -> str:
    if strategy["_target_"] != GRADSYNC_STRATEGY:
        return "ddp" if strategy["_target_"] == LIGHTNING_DDP else strategy["_target_"].rsplit(".", 1)[-1]
    compressor = strategy.get("compressor")
    chosen = (strategy.get("scheduler") or "auto", compressor["type"] if compressor else None,
              strategy.get("transport") or (strategy.get("options") or {}).get("transport"))
    for name, (init_params, _) in strategy_entries().items():
        if (init_params.get("scheduler", "auto"), init_params.get("compressor"), init_params.get("transport")) == chosen:
            return name
    return "+".join(part for part in chosen if part)


def _name_of(node, named: dict) -> str:
    """The name under which `named` holds `node`'s target, else the target's last part."""
    target = node["_target_"]
    found = [name for name, function in named.items() if f"{function.__module__}.{function.__qualname__}" == target]
    return found[0] if found else target.rsplit(".", 1)[-1]


def instantiate(node, path: str, **arguments):
    """Hydra's instantiate of `node` (with `arguments` added, containers passed as dicts and lists);
    an error of the call raised as ConfigError naming `path`, the node's key."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(node, _convert_="all", **arguments)
    except InstantiationException as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, ConfigError) else exc
        if str(cause).startswith(f"{path}."):  # it names the key at fault already
            raise ConfigError(str(cause)) from exc
        raise ConfigError(f"{path}: {cause}") from exc


def _choice(key: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{key}: {unknown_name(key.rsplit('.', 1)[-1], value, valid)}")


def _at_least(key: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"{key} must be >= {low}, got {value!r}")


def check(cfg: DictConfig, directions: Optional[List[str]] = None) -> None:
    """Raise ConfigError (naming the key and the valid choices) for any value the job would refuse;
    `directions`: those of the sweeper optimising the job's objectives (one per objective), if any.
    Builds the data module (rank 0's shard) and the network here, as a rank would."""
    _check_known_keys(cfg, Config)
    _check_trainer(cfg.trainer, cfg.cluster)
    _check_strategy(cfg.strategy, cfg.trainer.devices * cfg.trainer.num_nodes)
    _check_cluster(cfg.cluster, cfg.trainer.devices)
    _choice("logger.kind", cfg.logger.kind, LOGGERS)
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"seed must be in 0..{MAX_SEED}, got {cfg.seed!r}")
    _check_objectives(list(cfg.objectives), directions)
    labels = job_labels(cfg)
    reads, gives = MODEL_INPUTS.get(labels["model"]), DATA_KINDS.get(labels["data"])
    if reads and gives and reads != gives:
        fitting = sorted(name for name, kind in DATA_KINDS.items() if kind == reads)
        raise ConfigError(f"data: model {labels['model']!r} reads {reads} but data {labels['data']!r} gives {gives}; "
                          f"valid data for it: {', '.join(fitting)}")
    _check_model(cfg.model, labels["data"], _check_data(cfg))


# the arguments the recipe gives a node's target itself: what to set instead
RECIPE_ARGUMENTS = {
    "trainer": {"accelerator": "set cluster.accelerator", "strategy": "choose strategy=<name>",
                "logger": "choose logger=<kind>", "callbacks": "the recipe's callbacks time and report the job",
                "use_distributed_sampler": "each rank loads its own shard of the data",
                "default_root_dir": "the job's directory is hydra.run.dir (hydra.sweep.dir in a sweep)"},
    "data": {"rank": "each rank gives its own", "world_size": "trainer.devices x trainer.num_nodes ranks",
             "seed": "set the top-level seed"},
    "data.dataset": {"rank": "each rank gives its own", "world_size": "trainer.devices x trainer.num_nodes ranks",
                     "batch_size": "set data.batch_size", "seed": "set the top-level seed"},
    "strategy": {"process_group_backend": f"set cluster.backend (valid: {', '.join(BACKENDS['gpu'])})"},
}


def _check_known_keys(cfg: DictConfig, schema: type, path: str = "") -> None:
    """A key that nothing reads is refused: Hydra's `+` adds any key, so `+trainer.nodes=2` would
    be ignored. A node with a ``_target_`` takes its target's arguments; the free-form mappings
    (``strategy.options``, ``strategy.compressor``) are checked by what reads them."""
    fields = typing.get_type_hints(schema)
    for key in cfg.keys():
        if not path and key == "hydra":  # Hydra's own settings, where the config carries them
            continue
        if key not in fields:
            where = f" of {path.rstrip('.')}" if path else ""
            raise ConfigError(f"{path}{key}: gradsync-train reads no such key; the keys{where} are "
                              f"{', '.join(sorted(fields))}")
        if OmegaConf.is_dict(cfg[key]) and "_target_" in cfg[key]:
            _check_arguments(cfg[key], f"{path}{key}")
        elif dataclasses.is_dataclass(fields[key]) and cfg[key] is not None:
            _check_known_keys(cfg[key], fields[key], f"{path}{key}.")


def _check_arguments(node: DictConfig, path: str) -> None:
    """The keys of `node` are arguments its ``_target_`` takes (a target taking any keyword takes
    any) and none the recipe gives it; nested nodes with a ``_target_`` likewise."""
    target = _target(node, path)
    parameters = inspect.signature(target).parameters
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    given_by_recipe = RECIPE_ARGUMENTS.get(path, {})
    for key in node.keys():
        if key.startswith("_") and key.endswith("_"):  # Hydra's own: _target_, _partial_, ...
            continue
        if key in given_by_recipe:
            raise ConfigError(f"{path}.{key}: gradsync-train gives {node._target_} this argument itself; "
                              f"{given_by_recipe[key]}")
        if not takes_any and key not in parameters:
            raise ConfigError(f"{path}.{key}: {unknown_name(f'argument of {node._target_}', key, parameters)}")
        if OmegaConf.is_dict(node[key]) and "_target_" in node[key]:
            _check_arguments(node[key], f"{path}.{key}")


def _target(node: DictConfig, path: str):
    """The callable `node._target_` names."""
    from hydra.utils import get_object

    try:
        target = get_object(node._target_)
    except Exception as exc:  # noqa: BLE001 - Hydra raises ImportError or its own for a path it cannot find
        raise ConfigError(f"{path}._target_: cannot import {node._target_!r}: {exc}") from None
    if not callable(target):
        raise ConfigError(f"{path}._target_: {node._target_!r} is not a class or function")
    return target


def _check_strategy(strategy: DictConfig, ranks: int) -> None:
    """Lightning's DDP takes no gradsync arguments; gradsync's strategies get their scheduler and
    compressor checked by name, and the forest transport its number of ranks. The strategy checks
    the rest itself when built."""
    if strategy._target_ == LIGHTNING_DDP:
        chosen = [key for key in ("scheduler", "compressor", "options") if strategy.get(key)]
        if chosen:
            raise ConfigError(f"strategy.{chosen[0]}: Lightning's 'ddp' takes no gradsync scheduler, compressor or "
                              "options; choose a gradsync strategy for those")
        return
    if strategy.get("scheduler") is not None:
        _choice("strategy.scheduler", strategy.scheduler, planners.names())
    if strategy.get("compressor") is not None:
        _check_compressor(strategy.compressor)
    options = {**strategy.get("options", {}), **{key: value for key, value in strategy.items()
                                                  if key not in ("scheduler", "compressor", "options")
                                                  and not key.startswith("_")}}
    if "process_group_backend" in options:  # the recipe sets it from cluster.backend
        raise ConfigError("strategy.options.process_group_backend: the ranks' backend is chosen by cluster.backend "
                          f"(valid: {', '.join(BACKENDS['gpu'])}); set cluster.backend instead")
    if options.get("transport") == "forest":
        if ranks < 2:
            raise ConfigError(f"trainer.devices: the strategy packs reduce/broadcast trees (transport 'forest'), "
                              f"which needs 2 or more ranks, got {ranks}")
        topology = check_wrap_arguments(transport="forest", topology=options.get("topology")).topology
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


def _check_trainer(trainer: DictConfig, cluster: DictConfig) -> None:
    if trainer.max_steps != -1:
        _at_least("trainer.max_steps", trainer.max_steps, 1)
    _at_least("trainer.max_epochs", trainer.max_epochs, 1)
    _at_least("trainer.devices", trainer.devices, 1)
    _at_least("trainer.num_nodes", trainer.num_nodes, 1)
    _at_least("trainer.log_every_n_steps", trainer.log_every_n_steps, 1)
    if trainer.num_nodes > 1 and cluster.launcher == "local":
        raise ConfigError(f"trainer.num_nodes: {trainer.num_nodes} nodes need their ranks started on every node, "
                          "and cluster.launcher 'local' starts trainer.devices ranks on this node only; use "
                          "cluster=torchrun (torchrun on each node) or cluster=slurm (SLURM through submitit)")


def _check_cluster(cluster: DictConfig, ranks: int) -> None:
    _choice("cluster.accelerator", cluster.accelerator, ACCELERATORS)
    _choice("cluster.backend", cluster.backend, BACKENDS[cluster.accelerator])
    _choice("cluster.launcher", cluster.launcher, LAUNCHERS)
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
    """Rank 0's shard of the data set, built as the ranks will build theirs: the loader's options
    checked, what it gives against cfg.data, a rank's share against the batch size."""
    _at_least("data.batch_size", cfg.data.batch_size, 1)
    _at_least("data.classes", cfg.data.classes, 1)
    _check_counts(cfg.data.dataset, "data.dataset")
    ranks = cfg.trainer.devices * cfg.trainer.num_nodes
    split = instantiate(cfg.data, "data", rank=0, world_size=ranks, seed=cfg.seed).split
    if not len(split.train):
        raise ConfigError(f"data.batch_size: {cfg.data.batch_size} is more than the {len(split.train.dataset)} "
                          f"training samples each of the {ranks} ranks gets")
    return split


def _check_model(model: DictConfig, data_name: str, split: data.Split) -> None:
    """The network's arguments that describe the data checked against what `split` gives; the
    network built and run on one test sample."""
    if not 0 < model.lr < math.inf:
        raise ConfigError(f"model.lr must be a finite number > 0, got {model.lr!r}")
    if not 0 <= model.momentum < 1:
        raise ConfigError(f"model.momentum must be in [0, 1), got {model.momentum!r}")
    network = model.network
    _check_counts(network, "model.network")
    defaults = {name: parameter.default for name, parameter in
                inspect.signature(_target(network, "model.network")).parameters.items()}
    arguments = {**defaults, **OmegaConf.to_container(network, resolve=True)}
    for argument, key in MODEL_FROM_DATA.items():
        if argument in arguments and arguments[argument] != getattr(split, key):
            raise ConfigError(f"model.network.{argument}: data {data_name!r} has {key} {getattr(split, key)}, "
                              f"got {arguments[argument]!r}")
    module = instantiate(network, "model.network")
    sample = split.test.dataset.tensors[0][:1]
    try:
        module(sample)
    except (RuntimeError, IndexError) as exc:  # a shape the explicit checks above do not cover (e.g. image channels)
        raise ConfigError(f"model.network: {network._target_} cannot read a sample of data {data_name!r} "
                          f"(shape {list(sample.shape[1:])}): {exc}") from exc


def _check_counts(node: DictConfig, path: str) -> None:
    """The arguments of `node` that count something are integers >= 1."""
    for key in COUNTS:
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{path}.{key} must be an integer >= 1, got {value!r}")


def _check_objectives(objectives: list, directions: Optional[list]) -> None:
    if not objectives:
        raise ConfigError(f"objectives: give one or more; valid: {', '.join(OBJECTIVES)}")
    for objective in objectives:
        _choice("objectives", objective, OBJECTIVES)
    if directions is not None and len(directions) != len(objectives):
        raise ConfigError(f"objectives: {len(objectives)} given ({', '.join(objectives)}) but the sweeper optimises "
                          f"{len(directions)} ({', '.join(map(str, directions))}): give one objective per direction")
