"""Half-precision wires, as torch's ``fp16_compress_hook`` and ``bf16_compress_hook`` and Horovod's
fp16 compression: each rank's share of the mean travels cast to float16 (or bfloat16), is summed
by the all-reduce in that type and is cast back into the gradient. Half the bytes of float32; no
state. What the cast rounds off each step is lost, as with the torch hooks; float16's range ends at
65504, so a larger share overflows to inf (bfloat16 keeps float32's range at 8 bits of precision).
"""
from __future__ import annotations

import torch

from ..profile import TensorSpec
from .codec import Codec
from .gradients import refuse_non_float
from .spec import CodecSpec

WIRE_BYTES = 2


class HalfPrecisionWire(Codec):
    """The gradient cast to `wire` on the wire (the runtime writes each rank's share of the mean
    into the op's buffer of that type), the averaged wire cast back into the gradient."""

    wire: torch.dtype

    def setup(self, specs, world_size: int, seed: int) -> None:
        refuse_non_float(self.name, specs)
        super().setup(specs, world_size, seed)
        self.staging: dict[str, torch.Tensor] = {}

    def wire_spec(self, spec: TensorSpec, layout: str) -> TensorSpec:
        return TensorSpec(spec.name, spec.numel, WIRE_BYTES, spec.shape)

    def wire_dtype(self, layout: str, gradient_dtype: torch.dtype) -> torch.dtype:
        return self.wire

    def compute_seconds(self, spec: TensorSpec, layout: str, flops_per_second: float) -> tuple[float, float]:
        """One element-wise pass each way: the cast with the division, and the cast back."""
        return spec.numel / flops_per_second, spec.numel / flops_per_second

    def reduced_target(self, name: str, parameter: torch.nn.Parameter, step: int) -> torch.Tensor:
        staging = self.staging.get(name)
        if staging is None or staging.device != parameter.device:
            staging = self.staging[name] = torch.empty(parameter.numel(), dtype=self.wire, device=parameter.device)
        return staging

    def finish(self, name: str, parameter: torch.nn.Parameter, step: int) -> None:
        Codec.reduced_target(self, name, parameter, step).copy_(self.staging[name])


class Float16Wire(HalfPrecisionWire):
    name = "fp16"
    wire = torch.float16


class BFloat16Wire(HalfPrecisionWire):
    name = "bf16"
    wire = torch.bfloat16


SPECS = (
    CodecSpec(Float16Wire, "gradients cast to float16 on the wire (torch's fp16_compress_hook)",
              source="torch DDP fp16_compress_hook"),
    CodecSpec(BFloat16Wire, "gradients cast to bfloat16 on the wire (torch's bf16_compress_hook)",
              source="torch DDP bf16_compress_hook"),
)
