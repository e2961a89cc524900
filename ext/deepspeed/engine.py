"""``build``: DeepSpeed's engine with gradsync owning the gradient synchronisation, when its config
has a top-level ``"gradsync"`` section (``gradsync.deepspeed_entry`` routes every engine here).

The engine keeps DeepSpeed's loop (``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``,
gradient accumulation, LR scheduling, checkpoints, its monitor); gradsync replaces its gradient
all-reduce:
- ``engine.enable_backward_allreduce = False`` switches DeepSpeed's own all-reduce off;
- gradsync's hooks on ``engine.module`` launch the plan's ops during the backward pass of an
  accumulation boundary (the other micro-batches accumulate locally, as under ``no_sync``);
- at ZeRO stage 0 in fp32 ``engine.optimizer`` becomes gradsync's SyncedOptimizer
  (``deepspeed.initialize`` returns it), so the ``optimizer.step()`` DeepSpeed calls at the
  boundary waits for the ops and applies (or defers) the update, and the optimizer state DeepSpeed
  checkpoints carries gradsync's codec state and step; DeepSpeed's own optimizer stays where it
  wraps the user's (fp16 and bf16 at stage 0, ZeRO's at stages 1 and 2), taken over as
  ``gradsync.deepspeed.takeover`` and ``gradsync.deepspeed.zero`` describe;
- a step skipped for non-finite gradients (``"nonfinite": "skip"``) is the optimizer's
  ``overflow``, as DeepSpeed's fp16 optimizers report one: the engine counts it in
  ``skipped_steps``, ``was_step_applied()`` is False and the LR scheduler does not advance;
- each step's statistics go to DeepSpeed's monitor (``tensorboard``, ``wandb``, ``csv_monitor``)
  as ``Train/gradsync/<name>``, and the plan chosen is logged once, on rank 0.
"""
from __future__ import annotations

import contextlib
import inspect

from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import log_dist

from ..runtime import SyncedOptimizer, WrapArguments, attach as attach_runtime, attached, check_not_attached, no_sync
from ..runtime.parameter_table import ParameterTable
from .config import SECTION, check_engine_config, default_nonfinite, wrap_arguments
from .takeover import OwnStep, extended, take_over
from .zero import ZeroStep, take_over as take_over_zero, zero_partition

MIXED_PRECISION_OPTIMIZERS = (FP16_Optimizer, FP16_UnfusedOptimizer)  # stage 0's fp16 and bf16

MONITOR_PREFIX = "Train/gradsync/"


def build(init, engine, *args, **kwargs) -> None:
    """``DeepSpeedEngine.__init__`` (`init`, called with `engine`, `args` and `kwargs`) honouring
    the ``"gradsync"`` section of its config; without the section, `init` alone.

    1. The section and the DeepSpeed settings gradsync depends on are checked: ConfigError naming
       the key before the engine starts anything (no collective, no broadcast of the weights); so is
       a model whose earlier engine still holds gradsync (not destroyed).
    2. `init` builds DeepSpeed's engine.
    3. gradsync is attached (`attach`).

    Raises:
        ConfigError: for a bad ``"gradsync"`` section or a DeepSpeed setting gradsync does not support.
    """
    call = inspect.signature(init).bind(engine, *args, **kwargs).arguments
    config = call["config_class"]
    if SECTION not in config._param_dict:
        init(engine, *args, **kwargs)
        return
    arguments = wrap_arguments(config._param_dict[SECTION], default_nonfinite(config))
    check_engine_config(config, arguments.codec, call["model"], call.get("optimizer"), call.get("mpu"),
                        call.get("mesh_device"))
    check_not_attached(call["model"])
    init(engine, *args, **kwargs)
    attach(engine, arguments)


def attach(engine, arguments: WrapArguments) -> None:
    """Turn off the engine's all-reduce and attach gradsync with the checked `arguments`;
    ``engine.gradsync`` is the runtime (``engine.gradsync.report()``: plans, trials, statistics).
    Under ZeRO stages 1 and 2 gradsync delivers each rank its partition to DeepSpeed's ZeRO
    optimizer, which stays the engine's (``gradsync.deepspeed.zero``), as DeepSpeed's fp16 or bf16
    optimizer does at stage 0 (``gradsync.deepspeed.takeover``: its step reads the averaged
    gradients); at stage 0 in fp32 the engine's optimizer becomes gradsync's SyncedOptimizer. A
    parameter no rank produced a gradient for gets zeros, as DeepSpeed's all-reduce gives it (so
    that momentum and weight decay act on it as they do without gradsync). A parameter frozen at
    ``deepspeed.initialize`` and unfrozen later joins the plans at stage 0 in fp32, as DeepSpeed's
    all-reduce takes it; ZeRO's partitions and the mixed-precision optimizers' flat buffers hold the
    parameters trainable at ``initialize`` alone, there as without gradsync."""
    if isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
        zero = engine.optimizer
        table = ParameterTable.of(engine.module)
        _, synced = attach_runtime(engine.module, ZeroStep(zero, list(table.parameters.values())), arguments,
                                   partition=zero_partition(zero, table), unused_as_zeros=True, takes_unfrozen=False)
        take_over_zero(zero, synced)
    elif isinstance(engine.optimizer, MIXED_PRECISION_OPTIMIZERS):
        own = engine.optimizer
        parameters = list(ParameterTable.of(engine.module).parameters.values())
        _, synced = attach_runtime(engine.module, OwnStep(own, parameters), arguments, unused_as_zeros=True,
                                   takes_unfrozen=False)
        take_over(own, synced)
    else:
        _, synced = attach_runtime(engine.module, engine.optimizer, arguments, unused_as_zeros=True)
        engine.optimizer = DeepSpeedSyncedOptimizer(synced.optimizer, synced.sync)
    engine.enable_backward_allreduce = False
    engine.gradsync = attached(engine.module)
    engine.gradsync_logged_iteration = -1
    engine.gradsync_plan_logged = False
    engine.__class__ = extended(GradSyncEngine, type(engine))
    engine.log_gradsync_plan(f"attached to {type(engine.module).__name__}")


class DeepSpeedSyncedOptimizer(SyncedOptimizer):
    """SyncedOptimizer with the ``overflow`` flag DeepSpeed's engine reads after ``step()``."""

    @property
    def overflow(self) -> bool:
        """Whether the last step was skipped for non-finite gradients (on every rank)."""
        return self.sync.last_step_skipped


class GradSyncEngine:
    """Overrides mixed into the engine's own class (``DeepSpeedEngine`` or a subclass)."""

    def backward(self, loss, *args, **kwargs):
        """Synchronise only on the accumulation boundary and outside ``engine.no_sync()``."""
        local = self.inside_no_sync_ctxt or not self.is_gradient_accumulation_boundary()
        with no_sync(self.module) if local else contextlib.nullcontext():
            return super().backward(loss, *args, **kwargs)

    def coalesce_grad_reduction(self):
        """Refused: DeepSpeed's context reduces the gradients once its block ends, after the last
        backward pass; gradsync reduces them during the backward pass of the accumulation boundary,
        which must be known as it starts."""
        raise NotImplementedError(
            "gradsync synchronises the gradients in the backward pass of the accumulation boundary, so it cannot "
            "reduce them after a coalesce_grad_reduction() block: mark the boundary instead, with "
            "engine.set_gradient_accumulation_boundary(False) before each backward of the step but the last and "
            "set_gradient_accumulation_boundary(True) before the last (or let 'gradient_accumulation_steps' do it)")

    def step(self, *args, **kwargs):
        """DeepSpeed's step, then the iteration's statistics to its monitor (rank 0's)."""
        output = super().step(*args, **kwargs)
        report = self.gradsync.report()
        latest = report.latest
        if latest is not None and latest.iteration > self.gradsync_logged_iteration:
            self.gradsync_logged_iteration = latest.iteration
            if self.monitor.enabled and self.global_rank == 0:
                self.monitor.write_events([(MONITOR_PREFIX + name, value, self.global_samples)
                                           for name, value in latest.metrics(report.gradient_bytes).items()])
        if not self.gradsync_plan_logged and not report.measuring:
            self.log_gradsync_plan(f"chosen after {report.iteration} iterations of measurement")
        return output

    def log_gradsync_plan(self, when: str) -> None:
        """One line on rank 0 to DeepSpeed's logger: `when`, then the plan that runs (or that the
        measurement runs first)."""
        report = self.gradsync.report()
        self.gradsync_plan_logged = not report.measuring
        log_dist(f"gradsync ({report.scheduler}, compressor {report.compressor}): {when}; {report.plan_summary()}",
                 ranks=[0])

    def zero_grad(self):
        """Through gradsync: a module whose update is deferred to its next forward keeps its
        gradient until that update."""
        self.optimizer.zero_grad(set_to_none=True)

    def clip_fp32_gradients(self):
        """Clip the averaged gradients: wait for every op first (the clip needs the global norm)."""
        self.optimizer.synchronize()
        super().clip_fp32_gradients()

    def destroy(self):
        """Detach gradsync (hooks, channel process groups) before DeepSpeed's teardown."""
        self.gradsync.detach()
        super().destroy()

