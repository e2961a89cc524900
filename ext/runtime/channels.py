"""Channels: one process group each, so collectives on different channels run simultaneously.

Gloo runs the collectives of one process group in call order, and NCCL serialises the operations
of one communicator; concurrency therefore needs one group per channel. Every rank issues the ops
of a channel in the same (plan) order, which keeps several NCCL communicators deadlock-free.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..errors import ConfigError


class Channels:
    """`count` process groups over the ranks of `process_group` (channel 0 may be that group)."""

    def __init__(self, count: int, process_group=None, timeout: timedelta | None = None):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"'channels' must be an integer >= 1, got {count!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call init_process_group first")
        self.process_group = process_group
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self.world_size = len(ranks)
        self.rank = dist.get_rank(process_group)
        self.groups = [dist.new_group(ranks, timeout=timeout) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.groups)

    def all_reduce(self, channel: int, tensor):
        """Start a sum all-reduce of `tensor` on `channel`; returns the work handle."""
        return dist.all_reduce(tensor, group=self.groups[channel], async_op=True)

    def destroy(self) -> None:
        for group in self.groups:
            dist.destroy_process_group(group)
        self.groups = []
