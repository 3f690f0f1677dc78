"""The quantizer ops are not differentiable: backprop through one raises a clear error naming it
(ops/_nondiff.py), never torch's "an autograd kernel was not registered ... silently incorrect
behavior" warning with a silently missing gradient; compiled code behaves the same."""

from __future__ import annotations

import warnings

import pytest
import torch

from _util import same_bits
from op_cases import _x
from test_boundary import OPS, call, good_call, outputs

ops = torch.ops.deepwell


NOT_DIFFERENTIABLE = [op for op in OPS if "linear" not in op]


def _differentiable_inputs(op: str) -> dict:
    kw = good_call(op)
    for k, v in kw.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            kw[k] = v.detach().clone().requires_grad_()
    return kw


# Ops with no floating-point input (swizzles, fp8 dequantizers) cannot receive a requires-grad tensor.
WITH_FLOAT_INPUT = [
    op for op in NOT_DIFFERENTIABLE if any(getattr(v, "requires_grad", False) for v in _differentiable_inputs(op).values())
]


@pytest.mark.parametrize("op", [pytest.param(op, id=op) for op in WITH_FLOAT_INPUT])
def test_backward_raises(op):
    kw = _differentiable_inputs(op)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = [o for o in outputs(call(op, kw)) if o.requires_grad]
        assert outs, f"{op}: no output requires grad"
        loss = sum(o.float().sum() for o in outs)
        with pytest.raises(RuntimeError, match=rf"deepwell\.{op} is not differentiable: .*scaled_linear"):
            loss.backward()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_roundtrip_backward_raises(compiled):
    """quantize -> dequantize -> sum().backward(): a clear error, eager and compiled (fullgraph); the
    compiled forward itself works (the error waits for a backward that reaches the op)."""

    def f(x):
        data, scale = ops.mxfp8_quantize(x)
        return ops.mxfp8_dequantize(data, scale, out_dtype=torch.float32)

    x = _x(4, 64, dtype=torch.float32).requires_grad_()
    torch._dynamo.reset()
    fn = torch.compile(f, fullgraph=True) if compiled else f
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = fn(x)
        assert same_bits(y.detach(), f(x.detach()))
        with pytest.raises(RuntimeError, match=r"deepwell\.mxfp8_(de)?quantize is not differentiable"):
            y.sum().backward()
    assert x.grad is None
