"""Planners: pure functions ``(profile, cost, **options) -> Plan``, each declared once as a
PlannerSpec (one module per paper) and registered by name.

A scheduler name and its options are resolved once, at the edge, into a BoundPlanner (``bind``):
the function and its checked options. The runtime, the codec planning and the front-ends call the
bound planner and never read a planner's name or options themselves. A separately installed
package adds a planner with ``register(PlannerSpec(...))`` or an entry point in the group
``gradsync.planners`` naming its spec.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import import_module
from typing import Callable, Mapping

from ..cost import CostModel
from ..errors import ConfigError
from ..plan import Plan
from ..profile import ModelProfile
from ..registry import Option, Registry, check_options, flag, with_defaults

# built-in planners, simplest first (auto prefers an earlier one on a tie): modules defining SPEC
BUILTIN_MODULES = ("wfbp", "ddp_buckets", "mg_wfbp", "optimal_merge", "asc_wfbp", "bytescheduler", "us_byte",
                   "auto")

# the option every planner takes: us-byte's dependency graph (Fig. 1) for any plan
OVERLAP_FORWARD = Option("overlap_forward", False, flag,
                         "defer the step's waits to each layer's next forward (us-byte Fig. 1)")


@dataclass(frozen=True)
class PlannerSpec:
    """A planner, declared once.

    Args:
        name: the scheduler name (``gradsync.wrap(scheduler=name)``); a Python identifier.
        plan: ``plan(profile, cost, **options) -> Plan``, called with every declared option.
        description: one line, for listings and the Lightning strategy's description.
        options: its typed options (OVERLAP_FORWARD included where it applies).
        source: the paper and section it implements (a key of the bibliography), or "".
        strategy: the Lightning strategy name, when not `name` (e.g. torch's own ``ddp``).
        chooses: it picks one of the other planners' plans; it then takes ``candidates`` (names,
            None for all), ``tolerance`` (how much faster a later candidate must be), and, for its
            trials on the job (``runtime.measure.trials``), ``confidence`` and ``trial_seconds``.
        baseline: its plans are the closest to torch DDP's: a choosing planner's trials keep them
            unless another plan is faster with confidence.
    """

    name: str
    plan: Callable[..., Plan]
    description: str
    options: tuple[Option, ...] = (OVERLAP_FORWARD,)
    source: str = ""
    strategy: str | None = None
    chooses: bool = False
    baseline: bool = False

    @property
    def strategy_name(self) -> str:
        return self.strategy or self.name

    @property
    def takes_channels(self) -> bool:
        return any(option.name == "channels" for option in self.options)

    def option(self, name: str) -> Option:
        return next(option for option in self.options if option.name == name)


@dataclass(frozen=True)
class BoundPlanner:
    """A planner with checked options: call it with ``(profile, cost)`` for the Plan."""

    spec: PlannerSpec
    options: Mapping = field(default_factory=dict)  # the given options (defaults not filled in)

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, profile: ModelProfile, cost: CostModel) -> Plan:
        plan = self.spec.plan(profile, cost, **with_defaults(self.spec.options, self.options))
        return replace(plan, planner=self.spec.name)

    def with_options(self, **changes) -> BoundPlanner:
        return bind(self.spec.name, **{**self.options, **changes})

    def scaled(self, rate: float) -> BoundPlanner:
        """Byte thresholds (the byte-size options, given or default) describe uncompressed gradients;
        on a wire `rate` times smaller they shrink alike (acp-sgd §IV-B: fusion buffer sizes scaled
        by the compression rate)."""
        if rate >= 1.0:
            return self
        full = with_defaults(self.spec.options, self.options)
        return replace(self, options={**self.options, **{option.name: max(1, int(full[option.name] * rate))
                                                         for option in self.spec.options if option.is_bytes}})

    @property
    def chooses(self) -> bool:
        return self.spec.chooses

    @property
    def tolerance(self) -> float:
        """How much faster (relative) a plan other than its own choice must be to replace it."""
        return with_defaults(self.spec.options, self.options)["tolerance"] if self.chooses else 0.0

    @property
    def confidence(self) -> float:
        """The confidence with which its trials must find another plan faster than the baseline's."""
        return self._setting("confidence")

    @property
    def trial_seconds(self) -> float:
        """The time its trials on the job may take before keeping what they have found."""
        return self._setting("trial_seconds")

    def _setting(self, name: str):
        if not self.chooses:
            raise ConfigError(f"scheduler {self.name!r} does not choose among planners: it has no {name!r}")
        return with_defaults(self.spec.options, self.options)[name]

    def alternatives(self) -> list[BoundPlanner]:
        """A choosing planner restricted to each of its candidates in turn (none otherwise)."""
        if not self.chooses:
            return []
        return [self.with_options(candidates=(name,)) for name in self.options.get("candidates") or candidates()]

    def baseline(self) -> BoundPlanner | None:
        """A choosing planner restricted to its baseline candidate (``PlannerSpec.baseline``: torch
        DDP's buckets), if its candidates include one."""
        return next((single for single in self.alternatives()
                     if registry.get(single.options["candidates"][0]).baseline), None)

    def described(self) -> str:
        """Its name and given options, for messages and reports."""
        return self.name + (f" {dict(self.options)}" if self.options else "")


def _builtins() -> list[PlannerSpec]:
    return [import_module(f"{__name__}.{module}").SPEC for module in BUILTIN_MODULES]


registry: Registry[PlannerSpec] = Registry("scheduler", "gradsync.planners", _builtins)


def candidates() -> list[str]:
    """The planners a choosing planner picks among by default: every one that does not choose."""
    return [spec.name for spec in registry if not spec.chooses]


def register(spec: PlannerSpec, replace: bool = False) -> PlannerSpec:
    """Add a planner (Lightning strategy, Hydra strategy option and CLI listing follow)."""
    if not isinstance(spec, PlannerSpec):
        raise ConfigError(f"planners.register takes a PlannerSpec, got {type(spec).__name__}")
    return registry.register(spec, replace)


def names() -> list[str]:
    """Every registered planner name."""
    return registry.names()


def spec(name: str) -> PlannerSpec:
    return registry.get(name)


def bind(name: str, **options) -> BoundPlanner:
    """The planner `name` with `options` checked (unknown names and bad values refused)."""
    found = registry.get(name)
    return BoundPlanner(found, check_options(f"scheduler {name!r}", found.options, options))


def get(name: str) -> Callable[..., Plan]:
    """``plan(profile, cost, **options)`` of the planner `name`, checking the options."""
    found = registry.get(name)
    return lambda profile, cost, **options: bind(found.name, **options)(profile, cost)


def option_names(name: str) -> list[str]:
    """The keyword options the planner `name` takes."""
    return [option.name for option in registry.get(name).options]


def one_bucket() -> BoundPlanner:
    """Every gradient in one all-reduce at the end of the backward pass (torch DDP's buckets with
    no cap): nothing in flight beside the layers, for timing them."""
    return bind("ddp", bucket_cap_bytes=1 << 62, first_bucket_bytes=1 << 62)


def chosen_planner(plan: Plan) -> str:
    """The planner whose plan `plan` is: a choosing planner's choice, else its own name."""
    return plan.options.get("chosen", plan.planner)


def chosen_label(plans) -> str:
    """The planners `plans` (a step's or a codec cycle's) come from, "/"-joined (``chosen_planner``)."""
    return "/".join(sorted({chosen_planner(plan) for plan in plans}))


__all__ = ["BoundPlanner", "OVERLAP_FORWARD", "PlannerSpec", "bind", "candidates", "chosen_label", "chosen_planner",
           "get", "names", "one_bucket", "option_names", "register", "registry", "spec"]
