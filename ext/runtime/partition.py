"""Partition: which rank owns which elements of each gradient, for plans of reduce-scatters.

A sharded optimizer (DeepSpeed's ZeRO stages 1 and 2) steps only its rank's partition of the
parameters, so each rank needs only its partition of the averaged gradients: an op whose
collective is ``reduce_scatter`` delivers each rank the elements it owns and no others. Ownership
is by element of the flattened gradient, so a tensor may straddle two ranks' partitions.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Partition:
    """`spans[name]`: the (start, end, rank) element ranges of tensor `name`'s flattened gradient,
    in order, covering it; ranks 0..`world_size` − 1."""

    spans: dict[str, tuple[tuple[int, int, int], ...]]
    world_size: int

    def check(self, numels: dict[str, int], world_size: int) -> "Partition":
        """Return self if it covers exactly the tensors `numels` (name: elements) of a
        `world_size`-rank run, else raise ConfigError."""
        if world_size != self.world_size:
            raise ConfigError(f"partition: made for {self.world_size} ranks, the run has {world_size}")
        if set(self.spans) != set(numels):
            missing, extra = sorted(set(numels) - set(self.spans)), sorted(set(self.spans) - set(numels))
            raise ConfigError(f"partition: tensors without owners {missing[:4]}, owners of unknown tensors {extra[:4]}")
        for name, spans in self.spans.items():
            position = 0
            for start, end, rank in spans:
                if start != position or end <= start or not 0 <= rank < world_size:
                    raise ConfigError(f"partition: tensor {name!r}: span ({start}, {end}, rank {rank}) does not "
                                      f"continue its spans from element {position} with a rank below {world_size}")
                position = end
            if position != numels[name]:
                raise ConfigError(f"partition: tensor {name!r}: spans end at {position} of {numels[name]} elements")
        return self

    def split(self, name: str, offset: int, length: int) -> list[tuple[int, int, int]]:
        """The parts of a slice by owner: (rank, start, length) each, in element order.

        Args:
            name: the tensor's name.
            offset, length: the slice, elements [offset, offset + length) of its flattened gradient.
        """
        end = offset + length
        return [(rank, max(start, offset), min(stop, end) - max(start, offset))
                for start, stop, rank in self.spans[name] if start < end and stop > offset]
