"""Small profiles for hand-computed tests."""
from gradsync.profile import LayerProfile, ModelProfile, TensorSpec

MS = 1e-3


def toy_profile(layers, name="toy"):
    """`layers`: (numel, forward_ms, backward_ms) tuples, input → output; one fp32 tensor each."""
    return ModelProfile(
        name,
        tuple(
            LayerProfile(f"layer{i}", (TensorSpec(f"t{i}", numel),), f * MS, b * MS)
            for i, (numel, f, b) in enumerate(layers)
        ),
    )
