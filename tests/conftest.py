"""Shared fixtures. GPU tests (`@pytest.mark.gpu`) are skipped on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

import deepwell  # (defines and registers torch.ops.deepwell)
import deepwell.plan.backend


# `pip install` registers the torch.compile backend through its entry point; a source checkout on
# PYTHONPATH (development, the GPU machine) has none.
deepwell.plan.backend.ensure_registered()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A fresh, seeded generator per test (fresh random inputs, reproducible failures)."""
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
