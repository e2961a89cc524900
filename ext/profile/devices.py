"""GPU presets for the zoo's compute-time model, t = FLOPs / (peak · efficiency) + launch overhead
(a concrete T_b(p, G, θ) of mg-wfbp eq. 18).

Peak fp32 FLOP/s are the vendor's spec-sheet numbers:
- K80: Tesla K80 datasheet, 8.73 TFLOPS with GPU Boost for the board's two GK210 GPUs; a worker
  drives one GK210, so half of it.
- RTX2080Ti: Turing architecture whitepaper, 13.4 TFLOPS at the reference boost clock
  (4352 cores × 2 × 1.545 GHz).
- V100: Tesla V100 datasheet, 15.7 TFLOPS (SXM2). V100S: V100S PCIe datasheet, 16.4 TFLOPS
  (the GPU of us-byte's Cluster 1).
- RTX3090: Ampere GA102 whitepaper, 35.6 TFLOPS (10496 cores × 2 × 1.695 GHz).

Efficiency (the fraction of peak that fp32 cuDNN training sustains) is calibrated for the RTX2080Ti
on asc-wfbp §V (ResNet-152, batch 32: forward 0.091 s, backward 0.182 s) and set for the other GPUs
from published single-GPU fp32 ResNet-50 training throughputs (about 50, 370 and 430 images/s
on a K80 GPU, a V100 and an RTX 3090, at 3 × 8.2 GFLOP per image); these are estimates.
The launch overhead (seconds per layer and pass) is the order of a CUDA kernel launch; it gives
the FLOP-free layers (batch norm, LayerNorm) their small, non-zero time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError, unknown_name


@dataclass(frozen=True)
class Device:
    """A processor's sustained fp32 throughput and per-layer launch overhead."""

    name: str
    peak_flops: float
    efficiency: float = 1.0
    launch_overhead: float = 0.0

    def compute_time(self, flops: float) -> float:
        """Seconds to run `flops` floating-point operations as one layer."""
        return flops / (self.peak_flops * self.efficiency) + self.launch_overhead


DEVICES: dict[str, Device] = {
    device.name: device
    for device in (
        Device("K80", 4.365e12, efficiency=0.28, launch_overhead=10e-6),
        Device("RTX2080Ti", 13.4e12, efficiency=0.61, launch_overhead=5e-6),
        Device("V100", 15.7e12, efficiency=0.58, launch_overhead=5e-6),
        Device("V100S", 16.4e12, efficiency=0.58, launch_overhead=5e-6),
        Device("RTX3090", 35.6e12, efficiency=0.30, launch_overhead=5e-6),
    )
}


def resolve_device(device: str | float) -> Device:
    """A preset by name (case-insensitive), or a number: a sustained throughput in FLOP/s with no
    launch overhead, so times are exactly FLOPs / throughput."""
    if isinstance(device, str):
        for name, preset in DEVICES.items():
            if name.lower() == device.lower():
                return preset
        raise unknown_name("device", device, DEVICES)
    if isinstance(device, bool) or not isinstance(device, (int, float)) or not math.isfinite(device) or device <= 0:
        raise ConfigError(
            f"'device' must be one of {', '.join(sorted(DEVICES))} or a throughput in FLOP/s > 0, got {device!r}"
        )
    return Device(f"{device:g} FLOP/s", float(device))
