"""WFBP: one all-reduce per gradient tensor, launched as soon as the tensor is computed
(wait-free backpropagation; mg-wfbp §III, asc-wfbp §II-B)."""
from __future__ import annotations

from ..cost import CostModel
from ..plan import Op, Plan, whole
from ..profile import ModelProfile
from . import PlannerSpec
from .options import deferred_if


def plan(profile: ModelProfile, cost: CostModel, *, overlap_forward: bool) -> Plan:
    """One op per tensor in backward order (output layer first).

    Args:
        profile: the model's per-layer times and tensors (ModelProfile).
        cost: the all-reduce cost model (unused: the plan does not depend on it).
        overlap_forward: defer the step's waits to each layer's next forward (us-byte Fig. 1).
    """
    ops = tuple(
        Op((whole(tensor),), priority=index)
        for index, (layer_index, tensor) in enumerate(backward_order(profile))
    )
    return deferred_if(Plan(ops), overlap_forward)


def backward_order(profile: ModelProfile):
    """(layer index, tensor) pairs in the order backward produces them: output layer first."""
    for layer_index in range(len(profile.layers) - 1, -1, -1):
        for tensor in reversed(profile.layers[layer_index].tensors):
            yield layer_index, tensor


SPEC = PlannerSpec("wfbp", plan, "wait-free backpropagation: one all-reduce per gradient as soon as it is ready",
                   source="mg-wfbp §III")
