"""CodecSpec: a compressor declared once (kept apart from the package so that each codec module
can declare its own)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from .codec import Codec


@dataclass(frozen=True)
class CodecSpec:
    """A compressor, declared once.

    Args:
        codec: the Codec subclass; its `name` is the compressor's name and its constructor's
            keyword arguments are the options (with their defaults), checked there.
        description: one line, for listings and the Lightning strategy's description.
        source: the paper and section it implements (a key of the bibliography), or "".
        strategy: whether it gets a Lightning strategy and a Hydra strategy option of its name.
        aliases: other names accepted for options (alias: option), e.g. those of the torch hook a
            codec follows, so that its users' settings carry over.
    """

    codec: type[Codec]
    description: str
    source: str = ""
    strategy: bool = True
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.codec.name

    def defaults(self) -> dict:
        """Its options and their defaults, from the codec's constructor."""
        return {name: parameter.default for name, parameter in inspect.signature(self.codec).parameters.items()
                if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}

    def canonical(self, options: dict) -> dict:
        """`options` with each alias replaced by the option it names; an alias given beside its
        option is refused."""
        resolved = dict(options)
        for alias, option in self.aliases.items():
            if alias in resolved:
                if option in resolved:
                    raise ConfigError(f"compressor {self.name!r}: {alias!r} is another name for {option!r}; "
                                      "give one of them")
                resolved[option] = resolved.pop(alias)
        return resolved
