import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# DeepSpeed's CPU communication makes a shared-memory buffer per rank and master port (69 MB each)
# and never removes it; the DeepSpeed jobs here each take a new port
DEEPSPEED_BUFFERS = Path("/dev/shm")
DEEPSPEED_BUFFER_PREFIX = "deepspeed_allreduce_buffer_"
# DeepSpeed's CPU communication compiles its shared-memory op at a job's start, under a lock file in
# torch's extensions folder (shared by every checkout by default, each rebuilding it for its own
# sources); a build killed midway leaves the lock behind and every later job waits on it. Each
# virtual environment builds into its own folder.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def deepspeed_buffers() -> set[Path]:
    return set(DEEPSPEED_BUFFERS.glob(DEEPSPEED_BUFFER_PREFIX + "*")) if DEEPSPEED_BUFFERS.is_dir() else set()


def pytest_sessionstart(session):
    session.config.deepspeed_buffers_before = deepspeed_buffers()


def pytest_sessionfinish(session):
    """Remove the DeepSpeed buffers this session's jobs left (a few GB over the suite). With
    parallel workers the controlling process does it, once every worker's jobs have ended."""
    if hasattr(session.config, "workerinput"):
        return
    for path in deepspeed_buffers() - getattr(session.config, "deepspeed_buffers_before", set()):
        path.unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip without a CUDA GPU; `make gpu-check` runs them on one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by make gpu-check)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
