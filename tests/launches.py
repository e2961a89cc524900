"""Several runs of one function per launch of ranks: starting the processes costs more than a run."""
from gradsync.launch import run_local


def in_turn(rank, world_size, function, *variants):
    """`function` run on this rank once per tuple of arguments in `variants`, in turn, in one
    process: the results, one per tuple."""
    return [function(rank, world_size, *arguments) for arguments in variants]


def side_by_side(function, *variants: tuple, world_size: int = 2, **launch) -> list[list]:
    """Per tuple of arguments in `variants`, every rank's result of `function` with them: the
    variants run in turn in each rank of one launch (``run_local``'s other options in `launch`)."""
    results = run_local(in_turn, world_size, function, *variants, **launch)
    return [[result[index] for result in results] for index in range(len(variants))]
