"""Checks shared by the planners for their keyword options."""
from __future__ import annotations

import math

from ..errors import ConfigError


def reject_unknown(planner: str, options: dict, valid: tuple[str, ...] = ()) -> None:
    """Raise if `options` holds a key the planner does not take."""
    unknown = sorted(set(options) - set(valid))
    if unknown:
        accepted = ", ".join(valid) if valid else "none"
        raise ConfigError(f"scheduler {planner!r}: unknown option(s) {unknown}; valid: {accepted}")


def positive_number(planner: str, field: str, value) -> float:
    """`value` as a finite number > 0, or an error naming the option."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"scheduler {planner!r}: {field!r} must be a finite number > 0, got {value!r}")
    return value


def positive_int(planner: str, field: str, value) -> int:
    """`value` as an integer >= 1, or an error naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"scheduler {planner!r}: {field!r} must be an integer >= 1, got {value!r}")
    return value
