"""Runs the steps one after another, each in its own process and process group, within its own time
limit and what is left of the overall budget; a step that fails, crashes or runs over is recorded
and the next one starts."""
from __future__ import annotations

import dataclasses
import importlib.abc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .steps import ABSENT_ON_TARGET, BY_NAME, ROOT, Outcome

MIN_STEP_SECONDS = 5.0  # a step is not started with less of the budget left
OUTPUT_TAIL = 2000  # characters of a failed step's output kept in the report


class Absent(importlib.abc.MetaPathFinder):
    """Makes the named top-level modules unimportable, as on the GPU machine."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU machine)", name=name)
        return None


def describe(prepared) -> str:
    """What a dry run found ready, in a few words."""
    if isinstance(prepared, list) and all(isinstance(p, str) and "::" in p for p in prepared):
        return f"{len(prepared)} gpu test(s) collected"
    if isinstance(prepared, list):
        return "command: " + " ".join(Path(p).name if os.sep in p else p for p in prepared)
    if isinstance(prepared, dict):
        return ", ".join(f"{k} {v}" for k, v in prepared.items())
    return getattr(prepared, "__name__", "prepared")


def run_step_here(name: str, dry_run: bool) -> Outcome:
    """The step's work in this process (the child's side): prepare, then run unless dry."""
    step = BY_NAME[name]
    try:
        prepared = step.prepare()
        if dry_run:
            return Outcome("ready", f"would start: {describe(prepared)}")
        return step.run(prepared)
    except Exception as exc:  # recorded as the step's failure; the driver goes on
        traceback.print_exc()
        return Outcome("failed", f"{type(exc).__name__}: {str(exc)[:500]}")


def step_main(name: str, result: Path, dry_run: bool) -> int:
    if dry_run:
        sys.meta_path.insert(0, Absent(ABSENT_ON_TARGET))
    outcome = run_step_here(name, dry_run)
    result.write_text(json.dumps(dataclasses.asdict(outcome), default=str))
    return 0


@dataclasses.dataclass
class StepRecord:
    name: str
    title: str
    target: str
    status: str  # passed, failed, ready (dry run), error (no result), timeout, skipped (budget spent)
    seconds: float
    summary: str
    numbers: dict
    output: str


def run_child(command: list[str], timeout: float, env: dict) -> tuple[int | None, str]:
    """(exit code or None on timeout, combined output); on timeout the child's whole process group
    (pytest's ranks, the forkserver) is killed."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output


def step_command(step, result: Path, dry_run: bool) -> list[str]:
    """The command of one step's process: it writes its Outcome as JSON to `result`."""
    return [sys.executable, "-m", "benchmarks.gpu_check", "--step", step.name, "--result", str(result),
            *(["--dry-run"] if dry_run else [])]


def run_steps(steps, dry_run: bool, budget: float, log, command_for=step_command) -> list[StepRecord]:
    """Every step in its own process (`command_for(step, result, dry_run)`); `log` receives each
    step's output. A dry run's steps, which do no GPU work, run two at a time."""
    deadline = time.monotonic() + budget
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONUNBUFFERED"] = "1"

    def run(step, limit: float) -> tuple[int | None, str, float, dict | None]:
        with tempfile.TemporaryDirectory() as folder:
            result = Path(folder) / "result.json"
            started = time.monotonic()
            code, output = run_child(command_for(step, result, dry_run), limit, env)
            return code, output, time.monotonic() - started, json.loads(result.read_text()) if result.exists() else None

    if dry_run:
        with ThreadPoolExecutor(max_workers=2) as pool:
            finished = list(pool.map(lambda step: run(step, step.timeout), steps))
        return [_record(step, *done, step.timeout, log) for step, done in zip(steps, finished)]
    records = []
    for step in steps:
        left = deadline - time.monotonic()
        if left < MIN_STEP_SECONDS:
            records.append(StepRecord(step.name, step.title, step.target, "skipped", 0.0,
                                      "not started: the overall budget was spent", {}, ""))
            continue
        limit = min(step.timeout, left)
        records.append(_record(step, *run(step, limit), limit, log))
    return records


def _record(step, code: int | None, output: str, seconds: float, outcome: dict | None, limit: float,
            log) -> StepRecord:
    """A finished step's record, its output written to `log` and its line printed."""
    log.write(f"\n===== {step.name} ({seconds:.1f} s, exit {code}) =====\n{output}\n")
    log.flush()
    if outcome is not None:
        status, summary, numbers = outcome["status"], outcome["summary"], outcome["numbers"]
    elif code is None:
        status, summary, numbers = "timeout", f"stopped after {limit:.0f} s", {}
    else:
        status, summary, numbers = "error", f"exited with code {code} without a result", {}
    tail = output[-OUTPUT_TAIL:] if status not in ("passed", "ready") else ""
    print(f"{step.name}: {status} in {seconds:.1f} s: {summary}", flush=True)
    return StepRecord(step.name, step.title, step.target, status, seconds, summary, numbers, tail)
