"""One-line entry points on top of the `deepwell` torch.compile backend."""

from __future__ import annotations

import torch

from .policy import PrecisionPolicy


def optimize(model, precision: str = "auto", policy: PrecisionPolicy | None = None, verbose: bool = False, **compile_kw):
    """`torch.compile(model, backend="deepwell")` with deepwell's options: every linear on a
    parameter runs in the recipe the Rust planner picks for it (`precision="auto"`: the device's
    fastest native recipe), the rest is fused by Inductor. `verbose=True` prints the plan."""
    options = {"precision": precision, "verbose": verbose}
    if policy is not None:
        options["policy"] = policy
    return torch.compile(model, backend="deepwell", options=options, **compile_kw)


def optimize_for_blackwell(model, precision: str = "mxfp8", **kw):
    """The seeds' alias: `optimize` with MXFP8 (native on sm_100/sm_120, emulated elsewhere)."""
    return optimize(model, precision=precision, **kw)
