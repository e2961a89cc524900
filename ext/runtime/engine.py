"""GradSync: attaches a plan's execution to a model with hooks, and steps the optimizer.

Lifecycle of one iteration:
1. forward: a module with deferred parameters first waits for their ops and applies their update,
   as does any other module holding one of them (tied weights); modules whose own forward did not
   run in a forward pass (e.g. nn.MultiheadAttention's out_proj, whose weight its parent reads
   directly) are updated when the model's forward starts;
2. backward: each parameter's post-accumulate-grad hook marks it ready; ops launch in plan order
   per channel as their slices become ready; when the backward pass ends, the remaining
   (forward-phase) ops launch and the buffers are broadcast from the first rank;
3. ``optimizer.step()``: waits for the backward-phase ops that are not deferred and updates the
   parameters whose ops are complete; the others are updated by step 1 of the next iteration, or
   when the model's ``state_dict()`` or ``load_state_dict()`` is called before it.
While ``profile``/``cost`` are being measured the plan is ``ddp`` with unbounded buckets: one op per
element size, launched when the backward pass ends; then the real plan replaces it (made again
once a codec warming up has reached its steady state: gradsync.runtime.measure).
Then the predictions follow the computation's measured speed (gradsync.runtime.compute_speed).
"""
from __future__ import annotations

import time
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..agreement import check_same_on_all_ranks, waiting_for
from ..cost import CostModel
from ..errors import ConfigError
from ..compress import Codec
from ..planners import BoundPlanner
from ..planning import StepPrediction, at_compute_scale, plan_layouts, steady_layouts, step_prediction
from ..plan import Plan
from ..profile import ModelProfile
from .channels import Channels
from .compute_speed import ComputeSpeed, slowest_over_ranks
from .executor import PlanExecutor
from .layout import ParameterLayout
from .optimizer import ParameterSubset, hyperparameters
from .report import LayoutReport, SyncReport

HISTORY_LENGTH = 10_000  # iterations whose statistics GradSync.history keeps (the most recent)

_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, GradSync]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class IterationStats:
    """One iteration as measured on this rank, beside the simulator's prediction (seconds)."""

    iteration: int
    iteration_time: float  # from the end of the previous step to the end of this one
    comm_wait: float  # time blocked on communication: the non-overlapped part
    bytes_sent: int
    predicted_time: float
    update_time: float = 0.0  # serial work: buffer broadcast, optimizer step, codec work outside the hooks
    busy_time: float = 0.0  # from the iteration's first forward to the end of its step, less comm_wait
    compute_scale: float = 1.0  # the factor on the profile's times the prediction was made with
    codec_time: float = 0.0  # the codec's encoding in this step and decoding in this iteration's waits


class GradSync:
    """The runtime attached to one model (see the module docstring)."""

    def __init__(self, model, layout: ParameterLayout, channels: Channels, planner: BoundPlanner,
                 nonfinite: str, broadcast_buffers: bool, codec: Codec, trace=None):
        self.model = model
        self.layout = layout
        self.channels = channels
        self.codec = codec
        self.planner = planner  # the user's scheduler (the calibration and trials install others)
        self.gradient_bytes = sum(p.numel() * p.element_size() for p in layout.parameters.values())
        self.nonfinite = nonfinite
        self.broadcast_buffers = broadcast_buffers
        self.trace = trace
        self.enabled = True
        self.in_backward = False
        self.backward_synced = False
        self.used_unsynced: set[str] = set()  # parameters whose gradients accumulated under no_sync since the last sync
        self.gradients_held = False  # a synchronised backward's gradients, neither stepped nor zeroed
        self.wait_at_backward_end = False  # for front-ends whose hooks read the gradients before the step
        self.iteration = 0
        self.sync_steps = 0  # synchronised backward passes so far: the codec's step
        self.history: deque[IterationStats] = deque(maxlen=HISTORY_LENGTH)  # `iteration` counts them all
        self.plans: dict[str, Plan] = {}  # per codec layout
        self.executors: dict[str, PlanExecutor] = {}
        self.layout_plans = {}
        self.predictions: dict[tuple[str, ...], StepPrediction] = {}
        self.speed = ComputeSpeed()
        self.profile: ModelProfile | None = None
        self.rank_profiles: list[ModelProfile] = []  # each rank's measured profile (`profile` combines them)
        self.cost: CostModel | None = None
        self.executor: PlanExecutor | None = None  # the one running the current iteration
        self.measurement = None
        self.trial_times: list[tuple[str, float]] | None = None  # auto's timed plans (PlanTrials)
        self.pending: dict[str, list[dict]] = {}  # module -> hyper-parameters at step time
        self.zero_after: dict[str, bool] = {}  # module -> set_to_none requested while pending
        self.ran_forward: set[str] = set()  # owner modules whose forward ran in this forward pass
        self.silent: set[str] = set()  # owner modules seen skipping their forward: updated at the root
        self.layer_subsets: dict[str, ParameterSubset] = {}  # owner module -> its parameters
        self.iteration_started = time.perf_counter()
        self.forward_started: float | None = None  # the iteration's first forward
        self.comm_wait = 0.0
        self.update_time = 0.0
        self.decode_time = 0.0
        self.optimizer = None
        self.handles = [model.register_forward_pre_hook(self._root_pre_forward),
                        model.register_state_dict_pre_hook(lambda *_: self.flush_deferred()),
                        model.register_load_state_dict_pre_hook(lambda *_: self.flush_deferred())]
        for name, parameter in layout.parameters.items():
            self.handles.append(parameter.register_hook(self._refuse_second_backward))
            self.handles.append(parameter.register_post_accumulate_grad_hook(self._hook_for(name)))
        for module, owners in layout.borrowers.values():
            self.handles.append(module.register_forward_pre_hook(self._pre_forward_borrowing(owners)))
        for module_name, module in layout.modules.items():
            self.handles.append(module.register_forward_pre_hook(self._pre_forward_for(module_name)))
            if trace is not None:
                self.handles.append(module.register_forward_hook(
                    lambda _m, _i, _o, name=module_name: trace.forward_end(name)))
        self.module_of = {name: m for m, names in layout.owners.items() for name in names}
        _ATTACHED[model] = self

    # -- planning ----------------------------------------------------------------------------------
    def install_plan(self, profile: ModelProfile, cost: CostModel, planner: BoundPlanner | None = None) -> None:
        """Plan every codec layout on its wire profile with `profile` and `cost` (equal on every
        rank) by `planner` (default: the user's), check the hashes on every rank, and execute the
        plans from the next backward pass."""
        planner = planner or self.planner
        layout_plans = {layout: replace(entry, plan=entry.plan.with_transport(self.channels.transport))
                        for layout, entry in plan_layouts(profile, cost, planner, self.codec).items()}
        plans = {layout: entry.plan for layout, entry in layout_plans.items()}
        self._check_same_plans(plans)
        self.layout_plans, self.plans, self.profile, self.cost = layout_plans, plans, profile, cost
        self.predictions, self.speed = {}, ComputeSpeed()
        self.executors = {layout: PlanExecutor(plan, self.layout.parameters, self.channels, self.codec, layout,
                                               self.nonfinite, self.trace) for layout, plan in plans.items()}

    def prediction(self, rounds: tuple[str, ...]) -> StepPrediction:
        """The simulator's prediction for a step sending `rounds`, on the profile's times scaled to
        the measured speed of the computation (gradsync.runtime.compute_speed); cached."""
        if rounds not in self.predictions:
            scaled = at_compute_scale(self.layout_plans, self.speed.scale)
            self.predictions[rounds] = step_prediction(scaled, rounds, self.cost)
        return self.predictions[rounds]

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped for non-finite gradients (on every rank)."""
        return self.executor is not None and self.executor.skip_step

    @property
    def plan(self) -> Plan:
        """The (first) plan the next iteration executes."""
        return self.plans[self.codec.rounds(self.sync_steps)[0]]

    def report(self) -> SyncReport:
        """A read-only snapshot for front-ends (gradsync.runtime.report)."""
        return SyncReport(
            scheduler=self.planner.described(), compressor=self.codec.name,
            layouts={layout: LayoutReport(layout, entry.plan, entry.wire, self.cost)
                     for layout, entry in self.layout_plans.items()},
            steady_layouts=tuple(steady_layouts(self.codec)),
            measuring=self.measurement is not None,
            trials=None if self.trial_times is None else tuple(self.trial_times),
            iteration=self.iteration, history=tuple(self.history), gradient_bytes=self.gradient_bytes)

    def _check_same_plans(self, plans: dict[str, Plan]) -> None:
        with waiting_for("the plan hash check", self.channels.timeout):
            check_same_on_all_ranks(tuple(plan.hash for plan in plans.values()), "plan (plan hash mismatch)",
                                    "give every rank the same model, profile, cost and options",
                                    self.channels.process_group)

    def check_optimizer(self, optimizer) -> None:
        self.layout.check_optimizer(optimizer)
        self.optimizer = optimizer
        self.layer_subsets = {m: ParameterSubset(optimizer, [self.layout.parameters[n] for n in names])
                              for m, names in self.layout.owners.items()}

    def _subset(self, modules: list[str]) -> ParameterSubset:
        """The parameters of the owner `modules`, for one optimizer call."""
        return ParameterSubset.union([self.layer_subsets[m] for m in modules])

    def _complete(self, executor: PlanExecutor, module_name: str) -> bool:
        """Whether every op carrying the module's gradients is done."""
        return all(executor.complete(n) for n in self.layout.owners[module_name])

    # -- hooks -------------------------------------------------------------------------------------
    def _hook_for(self, name: str):
        def hook(_parameter):
            if not self.enabled:  # counted as used by the next synchronised backward, as torch DDP does
                self.used_unsynced.add(name)
                return
            if not self.in_backward:
                self._begin_backward()
            self.executor.mark_ready(name)
            if self.measurement is not None:
                self.measurement.gradient_ready(name)
            if self.trace is not None:
                self.trace.gradient_ready(self.module_of[name])
        return hook

    def _refuse_second_backward(self, _gradient) -> None:
        """Before a gradient accumulates: a backward pass after a synchronised one, with neither
        optimizer.step() nor optimizer.zero_grad() between, would add its gradients to the averaged
        ones, some in buffers still being reduced."""
        if self.gradients_held and not self.in_backward:
            raise RuntimeError(
                "a backward pass after a synchronised one and before optimizer.step(): run all but the "
                "last backward of a step inside gradsync.no_sync(model), or sum the losses before one "
                "backward (after a step skipped on purpose, as a GradScaler does, call "
                "optimizer.zero_grad() first)")

    def _begin_backward(self) -> None:
        self.silent.update(m for m in self.layout.owners if m not in self.ran_forward)
        self.flush_deferred()
        self.in_backward = True
        self.rounds_now = self.codec.rounds(self.sync_steps)
        self.executor = self.executors[self.rounds_now[0]]
        self.executor.start_iteration(self.sync_steps, ready=self.used_unsynced)
        self.used_unsynced = set()
        self.sync_steps += 1
        if self.trace is not None:
            self.trace.mark("backward start")
        Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.in_backward = False
        self.backward_synced = self.gradients_held = True
        self.executor.end_backward()
        if self.broadcast_buffers:  # the next forward reads rank 0's buffers, as after DDP's synchronised
            # forwards; here every rank takes part, even if one evaluates alone next
            with self._updating(), waiting_for("the broadcast of rank 0's buffers after the backward pass",
                                               self.channels.timeout):
                _broadcast_from_first([b for b in self.model.buffers() if b.numel()], self.channels.process_group)
        for layout in self.rounds_now[1:]:  # a later round starts once the one before is reduced
            previous, self.executor = self.executor, self.executors[layout]
            self._wait(previous, previous.wait_all)
            with self._updating():  # the round's encoding
                self.executor.start_iteration(previous.step, ready=previous.ready)
                self.executor.skip_step = previous.skip_step  # a skip found in one round holds for the step
                self.executor.end_backward()
        if self.wait_at_backward_end:
            self._wait(self.executor, self.executor.wait_all)

    def _root_pre_forward(self, _module, _inputs) -> None:
        self.ran_forward.clear()
        if self.forward_started is None:
            self.forward_started = time.perf_counter()
        for module_name in [m for m in self.pending if m in self.silent]:
            self._apply_deferred(module_name)
        if self.measurement is not None:
            self.measurement.forward_start()

    def _pre_forward_for(self, module_name: str):
        def pre_forward(_module, _inputs):
            self.ran_forward.add(module_name)
            if module_name in self.pending:
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

    # -- optimizer ---------------------------------------------------------------------------------
    def step(self, optimizer) -> None:
        if not self.backward_synced:
            raise RuntimeError(
                "optimizer.step() without a synchronised backward pass: call backward() outside "
                "gradsync.no_sync() before stepping, or the replicas would diverge"
            )
        self.backward_synced = self.gradients_held = False
        executor = self.executor
        self._wait(executor, executor.wait_all if self.nonfinite == "skip" else executor.wait_before_step)
        if executor.skip_step:
            self._finish_iteration()
            return None
        complete, incomplete = [], []
        for module_name in self.layout.owners:
            (complete if self._complete(executor, module_name) else incomplete).append(module_name)
        with self._updating():
            if not incomplete:
                optimizer.step()
            else:
                hyper = hyperparameters(optimizer)
                if complete:
                    self._subset(complete).step(optimizer)
                self.pending = {m: hyper for m in incomplete}
        self._finish_iteration()
        return None

    def _apply_deferred(self, module_name: str) -> None:
        """Wait for the ops of a pending module and update it (nothing if an earlier call did)."""
        if module_name not in self.pending:
            return
        started, executor = time.perf_counter(), self.executor

        def wait_for_the_modules_ops():
            for index in executor.pending_ops(self.layout.owners[module_name]):
                executor.wait(index)

        self._wait(executor, wait_for_the_modules_ops)
        # with it, every pending module whose ops are done by now: one optimizer call for an op's modules
        ready = [m for m in self.pending if m == module_name or self._complete(executor, m)]
        with self._updating():
            self._subset(ready).step(self.optimizer, self.pending[module_name])
            for name in ready:
                del self.pending[name]
                if name in self.zero_after:
                    _zero(self.layout.owners[name], self.layout.parameters, self.zero_after.pop(name))
        if self.measurement is not None:  # neither the wait nor the update is the layer's forward
            self.measurement.exclude(time.perf_counter() - started)

    def _wait(self, executor: PlanExecutor, wait) -> None:
        """Run `wait` on `executor`'s ops: its time is communication wait, except the codec's
        decoding inside it, which is update time."""
        decoded, started = executor.decode_seconds, time.perf_counter()
        wait()
        decoding = executor.decode_seconds - decoded
        self.comm_wait += time.perf_counter() - started - decoding
        self.update_time += decoding
        self.decode_time += decoding

    @contextmanager
    def _updating(self):
        """Time the block as update time (optimizer step, a codec's work outside the hooks)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.update_time += time.perf_counter() - started

    def flush_deferred(self) -> None:
        """Apply every pending deferred update now, in layer order."""
        for module_name in list(self.pending):
            self._apply_deferred(module_name)

    def flush(self) -> None:
        """Wait for every launched op and apply every deferred update."""
        if self.executor is not None and self.backward_synced:
            self.executor.wait_all()
        self.flush_deferred()

    def zero_grad(self, optimizer, set_to_none: bool) -> None:
        if self.gradients_held:  # a step skipped on purpose: its ops must not write after the zeroing
            self._wait(self.executor, self.executor.wait_all)
            self.gradients_held = False
        for module_name, names in self.layout.owners.items():
            if module_name in self.pending:
                self.zero_after[module_name] = set_to_none
            else:
                _zero(names, self.layout.parameters, set_to_none)
        # parameters the optimizer holds outside the layout (frozen ones) follow the usual rule
        known = {id(p) for p in self.layout.parameters.values()}
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if id(parameter) not in known and parameter.grad is not None:
                    _zero_one(parameter, set_to_none)

    def _finish_iteration(self) -> None:
        now = time.perf_counter()
        busy = max(0.0, now - (self.forward_started or self.iteration_started) - self.comm_wait)
        prediction = self.prediction(self.rounds_now)
        encoding = sum(self.executors[layout].encode_seconds for layout in set(self.rounds_now))
        stats = IterationStats(self.iteration, now - self.iteration_started, self.comm_wait,
                               sum(self.executors[layout].wire_bytes() for layout in self.rounds_now),
                               prediction.time, self.update_time, busy, self.speed.scale, encoding + self.decode_time)
        self.history.append(stats)
        if self.trace is not None:
            self.trace.iteration(stats)
        self.iteration += 1
        self.iteration_started, self.forward_started = now, None
        self.comm_wait = self.update_time = self.decode_time = 0.0
        if self.measurement is not None:
            self.measurement.iteration_done(self)
        elif self.speed.observe(busy, prediction.busy):
            self._follow_compute_speed()

    def _follow_compute_speed(self) -> None:
        """Rescale the predictions to the slowest rank's measured speed (a collective; every rank
        reaches it at the same iteration)."""
        with waiting_for("the compute-speed check (every 8 iterations)", self.channels.timeout):
            ratio = slowest_over_ranks(self.speed.window_ratio(), self.channels.process_group, self.layout.device)
        if self.speed.rescale(ratio):
            self.predictions = {}

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
        self.flush()
        if state["codec"] != self.codec.name:
            raise ConfigError(f"checkpoint was made with compressor {state['codec']!r}, this run uses "
                              f"{self.codec.name!r}")
        per_rank = None
        if state["per_rank"] is not None:
            if state["world_size"] != self.channels.world_size:
                raise ConfigError(
                    f"checkpoint holds {self.codec.name!r} error feedback of {state['world_size']} ranks; this run "
                    f"has {self.channels.world_size}. Error feedback is per rank and cannot be redistributed: "
                    "resume with the same number of ranks")
            per_rank = state["per_rank"][self.channels.rank]
        self.codec.load_state_dict(state["shared"], per_rank)
        self.sync_steps = state["step"]

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
        """Remove every hook, apply pending updates and release the channels."""
        self.flush()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        _ATTACHED.pop(self.model, None)
        try:
            if self.trace is not None:
                self.trace.close()
        finally:
            self.channels.destroy()


def _zero_one(parameter, set_to_none: bool) -> None:
    """As torch's Optimizer.zero_grad; a gradient that is a span of an op buffer (a view) is
    zeroed in place without the in-place detach a view refuses."""
    if set_to_none:
        parameter.grad = None
    elif parameter.grad is not None:
        if parameter.grad.grad_fn is not None:
            parameter.grad.detach_()
        else:
            parameter.grad.requires_grad_(False)
        parameter.grad.zero_()


def _zero(names, parameters, set_to_none: bool) -> None:
    for name in names:
        _zero_one(parameters[name], set_to_none)


def _broadcast_from_first(tensors, process_group) -> None:
    """Give every rank the first rank's values of `tensors`: one broadcast of their bytes, packed
    by one concatenation with the largest elements first, so that each tensor starts at a multiple
    of its own element size (whatever the mix of dtypes)."""
    if not tensors:
        return
    ordered = sorted(tensors, key=lambda tensor: -tensor.element_size())
    flat = torch.cat([tensor.detach().reshape(-1).view(torch.uint8) for tensor in ordered])
    source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast(flat, src=source, group=process_group)
    if dist.get_rank() == source:  # its tensors hold what it sent
        return
    with torch.no_grad():
        parts = torch.split(flat, [tensor.numel() * tensor.element_size() for tensor in ordered])
        for tensor, part in zip(ordered, parts):
            tensor.copy_(part.view(tensor.dtype).view_as(tensor))


def attached(model) -> GradSync:
    if model not in _ATTACHED:
        raise ConfigError("this model was not wrapped with gradsync.wrap")
    return _ATTACHED[model]


def check_not_attached(model) -> None:
    """A model takes one runtime at a time: a second would launch every gradient's ops twice."""
    if model in _ATTACHED:
        raise ConfigError("this model is already wrapped by gradsync: detach that runtime first "
                          "(gradsync.runtime.attached(model).detach())")


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
