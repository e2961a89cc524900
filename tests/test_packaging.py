"""The distribution maps every top-level folder onto the gradsync package, installed or editable."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["gradsync", "gradsync.planners", "gradsync.profile", "gradsync.strategies",
               "gradsync.triton_kernels", "gradsync.recipes", "gradsync.cli"]
IMPORT_ALL = "import importlib; [importlib.import_module(m) for m in %r]; import gradsync; print(gradsync.__file__)"


def test_non_editable_install_imports_every_subpackage(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL % SUBPACKAGES], cwd=tmp_path, check=True,
                          capture_output=True, text=True, env={"PYTHONPATH": str(target), "PATH": ""})
    assert done.stdout.strip().startswith(str(target))
    [info] = target.glob("gradsync-*.dist-info")  # the license travels with the distribution
    assert "Apache-2.0" in (info / "METADATA").read_text()
    assert "Apache License\n                           Version 2.0" in next(info.rglob("LICENSE")).read_text()


def test_editable_install_imports_every_subpackage_from_the_folders(tmp_path):
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL % SUBPACKAGES], cwd=tmp_path, check=True,
                          capture_output=True, text=True)
    assert done.stdout.strip() == str(ROOT / "ext" / "__init__.py")


LAZY_ATTRIBUTES = """import sys, gradsync
assert "deepspeed" not in sys.modules, "import gradsync imported deepspeed"
assert "pytorch_lightning" not in sys.modules, "import gradsync imported Lightning"
print(gradsync.launch.run_local.__name__, gradsync.timeline_plot.plot_timeline.__name__)
assert "deepspeed" not in sys.modules, "gradsync.launch imported deepspeed"
try:
    gradsync.no_such_name
except AttributeError as error:
    print(error)
if %r:
    print(gradsync.deepspeed.initialize.__module__)
"""


def test_a_plain_import_reaches_launch_and_deepspeed_lazily():
    with_deepspeed = importlib.util.find_spec("deepspeed") is not None  # an optional extra
    done = subprocess.run([sys.executable, "-c", LAZY_ATTRIBUTES % with_deepspeed], check=True,
                          capture_output=True, text=True)
    lines = done.stdout.splitlines()
    assert lines[:2] == ["run_local plot_timeline", "module 'gradsync' has no attribute 'no_such_name'"]
    assert (lines[-1] == "deepspeed") if with_deepspeed else len(lines) == 2  # after DeepSpeed's log


def test_after_import_runs_now_or_when_the_module_is_imported(tmp_path, monkeypatch):
    """How gradsync reaches DeepSpeed's engine and Lightning's registries without importing them."""
    from gradsync.import_hooks import after_import

    (tmp_path / "late_module.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_module", raising=False)
    seen = []
    after_import("late_module", lambda module: seen.append(module.VALUE))
    assert seen == []
    importlib.import_module("late_module")
    assert seen == [3]
    after_import("late_module", lambda module: seen.append(-module.VALUE))
    assert seen == [3, -3]


TOOLS = {"simulator_replay",  # re-predicts a stored head-to-head with the simulator: writes no result
         "netbed",  # the emulated cluster the benchmarks run on
         "gpu_check"}  # the GPU acceptance run: `make gpu-check`, on a CUDA machine


def bench_recipe() -> str:
    """The commands of the Makefile's `bench` target."""
    return re.search(r"^bench:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)[1]


def test_make_bench_runs_every_benchmark_script():
    recipe = bench_recipe()
    modules = {path.stem for path in (ROOT / "benchmarks").glob("*.py")
               if 'if __name__ == "__main__":' in path.read_text()}
    packages = {path.parent.name for path in (ROOT / "benchmarks").glob("*/__main__.py")}
    scripts = (modules | packages) - TOOLS
    assert {"reproduce_topology", "triton_kernels", "head_to_head"} <= scripts
    missing = [name for name in sorted(scripts)
               if f"benchmarks/{name}.py" not in recipe and f"-m benchmarks.{name}" not in recipe]
    assert not missing, f"make bench does not run {missing}"
