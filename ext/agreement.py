"""Agreement across ranks: share rank 0's value, gather every rank's, or check that every rank
holds the same one; and naming the collective the ranks failed to meet at (`waiting_for`).

They are collectives over `process_group` (None: the default group; gradsync passes its own group,
created with wrap's `timeout`), so a rank configured differently fails with a message naming it
instead of hanging later, and a rank that never comes fails its peers within the timeout.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

from .errors import ConfigError, PeersTimedOut


@contextmanager
def waiting_for(what: str, timeout: float):
    """Name `what` the ranks were to meet at when a collective inside fails: the backend's error for
    a peer that did not come within `timeout` seconds (or failed, or exited) becomes PeersTimedOut."""
    try:
        yield
    except PeersTimedOut:
        raise
    except RuntimeError as exc:  # the backends' errors (DistBackendError, gloo's and the store's timeouts)
        raise PeersTimedOut(f"gradsync: the ranks did not all reach {what} within the timeout of {timeout:g} s "
                            f"(a rank stalled, failed or exited): {exc}") from exc


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
    """Raise on every rank if some rank's `value` (picklable, comparable) differs from rank 0's.

    A collective: every rank of `process_group` must call it.

    Args:
        value: this rank's value; every rank's is gathered and compared with ``==`` to rank 0's.
        what: names the value in the ConfigError (``"ranks [..] have a different {what} from rank 0"``).
        remedy: what to do about it, appended to the message.
        process_group: the group to compare over (None: the default group).

    Raises:
        ConfigError: on every rank, when some rank's value differs from rank 0's.
    """
    values = gather_from_all(value, process_group)
    differing = [rank for rank, v in enumerate(values) if v != values[0]]
    if differing:
        raise ConfigError(f"ranks {differing} have a different {what} from rank 0; {remedy}")
