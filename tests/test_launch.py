"""gradsync.launch.run_local: a rank that raises, one that dies without a word, and the environment
and state the ranks start with."""
import os
import time

import pytest

from gradsync.launch import RankFailed, run_local


def rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("bad input on rank 1")
    return "fine"


def rank_one_vanishes(rank, world_size):
    if rank == 1:
        os._exit(3)  # no exception, no report: as a crash or a kill would end it
    return "fine"


def environment_and_state(rank, world_size):
    """What a rank sees: a variable the caller set, and whether an earlier rank's changes linger."""
    import gradsync.launch as launch

    seen = (os.environ.get("GRADSYNC_PROBE"), getattr(launch, "touched_by_a_rank", False))
    launch.touched_by_a_rank = True
    return seen


def test_each_call_gives_ranks_the_callers_current_environment_and_a_clean_state(monkeypatch):
    """Ranks fork from a server started at the first call; they still see the environment as it is
    at each call, and nothing an earlier call's ranks did."""
    for value in ("first", "second"):
        monkeypatch.setenv("GRADSYNC_PROBE", value)
        assert run_local(environment_and_state, 2, timeout=120) == [(value, False)] * 2


def test_a_raising_rank_is_reported_with_its_traceback():
    with pytest.raises(RankFailed, match="rank 1: ValueError: bad input on rank 1"):
        run_local(rank_one_raises, 2, timeout=60)


def test_a_rank_that_dies_without_reporting_fails_at_once_not_at_the_timeout():
    started = time.monotonic()
    outcomes = run_local(rank_one_vanishes, 2, return_errors=True, timeout=300)
    assert time.monotonic() - started < 60
    assert outcomes[0] == ("ok", "fine")
    assert outcomes[1] == ("error", "process exited with code 3 without reporting")
