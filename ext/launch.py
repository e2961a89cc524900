"""Run a function on N local ranks in fresh processes (gloo on CPU) and collect what each returns;
or find this process's place among ranks another launcher started (torchrun, submitit).

`run_local` is used by the benchmarks, tests and recipes; each call initialises and destroys its own
process group, so calls can follow one another in one program (e.g. the jobs of a sweep). Ranks are
forked from a server process that has imported gradsync (and so torch) once, and that has run
nothing: a rank starts in milliseconds instead of re-importing for seconds. Each rank takes the
caller's environment as it is at the call.
"""
from __future__ import annotations

import os
import pickle
import queue as queues
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import ConfigError


POLL_SECONDS = 0.5  # how often a waiting parent looks for ranks that died without a word


class RankFailed(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(queue, processes, timeout: float) -> dict:
    """Each rank's (status, value) as it reports; a process gone without a report counts as failed."""
    results, deadline = {}, time.monotonic() + timeout
    while len(results) < len(processes):
        for rank, status, value in _drain(queue, min(POLL_SECONDS, max(0.0, deadline - time.monotonic()))):
            results[rank] = (status, pickle.loads(value))
        dead = [r for r, p in enumerate(processes) if r not in results and p.exitcode not in (None, 0)]
        if dead:  # a report written just before the process ended may still be in the pipe: one more look
            for rank, status, value in _drain(queue, POLL_SECONDS):
                results[rank] = (status, pickle.loads(value))
        for rank in dead:
            results.setdefault(rank, ("error", f"process exited with code {processes[rank].exitcode} "
                                               "without reporting"))
        if len(results) < len(processes) and time.monotonic() >= deadline:
            raise TimeoutError(f"ranks {sorted(set(range(len(processes))) - set(results))} did not report "
                               f"within {timeout:g} s")
    return results


def _drain(queue, wait: float) -> list:
    """The reports that arrive until `wait` seconds pass without one."""
    reports = []
    try:
        while True:
            reports.append(queue.get(timeout=wait))
    except queues.Empty:
        return reports


def _entry(rank, world_size, port, rendezvous, backend, threads, fn, args, queue, environment):
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch

        torch.set_num_threads(threads)
        # a rendezvous file of this call alone: concurrent calls can never meet on one port
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
        # every rank's connections are up before any rank can finish and close its own: a rank done
        # first would otherwise close a connection its peer was still completing
        dist.barrier()
        # pickled here, by value: torch's queue would share a tensor's storage through a file descriptor
        # and a server thread, which can outlive neither this process nor its exit
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as exc:  # reported to the parent with its traceback
        queue.put((rank, "error", pickle.dumps(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn, world_size: int, *args, backend: str = "gloo", threads: int = 1, timeout: float = 600.0,
              return_errors: bool = False):
    """`fn(rank, world_size, *args)` on every rank; the list of their return values (anything that
    pickles; tensors come back by value).

    A failing rank raises RankFailed, or with `return_errors` every rank's ("ok" | "error", value)
    comes back instead; a rank whose process dies without reporting (a crash, a kill, arguments
    it cannot unpickle) fails with its exit code at once. Ranks that do not report within `timeout`
    seconds are killed.

    Args:
        fn: called as ``fn(rank, world_size, *args)`` in each rank's process, inside an initialised
            default process group; it and `args` must pickle (a module-level function, not a lambda).
        world_size: the number of ranks (processes) to start.
        *args: passed on to `fn` after the rank and world size.
        backend: the torch.distributed backend of the ranks' process group (``"gloo"``; ``"nccl"`` on GPUs).
        threads: torch's intra-op thread count in each rank (``torch.set_num_threads``).
        timeout: seconds to wait for every rank to report; then TimeoutError, and the ranks still running
            are killed.
        return_errors: return every rank's ``("ok" | "error", value)`` pair (the value of an error: its
            traceback, as text) instead of raising RankFailed.

    Raises:
        RankFailed: when a rank raised or died, unless `return_errors`.
        TimeoutError: when some rank did not report within `timeout`.
    """
    context = mp.get_context("forkserver")
    # read when the server starts (the first call); with the strategies, Lightning (when installed)
    # is imported once there rather than in every rank
    context.set_forkserver_preload(["gradsync", "gradsync.strategies"])
    queue = context.Queue()
    port = free_port()  # for code that reads MASTER_PORT; the process group meets through a file
    workdir = tempfile.mkdtemp(prefix="gradsync-ranks-")
    rendezvous = os.path.join(workdir, "rendezvous")
    processes = [context.Process(target=_entry, args=(r, world_size, port, rendezvous, backend, threads, fn, args,
                                                      queue, dict(os.environ)))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    try:
        results = _collect(queue, processes, timeout)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    if return_errors:
        return [results[r] for r in range(world_size)]
    failures = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    if failures:
        raise RankFailed("\n".join(failures))
    return [results[r][1] for r in range(world_size)]


@dataclass(frozen=True)
class ExternalRank:
    """This process's place among the ranks a launcher started."""

    rank: int
    world_size: int
    local_rank: int  # among the ranks of its node
    node_rank: int


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def external_rank() -> ExternalRank:
    """This process's place when torchrun (or any launcher that sets torch's env:// variables:
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; the node from GROUP_RANK or NODE_RANK)
    or submitit (SLURM or local tasks, its job environment exported as those variables, replacing
    any inherited; a MASTER_PORT set before is kept) started it.
    ``dist.init_process_group(backend)`` then meets the other ranks.

    Raises:
        ConfigError: when no launcher set them (a plain ``python`` run), naming what is missing.
    """
    if os.environ.get("SUBMITIT_EXECUTOR"):  # inside a submitit job its job environment is the truth
        import submitit

        place = submitit.JobEnvironment()
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        os.environ["NODE_RANK"] = str(place.node)
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError(f"this process was not started by torchrun or submitit: {', '.join(missing)} unset; "
                          "start every rank with torchrun (or SLURM through submitit), or let gradsync start "
                          "them on this node")
    local_rank = int(os.environ["LOCAL_RANK"])
    node_rank = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))
    if node_rank is None:  # every node holds LOCAL_WORLD_SIZE ranks
        node_rank = int(os.environ["RANK"]) // int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return ExternalRank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, int(node_rank))
