"""Gradient compressors as codecs: what travels per tensor, and how it is encoded and decoded.

Each compressor is declared once as a CodecSpec (its Codec class, whose constructor's keyword
arguments are its options, checked there) and registered by name. A separately installed package
adds one with ``register(CodecSpec(...))`` or an entry point in the group ``gradsync.compressors``
naming its spec.
"""
from __future__ import annotations

from importlib import import_module

from ..errors import ConfigError
from ..registry import Registry
from .codec import Codec
from .spec import CodecSpec
from .wire import wire_profile

# built-in codecs: modules defining SPEC (or SPECS, a tuple of several)
BUILTIN_MODULES = ("codec", "acp_sgd", "powersgd", "signsgd", "topk", "cast", "quantize")


def _builtins() -> list[CodecSpec]:
    modules = [import_module(f"{__name__}.{module}") for module in BUILTIN_MODULES]
    return [spec for module in modules for spec in getattr(module, "SPECS", None) or (module.SPEC,)]


registry: Registry[CodecSpec] = Registry("compressor", "gradsync.compressors", _builtins)


def register(spec: CodecSpec, replace: bool = False) -> CodecSpec:
    """Add a compressor (its Lightning strategy, Hydra option and CLI listing follow)."""
    if not isinstance(spec, CodecSpec) or not (isinstance(spec.codec, type) and issubclass(spec.codec, Codec)):
        raise ConfigError(f"compress.register takes a CodecSpec of a Codec subclass, got {spec!r}")
    return registry.register(spec, replace)


def names() -> list[str]:
    return registry.names()


def get(name: str | None, **options) -> Codec:
    """The codec `name` built with `options` (None means no compression; an option may be given by
    an alias its spec declares)."""
    spec = registry.get(Codec.name if name is None else name)
    aliased = sorted(set(options) & set(spec.aliases))
    try:
        return spec.codec(**spec.canonical(options))
    except TypeError as exc:
        raise ConfigError(f"compressor {spec.name!r}: {exc}") from exc
    except ConfigError as exc:
        if not aliased:
            raise
        raise ConfigError(f"{exc} (given as {', '.join(aliased)})") from exc


def build(spec) -> Codec:
    """A codec from a name, a ``{"type": name, **options}`` dict, a Codec (used as given) or None
    (no compression)."""
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, dict):
        options = dict(spec)
        if "type" not in options:
            raise ConfigError(f"'compressor' dict needs a 'type' key (one of: {', '.join(names())})")
        return get(registry.get(options.pop("type")).name, **options)
    if spec is None or isinstance(spec, str):
        return get(spec)
    raise ConfigError(f"'compressor' must be a name, a dict or a Codec, got {type(spec).__name__}")


__all__ = ["Codec", "CodecSpec", "build", "get", "names", "register", "registry", "wire_profile"]
