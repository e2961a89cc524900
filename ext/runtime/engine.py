"""GradSync: attaches a plan's execution to a model with hooks, and steps the optimizer.

Lifecycle of one iteration:
1. forward: a module with deferred parameters first waits for their ops and applies their update,
   as does any other module holding one of them (tied weights); modules whose own forward did not
   run in a forward pass (e.g. nn.MultiheadAttention's out_proj, whose weight its parent reads
   directly) are updated when the model's forward starts (the hooks sit on the modules that may
   need them: ``_hooks_where_needed``);
2. backward: the first gradient to arrive (a hook on every parameter, before it accumulates; or,
   where no op launches before the pass ends, the first gradient of the forward's outputs:
   ``output_start``) starts the iteration and the broadcast of the first rank's buffers (ahead of every op); each
   parameter whose gradient may let an op launch early (``Plan.tensors_launching_early``) has a
   post-accumulate-grad hook that marks it ready, the others are marked on arrival; ops launch in
   plan order per channel as their slices become ready; when the backward pass ends, the remaining
   ops (the last one, the forward-phase ones) launch and the buffers' broadcast is waited for;
3. ``optimizer.step()``: waits for the backward-phase ops that are not deferred and updates the
   parameters whose ops are complete; the others are updated by step 1 of the next iteration, or
   when the model's ``state_dict()`` or ``load_state_dict()``, or a module's ``parameters()`` or
   ``named_parameters()`` outside a forward pass, is called before it.
The parts: ``installed.InstalledPlans`` (the plans in force, their executors and predictions, the
measurement that replaces them while it runs: ``runtime.measure``), ``deferred.DeferredUpdates``
(step 3's updates left for step 1) and ``statistics.IterationClock`` (where each iteration's time
went).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import time
import types
import weakref
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..agreement import check_same_on_all_ranks, waiting_for
from ..compress import Codec
from ..compress.loss_scale import LossScaleFollower
from ..errors import ConfigError, GradientsChangedInFlight
from ..plan import Plan
from .channels import Channels
from .deferred import DeferredUpdates
from .executor import NonFiniteGradient, PlanExecutor
from .first_rank import FirstRankValues
from .output_start import OutputStart
from .over_ranks import reduction_over_ranks
from .installed import InstalledPlans
from . import read_through
from .module_hooks import on_module
from .parameter_table import ParameterTable
from .measure import IterationDone, Measurement
from .report import SyncReport
from .statistics import IterationClock

log = logging.getLogger("gradsync")
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, GradSync]" = weakref.WeakKeyDictionary()


class GradSync:
    """The runtime attached to one model: its hooks and the iteration's lifecycle (see the module
    docstring), over three parts: the installed plans and the measurement (``installed``), the
    deferred updates (``deferred``) and the iteration statistics (``clock``)."""

    def __init__(self, model, table: ParameterTable, channels: Channels, installed: InstalledPlans,
                 broadcast_buffers: bool, trace=None, takes_unfrozen: bool = True):
        self.model = model
        self.channels = channels
        self.codec = installed.codec
        self.clock = IterationClock()
        # a parameter frozen at wrap that trains later joins the plans (`_take_in_unfrozen`), not where a
        # partition was fixed at the attach
        self.takes_unfrozen = takes_unfrozen and installed.partition is None
        self.buffers_from_first = FirstRankValues(channels.process_group) if broadcast_buffers else None
        # the modules holding buffers at wrap time, as torch DDP lists them once: the model is not
        # walked again each iteration (a buffer a module holds is re-read, so a replaced one is sent)
        self.buffer_modules = [m for m in model.modules() if next(m.buffers(recurse=False), None) is not None]
        self.trace = trace
        self.enabled = True
        self.in_backward = False
        self.backward_synced = False
        self.used_unsynced: set[str] = set()  # parameters whose gradients accumulated under no_sync since the last sync
        self.zeroed_in_place: set[str] = set()  # gradients zero_grad zeroed in place instead of setting to None
        self.gradients_held = False  # a synchronised backward's gradients, neither stepped nor zeroed
        self.wait_at_backward_end = False  # for front-ends whose hooks read the gradients before the step
        self.loss_scale: LossScaleFollower | None = None  # a GradScaler's scale, followed by the error feedback
        self.steps_counted = 0  # synchronised steps settled so far with finite gradients: the codec's step
        self.step_unsettled = False  # the last synchronised backward's step, counted once its ops are all in
        self.rounds_now: tuple[str, ...] = ()  # the wire layouts the current iteration sends
        self.executor: PlanExecutor | None = None  # the one running the current iteration
        self.buffers_arriving: Callable[[], None] | None = None  # completes the backward pass's buffer broadcast
        # Every module hook acts on the module it was registered on alone: a copy of the model
        # (copy.deepcopy, as AveragedModel and EMA helpers make) carries the hooks, inert there.
        self.handles = [model.register_forward_pre_hook(on_module(model, self._root_pre_forward)),
                        model.register_state_dict_pre_hook(on_module(model, lambda *_: self.flush_deferred())),
                        model.register_load_state_dict_pre_hook(on_module(model, lambda *_: self.flush_deferred()))]
        self.handles.append(model.register_forward_hook(on_module(model, self._root_post_forward)))
        self.in_forward = False  # between the root's forward pre-hook and its forward hook
        self._take_table(table, installed)
        if type(model).zero_grad is torch.nn.Module.zero_grad:  # a class's own zero_grad is left as it is
            model.zero_grad = types.MethodType(_zero_grad_while_attached, model)
        self.read_through = read_through.install(model, self)  # parameters read after the step hold its updates
        _ATTACHED[model] = self

    def _take_table(self, table: ParameterTable, installed: InstalledPlans) -> None:
        """What is made for one table of the trainable parameters: its plans, its deferred updates,
        the hooks on its parameters and modules."""
        self.table = table
        self.installed = installed
        self.deferred = DeferredUpdates(table, self.clock)
        self.frozen_held: dict[str, torch.nn.Parameter] = {}  # parameters frozen at wrap that the optimizer holds
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in table.parameters.values())
        self.ran_forward: set[str] = set()  # owner modules whose forward ran in this forward pass
        self.silent: set[str] = set()  # owner modules seen skipping their forward: updated at the root
        self.arrival_hooks: dict[str, object] = {}  # parameter -> its arrival hook (none while begun at the outputs)
        self.output_start = OutputStart(table.parameters)
        self.begins_at_outputs = False  # the next iteration begins at the outputs' first gradient
        self.outputs_may_begin = False  # the plans in force let it (``_hooks_where_needed``)
        self.outputs_await_accumulators = False  # they would, once the accumulators can be reached
        self.output_pass = -1  # the autograd graph task whose outputs' first gradient came last
        self.used_in_graph: set[str] | None = None  # the graph's answer at that gradient, while the hooks begin
        # the last synchronised pass reached the outputs first, and the graph named its parameters
        self.announced = False
        self._hook_arrivals(True)
        self.table_handles = [module.register_forward_pre_hook(on_module(module, self._pre_forward_borrowing(owners)),
                                                               prepend=True)
                              for module, owners in table.borrowers.values()]
        if self.trace is not None:
            self.table_handles += [module.register_forward_hook(
                on_module(module, lambda _m, _i, _o, name=module_name: self.trace.forward_end(name)))
                for module_name, module in table.modules.items()]
        self.forward_hooks: dict[str, object] = {}  # owner module -> the handle of its pre-forward hook
        self.gradient_hooks: dict[str, object] = {}  # parameter -> the handle of its post-accumulate-grad hook
        self.ready_wanted: set[str] = set()  # the parameters the plans in force want ready hooks on
        self.hooks_made_for: tuple | None = None  # (plans, timing layers) the hooks were chosen for
        self.forward_hooks_base: set[str] = set()
        self.module_of = {name: m for m, names in table.owners.items() for name in names}
        self._hooks_where_needed()

    def _drop_table_hooks(self) -> None:
        """Remove the hooks `_take_table` and the plans put on the table's parameters and modules."""
        self._hook_arrivals(False)
        self.begins_at_outputs = False
        for handle in [*self.table_handles, *self.forward_hooks.values(), *self.gradient_hooks.values()]:
            handle.remove()
        self.table_handles, self.forward_hooks, self.gradient_hooks = [], {}, {}

    @property
    def measurement(self) -> Measurement | None:
        return self.installed.measurement

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped for non-finite gradients (on every rank)."""
        return self.executor is not None and self.executor.skip_step

    @property
    def sync_steps(self) -> int:
        """Synchronised steps whose averaged gradients were finite: the codec's step (settles the
        last one first, waiting for its ops)."""
        self.settle_step()
        return self.steps_counted

    def settle_step(self) -> None:
        """Count the last synchronised step once every op of it is in, unless an averaged gradient
        held inf or NaN: such a step is skipped (by ``nonfinite="skip"``, or by a GradScaler under
        "ignore"), its codec state left as before it, and the next runs as if it had never been."""
        if not self.step_unsettled:
            return
        self.executor.wait_all()
        self.step_unsettled = False
        self.steps_counted += not self.executor.nonfinite_seen

    @property
    def plan(self) -> Plan:
        """The (first) plan the next iteration executes."""
        return self.installed.plans[self.codec.rounds(self.sync_steps)[0]]

    def report(self) -> SyncReport:
        """A read-only snapshot for front-ends (``runtime.report``)."""
        installed = self.installed
        return SyncReport(
            scheduler=installed.planner.described(), compressor=self.codec.name,
            layouts=installed.layout_reports(), steady_layouts=installed.steady_layouts,
            measuring=installed.measurement is not None, trials=installed.trials, replans=tuple(installed.replans),
            iteration=self.clock.iteration, history=tuple(self.clock.history), gradient_bytes=self.gradient_bytes)

    def check_optimizer(self, optimizer) -> None:
        """Update with `optimizer` (its parameters checked against the table). One frozen when the
        table was made and trainable now joins the plans at the next forward pass where the runtime
        takes it (`_take_in_unfrozen`); else it is refused."""
        self.deferred.bind(optimizer)
        self.frozen_held = self.table.frozen_in(optimizer)
        if not self.takes_unfrozen:
            self._refuse_unfrozen(ConfigError)

    # -- hooks -------------------------------------------------------------------------------------
    def _arrival_hook_for(self, name: str):
        """The hook of parameter `name`'s gradient before it accumulates: the first of a backward
        pass starts the iteration; a gradient whose final value no op waits for before the pass ends
        (no hook of `_ready_hook_for` on it) is marked ready here, the ops reading it once the pass is
        over. A backward pass after a synchronised one, with neither optimizer.step() nor
        optimizer.zero_grad() between, adds its gradients to the averaged ones (`_settle_held`). A
        pass that accumulates no gradient (``torch.autograd.grad`` over the parameters) is no
        iteration, as under torch DDP."""
        def arriving(_gradient):
            if not self.in_backward:
                if not self.output_start.accumulates(name):
                    return
                self._settle_held()
                if not self.enabled:  # counted as used by the next synchronised backward, as torch DDP does
                    self.used_unsynced.add(name)
                    return
                self._begin_backward()
            if name not in self.gradient_hooks:
                self.executor.ready.add(name)
        return arriving

    def _settle_held(self) -> None:
        """Before a backward pass after a synchronised one, with neither optimizer.step() nor
        optimizer.zero_grad() between: that pass adds its gradients to the averaged ones, as under
        torch DDP (Lightning's manual accumulation, two ``engine.backward`` calls a DeepSpeed step),
        and its own iteration averages what it adds (every averaged gradient counts as used in it);
        the held iteration is collected first, so that it adds to averages, not to buffers still
        being reduced. Refused with a compressor
        (its error feedback would take the averaged gradients for this rank's) and where the
        gradients are released once reduced (a sharded optimizer's partitions)."""
        if not self.gradients_held:
            return
        if self.codec.name != Codec.name or self.installed.partition is not None:
            raise RuntimeError(
                "a backward pass after a synchronised one and before optimizer.step(), with a compressor or a "
                "sharded optimizer: run all but the last backward of a step inside gradsync.no_sync(model), or "
                "sum the losses before one backward (after a step skipped on purpose, as a GradScaler does, "
                "call optimizer.zero_grad() first)")
        held = self.executor
        self._collected_within("a backward pass that another one adds to before the step")
        held.copy_gradients_out()
        # every rank holds the averages: each sends them on, used by this pass or not, as under DDP
        self.used_unsynced |= {name for name, parameter in self.table.parameters.items() if parameter.grad is not None}

    def _hook_arrivals(self, on: bool) -> None:
        """Arrival hooks (`_arrival_hook_for`) on every parameter that trains now, or none: the
        iteration then begins at the outputs (``output_start``). A parameter frozen for now (a GAN's
        discriminator during the generator's step) takes its hook at the first forward after it
        trains again (`_root_pre_forward`): frozen while a forward runs, it has no gradient in the
        backward pass that follows."""
        for handle in self.arrival_hooks.values():
            handle.remove()
        self.arrival_hooks = {}
        if on:
            self._hook_missing_arrivals()
        self.begins_at_outputs = not on

    def _hook_missing_arrivals(self) -> None:
        for name, parameter in self.table.parameters.items():
            if name not in self.arrival_hooks and parameter.requires_grad:
                self.arrival_hooks[name] = parameter.register_hook(self._arrival_hook_for(name))

    def _trainable_left_out(self, names: set[str]) -> bool:
        """Whether a parameter that trains now is not in `names` (at once where all are in it)."""
        parameters = self.table.parameters
        return len(names) < len(parameters) and any(
            parameter.requires_grad for name, parameter in parameters.items() if name not in names)

    def _root_post_forward(self, _module, _inputs, outputs) -> None:
        """Where the plans in force let the outputs begin (``output_start``), a hook on each output
        tensor of a forward that records a graph: its gradient comes before that of any parameter
        the loss reaches through it."""
        self.in_forward = False
        if self.outputs_may_begin and torch.is_grad_enabled():
            for tensor in _tensors_requiring_grad(outputs):
                tensor.register_hook(self._output_gradient)

    def _output_gradient(self, _gradient) -> None:
        """The first gradient of an output in a backward pass: begins the iteration where the
        arrival hooks are off (``output_start``); else, where the plans let the outputs begin, asks
        the graph which parameters the pass uses, for `_end_backward` to compare with the hooks."""
        task = torch._C._current_graph_task_id()
        if task == self.output_pass or self.in_backward:  # another output, or begun by a parameter's gradient
            return
        self.output_pass = task
        if self.begins_at_outputs:
            self._begin_at_outputs()
        elif self.outputs_may_begin and self.enabled and not self.used_unsynced:
            self.used_in_graph = self.output_start.used_in_graph()

    def _begin_at_outputs(self) -> None:
        """Steps 1 and 2 of ``output_start``: refuse a pass after a synchronised one, count the
        parameters of a no_sync pass, or begin; the hooks are back at once, for the rest of the pass,
        where the graph leaves a parameter out."""
        used = self.output_start.used_in_graph()
        if used is None:  # torch.autograd.grad over the parameters: no gradient accumulates
            return
        left_out = self._trainable_left_out(used)  # (one frozen for now has no gradient in this pass)
        if not used:  # none trains in this pass, or the graph cannot tell (torch.autograd.grad over the
            # inputs, as a gradient penalty takes; the whole model in a reentrant checkpoint): the
            # parameters' hooks decide, from now on
            if left_out:
                self._leave_outputs()
            return
        self._settle_held()
        if not self.enabled:
            self.used_unsynced |= used
            if left_out:
                self._leave_outputs()
            return
        self._begin_backward()
        ready = self.executor.ready
        ready |= used
        if self._trainable_left_out(ready):
            self._leave_outputs()

    def _leave_outputs(self) -> None:
        """Back to the arrival hooks for good."""
        self.output_start.refused = True
        if self.begins_at_outputs:
            self._hook_arrivals(True)

    def _refuse_changed_in_flight(self, op: str) -> None:
        """The gradients of an op were written while it was in flight (``PlanExecutor.in_flight_watch``):
        the averages would replace what was written, so the op is refused (the next zero_grad waits for
        the others before zeroing). Where the iteration began at the outputs, a pass that bypassed them
        may have accumulated into them (step 3 of ``output_start``); else, the arrival hooks refusing
        such a pass, they were changed in place or replaced, as clipping or a GradScaler's unscale_
        does before ``optimizer.synchronize()``. After the step, while updates wait for their layer's
        next forward (``deferred``), they were cleared by hand rather than by a zero_grad."""
        self.gradients_held = True
        if self.deferred.pending:
            raise GradientsChangedInFlight(
                f"gradients being averaged ({op} of the plan) were changed after optimizer.step(), while their "
                "layer's update waited for them until its next forward: cleared by hand (p.grad = None, "
                "p.grad.zero_()) or written. The update needs their averages: clear gradients with "
                "optimizer.zero_grad() or model.zero_grad(), which leave them to that update, or call "
                "optimizer.synchronize() after the step first. Written in place while being averaged, they may have "
                "left the ranks' averages apart: resume from a checkpoint")
        if self.begins_at_outputs:
            self._leave_outputs()
            raise GradientsChangedInFlight(
                f"a backward pass after a synchronised one and before optimizer.step() accumulated into gradients "
                f"being averaged ({op} of the plan): it did not pass through the model's outputs (a loss on a "
                "submodule's output or on the parameters alone), where gradsync began this model's iterations. It "
                "begins at each parameter's gradient from now on, which refuses such a pass before it accumulates: "
                "call optimizer.zero_grad() and run the step again. (Gradients changed in place before the step, "
                "as by clipping, show the same: change them after optimizer.synchronize(), once they are averaged)")
        raise GradientsChangedInFlight(
            f"gradients being averaged ({op} of the plan) were changed before optimizer.step(): in place, as by "
            "clipping or a GradScaler's unscale_, or replaced. Their averages would overwrite the change: read or "
            "change them after optimizer.synchronize(), once they are averaged (a GradScaler: pass it to "
            "gradsync.wrap as grad_scaler). Call optimizer.zero_grad() and run the step again")

    def _choose_start(self) -> None:
        """At a step's end: begin the next iteration at the outputs where the plans in force let it,
        the last synchronised pass announced it and no front-end reads the gradients before the step
        (``wait_at_backward_end``: as after `flush`), else at the parameters (``output_start``)."""
        at_outputs = (self.outputs_may_begin and self.announced and not self.output_start.refused
                      and not self.wait_at_backward_end and self.hooks_made_for[0] is self.installed.plans)
        if at_outputs != self.begins_at_outputs:
            self._hook_arrivals(not at_outputs)

    def _ready_hook_for(self, name: str):
        """The hook of parameter `name` once its gradient has accumulated: it is final, and may let
        an op launch."""
        def ready(_parameter):
            if not self.enabled:
                return
            self.executor.mark_ready(name)
            if self.measurement is not None:
                self.measurement.gradient_ready(name)
            if self.trace is not None:
                self.trace.gradient_ready(self.module_of[name])
        return ready

    def _begin_backward(self) -> None:
        self.announced = self.begins_at_outputs or (
            self.used_in_graph is not None and self.output_pass == torch._C._current_graph_task_id())
        self.silent.update(m for m in self.forward_hooks if m not in self.ran_forward)
        self._refuse_read_before_update()
        self.flush_deferred()
        self.in_backward = True
        self.rounds_now = self.codec.rounds(self.sync_steps)
        if self.loss_scale is not None:
            self.loss_scale.follow(self.codec)
        self.executor = self.installed.executors[self.rounds_now[0]]
        self.executor.in_flight_watch = self._refuse_changed_in_flight
        if self.buffers_from_first is not None:  # the next forward reads rank 0's buffers, as after DDP's synchronised
            # forwards (every rank takes part, even if one evaluates alone next); sent before any op of
            # the plan, so that on a shared link its bytes go first and its wait is none of theirs
            self.buffers_arriving = self._start_buffers_broadcast()
        self.executor.start_iteration(self.sync_steps, ready=self.used_unsynced, ends_step=len(self.rounds_now) == 1,
                                      zeroed_in_place=self.zeroed_in_place)
        self.used_unsynced, self.zeroed_in_place = set(), set()
        self.step_unsettled = True
        if self.trace is not None:
            self.trace.mark("backward start")
        Variable._execution_engine.queue_callback(self._end_backward)

    def _refuse_read_before_update(self) -> None:
        """An update still pending as the backward pass begins is applied now, before the pass reads
        the parameters; where the pass produces their gradients, the forward read them before it:
        refused (a wrong gradient, or torch's error for a tensor changed in place) before any change."""
        stale = [name for module_name in self.deferred.pending for name in self.table.owners[module_name]
                 if self.output_start.accumulates(name)]
        if stale:
            raise RuntimeError(
                f"the forward read parameter(s) {stale[:4]}{' ...' if len(stale) > 4 else ''} before their update, "
                "which waited for their module's next forward (updates deferred under overlap_forward or "
                "US-Byte's forward-phase ops): the forward reached them outside that module's own forward. Call "
                "optimizer.synchronize() after the step, or wrap without deferring (overlap_forward=False)")

    def _start_buffers_broadcast(self) -> Callable[[], None]:
        """Start giving every rank rank 0's buffers; returns what completes it."""
        buffers = dict.fromkeys(b for m in self.buffer_modules for b in m.buffers(recurse=False) if b.numel())
        return self.buffers_from_first.start(list(buffers))

    def _end_backward(self) -> None:
        self.in_backward = False
        self.backward_synced = self.gradients_held = True
        if not self.begins_at_outputs:  # the graph named every parameter, and their hooks then ran
            self.announced = (self.announced and self.used_in_graph == self.executor.ready
                              and len(self.used_in_graph) == len(self.table.parameters))
            self.used_in_graph = None
        self.executor.end_backward()
        if self.buffers_arriving is not None:
            with self.clock.updating(), waiting_for("the broadcast of rank 0's buffers in the backward pass",
                                                    self.channels.timeout):
                self.buffers_arriving()
            self.buffers_arriving = None
        for round_index in range(1, len(self.rounds_now)):  # a later round starts once the one before is reduced
            previous, self.executor = self.executor, self.installed.executors[self.rounds_now[round_index]]
            self.executor.in_flight_watch = self._refuse_changed_in_flight
            self.clock.wait(previous, previous.wait_all)
            with self.clock.updating():  # the round's encoding
                self.executor.start_iteration(previous.step, ready=previous.ready,
                                              ends_step=round_index == len(self.rounds_now) - 1)
                # a skip found in one round holds for the step
                self.executor.skip_step, self.executor.nonfinite_seen = previous.skip_step, previous.nonfinite_seen
                self.executor.end_backward()
        if self.wait_at_backward_end:
            self.clock.wait(self.executor, self.executor.wait_all)

    def _root_pre_forward(self, _module, _inputs) -> None:
        if torch.is_grad_enabled():  # (an evaluation's forward leaves them to the next training one)
            self._take_in_any_unfrozen()
        self.in_forward = True
        self.ran_forward.clear()
        self.clock.forward_begins()
        if self.outputs_await_accumulators and self.output_start.can_prepare():
            self.hooks_made_for = None
        if not self.begins_at_outputs and len(self.arrival_hooks) < len(self.table.parameters):
            self._hook_missing_arrivals()
        self._hooks_where_needed()
        for module_name in [m for m in self.deferred.pending if m in self.silent]:
            self._apply_deferred(module_name)
        if self.measurement is not None:
            self.measurement.forward_start()

    def _hooks_where_needed(self) -> None:
        """The hooks this forward pass and the next backward pass need; each costs every pass a
        Python call, so only these run (also while auto's trials time a plan, as it will run):
        - pre-forward hooks (``_pre_forward_for``) on the owner modules whose gradients a plan in
          force defers to the next forward, and those with an update still pending (only a module
          with one is judged silent: ``_begin_backward``);
        - ready hooks (``_ready_hook_for``) on the parameters whose gradients may let an op of a
          plan in force launch before the backward pass ends (``Plan.tensors_launching_early``;
          every one where a plan of reduce-scatters releases each gradient as it is final).
        While a measurement times the layers or a trace records, every module and parameter has
        both (their forward times and gradient times)."""
        plans, measuring = self.installed.plans, self.measurement is not None and self.measurement.times_layers
        made_for = self.hooks_made_for
        if made_for is None or made_for[0] is not plans or made_for[1] != measuring:
            self.hooks_made_for = (plans, measuring)
            if measuring or self.trace is not None:
                self.forward_hooks_base, ready_wanted = set(self.table.modules), set(self.table.parameters)
            else:
                self.forward_hooks_base = {self.module_of[name] for plan in plans.values()
                                           for op in plan.ops if op.gates_forward for name in op.tensors()}
                releasing = any(executor.releases_gradients for executor in self.installed.executors.values())
                ready_wanted = set(self.table.parameters) if releasing else {
                    name for plan in plans.values() for name in plan.tensors_launching_early()}
            self._hook_gradients(ready_wanted)
            executors = list(self.installed.executors.values())
            # (a forest's all-reduce sums into the buffer with torch's own ops, which move its version)
            watchable = (not measuring and self.trace is None and not self.forward_hooks_base
                         and not self.channels.forests and len(executors) == 1 and executors[0].watchable())
            self.outputs_may_begin = watchable and self.output_start.prepare()
            self.outputs_await_accumulators = watchable and not self.outputs_may_begin  # retried when they can
            if not self.outputs_may_begin and self.begins_at_outputs:
                self._hook_arrivals(True)
        elif len(self.gradient_hooks) < len(self.ready_wanted):  # some were frozen then
            self._hook_gradients(self.ready_wanted)
        self._hook_forwards()

    def _hook_forwards(self) -> None:
        """Pre-forward hooks on the modules the plans in force defer to the next forward and on those
        with an update pending: the step calls it too, for the forward that follows even where the
        model's own forward never runs (a method of the model calling its layers)."""
        wanted = self.forward_hooks_base | self.deferred.pending.keys()
        if wanted == self.forward_hooks.keys():
            return
        for module_name in self.forward_hooks.keys() - wanted:
            self.forward_hooks.pop(module_name).remove()
        for module_name in wanted - self.forward_hooks.keys():
            module = self.table.modules[module_name]
            # first among the module's hooks: one that computes a weight from the parameters (pruning's
            # mask, the older weight_norm and spectral_norm) reads them once they are updated
            self.forward_hooks[module_name] = module.register_forward_pre_hook(
                on_module(module, self._pre_forward_for(module_name)), prepend=True)

    def _hook_gradients(self, wanted: set[str]) -> None:
        """Ready hooks on the parameters in `wanted` that train now, none on the others. A parameter
        frozen for now (a GAN's discriminator during the generator's step) takes its hook at the
        first forward after it trains again (`_hooks_where_needed`), as its arrival hook does."""
        self.ready_wanted = wanted
        for name in self.gradient_hooks.keys() - wanted:
            self.gradient_hooks.pop(name).remove()
        for name in wanted - self.gradient_hooks.keys():
            parameter = self.table.parameters[name]
            if parameter.requires_grad:
                self.gradient_hooks[name] = parameter.register_post_accumulate_grad_hook(self._ready_hook_for(name))

    def _pre_forward_for(self, module_name: str):
        def pre_forward(_module, _inputs):
            self.ran_forward.add(module_name)
            self._apply_deferred(module_name)
            if self.measurement is not None:
                self.measurement.module_start(module_name)
            if self.trace is not None:
                self.trace.forward_start(module_name)
        return pre_forward

    def _pre_forward_borrowing(self, owners: list[str]):
        """A module holding tied weights that `owners` own may read them first: their updates first."""
        def pre_forward(_module, _inputs):
            for owner in owners:
                self._apply_deferred(owner)
        return pre_forward

    def _apply_deferred(self, module_name: str) -> None:
        seconds = self.deferred.apply(module_name, self.executor)
        if seconds and self.measurement is not None:  # neither the wait nor the update is the layer's forward
            self.measurement.exclude(seconds)

    # -- optimizer ---------------------------------------------------------------------------------
    def step(self, optimizer) -> None:
        self.in_forward = False  # (a forward that raised left it set)
        self._refuse_unsynchronised("optimizer.step()")
        executor = self._collect(everything=self.installed.nonfinite == "skip")
        if not executor.skip_step:
            self.deferred.step(optimizer, executor)
            self._hook_forwards()
        self._finish_iteration()
        self._choose_start()

    def step_evaluating(self, optimizer, closure: Callable):
        """``optimizer.step(closure)`` for an optimizer that evaluates the loss within its step
        (LBFGS's line search): the gradients of a backward pass before the step, then those of each
        evaluation of `closure`, are averaged before the optimizer reads them, each pass an
        iteration of its own; the optimizer updates every parameter itself, nothing deferred to
        the next forward. Each evaluation's loss is averaged over the ranks too: the objective whose
        gradient the averaged gradients are, and the same on every rank, so that every rank's step
        takes the same decisions (LBFGS stops on the loss's change) and evaluates alike. Returns
        what the optimizer's step returns."""
        self.flush_deferred()
        if self.backward_synced:
            self._collected_in_full()
        average = reduction_over_ranks(dist.ReduceOp.SUM, self.channels.process_group, self.table.device,
                                       "the loss of optimizer.step's closure", self.channels.timeout)

        def evaluated():
            with torch.enable_grad():
                loss = closure()
            self._refuse_unsynchronised("the closure given to optimizer.step()")
            self._collected_in_full()
            if loss is None:
                return None
            mean = average([float(loss.detach() if torch.is_tensor(loss) else loss)])()[0] / self.channels.world_size
            return torch.tensor(mean, dtype=loss.dtype, device=loss.device) if torch.is_tensor(loss) else mean
        return optimizer.step(evaluated)

    def _refuse_unsynchronised(self, what: str) -> None:
        if self.backward_synced:
            return
        bypassed = self.begins_at_outputs
        if bypassed:
            self._leave_outputs()
        raise RuntimeError(
            f"{what} without a synchronised backward pass: call backward() outside "
            "gradsync.no_sync() before stepping, or the replicas would diverge" + (
                " (gradsync began this model's iterations at the first gradient of its outputs: a loss that "
                "does not pass through them is synchronised from now on, once optimizer.zero_grad() and "
                "the step run again)" if bypassed else ""))

    def _collect(self, everything: bool) -> PlanExecutor:
        """The averaged gradients of the synchronised backward pass: those the step waits for, or
        `everything`; gradients changed in flight and parameters unfrozen since the wrap refused first."""
        self._refuse_unfrozen()
        self.backward_synced = self.gradients_held = False
        executor = self.executor
        executor.refuse_changed_in_flight()
        self.clock.wait(executor, executor.wait_all if everything else executor.wait_before_step)
        return executor

    def _collected_in_full(self) -> None:
        """Every averaged gradient of the synchronised backward pass in place, for an optimizer that
        reads them within its step; its iteration finished."""
        self._collected_within("a step that evaluates its closure")
        self._choose_start()

    def _collected_within(self, within: str) -> None:
        """Every averaged gradient of the synchronised backward pass in place, its iteration finished,
        `within` what reads them before the step. Averaged gradients that hold inf or NaN cannot skip
        that step (the optimizer may have updated the parameters already, or a pass adds to them)."""
        if self._collect(everything=True).skip_step:
            raise NonFiniteGradient(f"non-finite averaged gradients within {within}, which cannot be skipped: "
                                    "use nonfinite='raise' there")
        self._finish_iteration()

    def _refuse_unfrozen(self, error: type[Exception] = RuntimeError) -> None:
        """A parameter frozen when the table was made and trainable now has a gradient no op averages:
        refused before the step updates anything (the optimizer holds it, so the step would apply it).
        Where the runtime takes such parameters in, only one with a gradient is: it was unfrozen after
        this iteration's forward began, and joins the plans at the next."""
        unfrozen = [name for name, parameter in self.frozen_held.items() if parameter.requires_grad
                    and (not self.takes_unfrozen or parameter.grad is not None)]
        if not unfrozen:
            return
        if self.takes_unfrozen:
            raise error(f"parameter(s) {unfrozen[:5]} were unfrozen after this iteration's forward pass began: their "
                        "gradients were not averaged, and the replicas would drift apart. Unfreeze parameters "
                        "before a forward pass of the model (they join the plans as its forward begins: the model's "
                        "own, not a method calling its layers); call optimizer.zero_grad() and run the step again")
        raise error(f"parameter(s) {unfrozen[:5]} were frozen when gradsync attached and train now: no rank averages "
                    "their gradients, so the replicas would drift apart, and this runtime's optimizer holds the "
                    "parameters trainable when it attached alone: attach it again once the parameters to train are "
                    "set")

    def _take_in_any_unfrozen(self) -> None:
        """Take in the parameters unfrozen since the table was made, if any and if the runtime takes them
        (not under inference mode, whose tensors the new plans' buffers would be)."""
        if self.takes_unfrozen and self.table.frozen and not torch.is_inference_mode_enabled():
            unfrozen = self.table.unfrozen()
            if unfrozen:
                self._take_in_unfrozen(unfrozen)

    def _take_in_unfrozen(self, names: list[str]) -> None:
        """Parameters frozen when the table was made train now (`names`: a backbone unfrozen for
        fine-tuning, as Lightning's BackboneFinetuning does), before this forward pass: the runtime
        takes them in, as torch DDP does not (it leaves them out without a word).

        1. Every launched op lands and every deferred update is applied (``flush``).
        2. Every rank checks that the others unfroze the same parameters (a collective: every rank
           unfreezes them before the same forward pass).
        3. A new table of the trainable parameters; the codec keeps each earlier tensor's state and
           starts the new ones (``Codec.take_in``); the profile is measured again over the next
           iterations, then planned on the cost in force, as at wrap (``InstalledPlans.for_table``).
        4. The hooks move to the new table's parameters and modules; the optimizer is checked again."""
        if self.gradients_held:
            raise RuntimeError(f"parameter(s) {names[:5]} were unfrozen between a synchronised backward pass and "
                               "its optimizer.step() or optimizer.zero_grad(): unfreeze parameters after the step, or "
                               "clear the gradients before this forward pass (they join the plans there)")
        self.settle_step()
        self.flush()
        with waiting_for("the check that every rank unfroze the same parameters", self.channels.timeout):
            check_same_on_all_ranks(names, "set of parameters unfrozen since the last plans were made",
                                    "unfreeze the same parameters on every rank, before the same forward pass",
                                    self.channels.process_group)
        table = ParameterTable.of(self.model, kept=self.table.parameters.values())
        table.check_compressor(self.codec.name)
        self.codec.take_in(table.tensor_specs())
        installed = self.installed.for_table(table, type(self.model).__name__)
        optimizer = self.deferred.optimizer
        self._drop_table_hooks()
        self._take_table(table, installed)
        self.check_optimizer(optimizer)
        if self.channels.rank == 0:
            log.info("gradsync: %d parameter(s) unfrozen (%s): measuring and planning %d trainable parameters again",
                     len(names), ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""), len(table.parameters))
        if self.trace is not None:
            self.trace.mark(f"{len(names)} parameter(s) unfrozen: planning again")

    def flush_deferred(self) -> None:
        """Apply every pending deferred update now, in layer order."""
        self.deferred.apply_all(self.executor)

    def flush(self) -> None:
        """Wait for every launched op and apply every deferred update; gradients changed since the
        backward pass ended are refused first (``runtime.in_flight``). Gradients read before the
        step (clipped, checked) end the iterations begun at the outputs: a later pass that bypassed
        them would add to averaged gradients that no op watches any more (``output_start``)."""
        if self.executor is not None and self.backward_synced:
            self.executor.refuse_changed_in_flight()
            self.executor.wait_all()
            self._leave_outputs()
        self.flush_deferred()

    def zero_grad(self, others: Iterable[torch.nn.Parameter], set_to_none: bool) -> None:
        """``optimizer.zero_grad``, or the model's ``zero_grad`` (`others`: the optimizer's parameters
        or the model's, those outside the table zeroed as torch does; a pending module's gradients
        are zeroed after its update). Gradients that are spans of an op's buffer (small ones, packed at
        once: ``PlanExecutor.zero_gradients_in_place``) are zeroed in place even when asked to be set
        to None, as Megatron-LM keeps its gradient buffers: the next backward pass accumulates into
        the buffer, with nothing to copy in before the op nor to point the gradients at after it. One
        that no rank then uses is set to None when its op is done, as set_to_none would leave it."""
        if self.gradients_held:  # a step skipped on purpose: its ops must not write after the zeroing
            self.clock.wait(self.executor, self.executor.wait_all)
            self.gradients_held = False
        if set_to_none and self.executor is not None and not self.deferred.pending:
            self.zeroed_in_place |= self.executor.zero_gradients_in_place()
        self.deferred.zero_grad(others, set_to_none, keep=self.zeroed_in_place)

    def _finish_iteration(self) -> None:
        now = time.perf_counter()
        prediction = self.installed.prediction(self.rounds_now)
        executors = self.installed.executors
        stats = self.clock.finish(now, sum(executors[layout].wire_bytes() for layout in self.rounds_now),
                                  prediction.time, self.installed.speed.scale,
                                  sum(executors[layout].encode_seconds for layout in set(self.rounds_now)),
                                  len(self.installed.replans))
        if self.trace is not None:
            self.trace.iteration(stats)
        next_step = self.steps_counted + (self.step_unsettled and not self.executor.nonfinite_seen)  # if known
        done = IterationDone(stats, self.rounds_now, self.codec.rounds(next_step),
                             self.installed.plans[self.rounds_now[0]], self.last_step_skipped)
        self.installed.iteration_done(done, prediction.busy)

    def follow_loss_scale(self, read_scale) -> None:
        """Follow the loss scale that `read_scale()` returns (a GradScaler's ``get_scale``): read
        at each synchronised backward's start, before any gradient is encoded, when the codec keeps
        error feedback; a change since the last one rescales it (``compress.loss_scale``)."""
        self.loss_scale = LossScaleFollower(read_scale)

    def loss_scale_changed(self, factor: float) -> None:
        """The loss scale became `factor` times what it was at the last step: the codec's error
        feedback, in the scaled gradients' units, follows it (``Codec.rescale_errors``). Call on
        every rank between steps, as a dynamic loss scaler changes the scale on every rank alike."""
        self.settle_step()
        self.codec.rescale_errors(factor)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The codec's state and step. Per-rank codec state (error feedback) of every rank is
        gathered, so this is a collective: call it on every rank, as checkpointing with DDP does."""
        self.flush()
        shared, per_rank = self.codec.state_dict()
        state = {"codec": self.codec.name, "step": self.sync_steps, "world_size": self.channels.world_size,
                 "shared": shared, "per_rank": None}
        if self.codec.per_rank_state:
            gathered = [None] * self.channels.world_size
            with waiting_for("state_dict's gather of every rank's error feedback", self.channels.timeout):
                dist.all_gather_object(gathered, per_rank, group=self.channels.process_group)
            state["per_rank"] = gathered
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict`'s result. A checkpoint of a run whose compressor kept no state (no
        compression) starts this run's compressor afresh, as one without gradsync's state does; one
        holding another compressor's state is refused, as that state would be lost. Parameters
        unfrozen since the last plans join them first (`_take_in_unfrozen`): the checkpoint may hold
        their state."""
        self._take_in_any_unfrozen()
        self.flush()
        if state["codec"] != self.codec.name:
            if not state["shared"] and state["per_rank"] is None:
                return
            raise ConfigError(
                f"checkpoint holds the state of compressor {state['codec']!r} (its error feedback), this run uses "
                f"{self.codec.name!r}, which cannot take it over: resume with {state['codec']!r}, or delete the "
                "'gradsync' entry of the checkpoint's optimizer state to start without it")
        per_rank = None
        if state["per_rank"] is not None:
            if state["world_size"] != self.channels.world_size:
                raise ConfigError(
                    f"checkpoint holds {self.codec.name!r} error feedback of {state['world_size']} ranks; this run "
                    f"has {self.channels.world_size}. Error feedback is per rank and cannot be redistributed: "
                    "resume with the same number of ranks")
            per_rank = state["per_rank"][self.channels.rank]
        self.codec.load_state_dict(state["shared"], per_rank)
        self.steps_counted, self.step_unsettled = state["step"], False

    # -- teardown ----------------------------------------------------------------------------------
    @contextmanager
    def detached_on_error(self):
        """Detach if the block raises (the rest of a wrap): the model is left free to wrap again."""
        try:
            yield
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        """Apply pending updates, remove every hook and release the channels; where the updates are
        refused (gradients or parameters changed before them), detach all the same, then raise."""
        try:
            self.flush()
        finally:
            self._release()

    def _release(self) -> None:
        """Remove every hook, give the model torch's zero_grad back and release the channels."""
        self._drop_table_hooks()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if getattr(self.model.__dict__.get("zero_grad"), "__func__", None) is _zero_grad_while_attached:
            del self.model.zero_grad
        read_through.remove(self.read_through)
        self.read_through = []
        _ATTACHED.pop(self.model, None)
        try:
            if self.trace is not None:
                self.trace.close()
        finally:
            self.channels.destroy()


@atexit.register
def _release_channels_at_exit() -> None:
    """At interpreter exit, release the channels of the runtimes still attached (a framework that
    never tears its engine down) while torch.distributed is still up, rather than leave their
    process groups to the interpreter's teardown. Pending updates are not applied: the process
    is ending."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    for sync in list(_ATTACHED.values()):
        sync.channels.destroy()


def _tensors_requiring_grad(outputs):
    """The tensors in a forward's outputs (nested in tuples, lists, dicts and dataclasses, as torch
    DDP finds them) that require a gradient."""
    if isinstance(outputs, torch.Tensor):
        if outputs.requires_grad:
            yield outputs
    elif isinstance(outputs, (list, tuple)):
        for item in outputs:
            yield from _tensors_requiring_grad(item)
    elif isinstance(outputs, dict):
        for item in outputs.values():
            yield from _tensors_requiring_grad(item)
    elif dataclasses.is_dataclass(outputs) and not isinstance(outputs, type):
        for field in dataclasses.fields(outputs):
            yield from _tensors_requiring_grad(getattr(outputs, field.name))


def _zero_grad_while_attached(model, set_to_none: bool = True) -> None:
    """``model.zero_grad`` while gradsync is attached to `model`: as the wrapped optimizer's, so
    that the gradients of layers whose update waits for their next forward are zeroed after it,
    not before (torch's would leave that update without them: a silent wrong step); on a copy of
    the model (``copy.deepcopy``), torch's own."""
    sync = _ATTACHED.get(model)
    if sync is None:
        torch.nn.Module.zero_grad(model, set_to_none)
    else:
        sync.zero_grad(read_through.own_parameters(model), set_to_none)


def attached(model) -> GradSync:
    if model not in _ATTACHED:
        raise ConfigError("this model was not wrapped with gradsync.wrap")
    return _ATTACHED[model]


def check_not_attached(model) -> None:
    """A model takes one runtime at a time: a second would launch every gradient's ops twice."""
    if model in _ATTACHED:
        raise ConfigError("this model is already wrapped by gradsync: detach that runtime first "
                          "(gradsync.runtime.attached(model).detach(); under DeepSpeed, the engine's destroy())")


@contextmanager
def no_sync(model):
    """Accumulate gradients locally inside the block, like DDP's ``no_sync``: the first backward
    after it synchronises the accumulated gradients."""
    sync = attached(model)
    previous, sync.enabled = sync.enabled, False
    try:
        yield
    finally:
        sync.enabled = previous
