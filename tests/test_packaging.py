"""The distribution maps every top-level folder onto the gradsync package, installed or editable."""
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


def test_editable_install_imports_every_subpackage_from_the_folders(tmp_path):
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL % SUBPACKAGES], cwd=tmp_path, check=True,
                          capture_output=True, text=True)
    assert done.stdout.strip() == str(ROOT / "ext" / "__init__.py")
