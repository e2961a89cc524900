"""``initialize``: ``deepspeed.initialize`` with gradsync owning the gradient synchronisation.

The engine keeps DeepSpeed's loop (``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``,
gradient accumulation, LR scheduling, checkpoints); gradsync replaces its gradient all-reduce:
- ``engine.enable_backward_allreduce = False`` switches DeepSpeed's own all-reduce off;
- gradsync's hooks on ``engine.module`` launch the plan's ops during the backward pass of an
  accumulation boundary (the other micro-batches accumulate locally, as under ``no_sync``);
- ``engine.optimizer`` becomes gradsync's SyncedOptimizer, so the ``optimizer.step()`` DeepSpeed
  calls at the boundary waits for the ops and applies (or defers) the update, and the optimizer
  state DeepSpeed checkpoints carries gradsync's codec state and step;
- a step skipped for non-finite gradients (``"nonfinite": "skip"``) is the optimizer's
  ``overflow``, as DeepSpeed's fp16 optimizers report one: the engine counts it in
  ``skipped_steps``, ``was_step_applied()`` is False and the LR scheduler does not advance.
"""
from __future__ import annotations

import contextlib
from functools import cache

import deepspeed

from ..runtime import SyncedOptimizer, WrapArguments, attach as attach_runtime, attached, no_sync
from .config import SECTION, check_engine_config, resolve, wrap_arguments


def initialize(args=None, model=None, optimizer=None, model_parameters=None, config=None, **kwargs):
    """A drop-in for ``deepspeed.initialize`` returning its tuple ``(engine, optimizer,
    training_dataloader, lr_scheduler)``. With a top-level ``"gradsync"`` section in the config,
    the section and the DeepSpeed settings gradsync depends on are checked first (ConfigError
    before any collective), then the engine is built and gradsync attached; without one this is
    ``deepspeed.initialize`` unchanged.

    With gradsync attached, the optimizer returned is the engine's, gradsync's SyncedOptimizer.

    Args:
        args, model, optimizer, model_parameters, config: passed on to ``deepspeed.initialize``
            unchanged; gradsync also reads the config from `config`, ``config_params`` or `args` (as
            DeepSpeed does) and checks `model` and `optimizer` (see ``check_engine_config``).
        **kwargs: passed on to ``deepspeed.initialize`` unchanged (``training_data``, ``lr_scheduler``,
            ``mpu``, ``config_params``, ...); ``mpu`` and ``mesh_param`` must be None with gradsync.

    Raises:
        ConfigError: for a bad ``"gradsync"`` section or a DeepSpeed setting gradsync does not support.
    """
    ds_config = resolve(args, config, kwargs.get("config_params"))
    if ds_config is None or SECTION not in ds_config:
        return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                    config=config, **kwargs)
    arguments = wrap_arguments(ds_config[SECTION])
    check_engine_config(ds_config, arguments.codec, model, optimizer, kwargs.get("mpu"),
                        kwargs.get("mesh_param"))
    engine, _, dataloader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, config=config, **kwargs)
    attach(engine, arguments)
    return engine, engine.optimizer, dataloader, lr_scheduler


def attach(engine, arguments: WrapArguments) -> None:
    """Turn off the engine's all-reduce and attach gradsync with the checked `arguments`;
    ``engine.gradsync`` is the runtime (``engine.gradsync.report()``: plans, trials, statistics)."""
    _, synced = attach_runtime(engine.module, engine.optimizer, arguments)
    engine.enable_backward_allreduce = False
    engine.optimizer = DeepSpeedSyncedOptimizer(synced.optimizer, synced.sync)
    engine.gradsync = attached(engine.module)
    engine.__class__ = _with_gradsync(type(engine))


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


@cache
def _with_gradsync(engine_class: type) -> type:
    return type(f"GradSync{engine_class.__name__}", (GradSyncEngine, engine_class), {})
