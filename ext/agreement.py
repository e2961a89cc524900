"""Agreement across ranks: share rank 0's value, gather every rank's, or check that every rank
holds the same one.

Both are collectives over `process_group` (None: the default group), called at set-up time, so a
rank configured differently fails with a message naming it instead of hanging later.
"""
from __future__ import annotations

import torch.distributed as dist

from .errors import ConfigError


def share_from_first(value, process_group):
    """Rank 0's `value` on every rank (any picklable object)."""
    box = [value]
    source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(box, src=source, group=process_group)
    return box[0]


def gather_from_all(value, process_group) -> list:
    """Every rank's `value` (any picklable object), in rank order, on every rank."""
    values = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(values, value, group=process_group)
    return values


def check_same_on_all_ranks(value, what: str, remedy: str, process_group) -> None:
    """Raise on every rank if some rank's `value` (picklable, comparable) differs from rank 0's."""
    values = gather_from_all(value, process_group)
    differing = [rank for rank, v in enumerate(values) if v != values[0]]
    if differing:
        raise ConfigError(f"ranks {differing} have a different {what} from rank 0; {remedy}")
