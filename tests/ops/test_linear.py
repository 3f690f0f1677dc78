"""The low-precision linear layers (torch.ops.deepwell.scaled_linear / mxfp8_linear): forward and
gradients against a float64 model of the same quantized maths (tests/reference/linear.py), against
unquantized float64 maths within each recipe's documented error budget, and the autograd plumbing
(needs_input_grad, leading dims, eager vs torch.compile). opcheck runs on the cases in op_cases.py
(test_opcheck.py); bad inputs are in test_errors.py; the weight cache in test_weight_cache.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import deepwell
from _util import same_bits
from reference import linear as ref

RECIPES = ("mxfp8", "fp8_block", "fp8_tensor", "nvfp4", "bf16")
ops = torch.ops.deepwell


def _inputs(gen, m, k, n, dtype=torch.float32, spread=True):
    """x (m, k) with rows of different magnitudes (so block scales differ), W (n, k), b (n), dy (m, n)."""
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    if spread:
        x = x * torch.pow(2.0, torch.randint(-6, 7, (m, 1), generator=gen)).double()
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / k**0.5
    b = torch.randn(n, generator=gen, dtype=torch.float64)
    dy = torch.randn(m, n, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, w, b, dy)]


def _np64(t) -> np.ndarray:
    return t.detach().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)


def _rel(a, b) -> float:
    a, b = _np64(a), _np64(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _f32(t):
    return t.detach().float().numpy()


def _run(x, w, b, dy, recipe, seed=11, device="cpu"):
    """Forward and backward through the op on `device`; returns (y, dx, dw, db) on the CPU."""
    x, w = (t.detach().to(device).clone().requires_grad_() for t in (x, w))
    b = None if b is None else b.detach().to(device).clone().requires_grad_()
    y = ops.scaled_linear(x, w, b, recipe, seed)
    y.backward(dy.to(device))
    grads = (x.grad, w.grad, None if b is None else b.grad)
    return tuple(None if t is None else t.cpu() for t in (y.detach(), *grads))


# (m, k, n): m a block multiple; m not a multiple of 32/128 (wgrad unquantized); K % 512 == 0 (sm_90's
# native fp8_block fprop; dgrad there needs N % 512 too: (256, 512, 512) runs all three natively).
SHAPES = [(128, 128, 256), (96, 256, 128), (256, 512, 128), (256, 512, 512)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _tolerance(device: str, recipe: str) -> float:
    """Emulated GEMMs multiply exactly representable values with fp32 accumulation (the CPU in fp32,
    cuBLAS in bf16 x bf16 -> fp32). cuBLASLt's native FP8 GEMMs accumulate in the tensor cores'
    reduced-precision adders between fp32 promotions, measured ~1e-4 here: bound 2e-3."""
    if device == "cuda" and recipe in ("fp8_block", "fp8_tensor") and torch.cuda.get_device_capability() == (9, 0):
        return 2e-3
    return 2e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_the_float64_model_of_the_recipe(device, recipe, m, k, n, gen):
    """fp32 inputs: the only difference from the float64 model is the GEMM's accumulation."""
    x, w, b, dy = _inputs(gen, m, k, n)
    y, dx, dw, db = _run(x, w, b, dy, recipe, seed=11, device=device)
    y_ref = ref.forward(_f32(x), _f32(w), _f32(b), recipe)
    dx_ref, dw_ref = ref.backward(_f32(dy), _f32(x), _f32(w), recipe, seed=11)
    tol = _tolerance(device, recipe)
    assert _rel(y, y_ref) < tol
    assert _rel(dx, dx_ref) < tol
    assert _rel(dw, dw_ref) < tol
    assert _rel(db, _f32(dy).astype(np.float64).sum(0)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_bf16_training_shapes_match_the_model(recipe, gen):
    """bf16 inputs and outputs on the GPU (the fused-bias cuBLAS / cuBLASLt paths), 3-D x."""
    x, w, b, dy = _inputs(gen, 512, 1024, 512, dtype=torch.bfloat16)
    x3, dy3 = x.reshape(2, 256, 1024), dy.reshape(2, 256, 512)
    y, dx, dw, db = _run(x3, w, b, dy3, recipe, seed=4, device="cuda")
    y_ref = ref.forward(_f32(x), _f32(w), _f32(b), recipe)
    dx_ref, dw_ref = ref.backward(_f32(dy), _f32(x), _f32(w), recipe, seed=4)
    # bf16 outputs: one rounding (2^-9 relative) on top of the accumulation.
    assert _rel(y.reshape(512, 512), y_ref) < 5e-3
    assert _rel(dx.reshape(512, 1024), dx_ref) < 5e-3
    assert _rel(dw, dw_ref) < 5e-3


# Norm-wise relative error vs unquantized float64 maths on Gaussian data, upper bounds (measured
# means on CPU: bf16 ~2e-3, mxfp8 and fp8_block ~3-4e-2, nvfp4 ~0.10-0.15; docs/OPS.md "Linear layers").
ERROR_BUDGET = {"bf16": 1e-2, "mxfp8": 6e-2, "fp8_block": 6e-2, "fp8_tensor": 0.1, "nvfp4": 0.25}


@pytest.mark.parametrize("recipe", RECIPES)
def test_error_vs_unquantized_maths_is_within_the_recipe_budget(recipe, gen):
    x, w, b, dy = _inputs(gen, 256, 256, 128, dtype=torch.bfloat16, spread=False)
    y, dx, dw, _ = _run(x, w, b, dy, recipe)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    y64 = xd @ wd.T + b.double()
    budget = ERROR_BUDGET[recipe]
    errs = {"y": _rel(y.double(), y64), "dx": _rel(dx.double(), dyd @ wd), "dw": _rel(dw.double(), dyd.T @ xd)}
    assert all(e < budget for e in errs.values()), errs
    if recipe in ("mxfp8", "fp8_block"):
        # The target: within 5e-2 of bf16's own error.
        _, _, _, _ = bf = _run(x, w, b, dy, "bf16")
        assert errs["y"] - _rel(bf[0].double(), y64) < 5e-2


def test_bf16_recipe_is_the_bf16_linear(gen):
    """bf16 on the CPU: bf16-rounded operands, fp32 accumulation, rounded once to bf16."""
    x, w, b, dy = _inputs(gen, 64, 64, 32, dtype=torch.bfloat16)
    y = ops.scaled_linear(x, w, b, "bf16")
    want = (x.float() @ w.float().T + b.float()).bfloat16()
    assert (y.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7


def test_mxfp8_linear_is_scaled_linear_mxfp8(gen):
    x, w, b, dy = _inputs(gen, 64, 64, 32, dtype=torch.bfloat16)
    assert same_bits(ops.mxfp8_linear(x, w, b), ops.scaled_linear(x, w, b, "mxfp8"))
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops.mxfp8_linear(xa, wa).backward(dy)
    _, dx, dw, _ = _run(x, w, None, dy, "mxfp8")
    assert same_bits(xa.grad, dx) and same_bits(wa.grad, dw)


def test_leading_dims_and_views(gen):
    """x of any leading dims, non-contiguous or offset, gives the 2-D result reshaped."""
    base = torch.randn(3, 5, 64, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    x = base[1:, :, 2]  # (2, 5, 64): a view with a storage offset, not contiguous
    y = ops.scaled_linear(x, w, None, "mxfp8")
    assert y.shape == (2, 5, 32)
    assert same_bits(y, ops.scaled_linear(x.reshape(10, 64).contiguous(), w, None, "mxfp8").reshape(2, 5, 32))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_needs_input_grad_is_respected(recipe, gen):
    x, w, b, dy = _inputs(gen, 32, 64, 32)
    for need_x, need_w in [(True, False), (False, True)]:
        xa, wa = x.clone().requires_grad_(need_x), w.clone().requires_grad_(need_w)
        ops.scaled_linear(xa, wa, None, recipe, 5).backward(dy)
        assert (xa.grad is not None) == need_x and (wa.grad is not None) == need_w
        _, dx, dw, _ = _run(x, w, None, dy, recipe, seed=5)
        if need_x:
            assert same_bits(xa.grad, dx)
        if need_w:
            assert same_bits(wa.grad, dw)


def test_dtypes_follow_the_inputs(gen):
    """y and dx in x's dtype, dW in W's dtype (mixed, as under autocast), db in b's dtype."""
    x = torch.randn(32, 64, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(32, 64, generator=gen).requires_grad_()
    b = torch.randn(32, generator=gen).requires_grad_()
    y = ops.scaled_linear(x, w, b, "mxfp8")
    y.sum().backward()
    assert (y.dtype, x.grad.dtype, w.grad.dtype, b.grad.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)


def test_nvfp4_stochastic_rounding_seeds(gen):
    """A given seed reproduces the gradients; no seed draws a fresh one per backward (manual_seed
    restarts the sequence)."""
    x, w, b, dy = _inputs(gen, 32, 32, 32)
    a = _run(x, w, None, dy, "nvfp4", seed=3)
    assert same_bits(a[1], _run(x, w, None, dy, "nvfp4", seed=3)[1])
    deepwell.manual_seed(1)
    r1 = _run(x, w, None, dy, "nvfp4", seed=None)[1]
    r2 = _run(x, w, None, dy, "nvfp4", seed=None)[1]
    deepwell.manual_seed(1)
    r1_again = _run(x, w, None, dy, "nvfp4", seed=None)[1]
    assert not same_bits(r1, r2)
    assert same_bits(r1, r1_again)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block", "nvfp4"])
def test_eager_and_compiled_training_step_agree(recipe, gen):
    """A small MLP step through torch.compile(fullgraph=True): same outputs and gradients. relu and
    a sum keep Inductor's code bit-identical to eager around the ops (a gelu an ulp apart can flip a
    quantized code at a rounding boundary, which is not what this test is about)."""
    k = 128
    x = torch.randn(4, 32, k, generator=gen)
    w1, w2 = (torch.randn(k, k, generator=gen) / k**0.5 for _ in range(2))

    def step(x, w1, w2):
        h = torch.relu(ops.scaled_linear(x, w1, None, recipe, 1))
        return ops.scaled_linear(h, w2, None, recipe, 2).sum()

    outs = []
    for f in (step, torch.compile(step, fullgraph=True)):
        a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        loss = f(x, a, b)
        loss.backward()
        outs.append((loss.detach(), a.grad, b.grad))
    torch._dynamo.reset()
    (loss_e, *grads_e), (loss_c, *grads_c) = outs
    assert torch.allclose(loss_e, loss_c, rtol=1e-4, atol=1e-3)  # the sum's order may differ
    for e, c in zip(grads_e, grads_c):
        assert same_bits(e, c)


@pytest.mark.gpu
def test_cuda_mixed_devices_are_refused(gen):
    x = torch.randn(4, 64, generator=gen).cuda()
    w = torch.randn(32, 64, generator=gen)
    with pytest.raises(RuntimeError, match="deepwell.scaled_linear: argument 'weight' must be on a CUDA device"):
        ops.scaled_linear(x, w, None, "mxfp8")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_matches_cpu(recipe, gen):
    """Same operands on both devices (the quantizers are bit-exact); only accumulation differs."""
    x, w, b, dy = _inputs(gen, 256, 512, 512)
    cpu = _run(x, w, b, dy, recipe, seed=9)
    gpu = _run(x, w, b, dy, recipe, seed=9, device="cuda")
    tol = _tolerance("cuda", recipe)
    for c, g in zip(cpu, gpu):
        assert _rel(g, c) < tol


@pytest.mark.parametrize(
    "arch,recipe",
    [("sm_100", "mxfp8"), ("sm_100", "nvfp4"), ("sm_120", "mxfp8"), ("sm_90", "fp8_block"), ("sm_90", "fp8_tensor")],
)
def test_native_gemm_arguments_on_the_cpu(arch, recipe, gen):
    """The native paths, run on the CPU: dispatch as `arch` would, build its `_scaled_mm_v2`
    arguments (swizzled E8M0 / E4M3 scales, float4_e2m1fn_x2 data, the NVFP4 global scale, sm_90's
    M-major and transposed fp32 scales), decode them with the CPU model of `_scaled_mm_v2`, and get
    the float64 model's answer: the argument construction of GPUs we do not have is tested here."""
    x, w, b, dy = _inputs(gen, 256, 512, 512)
    with deepwell.microbatches():
        native = _run(x, w, b, dy, f"{recipe}@{arch}", seed=6)
        emulated = _run(x, w, b, dy, recipe, seed=6)
        # The two runs cached the weight in two operand forms: the native path really ran.
        assert deepwell.weight_cache_info()["entries"] == 2
    y_ref = ref.forward(_f32(x), _f32(w), _f32(b), recipe)
    dx_ref, dw_ref = ref.backward(_f32(dy), _f32(x), _f32(w), recipe, seed=6)
    for got, want, emu in zip(native[:3], (y_ref, dx_ref, dw_ref), emulated[:3]):
        assert _rel(got, want) < 2e-6
        assert _rel(got, emu) < 2e-6


@pytest.mark.parametrize("recipe", ["fp8_block@sm_9x", "fp8_block@", "mxfp8@sm_100@sm_90", "fp8_block@gpu"])
def test_modelled_arch_must_be_known(recipe, gen):
    x, w, b, dy = _inputs(gen, 128, 128, 128)
    quoted = recipe.replace("@", "@")
    with pytest.raises(RuntimeError, match=f"argument 'recipe' must name a known GPU after '@'.*got \"{quoted}\""):
        ops.scaled_linear(x, w, b, recipe, None)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx, fw, fb = (mode.from_tensor(t) for t in (x, w, b))
        with pytest.raises(RuntimeError, match="must name a known GPU after '@'"):
            ops.scaled_linear(fx, fw, fb, recipe, None)


@pytest.mark.gpu
def test_modelled_arch_only_on_the_cpu(gen):
    x, w, b, _ = (t.cuda() for t in _inputs(gen, 128, 128, 128))
    with pytest.raises(RuntimeError, match="must name a GPU to model after '@' only for CPU tensors"):
        ops.scaled_linear(x, w, b, "fp8_block@sm_90", None)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(256, 512, 1024), (384, 1024, 512)])  # every pass native (K % 512)
def test_sm90_fp8_block_passes_bit_identical_to_the_public_quantizers(m, k, n, gen):
    """On sm_90 each fp8_block pass's operands come from internal one-pass kernels (x and dy along
    the tokens without a row copy; W^T's 128x128 blocks from one transposing read of W). Every
    output must equal, bit for bit, the same cuBLASLt GEMMs fed by the public quantizers: the row
    and transposed copies of fp8_block_quantize_rowcol and W's 128x128 copy transposed."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90's native blockwise GEMM")
    x, w, _, dy = (t.cuda().bfloat16() for t in _inputs(gen, m, k, n))
    st, mm = torch.nn.functional.ScalingType, torch.nn.functional.scaled_mm

    def m_major(s):
        return s.t().contiguous().t()

    xr, xs, xc, xcs = ops.fp8_block_quantize_rowcol(x)
    dr, ds, dc, dcs = ops.fp8_block_quantize_rowcol(dy)
    wq, ws = ops.fp8_block_quantize(w, 128, 128)
    wt, wts = wq.t().contiguous(), ws.t().contiguous()
    tiles, rows = st.BlockWise128x128, st.BlockWise1x128
    y = mm(xr, wq.t(), m_major(xs), rows, ws.t(), tiles, output_dtype=torch.bfloat16)
    dx = mm(dr, wt.t(), m_major(ds), rows, wts.t(), tiles, output_dtype=torch.bfloat16)
    dw = mm(dc, xc.t(), m_major(dcs), rows, m_major(xcs), rows, output_dtype=torch.bfloat16)
    got_y = ops.scaled_linear(x, w, None, "fp8_block", None)
    got_dx, got_dw = ops.scaled_linear_backward(dy, x, w, "fp8_block", None, True, True)
    for got, want in ((got_y, y), (got_dx, dx), (got_dw, dw)):
        assert same_bits(got, want)
