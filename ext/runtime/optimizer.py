"""SyncedOptimizer: the user's optimizer, stepped after gradsync has averaged the gradients.

It can update a subset of the parameters at a time (the rest wait for their forward-phase ops):
the wrapped optimizer's parameter lists are swapped for the subset's for the duration of one
``step``, which works for every optimizer whose update is per parameter, as torch's own (SGD, Adam, AdamW,
RMSprop, ...). Deferred updates use the hyper-parameters the groups had when ``step`` was called,
so an LR scheduler stepping in between does not leak into them.
"""
from __future__ import annotations

import inspect
import itertools
from typing import TYPE_CHECKING, Iterable

import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from .engine import GradSync


class ParameterSubset:
    """The parameters of `names`, split by the wrapped optimizer's groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: Iterable[torch.nn.Parameter]):
        wanted = {id(p) for p in parameters}
        self.per_group = [[p for p in group["params"] if id(p) in wanted] for group in optimizer.param_groups]

    @classmethod
    def union(cls, subsets: list["ParameterSubset"]) -> "ParameterSubset":
        """One subset with the parameters of `subsets` (of one optimizer), group by group."""
        if len(subsets) == 1:
            return subsets[0]
        merged = cls.__new__(cls)
        groups = zip(*(subset.per_group for subset in subsets))
        merged.per_group = [list(itertools.chain.from_iterable(lists)) for lists in groups]
        return merged

    def step(self, optimizer: torch.optim.Optimizer, hyper: list[dict] | None = None) -> None:
        """One ``optimizer.step()`` restricted to this subset, with `hyper` as the groups' settings."""
        groups = optimizer.param_groups
        saved = [(group["params"], {k: group[k] for k in (hyper[i] if hyper else ())}) for i, group in enumerate(groups)]
        try:
            for i, group in enumerate(groups):
                group["params"] = self.per_group[i]
                if hyper:
                    group.update(hyper[i])
            optimizer.step()
        finally:
            for group, (params, settings) in zip(groups, saved):
                group["params"] = params
                group.update(settings)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """A snapshot of every group's settings except its parameter list."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


class OptimizerGroup:
    """Optimizers that each update their own parameters of one model (a GAN's generator and
    discriminator), checked against the model and bound to gradsync's runtime as one. Each member's
    step waits for every op and updates its own parameters: no update is deferred to the next
    forward, where another member's step would find it pending."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @classmethod
    def of(cls, optimizers) -> "OptimizerGroup":
        """The group of `optimizers` (a list or tuple), each a torch optimizer; ConfigError for an
        empty one or another object (a parameter two of them update: ``ParameterTable.check_optimizer``)."""
        if not optimizers:
            raise ConfigError("'optimizer' is an empty list: give at least one torch.optim.Optimizer")
        others = [type(optimizer).__name__ for optimizer in optimizers
                  if not isinstance(optimizer, torch.optim.Optimizer)]
        if others:
            raise ConfigError(f"every optimizer in 'optimizer' must be a torch.optim.Optimizer, got {others}")
        return cls(list(optimizers))

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]


class SyncedOptimizer(torch.optim.Optimizer):
    """Behaves like the wrapped optimizer; `step` first completes gradsync's synchronisation.

    Attributes it does not define itself (hooks, private state) are the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, sync: "GradSync", bound=None):
        """`bound`: what the runtime is bound to, if not `optimizer`: the OptimizerGroup it belongs
        to. (No super().__init__: the state is the wrapped optimizer's.)"""
        self.__dict__["optimizer"] = optimizer
        self.__dict__["sync"] = sync
        self.__dict__["bound"] = optimizer if bound is None else bound

    def __getattr__(self, name):
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"SyncedOptimizer({self.optimizer!r})"

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def step(self, closure=None):
        """Run `closure` (forward and backward) if given, then synchronise and update; returns the
        closure's loss, as torch optimizers do. An optimizer whose step requires the closure
        (LBFGS, which evaluates the loss again within its step) is given it, each evaluation
        synchronised (``GradSync.step_evaluating``)."""
        if closure is not None and _requires_closure(self.optimizer):
            return self.sync.step_evaluating(self.optimizer, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sync.step(self.optimizer)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync.zero_grad((p for group in self.optimizer.param_groups for p in group["params"]), set_to_none)

    def synchronize(self) -> None:
        """Finish every outstanding op and deferred update now (before reading all gradients,
        clipping them, or checkpointing). Gradients changed before it, while their ops were in
        flight, raise ``gradsync.GradientsChangedInFlight``."""
        self.sync.flush()

    def state_dict(self):
        """The wrapped optimizer's state plus gradsync's (codec state and step) under "gradsync".
        With per-rank codec state (error feedback) this is a collective: call it on every rank."""
        gradsync_state = self.sync.state_dict()  # first: it applies pending updates
        return {**self.optimizer.state_dict(), "gradsync": gradsync_state}

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        gradsync_state = state_dict.pop("gradsync", None)
        if gradsync_state is not None:
            self.sync.load_state_dict(gradsync_state)
        else:
            self.sync.flush()
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        """The wrapped optimizer's ``add_param_group``; a group the runtime refuses is taken out again."""
        self.optimizer.add_param_group(param_group)
        try:
            self.sync.check_optimizer(self.bound)
        except ConfigError:
            self.optimizer.param_groups.pop()
            self.sync.check_optimizer(self.bound)
            raise


def _requires_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` takes its closure without a default: it evaluates the loss within
    the step (LBFGS), where the others evaluate an optional closure once, before they update."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty
