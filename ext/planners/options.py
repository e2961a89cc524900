"""Checks shared by the planners for their keyword options."""
from __future__ import annotations

from ..errors import ConfigError
from ..plan import Plan


def reject_unknown(planner: str, options: dict, valid: tuple[str, ...] = ()) -> None:
    """Raise if `options` holds a key the planner does not take."""
    unknown = sorted(set(options) - set(valid))
    if unknown:
        accepted = ", ".join(valid) if valid else "none"
        raise ConfigError(f"scheduler {planner!r}: unknown option(s) {unknown}; valid: {accepted}")


def positive_int(planner: str, field: str, value) -> int:
    """`value` as an integer >= 1, or an error naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"scheduler {planner!r}: {field!r} must be an integer >= 1, got {value!r}")
    return value


def overlapping(planner: str, plan: Plan, overlap_forward) -> Plan:
    """`plan`, with its backward ops deferred to the next forward where `overlap_forward` (the
    option every planner takes: us-byte's dependency graph, Fig. 1, for any plan)."""
    if not isinstance(overlap_forward, bool):
        raise ConfigError(f"scheduler {planner!r}: 'overlap_forward' must be true or false, got {overlap_forward!r}")
    return plan.with_deferred_waits() if overlap_forward else plan
