"""The model zoo: profiles of the papers' DNNs built from their architecture and FLOP counts.

A layer is a module that directly owns parameters, taken in forward execution order (recorded by
forward hooks during one forward pass on the meta device, so nothing is allocated); its tensors
are its own parameters, a shared parameter only in the first layer that uses it. Forward FLOPs are
counted by torch's FlopCounterMode; FLOPs that run outside every layer (attention products,
pooling, residual adds) go to the next layer to run, or to the last layer. A layer's backward costs
twice its forward FLOPs (one product for the input gradient, one for the weight gradient), and
the device model turns FLOPs into seconds (mg-wfbp eq. 18).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..errors import ConfigError, unknown_name
from .architectures import ARCHITECTURES, Architecture
from .devices import resolve_device
from .model_profile import LayerProfile, ModelProfile, TensorSpec

BACKWARD_FLOPS_PER_FORWARD_FLOP = 2


@dataclass(frozen=True)
class LayerFlops:
    """A parameter-owning layer with the gradient tensors it contributes and its forward FLOPs."""

    name: str
    tensors: tuple[TensorSpec, ...]
    flops: int


class _ForwardWalk:
    """Forward hooks that record layers in execution order and split the FLOP count among them."""

    def __init__(self, model: nn.Module, counter: FlopCounterMode) -> None:
        self.counter = counter
        self.module_names = {module: name for name, module in model.named_modules()}
        self.parameter_names = {id(p): name for name, p in model.named_parameters()}
        self.claimed: set[int] = set()
        self.layer_index: dict[nn.Module, int | None] = {}
        self.names: list[str] = []
        self.tensors: list[tuple[TensorSpec, ...]] = []
        self.flops: list[int] = []
        self.active: list[int] = []
        self.unassigned = 0
        self.counted = 0

    def before(self, module: nn.Module, args) -> None:
        self._settle()
        index = self._index(module)
        if index is not None:
            self.flops[index] += self.unassigned
            self.unassigned = 0
            self.active.append(index)

    def after(self, module: nn.Module, args, output) -> None:
        if self.layer_index[module] is not None:
            self._settle()
            self.active.pop()

    def layers(self) -> tuple[LayerFlops, ...]:
        """The layers seen; FLOPs after the last layer go to the last layer."""
        self._settle()
        if self.flops:
            self.flops[-1] += self.unassigned
        return tuple(LayerFlops(*fields) for fields in zip(self.names, self.tensors, self.flops))

    def _settle(self) -> None:
        """Charge the FLOPs counted since the last hook to the running layer, else hold them."""
        total = self.counter.get_total_flops()
        new_flops, self.counted = total - self.counted, total
        if self.active:
            self.flops[self.active[-1]] += new_flops
        else:
            self.unassigned += new_flops

    def _index(self, module: nn.Module) -> int | None:
        """The module's layer index, made on its first call; None if all its parameters are taken."""
        if module not in self.layer_index:
            fresh = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in self.claimed]
            self.claimed.update(id(p) for p in fresh)
            self.layer_index[module] = len(self.names) if fresh else None
            if fresh:
                self.names.append(self.module_names[module])
                self.tensors.append(
                    tuple(TensorSpec(self.parameter_names[id(p)], p.numel(), p.element_size(), tuple(p.shape)) for p in fresh)
                )
                self.flops.append(0)
        return self.layer_index[module]


def forward_layers(model: nn.Module, *inputs: torch.Tensor) -> tuple[LayerFlops, ...]:
    """The model's parameter-owning layers in forward order (input → output) with their forward
    FLOPs, from one forward pass on `inputs` (meta tensors keep it free of memory and compute)."""
    counter = FlopCounterMode(display=False)
    walk = _ForwardWalk(model, counter)
    owners = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    handles = [m.register_forward_pre_hook(walk.before) for m in owners]
    handles += [m.register_forward_hook(walk.after) for m in owners]
    try:
        with counter, torch.no_grad():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return walk.layers()


@functools.lru_cache(maxsize=None)
def architecture_layers(name: str, batch_size: int) -> tuple[LayerFlops, ...]:
    """`forward_layers` of a zoo model at `batch_size`, built on the meta device. Evaluation mode
    counts the same FLOPs (the zoo's models run every head in both modes) and lets batch norm
    take a batch of one."""
    architecture = ARCHITECTURES[name]
    with torch.device("meta"):
        model = architecture.build().eval()
    return forward_layers(model, *architecture.make_inputs(batch_size))


def zoo(name: str, batch_size: int | None = None, device: str | float = "V100") -> ModelProfile:
    """The profile of zoo model `name` at `batch_size` per GPU (default: the papers' value) on a
    device preset (see `devices.DEVICES`) or a sustained throughput in FLOP/s.

    Args:
        name: a zoo model (``zoo_names``).
        batch_size: samples per GPU (an integer >= 1; None: the papers' value for the model).
        device: a preset's name (case-insensitive, e.g. "V100") or a throughput in FLOP/s (> 0, no
            launch overhead).
    """
    architecture = _architecture(name)
    batch_size = architecture.default_batch_size if batch_size is None else _checked_batch_size(batch_size)
    processor = resolve_device(device)
    layers = architecture_layers(name, batch_size)
    forward_flops = sum(layer.flops for layer in layers)
    metadata = {
        "model": name,
        "batch_size": batch_size,
        "input": architecture.input_shape,
        "device": processor.name,
        "forward_flops": forward_flops,
        "backward_flops": BACKWARD_FLOPS_PER_FORWARD_FLOP * forward_flops,
    }
    profile_layers = tuple(
        LayerProfile(
            layer.name,
            layer.tensors,
            processor.compute_time(layer.flops),
            processor.compute_time(BACKWARD_FLOPS_PER_FORWARD_FLOP * layer.flops),
        )
        for layer in layers
    )
    return ModelProfile(name, profile_layers, metadata)


def zoo_names() -> list[str]:
    return sorted(ARCHITECTURES)


def _architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise unknown_name("model", name, ARCHITECTURES)
    return ARCHITECTURES[name]


def _checked_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"'batch_size' must be an integer >= 1, got {batch_size!r}")
    return batch_size
