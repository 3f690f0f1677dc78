"""Shared fixtures. GPU tests (`@pytest.mark.gpu`) are skipped on machines without CUDA. Tiers
(pyproject.toml): plain `pytest` deselects `slow` and `distributed`; `pytest -m "slow or distributed"`
runs the rest."""

from __future__ import annotations

import os

import pytest
import torch

import deepwell  # (defines and registers torch.ops.deepwell)
import deepwell.compiler.backend


# `pip install` registers the torch.compile backend through its entry point; a source checkout on
# PYTHONPATH (development, the GPU machine) has none.
deepwell.compiler.backend.ensure_registered()


def _sampled_out_of_a_sweep(item) -> bool:
    """test_opcheck runs every sample call of every op (tests/ops/op_cases.py): the fast tier keeps
    each op's first call (case 0), so every op still passes opcheck there; the others are `slow`."""
    callspec = getattr(item, "callspec", None)
    return item.path.name == "test_opcheck.py" and callspec is not None and callspec.params.get("i", 0) > 0


# tryfirst: the `slow` mark must be on the items before pytest's -m (pyproject.toml's addopts)
# deselects by it.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _sampled_out_of_a_sweep(item):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true), a skipped test that does not need a GPU is a failure: a missing test
    dependency or a broken precondition must not pass silently."""
    report = yield
    if os.environ.get("CI") == "true" and report.skipped and "gpu" not in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"skipped in CI without needing a GPU: {report.longrepr}"
    return report


@pytest.fixture
def gen():
    """A fresh, seeded generator per test (fresh random inputs, reproducible failures)."""
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
