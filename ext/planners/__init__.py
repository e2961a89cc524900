"""Planner registry: pure functions ``(profile, cost, **options) -> Plan``, one module per paper."""
from __future__ import annotations

import inspect
from importlib import import_module
from typing import Callable

from ..errors import unknown_name

# name -> module under gradsync.planners that defines ``plan(profile, cost, **options)``
_MODULES = {
    "wfbp": "wfbp",
    "ddp": "ddp_buckets",
    "mg_wfbp": "mg_wfbp",
    "optimal_merge": "optimal_merge",
    "asc_wfbp": "asc_wfbp",
    "bytescheduler": "bytescheduler",
    "us_byte": "us_byte",
    "auto": "auto",
}


def names() -> list[str]:
    """Every registered planner name."""
    return list(_MODULES)


def get(name: str) -> Callable:
    """The planner function registered under `name`."""
    if not isinstance(name, str) or name not in _MODULES:
        raise unknown_name("scheduler", name, _MODULES)
    return import_module(f"{__name__}.{_MODULES[name]}").plan


def option_names(name: str) -> list[str]:
    """The keyword options the planner `name` takes."""
    parameters = inspect.signature(get(name)).parameters
    return [p for p, spec in parameters.items()
            if spec.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p not in ("profile", "cost")]
