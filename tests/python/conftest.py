import os
import sys

import pytest

# Tests run against the package in this checkout (built by `make build` or pip install -e).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "torch_ops"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
