"""Per-layer times on the live job, combined over the ranks.

The MG-WFBP authors' method: hooks time each layer while iterations run (with a device synchronise
on GPU), here with all gradients in one all-reduce launched when the backward pass ends rather than
under WFBP, so that no op is in flight while the layers run and their times carry neither the ops'
host time nor their slowdown. A layer's backward time is the gap between its gradients becoming
ready and those of the layer before it in the backward pass.
"""
from __future__ import annotations

from dataclasses import replace

from ...plan import BACKWARD, Plan
from ...profile import LayerProfile, ModelProfile
from ..module_hooks import on_module
from ..parameter_table import ParameterTable
from . import median, now


class LayerTimer:
    """Forward and backward time per owning module over the iterations it is told to count."""

    def __init__(self, table: ParameterTable):
        self.table = table
        self.device = table.device
        self.module_of = {name: m for m, names in table.owners.items() for name in names}
        self.order: list[str] = []
        self.forward_ends: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.forward_samples: dict[str, list[float]] = {m: [] for m in table.owners}
        self.backward_samples: dict[str, list[float]] = {m: [] for m in table.owners}
        self.forward_begin = 0.0
        self.stalled = 0.0  # time inside the current layer's forward that is not its own (deferred updates)
        self.handles = [module.register_forward_hook(on_module(module, self._forward_end_for(name)))
                        for name, module in table.modules.items()]

    def forward_start(self) -> None:
        self.forward_begin = now(self.device)
        self.order, self.forward_ends, self.ready = [], {}, {}
        self.stalled = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` spent in the current forward out of the layer being timed."""
        self.stalled += seconds

    def module_start(self, module_name: str) -> None:
        if module_name not in self.forward_ends and module_name not in self.order:
            self.order.append(module_name)

    def _forward_end_for(self, module_name: str):
        def forward_end(_module, _inputs, _output):
            if module_name not in self.forward_ends:
                self.forward_ends[module_name] = now(self.device) - self.stalled
        return forward_end

    def gradient_ready(self, name: str) -> None:
        self.ready[self.module_of[name]] = now(self.device)

    def count_iteration(self) -> None:
        """Turn this iteration's timestamps into per-layer samples."""
        previous = self.forward_begin
        for module_name, end in sorted(self.forward_ends.items(), key=lambda item: item[1]):
            self.forward_samples[module_name].append(end - previous)
            previous = end
        previous = max(self.forward_ends.values(), default=self.forward_begin) + self.stalled
        for module_name, ready in sorted(self.ready.items(), key=lambda item: item[1]):
            self.backward_samples[module_name].append(ready - previous)
            previous = ready

    def profile(self, name: str, update_time: float = 0.0) -> ModelProfile:
        """Each layer's median time over the counted iterations (robust to one disturbed iteration)."""
        profile = self.table.profile(
            name,
            self.order,
            {m: median(s) for m, s in self.forward_samples.items()},
            {m: median(s) for m, s in self.backward_samples.items()},
        )
        return profile.with_update_time(update_time)

    def clear(self) -> None:
        """Forget the counted samples."""
        for samples in (*self.forward_samples.values(), *self.backward_samples.values()):
            samples.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def without_host(profile: ModelProfile, plan: Plan, host: float) -> ModelProfile:
    """`profile` as measured while `plan` ran, with the host time of its backward-phase ops taken
    out of the backward pass, in proportion to each layer's share of it (the ops' processor time
    falls wherever their transfers run).

    Args:
        profile: the timed profile.
        plan: the plan whose ops launched while it was timed.
        host: seconds of the computing thread per op (``CostModel.host``).
    """
    backward = profile.backward_time
    charged = host * sum(1 for op in plan.ops if op.phase == BACKWARD)
    if backward <= 0 or charged <= 0:
        return profile
    scale = max(0.0, backward - charged) / backward
    layers = tuple(LayerProfile(l.name, l.tensors, l.forward_time, l.backward_time * scale, l.update_time)
                   for l in profile.layers)
    return ModelProfile(profile.name, layers, dict(profile.metadata))


def slowest_times(profiles: list[ModelProfile]) -> ModelProfile:
    """The first profile's layers, in its order, each with its largest forward, backward and
    update time over `profiles` (one per rank), then the layers' forward times scaled so that they
    sum to the slowest rank's own forward time, and the backward and update times alike.

    A synchronised iteration waits for the slowest rank at every op, not at every layer: ranks
    slowed at different layers (descheduled on a shared host) do not each delay it, so the sum of
    the per-layer maxima overstates it (on the emulated cluster by up to 10% with 2 ranks, up to 66%
    with 4 ranks on 2 cores); the maxima only set how the slowest total spreads over the layers,
    and keep a layer that only other ranks run."""
    by_name = [{layer.name: layer for layer in profile.layers} for profile in profiles]
    first = profiles[0]
    largest = {attr: [max(getattr(layers[layer.name], attr) for layers in by_name) for layer in first.layers]
               for attr in ("forward_time", "backward_time", "update_time")}
    for attr, times in largest.items():
        slowest_rank = max(sum(getattr(layer, attr) for layer in profile.layers) for profile in profiles)
        summed = sum(times)
        factor = slowest_rank / summed if summed > 0 else 1.0
        largest[attr] = [seconds * factor for seconds in times]
    layers = tuple(replace(layer, **{attr: times[index] for attr, times in largest.items()})
                   for index, layer in enumerate(first.layers))
    return ModelProfile(first.name, layers, dict(first.metadata))
