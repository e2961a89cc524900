"""The watchers' reductions over the ranks (gradsync.runtime.over_ranks): started at one iteration,
read at a later one, the same values on every rank; a peer that never starts one fails the reader
within the group's timeout, naming the reduction."""
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.errors import PeersTimedOut
from gradsync.launch import run_local
from gradsync.runtime.over_ranks import PendingReduction, on_this_rank, reduction_over_ranks

CPU = torch.device("cpu")


def reduce_then_read(rank, world_size):
    """Each rank starts a MAX and a MIN reduction of its own numbers, works, then reads them."""
    largest = PendingReduction(reduction_over_ranks(dist.ReduceOp.MAX, None, CPU, "largest", 60.0))
    least = PendingReduction(reduction_over_ranks(dist.ReduceOp.MIN, None, CPU, "least", 60.0))
    assert largest.take() is None  # nothing started
    largest.start([float(rank), 10.0 - rank])
    least.start([float(rank), 10.0 - rank])
    time.sleep(0.05 * rank)  # the next iteration's work, longer on rank 1
    return largest.take(), least.take(), largest.take()


def test_a_reduction_started_at_one_iteration_is_read_at_the_next_alike_on_every_rank():
    assert run_local(reduce_then_read, 2) == [([1.0, 10.0], [0.0, 9.0], None)] * 2


def test_one_rank_reads_its_own_values():
    pending = PendingReduction(on_this_rank)
    values = [1.0, 2.0]
    pending.start(values)
    values.append(3.0)  # the caller's list is not the reduced one
    assert pending.take() == [1.0, 2.0] and pending.take() is None


def peer_never_starts(rank, world_size, released: str):
    """Rank 1 never starts the reduction (it sleeps until rank 0 has failed); rank 0 starts and
    reads it: the error it gets and how long the read took."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    if rank == 1:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not os.path.exists(released):
            time.sleep(0.02)
        return None
    pending = PendingReduction(reduction_over_ranks(dist.ReduceOp.MAX, group, CPU, "the speed check", 2.0))
    pending.start([1.0])
    started = time.monotonic()
    try:
        pending.take()
    except PeersTimedOut as failure:
        return str(failure), time.monotonic() - started
    finally:
        open(released, "w").close()
    return None


def test_a_peer_that_never_starts_the_reduction_fails_the_reader_within_the_timeout(tmp_path):
    message, seconds = run_local(peer_never_starts, 2, str(tmp_path / "released"), timeout=120)[0]
    assert "the ranks did not all reach the speed check within the timeout of 2 s" in message
    assert seconds < 2 + 5
