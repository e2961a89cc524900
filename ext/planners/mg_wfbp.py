"""MG-WFBP: merge a layer's gradients into the next layer's all-reduce when start-up dominates
(mg-wfbp §IV, Theorem 1, Algorithm 1).

Paper layers are numbered 1..L from input to output; backward runs L → 1. Here a paper "layer" is a
merge unit: one layer's tensors of one element size (the whole layer unless its gradients mix
fp16/fp32, which never share a buffer). Times are measured from the start of the backward pass,
which shifts the paper's τ by t_f and leaves every difference unchanged.

- ready(l) = τ_b(l) + t_b(l): when layer l's gradients are computed (eq. 19);
- t_c(l) = T_ar(p(l)) = cost.allreduce_time(bytes of l) (eqs. 9, 17);
- τ_c(L) = ready(L), τ_c(l) = max{τ_c(l+1) + t_c(l+1), ready(l)} (eq. 20, CALCULATECOMMSTART);
- for l = L → 2: layer l is a merged-gradient layer, (l) ⊕ (l−1), iff τ_b(l−2) − τ_c(l) < a
  (Theorem 1, eq. 27), where τ_b(l−2) = τ_b(l−1) + t_b(l−1) = ready(l−1) by eq. 6, which also
  defines τ_b(0) for l = 2; a merge sets t_c(l) = 0 (eq. 14), p(l−1) += p(l) (eq. 16),
  t_c(l−1) = T_ar(p(l−1)), and recomputes τ_c, which gives eq. 15 (Algorithm 1, lines 12–20).
  Two units of different element sizes are never merged: eq. 16 would mix them in one buffer.

Layers l, l−1, …, m+1 in 𝕄 and m not in 𝕄 form one op with m, launched once layer m's gradients
are ready (Algorithm 2, lines 25–28). Theorem 1 weighs each merge with the other choices fixed, so
the greedy result is not always the optimum its statement claims (the tests hold a 3-layer case);
`optimal_merge` solves the same problem exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..cost import CostModel
from ..plan import Op, Plan, whole
from ..profile import ModelProfile, TensorSpec
from . import PlannerSpec
from .options import deferred_if
from .wfbp import backward_order


@dataclass(frozen=True)
class MergeUnit:
    """Tensors that always travel together: one layer's consecutive tensors (in backward order)
    of one element size; `ready` is when backward has computed them."""

    tensors: tuple[TensorSpec, ...]
    ready: float

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def bytes_per_element(self) -> int:
        return self.tensors[0].bytes_per_element


def merge_units(profile: ModelProfile) -> list[MergeUnit]:
    """The profile's merge units in backward order (output layer first)."""
    ready_times = profile.backward_ready_times()
    runs: list[tuple[int, list[TensorSpec]]] = []
    for layer_index, tensor in backward_order(profile):
        last = runs[-1] if runs else None
        if last and last[0] == layer_index and last[1][0].bytes_per_element == tensor.bytes_per_element:
            last[1].append(tensor)
        else:
            runs.append((layer_index, [tensor]))
    return [MergeUnit(tuple(tensors), ready_times[layer_index]) for layer_index, tensors in runs]


def plan_from_groups(groups: Sequence[Sequence[MergeUnit]]) -> Plan:
    """One backward-phase op on channel 0 per group of units, groups in the order given."""
    ops = tuple(
        Op(tuple(whole(tensor) for unit in group for tensor in unit.tensors), priority=index)
        for index, group in enumerate(groups)
    )
    return Plan(ops)


def plan(profile: ModelProfile, cost: CostModel, *, overlap_forward: bool) -> Plan:
    """One op per run of merged-gradient layers found by Algorithm 1, in backward order.

    Args:
        profile: the model's per-layer times and tensors (ModelProfile).
        cost: the all-reduce cost model; its start-up ``a`` is Theorem 1's merge threshold.
        overlap_forward: defer the step's waits to each layer's next forward (us-byte Fig. 1).
    """
    units = merge_units(profile)[::-1]  # paper order: index 0 is layer 1, the input side
    merged = merged_gradient_layers(units, cost)
    groups: list[list[MergeUnit]] = []
    current: list[MergeUnit] = []
    for index in range(len(units) - 1, -1, -1):
        current.append(units[index])
        if index not in merged:  # layer 1 never is, so the last group closes
            groups.append(current)
            current = []
    return deferred_if(plan_from_groups(groups), overlap_forward)


def merged_gradient_layers(units: Sequence[MergeUnit], cost: CostModel) -> set[int]:
    """Algorithm 1: the set 𝕄 of merged-gradient layers, as indices into `units` (input → output)."""
    ready = [unit.ready for unit in units]
    nbytes = [unit.nbytes for unit in units]
    comm = [cost.allreduce_time(size) for size in nbytes]  # t_c (eq. 17)
    start = comm_start_times(comm, ready)
    merged: set[int] = set()
    for layer in range(len(units) - 1, 0, -1):  # l = L → 2
        same_buffer = units[layer].bytes_per_element == units[layer - 1].bytes_per_element
        if same_buffer and ready[layer - 1] - start[layer] < cost.a:  # eq. 27
            comm[layer] = 0.0  # eq. 14
            nbytes[layer - 1] += nbytes[layer]  # eq. 16
            comm[layer - 1] = cost.allreduce_time(nbytes[layer - 1])
            start = comm_start_times(comm, ready)  # eq. 15 through eq. 20
            merged.add(layer)
    return merged


def comm_start_times(comm: Sequence[float], ready: Sequence[float]) -> list[float]:
    """τ_c of every layer (eq. 20; Algorithm 1, CALCULATECOMMSTART), input → output order."""
    start = list(ready)
    for layer in range(len(ready) - 2, -1, -1):
        start[layer] = max(start[layer + 1] + comm[layer + 1], ready[layer])
    return start


SPEC = PlannerSpec("mg_wfbp", plan, "MG-WFBP: merge layers' gradients when all-reduce start-up dominates",
                   source="mg-wfbp Algorithm 1")
