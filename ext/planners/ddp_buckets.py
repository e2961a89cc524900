"""Fixed-size buckets as torch DDP builds them: the baseline users know.

Tensors are taken in backward order; the first bucket of each element size closes at 1 MiB, the rest at the cap
(25 MiB by default); a bucket closes as soon as its size reaches the cap, and tensors of different
element sizes never share one. Buckets launch in index order.
"""
from __future__ import annotations

from ..cost import CostModel
from ..plan import Op, Plan, whole
from ..profile import ModelProfile
from ..registry import Option, positive_int
from . import OVERLAP_FORWARD, PlannerSpec
from .options import deferred_if
from .wfbp import backward_order

MIB = 1 << 20


def plan(profile: ModelProfile, cost: CostModel, *, bucket_cap_bytes: int, first_bucket_bytes: int,
         overlap_forward: bool) -> Plan:
    """DDP's buckets in backward order, one op each, launched in bucket order (module docstring).

    Args:
        profile: the model's per-layer times and tensors (ModelProfile); only its tensors count.
        cost: the all-reduce cost model (unused: DDP's buckets do not depend on it).
        bucket_cap_bytes: the size (bytes) at which a bucket after an element size's first closes.
        first_bucket_bytes: the size (bytes) at which each element size's first bucket closes.
        overlap_forward: defer the step's waits to each layer's next forward (us-byte Fig. 1).
    """
    open_buckets: dict[int, list] = {}  # element size -> tensors of the bucket being filled
    filled: dict[int, int] = {}
    closed_sizes: set[int] = set()  # element sizes whose first bucket is closed
    ops: list[Op] = []

    def close(size: int) -> None:
        tensors = open_buckets.pop(size)
        filled.pop(size)
        closed_sizes.add(size)
        ops.append(Op(tuple(whole(t) for t in tensors), priority=len(ops)))

    for _, tensor in backward_order(profile):
        size = tensor.bytes_per_element
        open_buckets.setdefault(size, []).append(tensor)
        filled[size] = filled.get(size, 0) + tensor.nbytes
        cap = bucket_cap_bytes if size in closed_sizes else first_bucket_bytes
        if filled[size] >= cap:
            close(size)
    for size in list(open_buckets):
        close(size)
    buckets = Plan(tuple(ops), options={"bucket_cap_bytes": bucket_cap_bytes, "first_bucket_bytes": first_bucket_bytes})
    return deferred_if(buckets, overlap_forward)


SPEC = PlannerSpec(
    "ddp", plan, "PyTorch DDP's fixed-size gradient buckets, run by gradsync's runtime",
    options=(Option("bucket_cap_bytes", 25 * MIB, positive_int, "a bucket's size (bytes)", is_bytes=True),
             Option("first_bucket_bytes", 1 * MIB, positive_int, "the first bucket's size (bytes)", is_bytes=True),
             OVERLAP_FORWARD),
    source="torch DDP", strategy="ddp_buckets", baseline=True)
