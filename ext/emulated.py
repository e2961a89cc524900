"""An emulated accelerator: a model built from a ModelProfile whose layers hold real parameters of
the profile's sizes and take the profile's forward and backward times without occupying a core.

On the papers' testbeds the computation runs on a GPU and leaves the host's cores to the
communication; on a host of 2 cores, 4 or 8 ranks of real CPU computation measure the cores'
contention, not the scheduling. Here each layer's forward and backward wait their profiled time in
``time.sleep`` (which releases the GIL and the core), kept on a deadline so that many short waits
add up to their sum. The gradients are deterministic: each parameter's is a fixed pattern (drawn
once from a seed, equal on every rank) times a scalar of the rank's batch, so that replicas
synchronised by different means can be compared. Writing the gradients is the one real work left
per step (a multiply per element), as a GPU's kernels would write them; `size_scale` shrinks every
tensor (the times stay) so that this work stays small beside the emulated times.

``gradsync.wrap``, torch DDP and its communication hooks run on an EmulatedModel unchanged, and
gradsync's profiling measures it like any model.
"""
from __future__ import annotations

import math
import time

import torch
from torch import nn

from .errors import ConfigError
from .profile import LayerProfile, ModelProfile, TensorSpec

CATCH_UP = 0.002  # seconds of oversleeping a wait may recover by shortening the next ones


class DeviceClock:
    """Waits that release the GIL: each ends at a deadline advanced by the waited time, so that the
    overshoot of one sleep (up to `CATCH_UP`) is recovered by the next."""

    def __init__(self):
        self.deadline = 0.0
        self.waited = 0.0  # seconds of emulated work so far

    def wait(self, seconds: float) -> None:
        now = time.perf_counter()
        self.deadline = max(self.deadline, now - CATCH_UP) + seconds
        self.waited += seconds
        if self.deadline > now:
            time.sleep(self.deadline - now)


class DeviceWork:
    """The cost probes' computation on an emulated accelerator (``EmulatedModel.probe_work``, which
    ``gradsync.wrap`` gives ``measure_cost``): waits that leave the core free, as the model's layers
    take, so that the slowdowns the probes fit are those of this computation; matrix products would
    occupy the core and slow the transfers beside them, which the emulated layers do not."""

    SLICE = 0.001  # seconds per unit of work

    device = torch.device("cpu")

    def run(self, count: int) -> float:
        """Seconds that `count` slices took."""
        started = time.perf_counter()
        time.sleep(count * self.SLICE)
        return time.perf_counter() - started

    def count_for(self, seconds: float) -> int:
        """Slices in about `seconds`."""
        return max(1, math.ceil(seconds / self.SLICE))


def scaled_shape(shape: tuple[int, ...], scale: float) -> tuple[int, ...]:
    """`shape` with about `scale` times the elements: a vector's length scaled, a matrix's (or a
    convolution's) first two dimensions each by √scale, so it stays a matrix of the same aspect."""
    if scale == 1.0:
        return shape
    if len(shape) == 1:
        return (max(1, round(shape[0] * scale)),)
    side = math.sqrt(scale)
    return (max(1, round(shape[0] * side)), max(1, round(shape[1] * side)), *shape[2:])


def _dtype(tensor: TensorSpec) -> torch.dtype:
    return {4: torch.float32, 2: torch.float16, 8: torch.float64}[tensor.bytes_per_element]


class _TimedLayer(torch.autograd.Function):
    """Forward: the layer's forward time, the activation passed on. Backward: its backward time,
    each parameter's gradient its pattern times the sum of the incoming gradient."""

    @staticmethod
    def forward(ctx, activation, layer, *parameters):
        layer.clock.wait(layer.forward_time)
        ctx.layer = layer
        return activation.clone()

    @staticmethod
    def backward(ctx, grad_output):
        layer = ctx.layer
        layer.clock.wait(layer.backward_time)
        weight = grad_output.sum()
        return (grad_output, None, *(pattern * weight.to(pattern.dtype) for pattern in layer.patterns))


class EmulatedLayer(nn.Module):
    """One profiled layer: its parameters (``p0``, ``p1``, ... in the profile's tensor order) and
    its times.

    Args:
        layer: the layer's profile.
        clock: the model's clock.
        generator: draws the gradient patterns (seeded: equal on every rank).
        size_scale: the factor on every tensor's elements.
    """

    def __init__(self, layer: LayerProfile, clock: DeviceClock, generator: torch.Generator, size_scale: float):
        super().__init__()
        self.clock = clock
        self.forward_time = layer.forward_time
        self.backward_time = layer.backward_time
        self.patterns = []
        self.tensors = []
        for index, tensor in enumerate(layer.tensors):
            shape = scaled_shape(tensor.shape or (tensor.numel,), size_scale)
            dtype = _dtype(tensor)
            self.register_parameter(f"p{index}", nn.Parameter(torch.zeros(shape, dtype=dtype)))
            self.patterns.append(torch.randn(shape, generator=generator).to(dtype))
            self.tensors.append(TensorSpec(f"{layer.name}.p{index}", math.prod(shape), tensor.bytes_per_element, shape))

    def forward(self, activation: torch.Tensor) -> torch.Tensor:
        return _TimedLayer.apply(activation, self, *self.parameters())


class EmulatedModel(nn.Module):
    """The layers of a ModelProfile, input to output, each waiting its profiled times. Its
    `probe_work` is the computation gradsync's cost probes run beside their ops.

    Args:
        profile: the model to emulate (``gradsync.profile.zoo`` or a measured profile).
        size_scale: the factor on every tensor's elements (in (0, 1]); the times stay.
        seed: draws the gradient patterns; give every rank the same.
    """

    def __init__(self, profile: ModelProfile, size_scale: float = 1.0, seed: int = 0):
        super().__init__()
        if not (isinstance(size_scale, (int, float)) and 0 < size_scale <= 1):
            raise ConfigError(f"'size_scale' must be in (0, 1], got {size_scale!r}")
        self.clock = DeviceClock()
        self.probe_work = DeviceWork()
        generator = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(EmulatedLayer(layer, self.clock, generator, size_scale)
                                    for layer in profile.layers)
        self.emulated_profile = ModelProfile(
            f"{profile.name} (emulated)",
            tuple(LayerProfile(layer.name, tuple(module.tensors), layer.forward_time, layer.backward_time,
                               layer.update_time) for layer, module in zip(profile.layers, self.layers)),
            {**profile.metadata, "size_scale": size_scale})

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        activation = batch
        for layer in self.layers:
            activation = layer(activation)
        return activation


def emulated_batch(rank: int, step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's deterministic batch for an EmulatedModel: inputs that require no gradient and the
    targets the loss ``(output * target).mean()`` weighs them by.

    Args:
        rank, step: which rank's batch at which step (each pair its own).
        size: samples in the batch.
    """
    generator = torch.Generator().manual_seed(rank * 100_003 + step)
    return torch.randn(size, 1, generator=generator), torch.randn(size, 1, generator=generator)
