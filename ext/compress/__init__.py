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
    name = "identity" if name is None else name
    if not isinstance(name, str) or name not in _CODECS:
        raise unknown_name("compressor", name, _CODECS)
    module, cls = _CODECS[name].split(":")
    codec_class = getattr(import_module(f"{__name__}.{module}"), cls)
    try:
        return codec_class(**options)
    except TypeError as exc:
        raise ConfigError(f"compressor {name!r}: {exc}") from exc


def build(spec) -> Codec:
    """A codec from a name, a ``{"type": name, **options}`` dict, a Codec (used as given) or None
    (no compression)."""
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, dict):
        options = dict(spec)
        if "type" not in options:
            raise ConfigError(f"'compressor' dict needs a 'type' key (one of: {', '.join(names())})")
        if not isinstance(options["type"], str):
            raise unknown_name("compressor", options["type"], _CODECS)
        return get(options.pop("type"), **options)
    if spec is None or isinstance(spec, str):
        return get(spec)
    raise ConfigError(f"'compressor' must be a name, a dict or a Codec, got {type(spec).__name__}")


__all__ = ["Codec", "build", "get", "names", "wire_profile"]
