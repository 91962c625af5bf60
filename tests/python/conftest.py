import os
import sys

# Deterministic cuBLAS for the bit-exact GPU tests (must be set before the first cuBLAS call).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# One CPU thread per process: the tests' tensors are tiny, and the two-rank tests spawn ranks
# that would otherwise each start a thread per core and oversubscribe them (on 2 cores
# test_train_dist.py took 85 s with torch's default, 55 s with this). Before torch is imported;
# the spawned ranks inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
