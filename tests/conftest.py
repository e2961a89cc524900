import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip without a CUDA GPU; `make gpu-check` runs them on one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by make gpu-check)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
