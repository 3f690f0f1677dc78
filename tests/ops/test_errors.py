"""Bad input gets a RuntimeError that names the op, the argument, the expectation and the value,
from the real kernel and from the fake kernel alike; the process survives and the op keeps working."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import deepwell

ops = torch.ops.deepwell
X = torch.randn(4, 64)
X_BF16 = X.bfloat16()
MX = ops.mxfp8_quantize(X)
NV = ops.nvfp4_quantize(X)
FB = ops.fp8_block_quantize(torch.randn(4, 128))
SC = torch.zeros(5, 3, dtype=torch.uint8)
W = torch.randn(32, 96)
W64 = torch.randn(32, 64)
X48, W48 = torch.randn(4, 48), torch.randn(32, 48)

# (id, call, substrings the message must contain)
BAD = [
    ("mx-dtype", lambda: ops.mxfp8_quantize(X.int()), ["deepwell.mxfp8_quantize", "'x'", "torch.float32", "int32"]),
    ("mx-f64", lambda: ops.mxfp8_quantize(X.double()), ["'x'", "torch.float64"]),
    ("mx-divisible", lambda: ops.mxfp8_quantize(torch.randn(4, 48)), ["'x'", "divisible by 32", "[4, 48]"]),
    ("mx-dim-range", lambda: ops.mxfp8_quantize(X, 2), ["'dim'", "[-2, 1]", "got 2"]),
    ("mx-dim-neg", lambda: ops.mxfp8_quantize(X, -3), ["'dim'", "got -3"]),
    ("mx-dim-0-divisible", lambda: ops.mxfp8_quantize(X, 0), ["'x'", "size(dim=0) divisible by 32"]),
    ("mx-mode", lambda: ops.mxfp8_quantize(X, -1, "ceil"), ["'scale_mode'", "'rceil', 'floor'", '"ceil"']),
    ("mx-elem", lambda: ops.mxfp8_quantize(X, -1, "rceil", "e2m1"), ["'elem'", "'e4m3', 'e5m2'", '"e2m1"']),
    ("mx-empty", lambda: ops.mxfp8_quantize(torch.empty(0, 32)), ["'x'", "non-empty", "[0, 32]"]),
    ("mx-0d", lambda: ops.mxfp8_quantize(torch.tensor(1.0)), ["'x'", "at least 1 dimension", "0-d"]),
    ("mx-deq-scale-shape", lambda: ops.mxfp8_dequantize(MX[0], MX[1][:, :1]), ["'scale'", "[4, 2]", "[4, 1]"]),
    ("mx-deq-data-dtype", lambda: ops.mxfp8_dequantize(X, MX[1]), ["'data'", "float8_e4m3fn"]),
    ("mx-deq-out", lambda: ops.mxfp8_dequantize(*MX, -1, torch.int8), ["'out_dtype'", "int8"]),
    ("nv-divisible", lambda: ops.nvfp4_quantize(torch.randn(4, 24)), ["deepwell.nvfp4_quantize", "'x'", "divisible by 16"]),
    ("nv-2d-rows", lambda: ops.nvfp4_quantize(X, None, True), ["'x'", "rows in multiples of 16", "[4, 64]"]),
    ("nv-amax-dtype", lambda: ops.nvfp4_quantize(X, torch.tensor([1.0], dtype=torch.float64)), ["'global_amax'", "float32"]),
    ("nv-amax-numel", lambda: ops.nvfp4_quantize(X, torch.ones(2)), ["'global_amax'", "exactly one element", "[2]"]),
    ("nv-empty", lambda: ops.nvfp4_quantize(torch.empty(3, 0)), ["'x'", "non-empty"]),
    ("nv-deq-scale", lambda: ops.nvfp4_dequantize(NV[0], NV[1][:, :2], NV[2]), ["deepwell.nvfp4_dequantize", "'scale'", "[4, 4]"]),
    ("nv-deq-gs", lambda: ops.nvfp4_dequantize(NV[0], NV[1], torch.ones(3)), ["'global_scale'", "exactly one element"]),
    ("fb-block", lambda: ops.fp8_block_quantize(X, 1, 64), ["deepwell.fp8_block_quantize", "(1, 128), (128, 1) or (128, 128)", "(1, 64)"]),
    ("fb-divisible", lambda: ops.fp8_block_quantize(torch.randn(4, 130)), ["'x'", "divisible by 128", "[4, 130]"]),
    ("fb-1d", lambda: ops.fp8_block_quantize(torch.randn(128)), ["'x'", "at least 2 dimension", "1-d"]),
    ("fb-deq-scale", lambda: ops.fp8_block_dequantize(FB[0], FB[1].t()), ["deepwell.fp8_block_dequantize", "'scale_inv'", "[4, 1]"]),
    ("sw-dim", lambda: ops.swizzle_scales(torch.zeros(3, dtype=torch.uint8)), ["deepwell.swizzle_scales", "'scale'", "2-d", "1-d"]),
    ("sw-dtype", lambda: ops.swizzle_scales(torch.zeros(3, 3)), ["'scale'", "float8_e8m0fnu", "float32"]),
    ("unsw-len", lambda: ops.unswizzle_scales(SC.flatten(), 5, 3), ["deepwell.unswizzle_scales", "'swizzled'", "[512]", "[15]"]),
    ("unsw-rows", lambda: ops.unswizzle_scales(SC.flatten(), 0, 3), ["'rows, cols'", "positive"]),
    ("lin-k", lambda: ops.scaled_linear(X, W, None, "mxfp8"), ["deepwell.scaled_linear", "x has 64 features", "in_features 96", "[32, 96]"]),
    ("lin-recipe", lambda: ops.scaled_linear(X, W64, None, "fp4"), ["'recipe'", "'mxfp8', 'nvfp4', 'fp8_block', 'fp8_tensor', 'bf16'", '"fp4"']),
    ("lin-k-block", lambda: ops.scaled_linear(X48, W48, None, "mxfp8"), ["'weight'", "divisible by 32", "in_features", "[32, 48]"]),
    ("lin-n-block", lambda: ops.scaled_linear(X, W64[:24], None, "mxfp8"), ["'weight'", "out_features for dgrad", "[24, 64]"]),
    ("lin-fp8-block", lambda: ops.scaled_linear(X, W64, None, "fp8_block"), ["'weight'", "divisible by 128", "[32, 64]"]),
    ("lin-dtype", lambda: ops.scaled_linear(X.int(), W64, None, "bf16"), ["'x'", "torch.float32", "int32"]),
    ("lin-w-dtype", lambda: ops.scaled_linear(X, W64.double(), None, "bf16"), ["'weight'", "torch.float64"]),
    ("lin-w-dim", lambda: ops.scaled_linear(X, W64[0], None, "bf16"), ["'weight'", "2-d (out_features, in_features)", "1-d"]),
    ("lin-bias", lambda: ops.scaled_linear(X, W64, torch.ones(31), "bf16"), ["'bias'", "[32]", "[31]"]),
    ("lin-empty", lambda: ops.scaled_linear(torch.empty(0, 64), W64, None, "bf16"), ["'x'", "non-empty"]),
    ("mxlin-k", lambda: ops.mxfp8_linear(X, W), ["deepwell.mxfp8_linear", "x has 64 features"]),
    ("lin-bwd-grad", lambda: ops.scaled_linear_backward(X, X, W64, "bf16", None, True, True), ["deepwell.scaled_linear_backward", "'grad_out'", "[4, 32]", "[4, 64]"]),
]


@pytest.mark.parametrize("call,parts", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_real_kernel_error(call, parts):
    with pytest.raises(RuntimeError) as info:
        call()
    msg = str(info.value)
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"


@pytest.mark.parametrize("call,parts", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_fake_kernel_error(call, parts):
    """Tracing with fake tensors rejects the same inputs with the same message."""
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError) as info:
        call()
    msg = str(info.value)
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"


def test_ops_keep_working_after_errors():
    for _, call, _ in BAD:
        with pytest.raises(RuntimeError):
            call()
    data, scale = deepwell.mxfp8_quantize(X_BF16)
    assert data.shape == X_BF16.shape


