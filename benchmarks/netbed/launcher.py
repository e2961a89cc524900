"""Start one rank per namespace, wait for them, and collect what each returns.

Rank i runs ``ip netns exec gsnet-<i> <python> -m benchmarks.netbed.rank <job> <i>`` from the
repository root, with GLOO_SOCKET_IFNAME set to its namespace's interface, so every byte between
ranks crosses the shaped links. The ranks meet through a rendezvous file in the job's directory
(namespaces share the file system); MASTER_ADDR is host 0's address for code that reads it. Each
rank writes its result (or its traceback) as JSON; ranks still running at the timeout are killed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradsync.launch import RankFailed

from .spec import address, inner_interface, namespace

REPOSITORY = Path(__file__).resolve().parents[2]
MASTER_PORT = 29500
LOG_TAIL = 2000  # characters of a failed rank's output quoted in the error


def rank_command(rank: int, job_path: Path, python: str = sys.executable) -> list[str]:
    return ["ip", "netns", "exec", namespace(rank), python, "-m", "benchmarks.netbed.rank", str(job_path), str(rank)]


def rank_environment(rank: int, world_size: int, base: dict[str, str]) -> dict[str, str]:
    return {**base, "GLOO_SOCKET_IFNAME": inner_interface(rank), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": address(0), "MASTER_PORT": str(MASTER_PORT)}


def write_job(directory: Path, target: str, world_size: int, args: list, threads: int, timeout: float) -> Path:
    """The job file every rank reads: what to call, with which arguments, and where to meet."""
    job = {"target": target, "args": args, "world_size": world_size, "threads": threads, "timeout": timeout,
           "rendezvous": str(directory / "rendezvous"), "results": str(directory)}
    path = directory / "job.json"
    path.write_text(json.dumps(job))
    return path


def result_path(directory: Path | str, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}.json"


def launch(target: str, world_size: int, *args, threads: int = 1, timeout: float = 600.0,
           environment: dict[str, str] | None = None) -> list:
    """`target` ("package.module:function", importable from the repository root) called as
    ``function(rank, world_size, *args)`` in every namespace; the list of return values (JSON).
    Raises RankFailed with each failing rank's traceback or output."""
    directory = Path(tempfile.mkdtemp(prefix="gsnet-job-"))
    try:
        job = write_job(directory, target, world_size, list(args), threads, timeout)
        base = dict(os.environ if environment is None else environment)
        processes = [start_rank(rank, world_size, job, directory, base) for rank in range(world_size)]
        wait_or_kill(processes, timeout)
        return collect(directory, world_size, [p.returncode for p in processes])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def start_rank(rank: int, world_size: int, job: Path, directory: Path, base: dict[str, str]) -> subprocess.Popen:
    log = open(directory / f"rank-{rank}.log", "w")
    with log:
        return subprocess.Popen(rank_command(rank, job), env=rank_environment(rank, world_size, base),
                                cwd=REPOSITORY, stdout=log, stderr=subprocess.STDOUT)


def wait_or_kill(processes: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every process until `timeout` seconds from now; kill those still running then."""
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def collect(directory: Path, world_size: int, return_codes: list[int]) -> list:
    """Every rank's value, or RankFailed naming each rank without one."""
    values, failures = [], []
    for rank in range(world_size):
        path = result_path(directory, rank)
        outcome = json.loads(path.read_text()) if path.exists() else None
        if outcome is not None and outcome["status"] == "ok":
            values.append(outcome["value"])
            continue
        detail = outcome["error"] if outcome else "no result (exit code {}); output:\n{}".format(
            return_codes[rank], (directory / f"rank-{rank}.log").read_text()[-LOG_TAIL:])
        failures.append(f"rank {rank}: {detail}")
    if failures:
        raise RankFailed("\n".join(failures))
    return values
