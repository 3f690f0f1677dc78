"""deepwell.quantized_linear: the forward of scaled_linear from a weight's stored codes. The slow,
obviously-correct path it must equal bit for bit is scaled_linear's own forward on the weight the
codes came from (it quantizes that weight in the call), for every recipe, on the CPU's table, on
the CPU models of the GPUs' native GEMMs ("recipe@arch") and on the GPU."""

from __future__ import annotations

import pytest
import torch

from _util import same_bits
from deepwell.train.quantized import quantize_weight

ops = torch.ops.deepwell
RECIPES = ("fp8_block", "mxfp8", "nvfp4")


def _codes(w, recipe):
    q = quantize_weight(w, recipe)
    return q["data"], q["scale"], q.get("global_scale")


def _inputs(shape_x, n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    k = shape_x[-1]
    x = (torch.randn(shape_x, generator=g) * torch.exp(torch.randn(k, generator=g))).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    return x, w, b


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ["", "@sm_90", "@sm_100"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_identical_to_the_forward_on_the_weight(recipe, arch, dtype):
    for seed, (shape_x, n, bias) in enumerate([((64, 256), 128, True), ((2, 3, 512), 256, False), ((1, 128), 384, True)]):
        x, w, b = _inputs(shape_x, n, dtype, "cpu", seed)
        b = b if bias else None
        want = ops.scaled_linear(x, w, b, recipe + arch, None)
        got = ops.quantized_linear(x, *_codes(w, recipe), b, recipe + arch)
        assert got.dtype == x.dtype and got.shape == want.shape
        assert same_bits(got, want), (recipe, arch, shape_x)


def _bad_calls():
    x, w, _ = _inputs((4, 256), 128, torch.float32, "cpu", 0)
    fb, nv = _codes(w, "fp8_block"), _codes(w, "nvfp4")
    yield "recipe", (x, *fb, None, "bf16")
    yield "recipe", (x, *fb, None, "fp8_block@sm_999x")
    yield "x", (x.to(torch.int32), *fb, None, "fp8_block")
    yield "weight_data", (x, fb[0].view(torch.uint8), fb[1], None, None, "fp8_block")
    yield "weight_scale", (x, fb[0], fb[1][:, :1], None, None, "fp8_block")
    yield "weight_global_scale", (x, nv[0], nv[1], None, None, "nvfp4")
    yield "weight_global_scale", (x, fb[0], fb[1], nv[2], None, "fp8_block")
    yield "bias", (x, *fb, torch.ones(7), "fp8_block")
    yield "in_features", (x[:, :200], *fb, None, "fp8_block")


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("arg,args", list(_bad_calls()))
def test_bad_input_is_a_clear_error(arg, args, device):
    """The Rust kernel (CPU) and the fake kernel (meta) refuse the same calls, naming the op and the
    argument."""
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(RuntimeError, match=f"quantized_linear.*{arg}"):
        ops.quantized_linear(*args)


def test_not_differentiable():
    x, w, _ = _inputs((4, 256), 128, torch.float32, "cpu", 0)
    y = ops.quantized_linear(x.requires_grad_(), *_codes(w, "fp8_block"), None, "fp8_block")
    with pytest.raises(RuntimeError, match="inference only"):
        y.sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_bit_identical_on_the_gpu(recipe):
    """On the device's own table: fp8_block runs cuBLASLt's native block-scaled GEMM on sm_90,
    mxfp8/nvfp4 natively on Blackwell, emulated elsewhere; with the weight's forward operand from
    codes made on the GPU, the output equals scaled_linear's forward bit for bit."""
    for seed, (shape_x, n) in enumerate([((256, 512), 256), ((2, 128, 1024), 512)]):
        x, w, b = _inputs(shape_x, n, torch.bfloat16, "cuda", seed)
        want = ops.scaled_linear(x, w, b, recipe, None)
        got = ops.quantized_linear(x, *_codes(w, recipe), b, recipe)
        assert same_bits(got, want), (recipe, shape_x)
