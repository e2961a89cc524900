"""One rank of a netbed job: ``python -m benchmarks.netbed.rank <job.json> <rank>`` (see launcher.py).

Joins the gloo process group through the job's rendezvous file, calls the job's target and writes
``{"status": "ok", "value": ...}`` or ``{"status": "error", "error": traceback}`` to its result file.
"""
from __future__ import annotations

import importlib
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .launcher import result_path


def resolve(target: str):
    """The function named by "package.module:function"."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def run_rank(job: dict, rank: int) -> dict:
    torch.set_num_threads(job["threads"])
    try:
        dist.init_process_group("gloo", init_method=f"file://{job['rendezvous']}", rank=rank,
                                world_size=job["world_size"], timeout=timedelta(seconds=job["timeout"]))
        return {"status": "ok", "value": resolve(job["target"])(rank, job["world_size"], *job["args"])}
    except BaseException as exc:  # reported to the launcher with its traceback
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(job_path: str, rank: str) -> int:
    job = json.loads(Path(job_path).read_text())
    outcome = run_rank(job, int(rank))
    final = result_path(job["results"], int(rank))
    staging = final.with_suffix(".tmp")
    staging.write_text(json.dumps(outcome))
    staging.rename(final)  # the launcher never reads a half-written result
    return 0 if outcome["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
