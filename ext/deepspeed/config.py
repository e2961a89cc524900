"""The ``"gradsync"`` section of a DeepSpeed config, checked before DeepSpeed's engine starts.

DeepSpeed keeps unknown top-level keys of its config (its sub-sections are strict), so gradsync's
settings live in one top-level section. Everything here is local: no collective runs, so a bad
config fails on every rank alike before the engine sends anything.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.config import DeepSpeedConfig
from torch import nn

from .. import planners
from ..compress import Codec
from ..errors import ConfigError
from ..runtime import WrapArguments, check_wrap_arguments, wrap
from ..runtime.parameter_table import ParameterTable

SECTION = "gradsync"
KEYS = ("scheduler", "compressor", "channels", "profile", "cost", "trace", "timeout", "nonfinite", "options",
        "transport", "topology", "broadcast_buffers", "warmup_iterations", "measure_iterations", "plan_trials",
        "replan")
# DeepSpeed optimizers that compress their own communication (the momentum, not the gradient)
COMPRESSED_OPTIMIZERS = ("onebitadam", "onebitlamb", "zerooneadam")


@contextmanager
def field(key: str):
    """Prefix errors raised inside with the config path of `key`."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"DeepSpeed config '{SECTION}.{key}': {exc}") from exc


def wrap_arguments(section, nonfinite: str | None = None) -> WrapArguments:
    """``gradsync.wrap``'s arguments from the section, every value checked (no collective);
    `nonfinite`, if given, is the default of the section's ``nonfinite`` (``default_nonfinite``).
    ``broadcast_buffers`` defaults to false: DeepSpeed leaves each rank its own buffers."""
    if not isinstance(section, dict):
        raise ConfigError(f"DeepSpeed config '{SECTION}' must be an object with keys from: {', '.join(KEYS)}")
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        raise ConfigError(f"DeepSpeed config '{SECTION}': unknown key(s) {unknown}; valid: {', '.join(KEYS)}")
    with field("options"):
        options = _planner_options(section.get("options", {}))
    arguments = {"broadcast_buffers": False, **({"nonfinite": nonfinite} if nonfinite else {}),
                 **{key: section[key] for key in KEYS if key in section and key != "options"}}
    scheduler = arguments.get("scheduler", "auto")
    if isinstance(scheduler, str) and scheduler in planners.names():
        for name, value in options.items():  # each option alone first, so that an error names it
            with field(f"options.{name}"):
                planners.bind(scheduler, **{name: value})
    with field(", ".join(sorted(key for key in section if key != "options")) or "options"):
        return check_wrap_arguments(**arguments, **options)


def check_engine_config(config: DeepSpeedConfig, codec: Codec, model, optimizer, mpu, mesh_device) -> None:
    """Refuse DeepSpeed settings under which gradsync cannot own the gradient synchronisation.

    Refused: ZeRO stage 3; under stages 1 and 2 offloading, ZenFlow, DeepCompile, a
    ``grad_accum_dtype``, Muon, and ``torch_autocast`` over lower-precision-safe modules (their
    gradients reduced in the autocast dtype); ``nonfinite`` "raise" with fp16, ``torch_autocast`` with float16,
    ``managed_gradient_accumulation`` off, no optimizer at all, a compressor combined with
    DeepSpeed's compressed optimizers, a ``communication_data_type`` other than the model's dtype,
    a ``gradient_allreduce_op`` other than mean, model, tensor, sequence or expert parallelism,
    DeepSpeed's hybrid engine, a pipeline module and MoE layers.

    Args:
        config: the engine's DeepSpeed config, as DeepSpeed parsed it.
        codec: the compressor the ``"gradsync"`` section asks for.
        model: the model given to the engine; must be a ``torch.nn.Module``.
        optimizer: the client optimizer given to the engine (an instance, a class or callable, or
            None for the config's ``optimizer`` section).
        mpu, mesh_device: the engine's ``mpu`` and ``mesh_device`` (from ``deepspeed.initialize``'s
            ``mpu`` and ``mesh_param``); both must be None (they split the model over ranks).

    Raises:
        ConfigError: naming the first setting refused.
    """
    ds_config = config._param_dict
    stage = config.zero_optimization_stage
    if stage == 3:
        raise ConfigError("gradsync does not support ZeRO stage 3 ('zero_optimization.stage' 3): it partitions the "
                          "parameters themselves and gathers them layer by layer, so no rank ever holds a whole "
                          "gradient to synchronise; use stage 1 or 2")
    _check_zero(config, optimizer)
    precision = _precision(config)
    if precision == "fp16" and ds_config[SECTION].get("nonfinite") == "raise":
        raise ConfigError(f"'{SECTION}.nonfinite' 'raise' would stop at the first fp16 overflow, which DeepSpeed's "
                          "dynamic loss scaler expects and skips: use 'ignore' (the default with fp16) or 'skip'")
    if config.torch_autocast_enabled and config.torch_autocast_dtype == torch.float16:
        raise ConfigError("gradsync does not support 'torch_autocast' with dtype float16: its gradient scaler "
                          "unscales gradients before they are synchronised; use bfloat16")
    if not config.managed_gradient_accumulation:
        raise ConfigError("gradsync needs 'managed_gradient_accumulation': true: it synchronises during the "
                          "backward pass of the accumulation boundary, which must be known before step()")
    if optimizer is None and config.optimizer_name is None:
        raise ConfigError("gradsync needs an optimizer: pass one or set 'optimizer' in the DeepSpeed config")
    optimizer_name = _optimizer_name(config, optimizer)
    if codec.name != "identity" and optimizer_name in COMPRESSED_OPTIMIZERS:
        raise ConfigError(f"'{SECTION}.compressor' {codec.name!r} cannot be combined with DeepSpeed's compressed "
                          f"optimizer {optimizer_name!r}: it compresses its own communication; drop one of them")
    communication = ds_config.get("communication_data_type")
    if communication is not None and str(communication).lower() != precision:
        raise ConfigError(f"gradsync does not support 'communication_data_type' {communication!r}: it reduces "
                          f"the gradients in their own dtype; drop the setting or set {precision!r}")
    if config.gradient_allreduce_op != "mean":
        raise ConfigError(f"gradsync averages the gradients: 'gradient_allreduce_op' must be \"mean\", got "
                          f"{config.gradient_allreduce_op!r}")
    if config.hybrid_engine.enabled:
        raise ConfigError("gradsync does not support DeepSpeed's hybrid engine ('hybrid_engine.enabled'): it "
                          "switches the model between training and generation, with tensor-parallel inference")
    split = _model_parallelism(ds_config, mpu, mesh_device)
    if split:
        raise ConfigError("gradsync averages every parameter's gradient over all ranks, so it does not support "
                          "DeepSpeed's model, tensor, sequence or expert parallelism (ranks holding different "
                          f"shards, tokens or experts): {', '.join(split)}")
    _check_model(model)
    lowered = _reduced_in_autocast_dtype(config, model) if stage in (1, 2) else []
    if lowered:
        raise ConfigError(
            f"gradsync does not support 'torch_autocast' under ZeRO stage {stage} with lower-precision-safe modules "
            f"(here {len(lowered)}, the first: {lowered[0]!r}): DeepSpeed would reduce their gradients in "
            f"{config.torch_autocast_dtype}, gradsync reduces them in their own dtype; set "
            "'torch_autocast.lower_precision_safe_modules' to [] to reduce every gradient in its own dtype")


def _reduced_in_autocast_dtype(config: DeepSpeedConfig, model: nn.Module) -> list[str]:
    """The modules whose gradients DeepSpeed's ZeRO reduces in the autocast dtype under
    ``torch_autocast`` (those of its lower-precision-safe classes: Linear and Conv by default)."""
    if not config.torch_autocast_enabled:
        return []
    from deepspeed.runtime.torch_autocast import get_default_autocast_lower_precision_modules

    classes = config.torch_autocast_lower_precision_safe_modules
    classes = set(get_default_autocast_lower_precision_modules() if classes is None else classes)
    return [name for name, module in model.named_modules()
            if f"{type(module).__module__}.{type(module).__name__}" in classes
            and next(module.parameters(recurse=False), None) is not None]


def _precision(config: DeepSpeedConfig) -> str:
    """The model's dtype under DeepSpeed's mixed precision: "fp16", "bf16" or "fp32"."""
    return "fp16" if config.float16_config.enabled else "bf16" if config.bfloat16_config.enabled else "fp32"


def default_nonfinite(config: DeepSpeedConfig) -> str | None:
    """The section's default `nonfinite`: "ignore" under fp16 or bf16 and under ZeRO stages 1 and 2,
    whose optimizers check the averaged gradients for overflow themselves and skip the step (None:
    ``gradsync.wrap``'s, where the user's optimizer would step on them)."""
    return "ignore" if _precision(config) != "fp32" or config.zero_optimization_stage in (1, 2) else None


def _check_zero(config: DeepSpeedConfig, optimizer) -> None:
    """Refuse the ZeRO stage 1 and 2 features under which DeepSpeed's step reads gradients
    gradsync does not deliver, or reduces them itself."""
    zero = config.zero_config
    offloaded = [key for key, offload in (("offload_optimizer", zero.offload_optimizer), ("offload_param",
                                                                                          zero.offload_param))
                 if offload is not None and str(getattr(offload.device, "value", offload.device)) != "none"]
    refused = [f"'zero_optimization.{key}'" for key in offloaded]
    refused += ["'zero_optimization.zenflow'"] if zero.zenflow is not None else []
    refused += ["'compile.deepcompile'"] if config.compile_config.deepcompile else []
    refused += ["'data_types.grad_accum_dtype'"] if config.grad_accum_dtype is not None else []
    refused += ["the Muon optimizer"] if _optimizer_name(config, optimizer) == "muon" else []
    if refused:
        raise ConfigError(f"gradsync does not support {', '.join(refused)}: DeepSpeed then accumulates or reduces "
                          "the gradients on its own path (offloaded, compiled or in another dtype)")


def _model_parallelism(ds_config: dict, mpu, mesh_device) -> list[str]:
    """The arguments and config settings that split the model, the sequence or the experts over ranks."""
    tensor, expert = (ds_config[key] if isinstance(ds_config.get(key), dict) else {}
                      for key in ("tensor_parallel", "expert_parallel"))
    settings = [("mpu", mpu, (None,)), ("mesh_param", mesh_device, (None,)),
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


def _optimizer_name(config: DeepSpeedConfig, optimizer) -> str:
    """The optimizer DeepSpeed will step, lower-case: the client's if given, else the config's."""
    if optimizer is not None:
        return (optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__).lower()
    return (config.optimizer_name or "").lower()


def _planner_options(options) -> dict:
    """Planner options; names that ``gradsync.wrap`` takes itself belong at the section's top level."""
    if not isinstance(options, dict):
        raise ConfigError(f"must be an object of planner options, got {type(options).__name__}")
    reserved = sorted(set(options) & set(inspect.signature(wrap).parameters))
    if reserved:
        raise ConfigError(f"{reserved} are not planner options (the keys of '{SECTION}' itself: {', '.join(KEYS)})")
    return options
