"""Checking ``wrap``'s arguments without touching torch.distributed, so that front-ends (the
DeepSpeed plugin, the Lightning strategies) can refuse bad configuration before anything starts."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from .. import compress, planners
from ..compress import Codec
from ..cost import CostModel
from ..errors import ConfigError, unknown_name
from ..profile import LayerProfile, ModelProfile, TensorSpec
from ..topology import Topology, load as load_topology, preset as topology_preset
from .executor import check_nonfinite_mode

TRANSPORTS = ("allreduce", "forest")
MIN_TIMEOUT = 1e-3  # the process groups count milliseconds: less would round to 0, "wait forever"
MAX_TIMEOUT = timedelta.max.total_seconds()  # above what the process group's timedelta can hold (rounded up)
# A probe model for the planner options: enough layers, ready at once, for a planner to use every
# channel its options allow
PROBE = ModelProfile("probe", tuple(LayerProfile(f"layer{i}", (TensorSpec(f"x{i}", 1 << 16),), 1e-6, 1e-6)
                                    for i in range(16)))


@dataclass
class WrapArguments:
    """Every model-independent argument of ``wrap``, checked and loaded."""

    planner: planners.BoundPlanner  # the scheduler and its options
    codec: Codec
    channels: int
    profile: ModelProfile | None  # None: measure
    cost: CostModel | None  # None: measure
    trace: str | Path | None
    timeout: float
    nonfinite: str
    broadcast_buffers: bool
    warmup_iterations: int
    measure_iterations: int
    plan_trials: int
    replan: bool = True
    transport: str = "allreduce"
    topology: Topology | None = None  # forest only; None: the complete graph of the ranks

    def shared_settings(self) -> dict:
        """What every rank must pass alike: a difference makes the ranks' collectives differ
        (a hang or an error deep in the process group), so `attach` compares them first. The trace
        path and the timeout may differ; a given profile's contents are checked by the plans' hash."""
        return {"scheduler": self.planner.name, "scheduler options": dict(self.planner.options),
                "compressor": self.codec.name, "compressor options": self.codec.settings(),
                "channels": self.channels, "transport": self.transport,
                "topology": self.topology, "cost": self.cost, "profile measured": self.profile is None,
                "nonfinite": self.nonfinite, "broadcast_buffers": self.broadcast_buffers,
                "warmup_iterations": self.warmup_iterations, "measure_iterations": self.measure_iterations,
                "plan_trials": self.plan_trials, "replan": self.replan}


def check_wrap_arguments(scheduler: str = "auto", compressor=None, channels: int | None = None,
                         profile="measure", cost="measure", trace=None, timeout: float = 600.0,
                         nonfinite: str = "raise", broadcast_buffers: bool = True, warmup_iterations: int = 1,
                         measure_iterations: int = 3, plan_trials: int = 4, replan: bool = True,
                         transport: str = "allreduce", topology=None, **options) -> WrapArguments:
    """``wrap``'s arguments checked, with the scheduler bound once (``planners.bind``): ConfigError
    naming the argument otherwise. No collective.

    Args:
        scheduler, compressor, channels, profile, cost, trace, timeout, nonfinite, broadcast_buffers,
            warmup_iterations, measure_iterations, plan_trials, replan, transport, topology, options: as
            ``gradsync.wrap``.
    """
    codec = compress.build(compressor)
    count = 2 if channels is None else channels
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"'channels' must be an integer >= 1, got {channels!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not MIN_TIMEOUT <= timeout < MAX_TIMEOUT:
        raise ConfigError(f"'timeout' must be a finite number of seconds >= {MIN_TIMEOUT} and < {MAX_TIMEOUT:.0f}, "
                          f"got {timeout!r}")
    for name, value in (("broadcast_buffers", broadcast_buffers), ("replan", replan)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name!r} must be true or false, got {value!r}")
    check_nonfinite_mode(nonfinite)
    network = _topology(transport, topology, codec)
    for name, value, least in (("warmup_iterations", warmup_iterations, 0), ("measure_iterations", measure_iterations, 1),
                               ("plan_trials", plan_trials, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{name!r} must be an integer >= {least}, got {value!r}")
    if trace is not None:
        _check_trace(trace)
    if planners.spec(scheduler).takes_channels:
        options["channels"] = count
    planner = planners.bind(scheduler, **options)
    probe = planner(PROBE, CostModel(1e-4, 1e-9))
    if probe.channels > count:
        raise ConfigError(f"scheduler {scheduler!r} with options {options} runs up to {probe.channels} ops at "
                          f"once, one per channel, and 'channels' is {count}: raise 'channels' to "
                          f"{probe.channels}")
    return WrapArguments(
        planner=planner, codec=codec, channels=count,
        profile=_load(profile, "profile", ModelProfile.load, ModelProfile),
        cost=_load(cost, "cost", lambda path: CostModel.from_dict(_read_json(path)), CostModel, CostModel.from_dict),
        trace=trace, timeout=float(timeout), nonfinite=nonfinite, broadcast_buffers=broadcast_buffers,
        warmup_iterations=warmup_iterations, measure_iterations=measure_iterations, plan_trials=plan_trials,
        replan=replan, transport=transport, topology=network,
    )


def check_grad_scaler(grad_scaler, nonfinite: str | None) -> str:
    """``wrap``'s `nonfinite` mode given its `grad_scaler`: a GradScaler skips overflowing steps
    itself, so the mode defaults to "ignore" with one and to "raise" without; "raise" with one,
    and a scaler without ``get_scale``, are refused."""
    if grad_scaler is None:
        return "raise" if nonfinite is None else nonfinite
    if not callable(getattr(grad_scaler, "get_scale", None)):
        raise ConfigError(f"'grad_scaler' must be a torch.amp.GradScaler (with get_scale()), "
                          f"got {type(grad_scaler).__name__}")
    if nonfinite == "raise":
        raise ConfigError("'nonfinite' 'raise' with a 'grad_scaler' would stop at the first overflow, which the "
                          "scaler skips: use 'ignore' (the default with a grad_scaler) or 'skip'")
    return "ignore" if nonfinite is None else nonfinite


def _topology(transport: str, topology, codec: Codec) -> Topology | None:
    """The forest transport's topology: a Topology, a preset name or a topology file (YAML/JSON)."""
    if transport not in TRANSPORTS:
        raise unknown_name("transport", transport, TRANSPORTS)
    if transport != "forest":
        if topology is not None:
            raise ConfigError("'topology' is used by transport 'forest' only; set transport='forest' or drop it")
        return None
    if codec.collective != "allreduce":
        raise ConfigError(f"transport 'forest' runs all-reduces; compressor {codec.name!r} all-gathers "
                          "(use the 'allreduce' transport, or acp_sgd / powersgd)")
    if topology is None or isinstance(topology, Topology):
        return topology
    if isinstance(topology, (str, Path)):
        if Path(topology).is_file():
            return load_topology(topology)
        if Path(topology).suffix in (".yaml", ".yml", ".json"):
            raise ConfigError(f"'topology': no such file {str(topology)!r}")
        return topology_preset(str(topology))
    raise ConfigError(f"'topology' must be a Topology, a preset name or a file path, got {type(topology).__name__}")


def _check_trace(trace) -> None:
    """Each rank writes its trace beside `trace` (a file path) when the runtime detaches: its
    folder must exist now, not at the end of the run."""
    if not isinstance(trace, (str, Path)) or not str(trace):
        raise ConfigError(f"'trace' must be a file path, got {trace!r}")
    path = Path(trace)
    if path.is_dir():
        raise ConfigError(f"'trace' must be a file path, {str(trace)!r} is a folder")
    if not path.parent.is_dir():
        raise ConfigError(f"'trace': no such folder {str(path.parent)!r}")


def _read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc}") from exc


def _load(value, name: str, loader, kind, from_mapping=None):
    """`value` as an object of `kind`, loaded from a JSON path (or, with `from_mapping`, made from a
    mapping, as a JSON config gives it), or None for "measure"."""
    if isinstance(value, kind):
        return value
    if from_mapping is not None and isinstance(value, dict):
        return from_mapping(value)
    if isinstance(value, str) and value == "measure":
        return None
    if isinstance(value, (str, Path)):
        if not Path(value).is_file():
            raise ConfigError(f"{name!r}: no such file {str(value)!r} (give a {kind.__name__}, a JSON path "
                              "or 'measure')")
        return loader(value)
    mapping = ", a mapping of its fields" if from_mapping is not None else ""
    raise ConfigError(f"{name!r} must be a {kind.__name__}{mapping}, a JSON path or 'measure', "
                      f"got {type(value).__name__}")
