"""The ``"gradsync"`` section of a DeepSpeed config, checked before DeepSpeed starts.

DeepSpeed keeps unknown top-level keys of its config (its sub-sections are strict), so gradsync's
settings live in one top-level section. Everything here is local: no collective runs, so a bad
config fails on every rank alike before any process group is used.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.config import (get_managed_gradient_accumulation, get_torch_autocast_dtype,
                                      get_torch_autocast_enabled)
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from pydantic import ValidationError
from torch import nn

from .. import planners
from ..compress import Codec
from ..errors import ConfigError
from ..runtime import WrapArguments, check_wrap_arguments, wrap
from ..runtime.parameter_table import ParameterTable

SECTION = "gradsync"
KEYS = ("scheduler", "compressor", "channels", "profile", "cost", "trace", "timeout", "nonfinite", "options",
        "transport", "topology", "broadcast_buffers", "warmup_iterations", "measure_iterations", "plan_trials")
# DeepSpeed optimizers that compress their own communication (the momentum, not the gradient)
COMPRESSED_OPTIMIZERS = ("onebitadam", "onebitlamb", "zerooneadam")


def load(config) -> dict:
    """The DeepSpeed config as a dict, read by DeepSpeed's own loader (dict, JSON/HJSON path or base64)."""
    try:
        return load_ds_config(config)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the DeepSpeed config: {exc}") from exc


def resolve(args, config, config_params) -> dict | None:
    """The config `deepspeed.initialize` will use, by its own precedence: `config`, then
    `config_params`, then ``args.deepspeed_config`` (or the older ``args.deepscale_config``).

    Args:
        args: the ``args`` given to ``deepspeed.initialize`` (an argparse namespace or None); its
            ``deepspeed_config`` and ``deepscale_config`` attributes are read when present.
        config, config_params: the configs given to ``deepspeed.initialize``: a dict, a JSON/HJSON
            path or a base64 string, or None.

    Returns:
        The first config given, loaded as a dict; None when none is given.

    Raises:
        ConfigError: when the chosen config cannot be read.
    """
    for candidate in (config, config_params, getattr(args, "deepspeed_config", None),
                      getattr(args, "deepscale_config", None)):
        if candidate is not None:
            return load(candidate)
    return None


@contextmanager
def field(key: str):
    """Prefix errors raised inside with the config path of `key`."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"DeepSpeed config '{SECTION}.{key}': {exc}") from exc


def wrap_arguments(section) -> WrapArguments:
    """``gradsync.wrap``'s arguments from the section, every value checked (no collective)."""
    if not isinstance(section, dict):
        raise ConfigError(f"DeepSpeed config '{SECTION}' must be an object with keys from: {', '.join(KEYS)}")
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        raise ConfigError(f"DeepSpeed config '{SECTION}': unknown key(s) {unknown}; valid: {', '.join(KEYS)}")
    with field("options"):
        options = _planner_options(section.get("options", {}))
    arguments = {key: section[key] for key in KEYS if key in section and key != "options"}
    scheduler = arguments.get("scheduler", "auto")
    if isinstance(scheduler, str) and scheduler in planners.names():
        for name, value in options.items():  # each option alone first, so that an error names it
            with field(f"options.{name}"):
                planners.bind(scheduler, **{name: value})
    with field(", ".join(sorted(arguments)) or "options"):
        return check_wrap_arguments(**arguments, **options)


def check_engine_config(ds_config: dict, codec: Codec, model, optimizer, mpu, mesh_param) -> None:
    """Refuse DeepSpeed settings under which gradsync cannot own the gradient synchronisation.

    Refused: a ZeRO stage other than 0, ``fp16``/``bf16`` mixed precision, ``torch_autocast`` with
    float16, ``managed_gradient_accumulation`` off, no optimizer at all, a compressor combined with
    DeepSpeed's compressed optimizers, a ``communication_data_type`` other than fp32, model, tensor,
    sequence or expert parallelism, a pipeline module and MoE layers.

    Args:
        ds_config: the resolved DeepSpeed config, as a dict (see `resolve`).
        codec: the compressor the ``"gradsync"`` section asks for.
        model: the ``model`` given to ``deepspeed.initialize``; must be a ``torch.nn.Module``.
        optimizer: the ``optimizer`` given to ``deepspeed.initialize`` (an instance, a class or
            callable, or None for the config's ``optimizer`` section).
        mpu, mesh_param: the ``mpu`` and ``mesh_param`` given to ``deepspeed.initialize``; both must be
            None (they split the model over ranks).

    Raises:
        ConfigError: naming the first setting refused.
    """
    stage = zero_stage(ds_config)
    if stage != 0:
        raise ConfigError(f"gradsync needs ZeRO stage 0 ('zero_optimization.stage' is {stage}): stages 1-3 "
                          "partition gradients and reduce them inside DeepSpeed's optimizer")
    for key in ("fp16", "bf16", "bfloat16"):
        if isinstance(ds_config.get(key), dict) and ds_config[key].get("enabled", False):
            raise ConfigError(f"gradsync does not support '{key}.enabled': DeepSpeed's mixed-precision optimizer "
                              "steps fp32 master copies, not the module's parameters; use 'torch_autocast' "
                              "with dtype bfloat16, or fp32")
    if get_torch_autocast_enabled(ds_config) and get_torch_autocast_dtype(ds_config) == torch.float16:
        raise ConfigError("gradsync does not support 'torch_autocast' with dtype float16: its gradient scaler "
                          "unscales gradients before they are synchronised; use bfloat16")
    if not get_managed_gradient_accumulation(ds_config):
        raise ConfigError("gradsync needs 'managed_gradient_accumulation': true: it synchronises during the "
                          "backward pass of the accumulation boundary, which must be known before step()")
    if ds_config.get("optimizer") is not None and not isinstance(ds_config["optimizer"], dict):
        raise ConfigError(f"'optimizer' must be an object with a 'type', got {ds_config['optimizer']!r}")
    if optimizer is None and ds_config.get("optimizer") is None:
        raise ConfigError("gradsync needs an optimizer: pass one or set 'optimizer' in the DeepSpeed config")
    if codec.name != "identity" and _optimizer_name(ds_config, optimizer) in COMPRESSED_OPTIMIZERS:
        raise ConfigError(f"'{SECTION}.compressor' {codec.name!r} cannot be combined with DeepSpeed's compressed "
                          f"optimizer {_optimizer_name(ds_config, optimizer)!r}: it compresses its own "
                          "communication; drop one of them")
    communication = ds_config.get("communication_data_type")
    if communication is not None and str(communication).lower() != "fp32":
        raise ConfigError(f"gradsync does not support 'communication_data_type' {communication!r}: it reduces "
                          "the gradients in their own dtype; drop the setting or set \"fp32\"")
    split = _model_parallelism(ds_config, mpu, mesh_param)
    if split:
        raise ConfigError("gradsync averages every parameter's gradient over all ranks, so it does not support "
                          "DeepSpeed's model, tensor, sequence or expert parallelism (ranks holding different "
                          f"shards, tokens or experts): {', '.join(split)}")
    _check_model(model)


def _model_parallelism(ds_config: dict, mpu, mesh_param) -> list[str]:
    """The arguments and config settings that split the model, the sequence or the experts over ranks."""
    tensor, expert = (ds_config[key] if isinstance(ds_config.get(key), dict) else {}
                      for key in ("tensor_parallel", "expert_parallel"))
    settings = [("mpu", mpu, (None,)), ("mesh_param", mesh_param, (None,)),
                ("tensor_parallel.autotp_size", tensor.get("autotp_size", 0), (0, 1)),
                ("sequence_parallel_size", ds_config.get("sequence_parallel_size", 1), (1,)),
                ("expert_parallel.enabled", expert.get("enabled", False), (False,))]
    return [f"'{key}' {value!r}" for key, value, unsplit in settings if value not in unsplit]


def _check_model(model) -> None:
    """Refuse a pipeline, MoE experts, and what the runtime's parameter table refuses (sparse gradients)."""
    from deepspeed.pipe import PipelineModule

    if not isinstance(model, nn.Module):
        raise ConfigError(f"'model' must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, PipelineModule):
        raise ConfigError("gradsync does not support DeepSpeed pipeline parallelism (PipelineModule)")
    experts = [name for name, parameter in ParameterTable.of(model).parameters.items() if is_moe_param(parameter)]
    if experts:
        raise ConfigError("gradsync averages every parameter's gradient over all ranks, so it does not support "
                          f"DeepSpeed MoE layers: DeepSpeed reduces their {len(experts)} expert parameters (the "
                          f"first: {experts[0]!r}) over their expert group only")


def zero_stage(ds_config: dict) -> int:
    """The ZeRO stage the config asks for, as DeepSpeed reads it (a bare boolean means stage 1)."""
    zero = ds_config.get("zero_optimization", {})
    if isinstance(zero, bool):
        return int(zero)
    if not isinstance(zero, dict):
        raise ConfigError(f"'zero_optimization' must be an object, got {type(zero).__name__}")
    try:
        return int(DeepSpeedZeroConfig(stage=zero.get("stage", 0)).stage)
    except ValidationError:
        raise ConfigError(f"'zero_optimization.stage' must be 0, 1, 2 or 3, got {zero['stage']!r}") from None


def _optimizer_name(ds_config: dict, optimizer) -> str:
    """The optimizer DeepSpeed will step, lower-case: the client's if given, else the config's."""
    if optimizer is not None:
        return (optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__).lower()
    return str((ds_config.get("optimizer") or {}).get("type", "")).lower()


def _planner_options(options) -> dict:
    """Planner options; names that ``gradsync.wrap`` takes itself belong at the section's top level."""
    if not isinstance(options, dict):
        raise ConfigError(f"must be an object of planner options, got {type(options).__name__}")
    reserved = sorted(set(options) & set(inspect.signature(wrap).parameters))
    if reserved:
        raise ConfigError(f"{reserved} are not planner options (the keys of '{SECTION}' itself: {', '.join(KEYS)})")
    return options
