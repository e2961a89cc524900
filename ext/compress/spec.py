"""CodecSpec: a compressor declared once (kept apart from the package so that each codec module
can declare its own)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
    """

    codec: type[Codec]
    description: str
    source: str = ""
    strategy: bool = True

    @property
    def name(self) -> str:
        return self.codec.name

    def defaults(self) -> dict:
        """Its options and their defaults, from the codec's constructor."""
        return {name: parameter.default for name, parameter in inspect.signature(self.codec).parameters.items()
                if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}
