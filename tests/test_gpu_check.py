"""The GPU acceptance run's driver (benchmarks/gpu_check) on a machine without a GPU: the dry run of
every step, the driver's handling of steps that fail, crash, hang or find the budget spent, the
JUnit reading and the report, and that every `gpu`-marked test belongs to a step."""
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check import driver, report
from benchmarks.gpu_check.driver import run_child, run_steps
from benchmarks.gpu_check.steps import ROOT, STEPS, Step, junit_results


def test_dry_run_prepares_every_step_without_the_modules_the_gpu_machine_lacks(tmp_path):
    """`make gpu-check DRY_RUN=1`'s command: every step starts (imports, inputs, test collection)
    with deepspeed, hydra, omegaconf and wandb unimportable, and the report lists each."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run"], cwd=ROOT,
                          env={**os.environ, "GPU_CHECK_DIR": str(tmp_path)}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:]
    document = json.loads((tmp_path / "gpu_check.json").read_text())
    assert document["dry_run"] is True
    assert [(step["name"], step["status"]) for step in document["steps"]] == [(s.name, "ready") for s in STEPS]
    collected = {step["name"]: step["summary"] for step in document["steps"] if "collected" in step["summary"]}
    assert set(collected) == {s.name for s in STEPS if s.tests}
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.startswith("# GPU acceptance run (dry run)")
    assert all(f"| {s.name} | ready |" in markdown for s in STEPS)
    assert "===== lightning" in (tmp_path / "gpu_check.log").read_text()


def _scripted_step(name: str, timeout: float = 20.0) -> Step:
    return Step(name, f"the {name} step", "it passes", timeout, lambda: None, lambda _: None)


SCRIPTS = {
    "passes": "write('passed', 'fine', {'x': 1})",
    "fails": "write('failed', 'missed', {})",
    "crashes": "import os; os._exit(3)",
    "hangs": "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "time.sleep(60)",
}


def _scripted_command(step, result, dry_run):
    """Each scripted step's process: write an Outcome, exit without one, or outlive its limit."""
    prelude = textwrap.dedent(f"""
        import json
        def write(status, summary, numbers):
            open({str(result)!r}, 'w').write(json.dumps(dict(status=status, summary=summary, numbers=numbers)))
        """)
    return [sys.executable, "-c", prelude + SCRIPTS[step.name]]


def test_a_failing_crashing_or_hanging_step_never_stops_the_next():
    steps = [_scripted_step("fails"), _scripted_step("crashes"), _scripted_step("hangs", timeout=2.0),
             _scripted_step("passes")]
    log = io.StringIO()
    started = time.monotonic()
    records = run_steps(steps, False, 60.0, log, _scripted_command)
    assert time.monotonic() - started < 20  # the hanging step and its child were stopped at 2 s
    assert [(r.name, r.status) for r in records] == [("fails", "failed"), ("crashes", "error"),
                                                       ("hangs", "timeout"), ("passes", "passed")]
    assert records[3].numbers == {"x": 1} and records[3].output == ""  # output kept only for failures
    assert "exit 3" in log.getvalue() and "(exited with code 3" not in records[0].summary


def test_steps_left_when_the_budget_is_spent_are_recorded_as_skipped(monkeypatch):
    monkeypatch.setattr(driver, "MIN_STEP_SECONDS", 1.0)
    steps = [_scripted_step("hangs", timeout=60.0), _scripted_step("passes")]
    records = run_steps(steps, False, 2.0, io.StringIO(), _scripted_command)
    assert [(r.name, r.status) for r in records] == [("hangs", "timeout"), ("passes", "skipped")]
    assert 1.9 < records[0].seconds < 6


def test_a_timed_out_child_takes_its_own_children_with_it(tmp_path):
    marker = tmp_path / "grandchild.pid"
    script = (f"import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
              f"'import time; time.sleep(60)']); open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    code, _ = run_child([sys.executable, "-c", script], 2.0, dict(os.environ))
    assert code is None
    status = Path(f"/proc/{marker.read_text()}/status")
    time.sleep(0.2)
    # killed with its group: gone, or a zombie its new parent has not reaped yet
    assert not status.exists() or "\nState:\tZ" in status.read_text()


def test_junit_results_read_outcomes_times_properties_and_messages():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.test_a" name="test_ok" time="1.5">
        <properties><property name="error" value="3e-06"/></properties></testcase>
      <testcase classname="tests.test_a" name="test_bad[x]" time="0.2">
        <failure message="assert 0.1 &lt; 0.0001">trace</failure></testcase>
      <testcase classname="tests.test_b" name="test_skip" time="0"><skipped message="no"/></testcase>
    </testsuite></testsuites>"""
    assert junit_results(xml) == {
        "tests.test_a::test_ok": {"outcome": "passed", "seconds": 1.5, "properties": {"error": "3e-06"},
                                  "message": None},
        "tests.test_a::test_bad[x]": {"outcome": "failure", "seconds": 0.2, "properties": {},
                                      "message": "assert 0.1 < 0.0001"},
        "tests.test_b::test_skip": {"outcome": "skipped", "seconds": 0.0, "properties": {}, "message": "no"},
    }


def test_report_names_the_device_and_shows_each_steps_numbers(tmp_path):
    records = run_steps([_scripted_step("passes"), _scripted_step("fails")], False, 60.0, io.StringIO(),
                        _scripted_command)
    records[0].name, records[0].numbers = "environment", {
        "device": "NVIDIA H200", "versions": {"torch": "2.11.0"}, "capability": "9.0", "multiprocessors": 132,
        "memory_gib": 139.8, "driver": "580", "cuda": "13.0", "nccl": "2.28.9"}
    document = report.write(tmp_path, records, False, "python -m benchmarks.gpu_check", 12.0)
    assert document["device"] == "NVIDIA H200" and document["versions"] == {"torch": "2.11.0"}
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "Device: NVIDIA H200 (compute capability 9.0, 132 SMs" in markdown
    assert "1 of 2 steps passed." in markdown
    assert "| fails | failed |" in markdown and "## environment: the passes step" in markdown
    assert json.loads((tmp_path / "gpu_check.json").read_text())["steps"][1]["status"] == "failed"


def test_every_gpu_test_of_the_suite_is_run_by_a_step():
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                           "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(ids) >= 30, done.stdout[-2000:]
    selections = [entry for step in STEPS for entry in step.tests]
    orphans = [i for i in ids if not any(i == s or i.startswith((s + "::", s + "[")) for s in selections)]
    assert orphans == []


@pytest.mark.parametrize("arguments, command", [
    ([], "python3 -m benchmarks.gpu_check"),  # on the GPU machine: its own python3
    (["DRY_RUN=1"], ".venv/bin/python -m benchmarks.gpu_check --dry-run"),
])
def test_make_gpu_check_runs_the_driver(arguments, command):
    done = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", *arguments], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].strip() == command
