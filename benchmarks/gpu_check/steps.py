"""The steps of the GPU acceptance run. Each step runs in its own process (`python -m
benchmarks.gpu_check --step NAME`): `prepare()` does what needs no GPU (imports, inputs, test
collection) and is all a dry run does; `run(prepared)` does the GPU work and returns an Outcome.
gradsync is imported inside the steps: the install step runs before it is importable.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("GPU_CHECK_WHEELS", ROOT / ".gpu-wheels"))
# what the GPU machine lacks: a dry run's steps must start without them
ABSENT_ON_TARGET = ("hydra", "omegaconf", "wandb")
VERSIONS = ("torch", "triton", "pytorch-lightning", "lightning", "numpy", "scipy", "networkx", "highspy", "deepspeed",
            "gradsync")


@dataclasses.dataclass
class Outcome:
    """A step's result: `status` is "passed", "failed" or (dry run) "ready"."""

    status: str
    summary: str
    numbers: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    title: str
    target: str  # what "passed" means
    timeout: float  # seconds
    prepare: Callable[[], object]
    run: Callable[[object], Outcome]
    tests: tuple[str, ...] = ()  # the pytest selection a test step runs


# -- install ------------------------------------------------------------------------------------------
def install_command() -> list[str]:
    """pip, offline: the wheels brought along (GPU_CHECK_WHEELS), then gradsync itself, editable
    (PEP 660 through the installed setuptools: the legacy `setup.py develop` would fetch build needs)."""
    wheels = sorted(str(path) for path in WHEELS.glob("*.whl"))
    return [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--no-index",
            "--no-build-isolation", "--use-pep517", *wheels, "-e", str(ROOT)]


def run_install(command: list[str]) -> Outcome:
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout, done.stderr, sep="\n")
    check = subprocess.run([sys.executable, "-c", "import gradsync, gradsync.strategies, gradsync.triton_kernels"],
                           capture_output=True, text=True, cwd=tempfile.gettempdir())
    wheels = [Path(part).name for part in command if part.endswith(".whl")]
    if done.returncode or check.returncode:
        return Outcome("failed", f"pip rc {done.returncode}; import gradsync: {check.stderr.strip()[-300:] or 'ok'}",
                       {"wheels": wheels})
    return Outcome("passed", f"installed gradsync and {len(wheels)} wheel(s) offline", {"wheels": wheels})


# -- environment --------------------------------------------------------------------------------------
def versions() -> dict:
    found = {"python": sys.version.split()[0]}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def describe_environment(found_versions: dict) -> Outcome:
    import torch

    numbers = {"versions": found_versions, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return Outcome("failed", "torch sees no CUDA device", numbers)
    properties = torch.cuda.get_device_properties(0)
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True)
    numbers.update(device=properties.name, capability=f"{properties.major}.{properties.minor}",
                   multiprocessors=properties.multi_processor_count,
                   memory_gib=round(properties.total_memory / 2**30, 1),
                   nccl=".".join(map(str, torch.cuda.nccl.version())), driver=driver.stdout.strip() or None)
    return Outcome("passed", f"{properties.name}, torch {torch.__version__}, CUDA {torch.version.cuda}", numbers)


# -- pytest selections --------------------------------------------------------------------------------
def absent_plugins() -> list[str]:
    """`-p no:NAME` for the pytest plugins of packages the GPU machine lacks (hydra's), which
    pytest would load from their entry points where they are installed."""
    return [argument for entry in importlib.metadata.entry_points(group="pytest11")
            if entry.value.partition(".")[0].partition(":")[0] in ABSENT_ON_TARGET
            for argument in ("-p", f"no:{entry.name}")]


def collect(selection: tuple[str, ...]) -> list[str]:
    """The `gpu`-marked test ids of `selection`; every entry must name at least one."""
    import pytest

    class Collector:
        def __init__(self):
            self.ids: list[str] = []

        def pytest_collection_finish(self, session):
            self.ids = [item.nodeid for item in session.items]

    collector = Collector()
    code = pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *absent_plugins(),
                        "--rootdir", str(ROOT),
                        *(str(ROOT / entry) for entry in selection)], plugins=[collector])
    missing = [entry for entry in selection if not any(i == entry or i.startswith(entry + "::") or
                                                        i.startswith(entry + "[") for i in collector.ids)]
    if code not in (0, 5) or missing or not collector.ids:
        raise RuntimeError(f"collecting {list(selection)} failed (pytest exit {code}); no gpu tests for {missing}")
    return collector.ids


def run_tests(ids: list[str]) -> Outcome:
    """Run the collected tests with the Triton kernels compiled (never interpreted); the outcome of
    each test and the properties it recorded, from pytest's JUnit XML."""
    os.environ.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "junit.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfE",
                        "-o", "junit_family=legacy",
                        "--rootdir", str(ROOT), f"--junitxml={report}", *(str(ROOT / i) for i in ids)], cwd=ROOT)
        tests = junit_results(report.read_text()) if report.exists() else {}
    failed = [name for name, test in tests.items() if test["outcome"] != "passed"]
    status = "passed" if tests and not failed else "failed"
    summary = f"{len(tests) - len(failed)} of {len(ids)} passed" + (f"; not passed: {failed[:8]}" if failed else "")
    return Outcome(status, summary, {"tests": tests})


def junit_results(xml: str) -> dict:
    """{test name: {outcome, seconds, properties, message}} from pytest's JUnit XML."""
    tests = {}
    for case in ElementTree.fromstring(xml).iter("testcase"):
        problem = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        tests[f"{case.get('classname')}::{case.get('name')}"] = {
            "outcome": "passed" if problem is None else problem.tag,
            "seconds": float(case.get("time", 0)),
            "properties": {p.get("name"): p.get("value") for p in case.iter("property")},
            "message": None if problem is None else (problem.get("message") or "")[:500],
        }
    return tests


def test_step(name: str, title: str, target: str, timeout: float, *selection: str) -> Step:
    return Step(name, title, target, timeout, lambda: collect(selection), run_tests, selection)


# -- benchmarks ---------------------------------------------------------------------------------------
def prepare_error_feedback():
    from benchmarks import triton_kernels

    import gradsync.triton_kernels  # noqa: F401

    return triton_kernels


EF_PASSES = 2  # every row is timed in each pass: a difference between passes is the run's noise


def run_error_feedback(benchmark) -> Outcome:
    import torch

    shapes = [(n, m, dtype) for dtype in (torch.float32, torch.float16) for n, m in benchmark.SHAPES]
    passes = [[benchmark.measure(n, m, dtype) for n, m, dtype in shapes] for _ in range(EF_PASSES)]
    numbers = {"rank": benchmark.RANK, "table": [], "rows": []}
    for number, rows in enumerate(passes, 1):
        numbers["table"] += ["", f"Pass {number} of {EF_PASSES}:", "", *benchmark.table(rows), "",
                             benchmark.verdict(rows)]
        for row in rows:
            s = row["seconds"]
            numbers["rows"].append({
                "pass": number, "matrix": "x".join(map(str, row["shape"])),
                "dtype": str(row["dtype"]).removeprefix("torch."),
                "fused_us": s["fused"] * 1e6, "eager_us": s["eager"] * 1e6, "addmm_us": s["addmm"] * 1e6,
                "fused_launch_us": s["fused_launch"] * 1e6,
                **benchmark.rates(row)})
    met = [r for r in numbers["rows"] if r["met"]]
    summary = "; ".join(f"pass {number}: {benchmark.verdict(rows)}" for number, rows in enumerate(passes, 1))
    return Outcome("passed" if len(met) == len(numbers["rows"]) else "failed", summary, numbers)


COMPRESSION_REPEATS = 15
LOW_RANK = {"ACP-SGD": ("acp_sgd", {"rank": 4}), "Power-SGD": ("powersgd", {"rank": 4})}


def prepare_compression():
    from benchmarks import codec_launch_costs, compression_speed  # noqa: F401 (a dry run checks both import)

    from gradsync import compress

    for name, options in LOW_RANK.values():
        compress.get(name, **options)
    return compression_speed


def wire_elements(shapes) -> dict:
    """Elements on the wire per step, uncompressed and per low-rank codec (its own wire sizes,
    averaged over its steady cycle of steps: ACP-SGD's P and Q steps)."""
    from gradsync import compress
    from gradsync.profile import TensorSpec

    specs = {f"w{i}": TensorSpec(f"w{i}", n * m, 4, (n, m)) for i, (n, m) in enumerate(shapes)}
    elements = {"uncompressed": sum(spec.numel for spec in specs.values())}
    for label, (name, options) in LOW_RANK.items():
        codec = compress.get(name, **options)
        codec.setup(specs, 1, seed=0)
        cycle = codec.steady_rounds()
        elements[label] = sum(codec.wire_spec(spec, layout).numel for rounds in cycle for layout in rounds
                              for spec in specs.values()) / len(cycle)
    return elements


def allreduce_seconds(elements: dict, repeats: int = 20) -> dict:
    """Median time of an NCCL all-reduce (one rank, in this process) of each count of fp32 elements."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from gradsync.launch import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        times = {}
        for label, count in elements.items():
            buffer = torch.ones(int(count), device="cuda")
            samples = []
            for _ in range(repeats + 2):
                torch.cuda.synchronize()
                started = time.perf_counter()
                dist.all_reduce(buffer)
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - started)
            times[label] = statistics.median(samples[2:])
        return times
    finally:
        dist.destroy_process_group()


def profiled_ops(benchmark, shapes, top: int = 15) -> dict:
    """Per low-rank codec, the ops with the most host time over a P and a Q step on `shapes`
    (torch.profiler; total includes the ops they call, self does not): where a launch-bound step's
    time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    found = {}
    for label, (name, options) in LOW_RANK.items():
        gradients = {f"w{i}": torch.randn(shape, device="cuda") for i, shape in enumerate(shapes)}
        codec, parameters = benchmark.prepared(name, options, gradients)
        for step in range(2):  # warm-up
            benchmark.step_seconds(codec, parameters, gradients, step)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            for step in range(2, 4):
                benchmark.step_seconds(codec, parameters, gradients, step)
        events = sorted(profiler.key_averages(), key=lambda event: event.cpu_time_total, reverse=True)[:top]
        found[label] = [{"op": event.key, "calls": event.count, "host_us": round(event.cpu_time_total, 1),
                         "self_host_us": round(event.self_cpu_time_total, 1),
                         "device_us": round(getattr(event, "device_time_total", 0.0), 1)} for event in events]
    return found


def operations_one_by_one() -> dict:
    """benchmarks/codec_launch_costs.py's rows: host and device µs per call of the codecs'
    operations, and whether each waits for the device."""
    from benchmarks import codec_launch_costs

    return {title: [{"shape": shape, "way": way, **numbers} for shape, way, numbers in rows]
            for title, rows in codec_launch_costs.measured().items()}


def run_compression(benchmark) -> Outcome:
    shapes = [shape for group in benchmark.GROUPS.values() for shape in group]
    per_group = {group: benchmark.median_steps(group_shapes, COMPRESSION_REPEATS, "cuda", LOW_RANK)
                 for group, group_shapes in benchmark.GROUPS.items()}
    codec = {label: sum(times[label] for times in per_group.values()) for label in LOW_RANK}
    ratio = codec["ACP-SGD"] / codec["Power-SGD"]
    elements = wire_elements(shapes)
    allreduce = allreduce_seconds(elements)
    saved = {label: (elements["uncompressed"] - elements[label]) * 4 for label in LOW_RANK}
    numbers = {
        "codec_ms_per_step": {label: seconds * 1e3 for label, seconds in codec.items()},
        "per_group_ms": {group: {k: v * 1e3 for k, v in times.items()} for group, times in per_group.items()},
        "acp_over_powersgd": ratio,
        "wire_mb_per_step": {label: count * 4 / 1e6 for label, count in elements.items()},
        "allreduce_ms_one_rank": {label: seconds * 1e3 for label, seconds in allreduce.items()},
        # compression saves time on links whose all-reduce bandwidth is below bytes saved / codec time
        "break_even_gbps": {label: saved[label] / codec[label] / 1e9 for label in LOW_RANK},
        "profile_768x768x4": profiled_ops(benchmark, benchmark.GROUPS["768×768 ×4"]),
        "operations_one_by_one": operations_one_by_one(),
    }
    summary = (f"ACP-SGD {codec['ACP-SGD'] * 1e3:.2f} ms, Power-SGD {codec['Power-SGD'] * 1e3:.2f} ms per step: "
               f"{ratio:.2f} (target <= {benchmark.TARGET}); uncompressed all-reduce on one rank "
               f"{allreduce['uncompressed'] * 1e3:.2f} ms")
    return Outcome("passed" if ratio <= benchmark.TARGET else "failed", summary, numbers)


STEPS = [
    Step("install", "gradsync installed offline", "pip succeeds and gradsync imports", 180, install_command,
         run_install),
    Step("environment", "device and versions", "torch sees a CUDA device", 60, versions, describe_environment),
    test_step("kernel_tests", "CUDA tests: Triton kernels compiled, codecs on CUDA",
              "every test passes", 240, "tests/test_triton_kernels.py",
              "tests/test_gpu_runtime.py::test_low_rank_codecs_on_cuda_follow_the_cpu",
              "tests/test_gpu_runtime.py::test_orthogonalize_on_cuda_matches_the_cpu_and_never_waits"),
    Step("error_feedback_benchmark", "fused error-feedback kernel (ACP-SGD Algorithm 2)",
         ">= 80% of copy bandwidth and faster than eager, every row", 120, prepare_error_feedback,
         run_error_feedback),
    Step("compression_benchmark", "ACP-SGD against Power-SGD on BERT-Base's matrices",
         "ACP-SGD <= 0.55 of Power-SGD's encoding + decoding time", 120, prepare_compression, run_compression),
    test_step("wrap_nccl", "gradsync.wrap on NCCL, one rank, against torch DDP; its communication timed for "
              "re-planning (NCCL's own op durations); iterations begun at the outputs; gradients clipped in flight "
              "refused; a backbone unfrozen after the wrap taken into new plans", "every test passes", 300,
              "tests/test_gpu_runtime.py::test_wrap_on_nccl_with_one_rank_trains_like_ddp",
              "tests/test_replanning.py::test_the_communication_is_timed_on_nccl",
              "tests/test_output_start.py::test_iterations_begin_at_the_outputs_on_cuda_over_nccl",
              "tests/test_changed_in_flight.py"
              "::test_gradients_clipped_before_synchronize_are_refused_on_cuda_over_nccl",
              "tests/test_unfreezing.py"
              "::test_a_backbone_unfrozen_after_the_wrap_trains_as_under_torch_ddp_on_cuda_over_nccl"),
    test_step("wrap_gloo_cuda", "gradsync.wrap on 2 ranks sharing the GPU (gloo, CUDA tensors), against torch DDP",
              "every test passes", 180,
              "tests/test_gpu_runtime.py::test_wrap_on_two_ranks_sharing_the_gpu_over_gloo_trains_like_ddp"),
    test_step("comm_hooks", "gradsync.comm_hooks under DDP on NCCL (one rank) and gloo (2 ranks, CUDA tensors)",
              "every test passes", 180, "tests/test_comm_hooks.py::test_hooks_run_on_cuda_and_acp_sgd_at_full_rank_equals_ddp",
              "tests/test_comm_hooks.py::test_a_step_the_grad_scaler_skips_on_cuda_leaves_training_as_without_it"),
    test_step("lightning", 'Lightning Trainer(strategy="acp_sgd", accelerator="gpu", devices=1)',
              "every test passes", 240, "tests/test_lightning.py::test_registered_names_train_on_one_gpu"),
    test_step("deepspeed", "DeepSpeed's engine with the gradsync section on CUDA: fp16 with overflows at ZeRO stages 2 and 0, and "
              "Lightning's DeepSpeedStrategy", "every test passes", 300,
              "tests/test_deepspeed.py::test_fp16_overflows_are_skipped_as_deepspeed_skips_them_on_cuda",
              "tests/test_deepspeed.py::test_lightnings_deepspeed_strategy_runs_gradsync_from_the_config"),
]
BY_NAME = {step.name: step for step in STEPS}
