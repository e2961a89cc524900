"""One allocation that the executors of a model's plans of reduce-scatters carve their op buffers from."""
from __future__ import annotations

import torch

ALIGN_BYTES = 64  # each buffer starts on a cache line (and on any dtype's alignment)


class SharedOpBuffers:
    """The op buffers of successive plans of reduce-scatters, views of one allocation.

    Only one such executor runs at a time, and none is needed past its step: each copies the
    gradients into its buffers from their hooks and its partition is delivered at the step, before
    a new plan is installed. So the plans that the profile measurement and auto's trials install one
    after another share one allocation, sized for the largest, instead of each allocating its own
    (which the allocator kept after they were freed: under ZeRO-2, auto's peak reached 1.37×
    DeepSpeed's own)."""

    def __init__(self):
        self.storage: torch.Tensor | None = None  # bytes

    def carve(self, sizes: list[tuple[int, torch.dtype]], device: torch.device) -> list[torch.Tensor]:
        """One buffer per (elements, dtype) of `sizes`, in order, on `device`; the allocation grows
        when these need more than it holds (earlier executors keep the one they were carved from)."""
        offsets, end = [], 0
        for numel, dtype in sizes:
            end = -(-end // ALIGN_BYTES) * ALIGN_BYTES
            offsets.append(end)
            end += numel * dtype.itemsize
        self.hold()  # views are cut from held memory; one outgrown stays held for the executors carved before
        if self.storage is None or self.storage.numel() < end or self.storage.device != device:
            self.storage = torch.empty(end, dtype=torch.uint8, device=device)
        return [self.storage[offset:offset + numel * dtype.itemsize].view(dtype)
                for offset, (numel, dtype) in zip(offsets, sizes)]

    def release(self) -> None:
        """Give the allocation's memory back until the next ``hold``, once the step's partitions are
        delivered: the buffers are idle until the next backward pass, as ZeRO-2 frees its buckets
        (38 MB of the ZeRO benchmark's peak). Its views stay; touching them before ``hold`` would
        read freed memory, so every executor carved from it holds it as its iteration starts."""
        if self.storage is not None:
            self.storage.untyped_storage().resize_(0)

    def hold(self) -> None:
        """The allocation's memory back (its contents undefined) where ``release`` gave it away."""
        if self.storage is not None and self.storage.untyped_storage().nbytes() < self.storage.numel():
            self.storage.untyped_storage().resize_(self.storage.numel())
