"""GradSyncStrategy: Lightning's DDP strategy with gradsync's runtime in place of DistributedDataParallel.

Lightning keeps launching the ranks, initialising the process group, moving the model and
splitting the data (all inherited from DDPStrategy); the model is never wrapped (`_setup_model`,
`_register_ddp_hooks`). Once the optimizers exist (`setup_optimizers`, called by DDPStrategy.setup
after the model is on its device), `gradsync.wrap` attaches hooks to the LightningModule and
broadcasts rank 0's parameters and buffers, and its SyncedOptimizers replace the strategy's
optimizers, so Lightning's optimizer steps and checkpoints go through them. `teardown` detaches it.
"""
from __future__ import annotations

import logging
import multiprocessing
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from typing_extensions import override

from .. import compress, planners
from ..errors import ConfigError, unknown_name
from ..runtime import attached, no_sync, wrap
from ..runtime.arguments import check_wrap_arguments

# DDPStrategy's own arguments; every other keyword goes to gradsync.wrap (DDPStrategy's **kwargs
# would configure DistributedDataParallel, which is not used here). `timeout` is gradsync's (seconds),
# given to Lightning's process group too. The Lightning objects (accelerator, cluster_environment,
# checkpoint_io, precision_plugin) go to DDPStrategy untouched, as with Lightning's own `ddp`; the
# other options are checked at construction (check_lightning_options).
LIGHTNING_OPTIONS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                     "process_group_backend", "start_method")
START_METHODS = ("popen", "spawn", "fork", "forkserver")  # DDPStrategy's

STATS_PREFIX = "gradsync/"

# DDPStrategy's keyword arguments for DistributedDataParallel (or its comm hooks), which
# GradSyncStrategy replaces: what to do instead
DDP_ONLY_OPTIONS = {
    "find_unused_parameters": "gradsync synchronises parameters that got no gradient on a rank by itself",
    "static_graph": "gradsync's plans are fixed once made; no graph to declare",
    "gradient_as_bucket_view": "gradsync's gradients are views of its op buffers already",
    "bucket_cap_mb": "torch DDP's buckets are the 'ddp' scheduler: scheduler='ddp', bucket_cap_bytes=<bytes>",
    **dict.fromkeys(("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"),
                    "compress with compressor=<name> (gradsync list); to keep torch DDP, use "
                    "DDPStrategy(ddp_comm_state=gradsync.comm_hooks.CompressionState(model, <name>), "
                    "ddp_comm_hook=gradsync.comm_hooks.compression_hook)"),
    "model_averaging_period": "post-local SGD is not one of gradsync's methods",
}


class GradSyncArguments:
    """What gradsync's Lightning and Fabric strategies share: their arguments, checked before any
    rank starts, the runtime they attach, its teardown and the registration of their names."""

    # the DDPStrategy's own arguments in this Lightning package; every other keyword goes to wrap
    LIGHTNING_OPTIONS = LIGHTNING_OPTIONS
    PRECISION = "precision_plugin"  # the strategy's attribute holding its precision plugin

    def __init__(self, scheduler: str = "auto", compressor=None, options: dict | None = None, **keywords):
        """The strategy, every argument checked before any rank starts.

        Args:
            scheduler: a gradsync scheduler name (``gradsync list``).
            compressor: None, a name, a ``{"type": name, ...}`` dict or a Codec.
            options: the keywords below as one mapping, for configs that name only declared
                arguments (LightningCLI's YAML: ``init_args: {options: {partition_bytes: 4096}}``).
            keywords: DDPStrategy's own (LIGHTNING_OPTIONS, e.g. ``start_method``); the rest go to
                ``gradsync.wrap`` (channels, profile, cost, timeout, nonfinite, scheduler options,
                ...). A given `timeout` (seconds) is also Lightning's process group timeout.
                DistributedDataParallel's options are refused, each with what to use instead.
        """
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"'options' must be a mapping of option names to values, got {type(options).__name__}")
        twice = sorted(set(options or {}) & set(keywords))
        if twice:
            raise ConfigError(f"{twice} given both in 'options' and as keywords: give each once")
        options = {**(options or {}), **keywords}
        for name in options:
            if name in DDP_ONLY_OPTIONS:
                raise ConfigError(f"{type(self).__name__} replaces DistributedDataParallel and takes no {name!r}: "
                                  f"{DDP_ONLY_OPTIONS[name]}")
        lightning = {name: options.pop(name) for name in self.LIGHTNING_OPTIONS if name in options}
        # bad values fail here, before any rank is launched
        check_lightning_options(lightning)
        arguments = check_wrap_arguments(scheduler=scheduler, compressor=compressor, **options)
        if "timeout" in options:
            lightning["timeout"] = timedelta(seconds=arguments.timeout)
        super().__init__(**lightning)
        self.scheduler = scheduler
        self.compressor = compressor
        self.gradsync_options = options
        self.runtime = None  # the GradSync attached to the model while fitting

    def _wrap_options(self) -> dict:
        """The user's gradsync options, and the GradScaler of fp16 AMP, if any: non-finite gradients
        then default to "ignore" (the scaler skips such steps on every rank and lowers its scale, as
        with DDP), and a compressor's error feedback follows the scale (``wrap``'s `grad_scaler`)."""
        if self._grad_scaler() is None:
            return self.gradsync_options
        return {"grad_scaler": self._grad_scaler(), **self.gradsync_options}

    def _grad_scaler(self):
        return getattr(getattr(self, self.PRECISION), "scaler", None)

    def _attach(self, module, optimizers: list) -> list:
        """``gradsync.wrap`` on `module` with `optimizers` (one, or several that each update their
        own parameters); the runtime kept, their SyncedOptimizers returned in order."""
        model, synced = wrap(module, optimizers[0] if len(optimizers) == 1 else list(optimizers), self.scheduler,
                             self.compressor, **self._wrap_options())
        self.runtime = attached(model)
        return synced if isinstance(synced, list) else [synced]

    @override
    def teardown(self) -> None:
        """Detach gradsync (apply pending updates, remove hooks, release its channel process
        groups) while the process group still exists."""
        if self.runtime is not None:
            self.runtime.detach()
            self.runtime = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Register with `cls` a strategy name for every planner and compressor registered now or
        later (`strategy_entries`), and the forest transport; re-registering replaces."""

        def add(entry) -> None:
            if entry is None:
                return
            name, init_params, description = entry
            taken = strategy_registry[name] if name in strategy_registry else None
            if taken is not None and not issubclass(taken["strategy"], GradSyncArguments):
                raise ConfigError(f"strategy name {name!r} is Lightning's own {taken['strategy'].__name__}: give the "
                                  "planner another strategy name (PlannerSpec(strategy=...))")
            strategy_registry.register(name, cls, description=description, override=True, **init_params)

        add(FOREST)
        planners.registry.subscribe(lambda spec: add(planner_entry(spec)))
        compress.registry.subscribe(lambda spec: add(codec_entry(spec)))


class GradSyncOverrides(GradSyncArguments):
    """The DDPStrategy methods that assumed a DistributedDataParallel wrapper, rewritten for
    gradsync's hooks; mixed into the DDPStrategy of each installed Lightning package."""

    DEFERRED_UPDATES_CALLBACK: type  # DeferredUpdatesFirst as a callback of that package

    def __init__(self, scheduler: str = "auto", compressor=None, progress_bar: bool = False,
                 options: dict | None = None, **keywords):
        """The strategy, every argument checked before any rank starts.

        Args:
            scheduler, compressor, options, keywords: as GradSyncArguments.
            progress_bar: show gradsync's per-step statistics on the progress bar too (they go to
                every logger either way).
        """
        if not isinstance(progress_bar, bool):
            raise ConfigError(f"'progress_bar' must be true or false, got {progress_bar!r}")
        super().__init__(scheduler, compressor, options, **keywords)
        self.progress_bar = progress_bar
        self.logged_iteration = -1  # the last iteration whose statistics were logged

    # -- no DistributedDataParallel --------------------------------------------------------------
    def _setup_model(self, model):
        return model

    def _register_ddp_hooks(self) -> None:
        """gradsync's hooks are attached by `wrap` in `setup_optimizers`."""

    def setup_optimizers(self, trainer) -> None:
        """Create the optimizers as Lightning does, then attach gradsync and step through its
        SyncedOptimizers: one runtime for the module, whichever optimizer steps (several, under
        manual optimisation: each updates its own parameters, as ``gradsync.wrap`` takes a list)."""
        super().setup_optimizers(trainer)
        started = time.perf_counter()
        synced = self._attach(self.lightning_module, self.optimizers)
        self.logged_iteration = -1
        self.plan_announced = False
        self._announce(f"attached in {time.perf_counter() - started:.1f} s")
        # gradients are local until gradsync's ops finish: when code between the backward pass and the
        # step may read them, the backward pass ends once they are averaged, as DDP's does (this gives
        # up overlapping forward-phase ops with the next forward)
        self.runtime.wait_at_backward_end = self._gradients_read_before_step()
        self.optimizers = synced
        callbacks = trainer.callbacks
        if not any(isinstance(callback, DeferredUpdatesFirst) for callback in callbacks):
            callbacks.insert(0, self.DEFERRED_UPDATES_CALLBACK(self))

    def training_step(self, *args, **kwargs):
        with self.precision_plugin.train_step_context():
            return self._through_module_call("training_step", *args, **kwargs)

    def validation_step(self, *args, **kwargs):
        with self.precision_plugin.val_step_context():
            return self._through_module_call("validation_step", *args, **kwargs)

    def _through_module_call(self, method: str, *args, **kwargs):
        """While fitting, run the step inside the LightningModule's own call, as DDP's wrapper
        does, so that gradsync's root forward hook (buffers from rank 0, layer timing) runs even
        when the step does not call `self(...)`."""
        module = self.lightning_module
        if self.runtime is None:
            return getattr(module, method)(*args, **kwargs)
        return self._forward_redirection(module, module, method, *args, **kwargs)

    @contextmanager
    def block_backward_sync(self):
        """Gradient accumulation (`accumulate_grad_batches`): the next synchronised backward pass
        reduces the accumulated gradients."""
        with no_sync(self.lightning_module):
            yield None

    def _gradients_read_before_step(self) -> bool:
        """Whether clipping (`gradient_clip_val` or the module's own `configure_gradient_clipping`),
        a GradScaler's unscaling, an `on_after_backward` or `on_before_optimizer_step` of the module
        or of a callback, or, under manual optimisation, the user's code runs between the backward
        pass and the step."""
        module = self.lightning_module
        trainer = module.trainer
        return bool(not module.automatic_optimization or trainer.gradient_clip_val or self._grad_scaler() is not None
                    or _overrides(module, "configure_gradient_clipping")
                    or any(_overrides(hooks, hook) for hooks in (module, *trainer.callbacks)
                           for hook in ("on_after_backward", "on_before_optimizer_step")))

    # -- per-iteration statistics ------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Step, then log the iteration's statistics (none when a GradScaler skipped the step)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        report = self.runtime.report()
        if report.latest is not None and report.latest.iteration > self.logged_iteration:
            self.logged_iteration = report.latest.iteration
            self._log_stats(report.latest, report.gradient_bytes)
        if not self.plan_announced and not report.measuring:
            self._announce(f"chosen after {report.iteration} iterations of measurement")
        return output

    def _announce(self, when: str) -> None:
        """One line on rank 0 to Lightning's console logger: `when`, then what runs: the plan of
        each wire layout (its planner, ops and predicted iteration time), or that the measurement
        runs first."""
        report = self.runtime.report()
        self.plan_announced = not report.measuring
        if self.global_rank == 0:
            console_logger(type(self)).info(f"gradsync ({report.scheduler}, compressor {report.compressor}): "
                                            f"{when}; {report.plan_summary()}")

    def _log_stats(self, stats, gradient_bytes: int) -> None:
        """Log an iteration's ``IterationStats.metrics`` to every Lightning logger, if any, and to the
        progress bar if asked (rank 0's values, as for any metric logged without sync_dist)."""
        has_logger = bool(self.lightning_module.trainer.loggers)
        for name, value in stats.metrics(gradient_bytes).items():
            self.lightning_module.log(STATS_PREFIX + name, value, on_step=True, on_epoch=False,
                                      prog_bar=self.progress_bar, logger=has_logger)

    # -- checkpoints -------------------------------------------------------------------------------
    def lightning_module_state_dict(self):
        """Apply deferred (forward-phase) updates first, so the saved weights are the stepped ones."""
        if self.runtime is not None:
            self.runtime.flush()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer):
        """The full state on every rank: Lightning dumps checkpoints on every rank (rank 0 writes),
        and the SyncedOptimizer's state_dict gathers every rank's error feedback, a collective."""
        return optimizer.state_dict()


class DeferredUpdatesFirst:
    """Put first among the Trainer's callbacks by the strategy: at the end of each training epoch
    and of the training, the updates deferred to the layers' next forward are applied before any
    other callback reads or writes the parameters. (StochasticWeightAveraging averages them at the
    next epoch's start and copies its average into the model at the training's end; applied later,
    at the teardown, the last step's update would land on that average.) A callback reading them at
    each batch's end still sees the deferred layers a step behind (``optimizer.synchronize()``)."""

    def __init__(self, strategy: GradSyncOverrides):
        self.strategy = strategy

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._apply()

    def on_train_end(self, trainer, pl_module) -> None:
        self._apply()

    def _apply(self) -> None:
        if self.strategy.runtime is not None:
            self.strategy.runtime.flush()


def console_logger(strategy_class: type) -> logging.Logger:
    """A child of the logger that the Lightning package of `strategy_class` prints at INFO."""
    base = next(cls for cls in strategy_class.__mro__ if cls.__name__ == "DDPStrategy")
    return logging.getLogger(base.__module__.rsplit(".strategies", 1)[0] + ".gradsync")


def check_lightning_options(options: dict) -> None:
    """ConfigError for a start method, process group backend or parallel_devices in `options`
    (DDPStrategy's) that the ranks could not use."""
    methods = [name for name in START_METHODS if name == "popen" or name in multiprocessing.get_all_start_methods()]
    if options.get("start_method", "popen") not in methods:
        raise unknown_name("start_method", options["start_method"], methods)
    backend = options.get("process_group_backend")
    # a backend or a "device:backend,..." map, as init_process_group takes
    if backend is not None and not (isinstance(backend, str) and all(
            dist.is_backend_available(part.rpartition(":")[2]) for part in backend.split(","))):
        available = [name for name in dist.Backend.backend_list
                     if name != "undefined" and dist.is_backend_available(name)]
        raise ConfigError(f"'process_group_backend' {backend!r} is not a torch.distributed backend available here; "
                          f"available: {', '.join(available)}")
    devices = options.get("parallel_devices")
    if devices is not None and not (isinstance(devices, (list, tuple))
                                    and all(isinstance(device, torch.device) for device in devices)):
        raise ConfigError(f"'parallel_devices' must be a list of torch.device, got {devices!r}")


def _overrides(instance, hook: str) -> bool:
    """Whether `instance` replaces the Lightning hook `hook` (Lightning's own test, against the base
    class that declares it, from either Lightning package)."""
    from lightning_utilities.core.overrides import is_overridden  # installed with Lightning

    declaring = next(cls for cls in reversed(type(instance).__mro__) if hook in vars(cls))
    return is_overridden(hook, instance, declaring)


# compressor strategies: the compressor of that name, scheduled by COMPRESSOR_SCHEDULER
COMPRESSOR_SCHEDULER = "optimal_merge"
# the transport strategy: the `auto` plan's ops carried by reduce/broadcast trees (topology: the
# complete graph of the ranks unless the strategy is built with ``topology=``)
FOREST = ("forest", {"scheduler": "auto", "transport": "forest"},
          "gradsync: reduce/broadcast trees packed on the network topology (forest packing)")


def planner_entry(spec: planners.PlannerSpec) -> tuple[str, dict, str]:
    """(strategy name, init params, description) of a planner's strategy."""
    return spec.strategy_name, {"scheduler": spec.name}, f"gradsync: {spec.description}"


def codec_entry(spec: compress.CodecSpec) -> tuple[str, dict, str] | None:
    """(strategy name, init params, description) of a compressor's strategy (None: it has none)."""
    if not spec.strategy:
        return None
    return spec.name, {"scheduler": COMPRESSOR_SCHEDULER, "compressor": spec.name}, f"gradsync: {spec.description}"


def strategy_entries() -> dict[str, tuple[dict, str]]:
    """Every strategy name gradsync registers with Lightning: its init params and description."""
    entries = [planner_entry(spec) for spec in planners.registry]
    entries += [entry for entry in map(codec_entry, compress.registry) if entry is not None]
    return {name: (init_params, description) for name, init_params, description in [*entries, FOREST]}
