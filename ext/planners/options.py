"""What the planners share about their options: the deferral every planner offers, and the
options more than one planner declares."""
from __future__ import annotations

from ..plan import Plan
from ..registry import Option, positive_int
from .partition import DEFAULT_PARTITION_BYTES

PARTITION_BYTES = Option("partition_bytes", DEFAULT_PARTITION_BYTES, positive_int,
                         "the size of a tensor block (bytes)", is_bytes=True)


def deferred_if(plan: Plan, overlap_forward: bool) -> Plan:
    """`plan`, with its backward ops deferred to the next forward where `overlap_forward` (the
    option every planner takes: us-byte's dependency graph, Fig. 1, for any plan)."""
    return plan.with_deferred_waits() if overlap_forward else plan
