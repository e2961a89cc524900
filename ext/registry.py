"""Declared extension points: typed options and a registry of named specs.

Planners (``gradsync.planners``) and compressors (``gradsync.compress``) are each declared once, as
a spec: name, implementation, a one-line description, the paper it follows and its typed options.
Everything that lists or checks them (the runtime's argument checks, the Lightning strategy names,
the Hydra config groups, the DeepSpeed section, the CLI, the README's tables) reads the registry.
A separately installed package adds its own through ``register`` or an entry point
(``[project.entry-points."gradsync.planners"]`` naming a spec object).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Generic, Iterator, TypeVar

from .errors import ConfigError, unknown_name

NO_DEFAULT = object()  # an Option without a default must be given


@dataclass(frozen=True)
class Option:
    """One keyword option: its default, the check its values pass (`check(value) -> message or
    None`), a one-line help, and whether it is a byte size (scaled by the compression rate when
    planned on a compressed wire, acp-sgd §IV-B)."""

    name: str
    default: Any
    check: Callable[[Any], str | None]
    help: str
    is_bytes: bool = False

    def checked(self, owner: str, value):
        """`value` if it passes the check; else a ConfigError naming `owner` and the option."""
        problem = self.check(value)
        if problem is not None:
            raise ConfigError(f"{owner}: {self.name!r} must be {problem}, got {value!r}")
        return value


# -- checks: None when the value is fine, else what it must be -----------------------------------------
def positive_int(value) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "an integer >= 1"


def optional_positive_int(value) -> str | None:
    return None if value is None or positive_int(value) is None else "an integer >= 1 or null"


def flag(value) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def optional_flag(value) -> str | None:
    return None if value is None or isinstance(value, bool) else "true, false or null"


def fraction(value) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value < 1
    return None if ok else "a number in [0, 1)"


def anything(value) -> str | None:
    return None


def check_options(owner: str, declared: tuple[Option, ...], given: dict) -> dict:
    """`given` checked against `declared`: unknown names refused (listing the valid ones), each
    value checked. Returns the given options (defaults are not filled in; see `with_defaults`).

    Args:
        owner: names what the options belong to in the ConfigError (e.g. ``"scheduler 'us_byte'"``).
        declared: the options it accepts.
        given: option name to value, as the user gave them.

    Raises:
        ConfigError: for an unknown option name or a value that fails its option's check.
    """
    valid = [option.name for option in declared]
    unknown = sorted(set(given) - set(valid), key=str)
    if unknown:
        raise ConfigError(f"{owner}: unknown option(s) {unknown}; valid: {', '.join(valid) or 'none'}")
    by_name = {option.name: option for option in declared}
    return {name: by_name[name].checked(owner, value) for name, value in given.items()}


def with_defaults(declared: tuple[Option, ...], given: dict) -> dict:
    """Every declared option: the given value, else the default."""
    return {option.name: given.get(option.name, option.default) for option in declared}


Spec = TypeVar("Spec")


class Registry(Generic[Spec]):
    """Specs by name: the built-in ones (loaded on first use), those of the installed packages'
    entry points (`group`), and those `register`ed at run time. Listeners hear of every spec as it
    is registered, the ones before they subscribed included."""

    def __init__(self, kind: str, group: str, builtins: Callable[[], list]):
        self.kind = kind  # "scheduler", "compressor": in error messages
        self.group = group
        self._builtins = builtins
        self._specs: dict[str, Spec] = {}
        self._listeners: list[Callable[[Spec], None]] = []
        self._loaded = False

    def register(self, spec: Spec, replace: bool = False) -> Spec:
        """Add `spec`; a name already registered is refused unless `replace`."""
        self._load()
        name = getattr(spec, "name", None)
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"a {self.kind}'s name must be a Python identifier, got {name!r}")
        if name in self._specs and not replace:
            raise ConfigError(f"{self.kind} {name!r} is already registered (pass replace=True to replace it)")
        self._add(spec)
        return spec

    def get(self, name) -> Spec:
        self._load()
        if not isinstance(name, str) or name not in self._specs:
            raise unknown_name(self.kind, name, self._specs)
        return self._specs[name]

    def names(self) -> list[str]:
        self._load()
        return list(self._specs)

    def __iter__(self) -> Iterator[Spec]:
        self._load()
        return iter(list(self._specs.values()))

    def subscribe(self, listener: Callable[[Spec], None]) -> None:
        """Call `listener(spec)` for every spec registered so far and every later one."""
        self._load()
        self._listeners.append(listener)
        for spec in list(self._specs.values()):
            listener(spec)

    def _add(self, spec: Spec) -> None:
        """Tell the listeners first: one that refuses the spec (raises) keeps it out."""
        for listener in self._listeners:
            listener(spec)
        self._specs[spec.name] = spec

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for spec in self._builtins():
            self._add(spec)
        for entry in entry_points(group=self.group):
            spec = entry.load()
            if spec.name in self._specs:
                raise ConfigError(f"entry point {entry.value!r} ({self.group}) registers {self.kind} {spec.name!r}, "
                                  "which is already registered")
            self._add(spec)
