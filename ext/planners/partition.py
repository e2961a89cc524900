"""Basic tensor blocks of S_p bytes, shared by ByteScheduler and US-Byte (us-byte §2.2, §3, Table 1).

A layer's tensors, concatenated in order, form one flat space of gradient elements; a block is a
contiguous range of it, mapped back to Slices of the underlying tensors. An op never mixes element
sizes (Plan.validate), so a layer is first split into gradient groups: maximal runs of consecutive
tensors with one element size, which is one group per layer in the usual case. A group plays the
part of us-byte's "tensor of layer l": M^(l) is its bytes and m^(l) = ⌈M^(l)/S_p⌉ its basic blocks
(Algorithm 1 line 2); all its blocks are ready when its layer's backward ends (eq. 2).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import groupby

from ..plan import Slice
from ..profile import ModelProfile, TensorSpec

MIB = 1 << 20
# S_p default: us-byte §6.7 sets "S_p = 4 Mb"; ByteScheduler partitions 1e6 elements by default,
# which is 4 MB of fp32. 4 MiB (1,048,576 fp32 elements) is that setting in whole fp32 elements.
DEFAULT_PARTITION_BYTES = 4 * MIB


@dataclass(frozen=True)
class GradientGroup:
    """Consecutive tensors of one layer with one element size, cut into blocks of `block_numel`."""

    layer: int
    tensors: tuple[TensorSpec, ...]
    ready: float
    block_numel: int

    @cached_property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @cached_property
    def nbytes(self) -> int:
        """M^(l): the bytes the group all-reduces per iteration."""
        return self.numel * self.tensors[0].bytes_per_element

    @cached_property
    def block_bytes(self) -> int:
        """S_p as applied to this group: a whole number of its elements."""
        return self.block_numel * self.tensors[0].bytes_per_element

    @cached_property
    def num_blocks(self) -> int:
        """m^(l) = ⌈M^(l)/S_p⌉ (us-byte Algorithm 1 line 2)."""
        return -(-self.numel // self.block_numel)

    def slices(self, first_block: int, blocks: int) -> tuple[Slice, ...]:
        """The slices of blocks [first_block, first_block + blocks) of the group's flat elements."""
        start = first_block * self.block_numel
        stop = min(self.numel, start + blocks * self.block_numel)
        found = []
        offset = 0
        for tensor in self.tensors:
            low, high = max(start, offset), min(stop, offset + tensor.numel)
            if low < high:
                found.append(Slice(tensor.name, low - offset, high - low))
            offset += tensor.numel
        return tuple(found)


def gradient_groups(profile: ModelProfile, partition_bytes: int) -> list[GradientGroup]:
    """The groups of every layer, input → output; blocks hold ⌊S_p / element size⌋ elements (at least 1)."""
    ready = profile.backward_ready_times()
    groups = []
    for index, layer in enumerate(profile.layers):
        for size, run in groupby(layer.tensors, key=lambda t: t.bytes_per_element):
            groups.append(GradientGroup(index, tuple(run), ready[index], max(1, partition_bytes // size)))
    return groups
