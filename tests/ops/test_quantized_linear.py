"""deepwell.quantized_linear: the forward of scaled_linear from a weight's stored codes, and
quantized_linear_backward, its backward from fp8_block codes (FSDP2's FP8 all-gather). The slow,
obviously-correct paths they must equal bit for bit are scaled_linear's own forward and
scaled_linear_backward on the weight the codes came from (they quantize that weight in the call),
on the CPU's table, on the CPU models of the GPUs' native GEMMs ("recipe@arch") and on the GPU."""

from __future__ import annotations

import pytest
import torch

from _util import same_bits
from deepwell.artifact.quantized import quantize_weight

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


@pytest.mark.parametrize("arch", ["", "@sm_90", "@sm_100"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_bit_identical_to_scaled_linear_backward(arch, dtype):
    """dx and dW from the codes equal scaled_linear_backward's on the weight, whichever gradients
    are asked for. The shapes cover every form of W^T's operand on sm_90: fprop and dgrad both
    emulated (K, N < 512: a transposed view of the dequantized W), fprop native and dgrad emulated
    (the dequantized W^T), both native (cuBLASLt's 128x128 W^T tiles, the codes transposed)."""
    for seed, (shape_x, n) in enumerate([((64, 256), 128), ((8, 512), 256), ((2, 4, 512), 512), ((4, 256), 512)]):
        x, w, _ = _inputs(shape_x, n, dtype, "cpu", seed)
        dy = _inputs((*shape_x[:-1], n), n, dtype, "cpu", seed + 10)[0]
        data, scale, _ = _codes(w, "fp8_block")
        for need in [(True, True), (True, False), (False, True)]:
            want = ops.scaled_linear_backward(dy, x, w, "fp8_block" + arch, None, *need)
            got = ops.quantized_linear_backward(dy, x, data, scale, "fp8_block" + arch, w.dtype, *need)
            assert all(same_bits(a, b) for a, b in zip(got, want)), (arch, shape_x, n, need)


def test_backward_gradient_dtype():
    x, w, _ = _inputs((4, 256), 128, torch.bfloat16, "cpu", 0)
    dx, dw = ops.quantized_linear_backward(torch.ones(4, 128, dtype=torch.bfloat16), x, *_codes(w, "fp8_block")[:2],
                                           "fp8_block", torch.float32, True, True)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32 and dw.shape == (128, 256)


def _bad_backward_calls():
    x, w, _ = _inputs((4, 256), 128, torch.float32, "cpu", 0)
    dy = torch.ones(4, 128)
    data, scale, _ = _codes(w, "fp8_block")
    f32 = torch.float32
    yield "recipe", (dy, x, data, scale, "mxfp8", f32, True, True)
    yield "recipe", (dy, x, data, scale, "fp8_block@sm_999x", f32, True, True)
    yield "weight_dtype", (dy, x, data, scale, "fp8_block", torch.int32, True, True)
    yield "grad_out", (dy[:, :64], x, data, scale, "fp8_block", f32, True, True)
    yield "grad_out", (dy.to(torch.int32), x, data, scale, "fp8_block", f32, True, True)
    yield "weight_data", (dy, x, data.view(torch.uint8), scale, "fp8_block", f32, True, True)
    yield "weight_scale", (dy, x, data, scale[:, :1], "fp8_block", f32, True, True)
    yield "in_features", (dy, x[:, :200], data, scale, "fp8_block", f32, True, True)


@pytest.mark.parametrize("arg,args", list(_bad_backward_calls()))
def test_backward_bad_input_is_a_clear_error(arg, args):
    """The Rust kernel and the fake kernel refuse the same calls with the same message, naming the
    op and the argument."""
    messages = []
    for device in ("cpu", "meta"):
        on = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        with pytest.raises(RuntimeError, match=f"quantized_linear_backward.*{arg}") as e:
            ops.quantized_linear_backward(*on)
        messages.append(str(e.value).splitlines()[0])
    assert messages[0] == messages[1]


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
def test_backward_bit_identical_on_the_gpu():
    """On the device's own table (sm_90: cuBLASLt's blockwise dgrad on the codes transposed, a
    1-byte transpose on the GPU; elsewhere emulated), dx and dW from the codes made on the GPU equal
    scaled_linear_backward's bit for bit."""
    for seed, (shape_x, n) in enumerate([((256, 512), 256), ((2, 128, 1024), 512), ((256, 512), 512)]):
        x, w, _ = _inputs(shape_x, n, torch.bfloat16, "cuda", seed)
        dy = _inputs((*shape_x[:-1], n), n, torch.bfloat16, "cuda", seed + 10)[0]
        data, scale, _ = _codes(w, "fp8_block")
        want = ops.scaled_linear_backward(dy, x, w, "fp8_block", None, True, True)
        got = ops.quantized_linear_backward(dy, x, data, scale, "fp8_block", w.dtype, True, True)
        assert all(same_bits(a, b) for a, b in zip(got, want)), shape_x


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
