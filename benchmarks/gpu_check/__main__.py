"""`python -m benchmarks.gpu_check [--dry-run] [--budget S] [--steps a,b]`: the GPU acceptance run
(see the package's docstring). `--step NAME --result FILE` is one step's process, started by the driver."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import __doc__ as DESCRIPTION
from . import report
from .driver import run_steps, step_main
from .steps import BY_NAME, ROOT, STEPS

DEFAULT_BUDGET = 450.0  # seconds: the whole run stays under 8 minutes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=DESCRIPTION.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="only prepare each step (no GPU needed)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for all steps together")
    parser.add_argument("--steps", help=f"comma-separated subset of {', '.join(BY_NAME)}")
    parser.add_argument("--step", choices=sorted(BY_NAME), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        return step_main(args.step, args.result, args.dry_run)
    if args.budget <= 0:
        parser.error("--budget must be positive")
    names = args.steps.split(",") if args.steps else list(BY_NAME)
    unknown = [name for name in names if name not in BY_NAME]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; valid: {', '.join(BY_NAME)}")
    folder = Path(os.environ.get("GPU_CHECK_DIR", ROOT / "gpu-check-report"))
    folder.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m benchmarks.gpu_check", *(argv if argv is not None else sys.argv[1:])])
    started = time.monotonic()
    with open(folder / f"{report.RESULTS_NAME}.log", "w") as log:
        records = run_steps([step for step in STEPS if step.name in names], args.dry_run, args.budget, log)
    report.write(folder, records, args.dry_run, command, time.monotonic() - started)
    print(f"wrote {folder / (report.RESULTS_NAME + '.md')}")
    good = {"ready"} if args.dry_run else {"passed"}
    return 0 if all(record.status in good for record in records) else 1


if __name__ == "__main__":
    sys.exit(main())
