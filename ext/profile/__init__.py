"""Model profiles: gradient tensors per layer and compute times, from the zoo or from JSON."""
from .model_profile import LayerProfile, ModelProfile, TensorSpec
from .model_zoo import zoo, zoo_names

__all__ = ["LayerProfile", "ModelProfile", "TensorSpec", "zoo", "zoo_names"]
