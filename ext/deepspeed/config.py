"""The ``"gradsync"`` section of a DeepSpeed config, checked before DeepSpeed starts.

DeepSpeed keeps unknown top-level keys of its config (its sub-sections are strict), so gradsync's
settings live in one top-level section. Everything here is local: no collective runs, so a bad
config fails on every rank alike before any process group is used.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from deepspeed.runtime.config import (get_managed_gradient_accumulation, get_torch_autocast_dtype,
                                      get_torch_autocast_enabled)
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from ..compress import Codec
from ..errors import ConfigError
from ..runtime import WrapArguments, check_wrap_arguments, wrap

SECTION = "gradsync"
KEYS = ("scheduler", "compressor", "channels", "profile", "cost", "trace", "timeout", "nonfinite", "options",
        "transport", "topology")
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
    `config_params`, then ``args.deepspeed_config`` (or the older ``args.deepscale_config``)."""
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
    with field(", ".join(sorted(arguments)) or "options"):
        return check_wrap_arguments(**arguments, **options)


def check_engine_config(ds_config: dict, codec: Codec, model, optimizer, mpu, mesh_param) -> None:
    """Refuse DeepSpeed settings under which gradsync cannot own the gradient synchronisation."""
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
    if optimizer is None and "optimizer" not in ds_config:
        raise ConfigError("gradsync needs an optimizer: pass one or set 'optimizer' in the DeepSpeed config")
    if codec.name != "identity" and _optimizer_name(ds_config, optimizer) in COMPRESSED_OPTIMIZERS:
        raise ConfigError(f"'{SECTION}.compressor' {codec.name!r} cannot be combined with DeepSpeed's compressed "
                          f"optimizer {_optimizer_name(ds_config, optimizer)!r}: it compresses its own "
                          "communication; drop one of them")
    if mpu is not None or mesh_param is not None:
        raise ConfigError("gradsync averages over every rank: model or sequence parallelism (mpu, mesh_param) "
                          "is not supported")
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        raise ConfigError("gradsync does not support DeepSpeed pipeline parallelism (PipelineModule)")


def zero_stage(ds_config: dict) -> int:
    """The ZeRO stage the config asks for (a bare boolean means stage 1, as DeepSpeed reads it)."""
    zero = ds_config.get("zero_optimization", {})
    if isinstance(zero, bool):
        return int(zero)
    if isinstance(zero, dict):
        return int(zero.get("stage", 0))
    raise ConfigError(f"'zero_optimization' must be an object, got {type(zero).__name__}")


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
        raise ConfigError(f"{reserved} are not planner options; set them at the top level of '{SECTION}'")
    return options
