"""The runtime: ``wrap`` attaches one engine that executes any plan on torch.distributed."""
from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..agreement import gather_from_all, share_from_first, waiting_for
from ..compress import Codec
from ..cost import CostModel
from ..errors import ConfigError
from ..profile import ModelProfile
from ..topology import Topology, complete
from ..topology.allreduce import check_group_size
from .arguments import WrapArguments, check_grad_scaler, check_wrap_arguments
from .channels import Channels, control_group
from .engine import GradSync, attached, check_not_attached, no_sync
from .first_rank import broadcast_from_first
from .executor import NonFiniteGradient
from .parameter_table import ParameterTable
from .partition import Partition
from .installed import InstalledPlans
from .measure.probes import measure_cost
from .optimizer import OptimizerGroup, SyncedOptimizer
from .report import LayoutReport, SyncReport
from .statistics import IterationStats
from .trace import ChromeTrace

__all__ = ["GradSync", "IterationStats", "LayoutReport", "NonFiniteGradient", "SyncReport", "SyncedOptimizer",
           "WrapArguments", "attached", "check_wrap_arguments", "no_sync", "report", "wrap"]


def report(model: torch.nn.Module) -> SyncReport:
    """The read-only report of the synchronisation attached to `model` (its plans per wire layout,
    their simulated timelines, auto's choice and trials, the latest statistics)."""
    return attached(model).report()


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    scheduler: str = "auto",
    compressor: str | dict | Codec | None = None,
    channels: int | None = None,
    process_group=None,
    profile: ModelProfile | str | Path = "measure",
    cost: CostModel | str | Path = "measure",
    trace: str | Path | None = None,
    timeout: float = 600.0,
    nonfinite: str | None = None,
    grad_scaler=None,
    broadcast_buffers: bool = True,
    warmup_iterations: int = 1,
    measure_iterations: int = 3,
    plan_trials: int = 4,
    replan: bool = True,
    transport: str = "allreduce",
    topology=None,
    **options,
):
    """Attach gradsync to `model` and return ``(model, optimizer)``: the model object itself (hooks,
    and a ``zero_grad`` that waits for the updates deferred to the next forward) and an optimizer
    wrapping `optimizer` (a list of them for a list). Every argument is checked before the first
    collective.

    Args:
        model: the replica on this rank (its parameters on their device).
        optimizer: a torch optimizer over the model's trainable parameters, or a list of optimizers
            that each update their own of them (a GAN's generator and discriminator): each pass's
            gradients are averaged whichever member steps next, and no update is deferred.
        scheduler: the scheduler's name (``gradsync list``); its options go in `options`.
        compressor: None, a name (``"acp_sgd"``), a dict ``{"type": name, **options}`` or a Codec.
        channels: process groups for simultaneous all-reduces (default 2; passed to planners that
            take it).
        process_group: the ranks to synchronise (default: the whole world).
        profile: a ModelProfile, a JSON path, or ``"measure"``: the first `warmup_iterations` +
            `measure_iterations` iterations run with one all-reduce at the end of the backward pass
            while the layers are timed.
        cost: a CostModel, a mapping or JSON path of its fields, or ``"measure"``: a, b, γ, the host
            time per op and the slowdowns, probed at wrap time.
        trace: a path for a Chrome trace of this rank's hooks and ops (None: no trace).
        timeout: seconds any collective of gradsync may wait for a peer before PeersTimedOut.
        nonfinite: ``"raise"`` (name the parameter; the default), ``"skip"`` (skip the step on
            every rank) or ``"ignore"`` (let them through, for a GradScaler to skip the step; the
            default with `grad_scaler`). A step whose averaged gradients hold inf or NaN is no
            compressor step: the next runs as if it had never been (Power-SGD's warm-up, ACP-SGD's
            P and Q alternation).
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss, if any: the backward pass
            then ends once the gradients are averaged (the scaler reads them before the step), and
            a compressor's error feedback follows each change of its scale.
        broadcast_buffers: give every rank rank 0's buffers in each synchronised backward pass (as
            its forward left them), ready for the next forward, as DDP does.
        warmup_iterations, measure_iterations: iterations skipped, then timed, by ``profile="measure"``.
        plan_trials: with a choosing scheduler (``auto``) and a measured profile, how many plans to
            time on the job (torch DDP's buckets, auto's choice, the next two best predicted): DDP's are
            kept unless another is faster with auto's `confidence` (``runtime.measure.trials``),
            and plans the trials left undecided are timed again as training goes on; below 2,
            auto's choice is kept untimed.
        replan: once the plans are installed, compare their ops' measured times with the cost model
            and, when the network changes (ops 1.5x slower or faster than at first, for 16
            iterations), re-fit the cost from those times and make the plans again, every rank at
            the same iteration (``runtime.measure.cost_watch``; ``report(model).replans``).
        transport: ``"allreduce"`` (the backend's) or ``"forest"`` (reduce/broadcast trees packed on
            `topology`).
        topology: for the forest transport, a Topology, a preset name or a file (default: the complete
            graph of the ranks).
        options: the scheduler's options (``gradsync.planners.spec(scheduler).options``).
    """
    nonfinite = check_grad_scaler(grad_scaler, nonfinite)
    arguments = check_wrap_arguments(scheduler, compressor, channels, profile, cost, trace, timeout, nonfinite,
                                     broadcast_buffers, warmup_iterations, measure_iterations, plan_trials,
                                     replan, transport, topology, **options)
    model, synced = attach(model, optimizer, arguments, process_group)
    if grad_scaler is not None:
        sync = attached(model)
        sync.wait_at_backward_end = True
        sync.follow_loss_scale(grad_scaler.get_scale)
    return model, synced


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer | list, arguments: WrapArguments,
           process_group=None, partition: Partition | None = None, unused_as_zeros: bool = False,
           takes_unfrozen: bool = True):
    """``wrap`` with arguments already checked by ``check_wrap_arguments``.

    Args:
        model, optimizer, process_group: as ``wrap``.
        arguments: the rest of ``wrap``'s arguments, checked.
        partition: for a sharded optimizer (ZeRO), the elements of each gradient each rank steps:
            then, uncompressed, the plans' ops are reduce-scatters that deliver each rank its
            partition of the averaged gradients alone, read with the current executor's
            ``reduced_partition`` (the gradients are released once sent); a compressor's decoded
            gradients are whole, in ``.grad``.
        unused_as_zeros: a trainable parameter no rank produced a gradient for gets a gradient of
            zeros, as DeepSpeed's engine fills them before its all-reduce (so that momentum and
            weight decay still act on it); else its gradient stays as it is, as under torch DDP.
        takes_unfrozen: a parameter frozen at the attach and trainable later joins the plans at the
            next training forward pass (``GradSync``; never with a partition); else one the optimizer
            holds is refused at the step (for optimizers whose parameters are fixed at the attach).
    """
    members = OptimizerGroup.of(optimizer) if isinstance(optimizer, (list, tuple)) else None
    bound = optimizer if members is None else members
    if members is None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"'optimizer' must be a torch.optim.Optimizer or a list of them, "
                          f"got {type(optimizer).__name__}")
    check_not_attached(model)
    table = ParameterTable.of(model)
    table.check_optimizer(bound)
    table.check_compressor(arguments.codec.name)
    if arguments.profile is not None:
        table.check_profile(arguments.profile)
    skeleton = table.profile(type(model).__name__)
    arguments.planner(skeleton, arguments.cost or CostModel(1e-4, 1e-9))  # the planner takes this model
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialised: call init_process_group first")
    if partition is not None:
        partition.check({name: parameter.numel() for name, parameter in table.parameters.items()},
                        dist.get_world_size(process_group))
    channels = _meet(model, arguments, process_group)
    try:
        with waiting_for("the codec's seed at gradsync.wrap", arguments.timeout):
            seed = share_from_first(random.randrange(2**62), channels.process_group)
    except BaseException:
        channels.destroy()
        raise
    writer = ChromeTrace(arguments.trace, channels.rank) if arguments.trace else None
    codec = arguments.codec
    codec.may_skip_steps = arguments.nonfinite != "raise"
    codec.setup(table.tensor_specs(), channels.world_size, seed)
    installed = InstalledPlans(table, channels, arguments.planner, codec, arguments.nonfinite, writer,
                               arguments.plan_trials, partition, arguments.replan, unused_as_zeros,
                               calibration=(arguments.warmup_iterations, arguments.measure_iterations))
    sync = GradSync(model, table, channels, installed, arguments.broadcast_buffers, writer, takes_unfrozen)
    with sync.detached_on_error():
        sync.check_optimizer(bound)
        with waiting_for("the network probes at gradsync.wrap", arguments.timeout):
            cost = arguments.cost or measure_cost(channels, skeleton.total_bytes, device=table.device,
                                                  collective=installed.collective,
                                                  work=getattr(model, "probe_work", None))
        if arguments.profile is not None:
            installed.install(arguments.profile, cost)
        else:
            installed.measure_profile(type(model).__name__, cost)
        if members is None:
            return model, SyncedOptimizer(optimizer, sync)
        return model, [SyncedOptimizer(member, sync, bound=members) for member in members.optimizers]


def _meet(model: torch.nn.Module, arguments: WrapArguments, process_group) -> Channels:
    """gradsync's process group over the caller's ranks (every collective of gradsync bounded by
    `timeout`), the settings check, rank 0's parameters and buffers broadcast, then the channels."""
    timeout = timedelta(seconds=arguments.timeout)
    group = control_group(process_group, timeout)
    try:
        with waiting_for("the settings check of gradsync.wrap", arguments.timeout):
            check_same_settings(arguments, model, group)
        forest = _forest_topology(arguments, group)
        with waiting_for("the broadcast of rank 0's parameters and buffers at gradsync.wrap", arguments.timeout):
            broadcast_from_first([t for t in (*model.parameters(), *model.buffers()) if t.numel()], group)
        return Channels(arguments.channels, group, timeout, forest, owns_group=True)
    except BaseException:
        dist.destroy_process_group(group)
        raise


SHOWN_DIFFERENCES = 5  # fields of a settings mismatch described in the error


def model_table(model: torch.nn.Module) -> dict:
    """What every rank's model must share: its parameters' and buffers' names, and each one's
    shape, dtype and device type (and a parameter's requires_grad)."""
    table = {"parameter names": tuple(name for name, _ in model.named_parameters()),
             "buffer names": tuple(name for name, _ in model.named_buffers())}
    for name, parameter in model.named_parameters():
        table[f"parameter {name!r}"] = (tuple(parameter.shape), str(parameter.dtype).removeprefix("torch."),
                                        parameter.device.type, parameter.requires_grad)
    for name, buffer in model.named_buffers():
        table[f"buffer {name!r}"] = (tuple(buffer.shape), str(buffer.dtype).removeprefix("torch."), buffer.device.type)
    return table


def check_same_settings(arguments: WrapArguments, model: torch.nn.Module, process_group) -> None:
    """Every rank passed `wrap` the same settings (`WrapArguments.shared_settings`: the planner's,
    the codec's and the transport's options among them) and the same model (`model_table`); else
    every rank raises, naming the fields that differ and the ranks, before any other collective
    (a dtype or shape that differs would otherwise meet inside the backend).

    Args:
        arguments: this rank's checked ``wrap`` arguments.
        model: this rank's model.
        process_group: gradsync's process group (bounded by ``wrap``'s timeout).
    """
    everyone = gather_from_all({**arguments.shared_settings(), **model_table(model)}, process_group)
    first = everyone[0]
    differing = {}
    for key in dict.fromkeys(key for settings in everyone for key in settings):
        ranks = [rank for rank, settings in enumerate(everyone) if settings.get(key) != first.get(key)]
        if ranks:
            differing[key] = ranks
    if not differing:
        return
    named = sorted(differing)[:SHOWN_DIFFERENCES]
    more = f" and {len(differing) - len(named)} more" if len(differing) > len(named) else ""
    details = "; ".join(f"{key}: rank {differing[key][0]} has {everyone[differing[key][0]].get(key)!r}, rank 0 has "
                        f"{first.get(key)!r}" for key in named)
    ranks = sorted({rank for ranks in differing.values() for rank in ranks})
    raise ConfigError(f"gradsync.wrap was given different {named}{more} on different ranks (ranks {ranks} differ "
                      f"from rank 0): {details}. Pass the same arguments and model on every rank")


def _forest_topology(arguments: WrapArguments, process_group) -> Topology | None:
    """The topology the forest transport packs (the complete graph of the ranks by default),
    checked against the group's size before any collective."""
    if arguments.transport != "forest":
        return None
    size = dist.get_world_size(process_group)
    topology = arguments.topology or complete(size)
    check_group_size(topology, size)
    return topology
