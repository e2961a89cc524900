"""The runtime: ``wrap`` attaches one engine that executes any plan on torch.distributed."""
from __future__ import annotations

import inspect
import random
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import compress, planners
from ..compress import Codec
from ..cost import CostModel
from ..errors import ConfigError
from ..profile import ModelProfile
from .channels import Channels
from .engine import GradSync, IterationStats, _broadcast_from_first, attached, no_sync
from .executor import NonFiniteGradient, check_nonfinite_mode
from .layout import ParameterLayout
from .measure import ProfileCalibration, measure_cost, share_from_first
from .optimizer import SyncedOptimizer
from .trace import ChromeTrace

__all__ = ["GradSync", "IterationStats", "NonFiniteGradient", "SyncedOptimizer", "attached", "no_sync", "wrap"]


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: str = "auto",
    compressor: str | dict | Codec | None = None,
    channels: int | None = None,
    process_group=None,
    profile: ModelProfile | str | Path = "measure",
    cost: CostModel | str | Path = "measure",
    trace: str | Path | None = None,
    timeout: float = 600.0,
    nonfinite: str = "raise",
    broadcast_buffers: bool = True,
    warmup_iterations: int = 1,
    measure_iterations: int = 3,
    **options,
):
    """Attach gradsync to `model` and return ``(model, optimizer)``.

    The model object comes back unchanged (hooks only). The returned optimizer wraps `optimizer`.
    `compressor`: a name (``"acp_sgd"``), a dict ``{"type": name, **options}`` or a Codec.
    `profile`/`cost`: an object, a JSON path, or ``"measure"`` (the first `warmup_iterations` +
    `measure_iterations` iterations run as WFBP while layers are timed; the cost is fitted from
    timed all-reduces at wrap time). `channels`: process groups for simultaneous all-reduces
    (default 2; passed to planners that take it). `nonfinite`: ``"raise"`` (name the parameter),
    ``"skip"`` (skip the step on every rank) or ``"ignore"``. `options` go to the planner.
    Every argument is checked before the first collective.
    """
    planner = planners.get(scheduler)
    codec = _codec(compressor)
    channel_count = 2 if channels is None else channels
    if isinstance(channel_count, bool) or not isinstance(channel_count, int) or channel_count < 1:
        raise ConfigError(f"'channels' must be an integer >= 1, got {channels!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"'timeout' must be a number of seconds > 0, got {timeout!r}")
    check_nonfinite_mode(nonfinite)
    for field, value in (("warmup_iterations", warmup_iterations), ("measure_iterations", measure_iterations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if field == "warmup_iterations" else 1):
            raise ConfigError(f"{field!r} must be an integer >= {0 if field == 'warmup_iterations' else 1}, got {value!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"'optimizer' must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    layout = ParameterLayout.of(model)
    layout.check_optimizer(optimizer)
    given_profile = _load(profile, "profile", ModelProfile.load, ModelProfile)
    given_cost = _load(cost, "cost", lambda p: CostModel(**_json(p)), CostModel)
    if given_profile is not None:
        layout.check_profile(given_profile)
    planner_options = dict(options)
    if "channels" in inspect.signature(planner).parameters:
        planner_options["channels"] = channel_count
    skeleton = layout.profile(type(model).__name__)
    planner(skeleton, given_cost or CostModel(1e-4, 1e-9), **planner_options)  # rejects bad options now
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialised: call init_process_group first")

    group = process_group
    _broadcast_from_first([t for t in (*model.parameters(), *model.buffers()) if t.numel()], group)
    channel_groups = Channels(channel_count, group, timedelta(seconds=timeout))
    writer = ChromeTrace(trace, dist.get_rank(group)) if trace else None
    codec.setup({name: layout.tensor_spec(name) for name in layout.parameters}, channel_groups.world_size,
                share_from_first(random.randrange(2**62), group))
    sync = GradSync(model, layout, channel_groups, scheduler, planner_options, nonfinite, broadcast_buffers, codec,
                    writer)
    sync.check_optimizer(optimizer)
    device = next(iter(layout.parameters.values())).device
    measured_cost = given_cost or measure_cost(channel_groups, skeleton.total_bytes, device=device)
    if given_profile is not None:
        sync.install_plan(given_profile, measured_cost)
    else:
        sync.install_plan(skeleton, measured_cost, planner_name="wfbp")
        sync.measurement = ProfileCalibration(layout, measured_cost, warmup_iterations, measure_iterations,
                                              type(model).__name__)
    return model, SyncedOptimizer(optimizer, sync)


def _json(path):
    import json

    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc}") from exc


def _load(value, field: str, loader, kind):
    """`value` as an object of `kind`, loaded from a JSON path, or None for "measure"."""
    if isinstance(value, kind):
        return value
    if value == "measure":
        return None
    if isinstance(value, (str, Path)):
        if not Path(value).is_file():
            raise ConfigError(f"{field!r}: no such file {str(value)!r} (give a {kind.__name__}, a JSON path or 'measure')")
        return loader(value)
    raise ConfigError(f"{field!r} must be a {kind.__name__}, a JSON path or 'measure', got {type(value).__name__}")


def _codec(compressor) -> Codec:
    """A fresh codec from a name, a {"type": name, **options} dict, or a Codec (used as given)."""
    if isinstance(compressor, Codec):
        return compressor
    if isinstance(compressor, dict):
        options = dict(compressor)
        if "type" not in options:
            raise ConfigError(f"'compressor' dict needs a 'type' key (one of: {', '.join(compress.names())})")
        return compress.get(options.pop("type"), **options)
    if compressor is None or isinstance(compressor, str):
        return compress.get(compressor)
    raise ConfigError(f"'compressor' must be a name, a dict or a Codec, got {type(compressor).__name__}")
