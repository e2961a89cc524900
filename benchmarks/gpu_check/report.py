"""The run's report: gpu_check.json (everything) and gpu_check.md (for people)."""
from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

RESULTS_NAME = "gpu_check"


def environment_of(records) -> dict:
    return next((r.numbers for r in records if r.name == "environment" and r.numbers), {})


def as_json(records, dry_run: bool, command: str, seconds: float) -> dict:
    environment = environment_of(records)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dry_run": dry_run, "command": command, "seconds": seconds,
            "device": environment.get("device"), "versions": environment.get("versions"),
            "steps": [dataclasses.asdict(record) for record in records]}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def details(record) -> list[str]:
    """A step's numbers as markdown: the kernel benchmark's table, each test's outcome and the
    properties it recorded, or the numbers as JSON."""
    numbers = record.numbers
    if "table" in numbers:
        return numbers["table"]
    if "tests" in numbers:
        lines = ["| test | outcome | s | recorded |", "|---|---|---:|---|"]
        for name, test in numbers["tests"].items():
            recorded = "; ".join(f"{k} = {v}" for k, v in test["properties"].items())
            if test["message"]:
                recorded = f"{recorded} {test['message']}".strip()
            lines.append(f"| {_cell(name.rpartition('.')[2])} | {test['outcome']} | {test['seconds']:.1f} | "
                         f"{_cell(recorded)} |")
        return lines
    return ["```", json.dumps(numbers, indent=1, default=str), "```"] if numbers else []


def as_markdown(document: dict, records) -> str:
    environment = environment_of(records)
    versions = ", ".join(f"{k} {v}" for k, v in (document["versions"] or {}).items())
    passed = sum(r.status == "passed" for r in records)
    lines = [f"# GPU acceptance run{' (dry run)' if document['dry_run'] else ''}", "",
             f"Date: {document['date']}. Command: `{document['command']}` ({document['seconds']:.0f} s).", "",
             f"Device: {document['device'] or 'none'}"
             + (f" (compute capability {environment['capability']}, {environment['multiprocessors']} SMs, "
                f"{environment['memory_gib']} GiB, driver {environment['driver']}, CUDA {environment['cuda']}, "
                f"NCCL {environment['nccl']})" if "capability" in environment else "") + ".", "",
             f"Versions: {versions or 'not read'}.", "",
             f"{passed} of {len(records)} steps passed.", "",
             "| step | status | s | target | result |", "|---|---|---:|---|---|"]
    for r in records:
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {_cell(r.target)} | {_cell(r.summary)} |")
    for r in records:
        body = details(r)
        if r.output:
            body += ["", "Output (end):", "```", r.output.strip(), "```"]
        if body:
            lines += ["", f"## {r.name}: {r.title}", "", *body]
    return "\n".join(lines) + "\n"


def write(folder: Path, records, dry_run: bool, command: str, seconds: float) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    document = as_json(records, dry_run, command, seconds)
    (folder / f"{RESULTS_NAME}.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    (folder / f"{RESULTS_NAME}.md").write_text(as_markdown(document, records))
    return document
