"""deepwell.ops.fp8_block_swiglu_mlp: a LLaMA MLP in fp8_block with SwiGLU fused into the FP8
quantizers. Against the three-layer way it replaces (fp8_block_linear for gate and up on one
quantization of x, deepwell's `swiglu`, fp8_block_linear for down): y, d w_gate, d w_up and
d w_down bit for bit (the same quantizations and GEMMs), dx within one bf16 rounding (summed in
fp32 inside one GEMM instead of two rounded dx added), on every path (emulated, sm_90's operands
through the CPU model, the GPU) and for ordinary and extreme inputs; autograd keeps x's and h's
column codes and gate_up, never x or h; inside a weight reuse scope a weight changed in place is
quantized again; bad arguments name the op and the argument."""

from __future__ import annotations

import pytest
import torch

import deepwell
from _util import same_bits, saved_activation_bytes
from test_fp8_block_linear import _x

ops = torch.ops.deepwell
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _weights(k, f, d, dtype, device, gen):
    ws = [torch.randn(f, k, generator=gen) / k**0.5, torch.randn(f, k, generator=gen) / k**0.5,
          torch.randn(d, f, generator=gen) / f**0.5]
    return [w.to(dtype).to(device) for w in ws]


def _unfused(x, w_gate, w_up, w_down, recipe):
    """The three layers on one quantization of x, deepwell's swiglu between them."""
    codes = ops.fp8_block_quantize_rowcol(x.detach().reshape(-1, x.shape[-1]), True, True)
    a = ops.fp8_block_linear(x, w_gate, None, recipe, *codes)[0]
    b = ops.fp8_block_linear(x, w_up, None, recipe, *codes)[0]
    gate_up = torch.cat([a, b], -1)
    h = deepwell.ops.swiglu(gate_up.reshape(-1, gate_up.shape[-1])).reshape(*a.shape)
    return deepwell.fp8_block_linear(h, w_down, None, recipe)


def _step(fn, x, ws, dy):
    """fn's y and its gradients (dx, d w_gate, d w_up, d w_down)."""
    leaves = [t.clone().requires_grad_() for t in (x, *ws)]
    y = fn(*leaves)
    return (y, *torch.autograd.grad(y, leaves, dy))


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(fused, unfused):
    """y and the weights' gradients bit for bit; dx one rounding apart (NaN where the other is)."""
    for i in (0, 2, 3, 4):
        assert same_bits(fused[i].cpu(), unfused[i].cpu()), i
    dx, want = fused[1].cpu().float(), unfused[1].cpu().float()
    assert torch.equal(dx.isnan(), want.isnan()) and torch.equal(dx.isinf(), want.isinf())
    finite = dx.isfinite() & want.isfinite()
    if want[finite].abs().max() > 0:
        assert _rel(dx[finite], want[finite]) < 1e-2
    else:
        assert dx[finite].abs().max() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,f,d", [((2, 128, 256), 384, 256), ((256, 128), 256, 384)])
@pytest.mark.parametrize("case", ["ordinary", "zeros", "tiny", "outlier", "inf", "nan"])
def test_matches_the_three_layers(device, shape, f, d, case, gen):
    """On the GPU the native GEMMs the dispatch table picks per pass; on the CPU the emulation."""
    x = _x(shape, case, gen).to(device)
    ws = _weights(shape[-1], f, d, torch.bfloat16, device, gen)
    dy = torch.randn(*shape[:-1], d, generator=gen).bfloat16().to(device)
    fused = _step(lambda *a: deepwell.ops.fp8_block_swiglu_mlp(*a), x, ws, dy)
    unfused = _step(lambda *a: _unfused(*a, "fp8_block"), x, ws, dy)
    _check(fused, unfused)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["ordinary", "outlier", "nan"])
def test_native_sm90_arguments_on_the_cpu(dtype, case, gen):
    """sm_90's operands (M-major scales, gate's and up's weight tiles side by side) through the CPU
    model of its GEMMs."""
    x = _x((2, 128, 128), case, gen, dtype)
    ws = _weights(128, 256, 128, dtype, "cpu", gen)
    dy = torch.randn(2, 128, 128, generator=gen).to(dtype)
    fused = _step(lambda *a: deepwell.ops.fp8_block_swiglu_mlp(*a, recipe="fp8_block@sm_90"), x, ws, dy)
    unfused = _step(lambda *a: _unfused(*a, "fp8_block@sm_90"), x, ws, dy)
    _check(fused, unfused)


@pytest.mark.parametrize("device", DEVICES)
def test_error_against_float64(device, gen):
    """The fused MLP is as close to the float64 MLP as the three layers are (FP8's ~7% here)."""
    x = torch.randn(256, 256, generator=gen).bfloat16().to(device)
    ws = _weights(256, 384, 256, torch.bfloat16, device, gen)
    dy = torch.randn(256, 256, generator=gen).bfloat16().to(device)

    def exact(x, w_gate, w_up, w_down):
        h = torch.nn.functional.silu(x @ w_gate.t()) * (x @ w_up.t())
        return h @ w_down.t()

    want = _step(exact, x.double(), [w.double() for w in ws], dy.double())
    fused = _step(lambda *a: deepwell.ops.fp8_block_swiglu_mlp(*a), x, ws, dy)
    unfused = _step(lambda *a: _unfused(*a, "fp8_block"), x, ws, dy)
    for i, (a, b, c) in enumerate(zip(fused, unfused, want)):
        assert _rel(a, c) < 0.1 and _rel(a, c) <= _rel(b, c) * 1.01 + 1e-4, i


def test_autograd_keeps_codes_and_gate_up_not_x_or_h(gen):
    """Saved for backward: x^T's codes and scales, gate_up (bf16, what SwiGLU's gradient reads), h^T's
    codes and scales; never x or h."""
    m, k, f = 256, 256, 384
    x = torch.randn(m, k, generator=gen).bfloat16().requires_grad_()
    mlp = torch.nn.ModuleList(torch.nn.Linear(*s, bias=False, dtype=torch.bfloat16) for s in ((k, f), (k, f), (f, k)))
    saved = saved_activation_bytes(lambda t: deepwell.ops.fp8_block_swiglu_mlp(t, *(l.weight for l in mlp)), x, mlp)
    codes = lambda rows, cols: rows * cols + (cols // 128) * rows * 4  # noqa: E731
    assert saved == codes(k, m) + m * 2 * f * 2 + codes(f, m)


@pytest.mark.parametrize("device", DEVICES)
def test_inside_a_weight_reuse_scope(device, gen):
    """Inside deepwell.microbatches() each weight's operands come from the weight cache (the joined
    gate_up operand is made per call from them): the same bits on a hit, and a weight changed in
    place between calls (the optimizer's step) is quantized again, never read stale."""
    x = torch.randn(256, 128, generator=gen).bfloat16().to(device)
    ws = _weights(128, 256, 128, torch.bfloat16, device, gen)
    dy = torch.randn(256, 128, generator=gen).bfloat16().to(device)

    def run():
        return _step(lambda t, *w: deepwell.ops.fp8_block_swiglu_mlp(t, *w), x, ws, dy)

    before = [w.clone() for w in ws]
    with deepwell.microbatches():
        first, again = run(), run()
        for w in ws:
            w.mul_(-0.5)  # the optimizer's in-place step, on every weight
        after = run()
    want_after = run()
    for w, b in zip(ws, before):
        w.copy_(b)
    want_first = run()
    for a, b, c in zip(first, again, want_first):
        assert same_bits(a.cpu(), c.cpu()) and same_bits(b.cpu(), c.cpu())
    for a, b in zip(after, want_after):
        assert same_bits(a.cpu(), b.cpu())
    assert not same_bits(first[0].cpu(), after[0].cpu())


def test_only_the_wanted_gradients(gen):
    """Frozen weights (no weight gradient) or an input without grad: the other gradients unchanged."""
    x = torch.randn(128, 128, generator=gen).bfloat16()
    ws = _weights(128, 256, 128, torch.bfloat16, "cpu", gen)
    dy = torch.randn(128, 128, generator=gen).bfloat16()
    full = _step(lambda *a: deepwell.ops.fp8_block_swiglu_mlp(*a), x, ws, dy)
    xl = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(deepwell.ops.fp8_block_swiglu_mlp(xl, *ws), (xl,), dy)
    assert same_bits(dx, full[1])
    wl = [w.clone().requires_grad_() for w in ws]
    grads = torch.autograd.grad(deepwell.ops.fp8_block_swiglu_mlp(x, *wl), wl, dy)
    for a, b in zip(grads, full[2:]):
        assert same_bits(a, b)


def test_errors_name_the_op_and_argument(gen):
    x = torch.randn(256, 128)
    wg, wu, wd = torch.randn(256, 128), torch.randn(256, 128), torch.randn(128, 256)
    codes = ops.fp8_block_quantize_rowcol(x, True, True)
    op = ops.fp8_block_swiglu_mlp
    with pytest.raises(RuntimeError, match=r"fp8_block_swiglu_mlp: argument 'recipe' must be 'fp8_block'"):
        op(x, *codes, wg, wu, wd, "mxfp8")
    with pytest.raises(RuntimeError, match=r"fp8_block_swiglu_mlp: w_up has shape \[128, 128\] but w_gate has \[256, 128\]"):
        op(x, *codes, wg, wu[:128], wd)
    with pytest.raises(RuntimeError, match=r"fp8_block_swiglu_mlp: w_down has in_features 128 .* but w_gate has out_features 256"):
        op(x, *codes, wg, wu, torch.randn(128, 128))
    with pytest.raises(RuntimeError, match=r"fp8_block_swiglu_mlp: x has 256 features .* but w_gate has in_features 128"):
        op(torch.randn(256, 256), *codes, wg, wu, wd)
    with pytest.raises(RuntimeError, match=r"fp8_block_swiglu_mlp: argument 'w_down' must have size\(dim=0\) divisible by 128"):
        op(x, *codes, wg, wu, torch.randn(100, 256))
    with pytest.raises(RuntimeError, match=r"fp8_block_swiglu_mlp: argument 'x_codes_t' must have shape \[128, 256\]"):
        op(x, codes[0], codes[1], codes[0], codes[3], wg, wu, wd)
    _, gate_up, h_t, h_s = op(x, *codes, wg, wu, wd)
    back = ops.fp8_block_swiglu_mlp_backward
    dy = torch.randn(256, 128)
    with pytest.raises(RuntimeError, match=r"fp8_block_swiglu_mlp_backward: argument 'gate_up' must have shape \[256, 512\]"):
        back(dy, codes[2], codes[3], gate_up[:, :256], h_t, h_s, wg, wu, wd, "fp8_block", True, True)
    with pytest.raises(RuntimeError, match=r"fp8_block_swiglu_mlp_backward: argument 'h_scale_inv_t' must have shape \[2, 256\]"):
        back(dy, codes[2], codes[3], gate_up, h_t, h_s.t(), wg, wu, wd, "fp8_block", True, True)
    with pytest.raises(RuntimeError, match=r"fp8_block_swiglu_mlp_backward: grad_out has 64 features"):
        back(torch.randn(256, 64), codes[2], codes[3], gate_up, h_t, h_s, wg, wu, wd, "fp8_block", True, True)
