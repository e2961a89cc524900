"""Gradient compressors as codecs: what travels per tensor, and how it is encoded and decoded."""
from __future__ import annotations

from importlib import import_module

from ..errors import ConfigError, unknown_name
from .codec import Codec
from .wire import wire_profile

# name -> "module:class" under gradsync.compress
_CODECS = {
    "identity": "codec:Codec",
    "acp_sgd": "acp_sgd:ACPSGD",
    "powersgd": "powersgd:PowerSGD",
    "signsgd": "signsgd:SignSGD",
    "topk": "topk:TopK",
}


def names() -> list[str]:
    return list(_CODECS)


def get(name: str | None, **options) -> Codec:
    """The codec `name` built with `options` (None means no compression)."""
    name = name or "identity"
    if name not in _CODECS:
        raise unknown_name("compressor", name, _CODECS)
    module, cls = _CODECS[name].split(":")
    codec_class = getattr(import_module(f"{__name__}.{module}"), cls)
    try:
        return codec_class(**options)
    except TypeError as exc:
        raise ConfigError(f"compressor {name!r}: {exc}") from exc


__all__ = ["Codec", "get", "names", "wire_profile"]
