"""The wire profile: a model profile as a codec sends it, for planning and simulation."""
from __future__ import annotations

from typing import Iterable

from ..profile import LayerProfile, ModelProfile, TensorSpec
from .codec import Codec


def wire_profile(profile: ModelProfile, codec: Codec, layout: str, flops_per_second: float | None = None) -> ModelProfile:
    """`profile` with each tensor replaced by what travels under `layout`, and, given the device's
    FLOP/s, the codec's encode time added to the layer's backward (it runs in the gradient hook,
    before the op can launch) and its decode time to the layer's forward (it runs before the
    layer's update).

    Args:
        profile: the model's uncompressed profile.
        codec: the compressor, set up on the profile's tensors.
        layout: one of ``codec.layouts()``.
        flops_per_second: the device's speed in floating-point operations a second; None (or 0)
            leaves the layer times as they are.
    """
    layers = []
    for layer in profile.layers:
        encode, decode = codec_seconds(layer.tensors, codec, layout, flops_per_second)
        layers.append(LayerProfile(
            layer.name,
            tuple(codec.wire_spec(spec, layout) for spec in layer.tensors),
            layer.forward_time + decode,
            layer.backward_time + encode,
            layer.update_time,
        ))
    name = profile.name if codec.name == "identity" else f"{profile.name} ({codec.name}, {layout})"
    return ModelProfile(name, tuple(layers),
                        {**profile.metadata, "codec": codec.name, "layout": layout})


def codec_seconds(tensors: Iterable[TensorSpec], codec: Codec, layout: str,
                  flops_per_second: float | None) -> tuple[float, float]:
    """The codec's modelled encode and decode time of `tensors` under `layout` (0 without FLOP/s).

    Args:
        tensors: the uncompressed gradient tensors.
        codec, layout, flops_per_second: as in ``wire_profile``; the times are in seconds.
    """
    encode = decode = 0.0
    if flops_per_second:
        for spec in tensors:
            more_encode, more_decode = codec.compute_seconds(spec, layout, flops_per_second)
            encode, decode = encode + more_encode, decode + more_decode
    return encode, decode
