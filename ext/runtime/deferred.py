"""Deferred updates: at ``optimizer.step()`` the modules whose ops are still in flight (a plan's
forward-phase ops) are not updated; each is updated before its next forward reads its parameters,
with the hyper-parameters the optimizer had at the step (us-byte Fig. 1). Parameters written in
place meanwhile (their version counters moved) are refused before their update: it would land on
what was written."""
from __future__ import annotations

import time
from typing import Iterable

import torch

from ..errors import ParametersChangedBeforeUpdate
from .executor import PlanExecutor
from .parameter_table import ParameterTable
from .optimizer import OptimizerGroup, ParameterSubset, hyperparameters
from .statistics import IterationClock


class DeferredUpdates:
    """The step's updates by owner module: done at once where the module's ops are complete, else
    pending until `apply` (its forward, a module borrowing its parameters, the model's forward when
    its own forward does not run, a checkpoint, the next backward pass)."""

    def __init__(self, table: ParameterTable, clock: IterationClock):
        self.table = table
        self.clock = clock
        self.optimizer = None
        self.layer_subsets: dict[str, ParameterSubset] = {}  # owner module -> its parameters
        self.groups_bound: tuple = ()  # the optimizer's groups the subsets were made for (`_groups`)
        self.pending: dict[str, list[dict]] = {}  # module -> hyper-parameters at step time
        self.versions: dict[str, int] = {}  # pending module -> its parameters' version counters' sum then
        self.zero_after: dict[str, bool] = {}  # module -> set_to_none requested while pending
        self.in_table = {id(parameter) for parameter in table.parameters.values()}
        self.steps_subsets = True  # the optimizer's step may update a subset of the parameters at a time

    def bind(self, optimizer) -> None:
        """Update with `optimizer` (its parameters checked against the table)."""
        self.table.check_optimizer(optimizer)
        self.optimizer = optimizer
        self.steps_subsets = steps_subsets(optimizer)
        self.layer_subsets = {m: ParameterSubset(optimizer, [self.table.parameters[n] for n in names])
                              for m, names in self.table.owners.items()}
        self.groups_bound = _groups(optimizer)

    def step(self, optimizer, executor: PlanExecutor) -> None:
        """``optimizer.step()`` for the modules whose ops `executor` has completed; the others pending
        (an optimizer that cannot step a subset waits for every op, then steps them all)."""
        if executor.ops_open and not self.steps_subsets:
            self.clock.wait(executor, executor.wait_all)
        complete, incomplete = [], []
        for module_name in self.table.owners:
            (complete if not executor.ops_open or self._complete(executor, module_name) else incomplete).append(
                module_name)
        with self.clock.updating():
            if not incomplete:
                optimizer.step()
            else:
                hyper = hyperparameters(optimizer)
                if complete:
                    self._subset(complete).step(optimizer)
                self.pending = {m: hyper for m in incomplete}
                self.versions = {m: self._version_sum(m) for m in incomplete}

    def apply(self, module_name: str, executor: PlanExecutor) -> float:
        """Wait for the ops of a pending module and update it, with every pending module whose ops
        are done by then (one optimizer call); the seconds it took (0 if nothing was pending)."""
        if module_name not in self.pending:
            return 0.0
        pending_ops = executor.pending_ops(self.table.owners[module_name])
        executor.refuse_changed_in_flight(pending_ops)  # gradients cleared by hand: the update needs them
        started = time.perf_counter()

        def wait_for_the_modules_ops():
            for index in pending_ops:
                executor.wait(index)

        self.clock.wait(executor, wait_for_the_modules_ops)
        ready = [m for m in self.pending if m == module_name or self._complete(executor, m)]
        self._refuse_written(ready)
        with self.clock.updating():
            self._subset(ready).step(self.optimizer, self.pending[module_name])
            for name in ready:
                del self.pending[name]
                if name in self.zero_after:
                    _zero_gradients(self.table.owners[name], self.table.parameters, self.zero_after.pop(name))
        return time.perf_counter() - started

    def apply_all(self, executor: PlanExecutor | None) -> None:
        """Apply every pending update now, in layer order."""
        for module_name in list(self.pending):
            self.apply(module_name, executor)

    def zero_grad(self, others: Iterable[torch.nn.Parameter], set_to_none: bool, keep: set[str]) -> None:
        """``optimizer.zero_grad`` or ``model.zero_grad``: a pending module's gradients are zeroed
        after its update.

        Args:
            others: the parameters to zero besides the table's (the optimizer's or the model's; the
                table's among them are left to the rule above).
            set_to_none: set the gradients to None rather than zero them in place.
            keep: gradients zeroed in place already (``PlanExecutor.zero_gradients_in_place``),
                left as they are.
        """
        if self.pending or len(keep) < len(self.table.parameters):  # else every one is zeroed in place
            for module_name, names in self.table.owners.items():
                if module_name in self.pending:
                    self.zero_after[module_name] = set_to_none
                else:
                    _zero_gradients([name for name in names if name not in keep], self.table.parameters, set_to_none)
        # parameters outside the table (frozen ones) follow the usual rule
        for parameter in others:
            if id(parameter) not in self.in_table and parameter.grad is not None:
                _zero_gradient(parameter, set_to_none)

    def _refuse_written(self, modules: list[str]) -> None:
        """ParametersChangedBeforeUpdate if a parameter of `modules` was written in place since the step."""
        written = [name for m in modules if self._version_sum(m) != self.versions[m] for name in self.table.owners[m]]
        if written:
            raise ParametersChangedBeforeUpdate(
                f"parameter(s) {written[:4]}{' ...' if len(written) > 4 else ''} were written in place after "
                "optimizer.step(), while their update waited for their next forward: it would land on what was "
                "written. Call optimizer.synchronize() after the step and before writing them (or read them)")

    def _version_sum(self, module_name: str) -> int:
        """The sum of the version counters of the module's parameters (each only grows)."""
        return sum(self.table.parameters[name]._version for name in self.table.owners[module_name])

    def _subset(self, modules: list[str]) -> ParameterSubset:
        """The parameters of the owner `modules`, for one optimizer call (bound again to groups
        replaced since, as an assignment of ``param_groups`` replaces them)."""
        if _groups(self.optimizer) != self.groups_bound:
            self.bind(self.optimizer)
        return ParameterSubset.union([self.layer_subsets[m] for m in modules])

    def _complete(self, executor: PlanExecutor, module_name: str) -> bool:
        """Whether every op carrying the module's gradients is done."""
        return all(executor.complete(n) for n in self.table.owners[module_name])


def _zero_gradient(parameter, set_to_none: bool) -> None:
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


def _zero_gradients(names, parameters, set_to_none: bool) -> None:
    """``_zero_gradient`` for each parameter of `names` (keys of `parameters`, the parameter table's)."""
    for name in names:
        _zero_gradient(parameters[name], set_to_none)


def _groups(optimizer) -> tuple:
    """What identifies the optimizer's parameter groups: each group, its list of parameters and the
    list's length."""
    return tuple((id(group), id(group["params"]), len(group["params"])) for group in optimizer.param_groups)


def steps_subsets(optimizer) -> bool:
    """Whether `optimizer.step()` may update a subset of the parameters at a time, as torch's own
    optimizers (``torch.optim``) may: each parameter's update reads its own gradient and state alone
    (``ParameterSubset.step``). Any other step may read more (a global gradient norm, a counter in
    the group, the shards of every parameter: ZeroRedundancyOptimizer, PostLocalSGDOptimizer, LAMB
    and LARS implementations), so its updates wait for every op at the step instead, as do those
    of an OptimizerGroup's members."""
    if isinstance(optimizer, OptimizerGroup):
        return False
    owner = next(cls for cls in type(optimizer).__mro__ if "step" in vars(cls))
    return owner.__module__.startswith("torch.optim.")
