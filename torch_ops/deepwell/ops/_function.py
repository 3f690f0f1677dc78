"""A rule for deepwell's `torch.autograd.Function` classes: a forward never returns a tensor made
by an op that hands back its own input (`t.to(t.dtype)`, `.contiguous()` of a contiguous tensor).

torch 2.11's Dynamo traces such a Function into a graph whose backward gives every input a zero
gradient, silently: `(x @ w).to(x.dtype)` returned from a Function's forward trains nothing under
torch.compile there (found on the H100's torch 2.11; torch 2.15 gives the right gradient). A view
(`view_as`, slicing) is fine. `cast` is the dtype change that skips the no-op
(tests/ops/test_function_outputs.py holds each Function to its eager gradients, compiled).
"""

from __future__ import annotations

import torch


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`: t itself where it has it already (no self-returning `.to()` in the graph)."""
    return t if t.dtype == dtype else t.to(dtype)
