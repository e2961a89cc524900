"""The watchers' reductions over the ranks (gradsync.runtime.over_ranks): started at one iteration,
read at a later one, the same values on every rank, those started at one iteration in one
all-reduce; a peer that never starts one fails the reader within the group's timeout, naming the
reduction."""
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gradsync.errors import PeersTimedOut
from gradsync.launch import run_local
from gradsync.runtime.over_ranks import CombinedReductions, PendingReduction, on_this_rank, reduction_over_ranks

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


def combined_then_read(rank, world_size):
    """A MAX and a MIN reduction started at one iteration and sent at its end, read at the next:
    the values read, and each all-reduce's values as sent."""
    sent = []
    largest_of = reduction_over_ranks(dist.ReduceOp.MAX, None, CPU, "the checks", 60.0)

    def counted(values):
        sent.append(list(values))
        return largest_of(values)
    reductions = CombinedReductions(counted)
    largest = PendingReduction(reductions.starting(dist.ReduceOp.MAX))
    least = PendingReduction(reductions.starting(dist.ReduceOp.MIN))
    largest.start([float(rank), 10.0 - rank])
    least.start([float(rank), 10.0 - rank])
    reductions.send()
    reductions.send()  # nothing started since: no all-reduce
    time.sleep(0.05 * rank)
    return largest.take(), least.take(), len(sent)


def test_reductions_started_at_one_iteration_travel_in_one_all_reduce():
    assert run_local(combined_then_read, 2) == [([1.0, 10.0], [0.0, 9.0], 1)] * 2


def test_a_reading_before_the_send_sends_and_later_values_wait_for_the_next():
    sent = []

    def counted(values):
        sent.append(list(values))
        return on_this_rank(values)
    reductions = CombinedReductions(counted)
    early = reductions.starting(dist.ReduceOp.MIN)([2.0, -1.0])
    assert early() == [2.0, -1.0] and sent == [[-2.0, 1.0]]  # a minimum travels as the maximum of its negation
    later = reductions.starting(dist.ReduceOp.MAX)([3.0])
    reductions.send()
    assert later() == [3.0] and early() == [2.0, -1.0] and sent == [[-2.0, 1.0], [3.0]]


def test_a_reduction_other_than_max_or_min_is_refused():
    with pytest.raises(ValueError, match="MAX or MIN"):
        CombinedReductions(on_this_rank).starting(dist.ReduceOp.SUM)
