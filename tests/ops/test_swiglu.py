"""deepwell.swiglu, swiglu_backward and the fused FP8-block quantizers (docs/NUMERICS.md "SwiGLU").

- The activation and its gradient against float64 within one rounding to the dtype; special values
  as the formula gives them; autograd through `swiglu` is `swiglu_backward`, eager and compiled.
- `fp8_block_swiglu_quantize_rowcol(gate_up)` is `fp8_block_quantize_rowcol(swiglu(gate_up))` bit
  for bit, and the backward one `fp8_block_quantize_rowcol(swiglu_backward(gate_up, dh))`, on every
  dtype, both scale rules, zeros, saturating and non-finite inputs, and strided views.
- GPU: every op bit-identical to the CPU reference (the op_cases sweep of test_cuda_kernels.py does
  the small cases; here large ones, the scalar path, the fused kernels against the two-pass way,
  and every 16-bit gate value and fp32's exp range ends through all four kernels).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _util import FLOAT_DTYPES, same_bits

ops = torch.ops.deepwell
#: One rounding to the dtype (half an ulp, relative) plus the fp32 maths' few ulps.
REL = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-21}
#: The dtype's subnormal spacing: below the normal range the rounding is absolute.
TINY = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}


def _gate_up(rows, f, dtype=torch.bfloat16, seed=0, scale=3.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * f, generator=g) * scale).to(dtype).to(device)


def _dh(rows, f, dtype=torch.bfloat16, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, f, generator=g).to(dtype).to(device)


def _float64(gate_up, dh):
    """silu(g) * u and its gradient in float64, and the size of the terms each sums (where
    silu'(g) = s * (1 + g * (1 - s)) cancels near g = -1.28, fp32's error is relative to them)."""
    g, u = gate_up.double().chunk(2, dim=-1)
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = F.silu(g) * u
    dg, du = torch.autograd.grad(h, (g, u), dh.double())
    s = torch.sigmoid(g.detach())
    terms = (dh.double() * u.detach() * s).abs() * (1 + (g.detach() * (1 - s)).abs())
    return h.detach(), torch.cat([dg, du], dim=-1), torch.cat([terms, du.abs()], dim=-1)


def _within_one_rounding(got, want, dtype, terms=None):
    err = (got.double() - want).abs()
    bound = want.abs() * REL[dtype] + 16 * 2**-24 * (want.abs() if terms is None else terms) + TINY[dtype]
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_forward_and_gradient_match_float64(dtype):
    gate_up, dh = _gate_up(64, 96, dtype), _dh(64, 96, dtype)
    want_h, want_d, terms = _float64(gate_up, dh)
    # Half an ulp of the dtype (the one rounding) plus a few ulps of fp32 (the maths).
    _within_one_rounding(ops.swiglu(gate_up), want_h, dtype)
    _within_one_rounding(ops.swiglu_backward(gate_up, dh), want_d, dtype, terms)


def test_special_values():
    g = torch.tensor([-100.0, float("inf"), float("-inf"), float("nan"), 0.0, 2.0, 1.0])
    u = torch.tensor([1.0, 1.0, 1.0, 1.0, 5.0, float("nan"), 0.0])
    h = ops.swiglu(torch.cat([g, u])[None])[0]
    # e^100 overflows, so sigmoid(-100) = 0 and silu(-100) = -0 (torch's silu gives -0 too).
    assert h[0].item() == 0.0 and torch.signbit(h[0])
    assert h[1].item() == float("inf")
    assert h[2:4].isnan().all() and h[5].isnan()  # -Inf * 0, NaN in, NaN up
    assert h[4].item() == 0.0 and h[6].item() == 0.0
    d = ops.swiglu_backward(torch.tensor([[0.0, 2.0]]), torch.tensor([[1.0]]))
    assert d.tolist() == [[1.0, 0.0]]  # silu'(0) = 1/2 times u = 2; d up = silu(0) = 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autograd_is_swiglu_backward(compiled):
    gate_up, dh = _gate_up(32, 64), _dh(32, 64)
    fn = ops.swiglu
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(lambda t: ops.swiglu(t), fullgraph=True)
    x = gate_up.clone().requires_grad_()
    h = fn(x)
    h.backward(dh)
    assert same_bits(h.detach(), ops.swiglu(gate_up))
    assert same_bits(x.grad, ops.swiglu_backward(gate_up, dh))


def test_double_backward_is_refused():
    x = _gate_up(4, 8).requires_grad_()
    (d,) = torch.autograd.grad(ops.swiglu(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"deepwell.swiglu_backward: double backward"):
        d.sum().backward()


def test_empty_rows():
    assert ops.swiglu(torch.empty(0, 256)).shape == (0, 128)
    assert ops.swiglu_backward(torch.empty(0, 256), torch.empty(0, 128)).shape == (0, 256)


def _rowcol_equal(got, want):
    assert len(got) == len(want) == 4
    for i, (a, b) in enumerate(zip(got, want)):
        assert same_bits(a, b), f"output {i} differs"


def _hostile(rows, f, dtype, seed):
    """Random values with zeros, saturating magnitudes (E4M3's 448 and far beyond), NaN and Inf
    spread over different 128-blocks of the gate and up halves."""
    gu = _gate_up(rows, f, dtype, seed)
    gu[3, 5] = 0.0
    gu[0:128, 130] = 0.0  # a whole column of zeros in the gate half
    gu[7, 2] = 3e4 if dtype != torch.float16 else 6e4
    gu[9, f + 3] = -5e4 if dtype != torch.float16 else -6e4
    gu[130 % rows, 200] = float("nan")
    gu[17, f + 140] = float("inf")
    gu[20, 150] = float("-inf")
    return gu


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
def test_fused_quantizers_are_rowcol_of_swiglu(dtype, pow2):
    gate_up = _hostile(256, 384, dtype, seed=3)
    dh = _dh(256, 384, dtype)
    dh[5, 7], dh[200, 300] = float("nan"), 1e4 if dtype != torch.float16 else 6e4
    _rowcol_equal(
        ops.fp8_block_swiglu_quantize_rowcol(gate_up, pow2), ops.fp8_block_quantize_rowcol(ops.swiglu(gate_up), pow2)
    )
    _rowcol_equal(
        ops.fp8_block_swiglu_backward_quantize_rowcol(gate_up, dh, pow2),
        ops.fp8_block_quantize_rowcol(ops.swiglu_backward(gate_up, dh), pow2),
    )


def test_fused_quantizers_take_views():
    gate_up, dh = _gate_up(128, 256), _dh(128, 256)
    view = torch.zeros(128, 1024, dtype=gate_up.dtype)[:, ::2]
    view.copy_(gate_up)
    _rowcol_equal(ops.fp8_block_swiglu_quantize_rowcol(view), ops.fp8_block_swiglu_quantize_rowcol(gate_up))
    dht = dh.t().contiguous().t()
    _rowcol_equal(
        ops.fp8_block_swiglu_backward_quantize_rowcol(view, dht),
        ops.fp8_block_swiglu_backward_quantize_rowcol(gate_up, dh),
    )


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ops.swiglu(torch.randn(4, 5)), r"argument 'gate_up' must have size\(dim=1\) divisible by 2"),
        (lambda: ops.swiglu(torch.randn(2, 4, 6)), r"argument 'gate_up' must be 2-d \(rows, 2 \* ffn\)"),
        (lambda: ops.swiglu(torch.zeros(4, 6, dtype=torch.int32)), r"argument 'gate_up' must have dtype"),
        (lambda: ops.swiglu_backward(torch.randn(4, 6), torch.randn(4, 4)),
         r"argument 'grad' must have shape \[4, 3\]"),
        (lambda: ops.swiglu_backward(torch.randn(4, 6), torch.randn(4, 3).bfloat16()),
         r"argument 'grad' must have dtype torch.float32, got torch.bfloat16"),
        (lambda: ops.fp8_block_swiglu_quantize_rowcol(torch.randn(128, 384)),
         r"argument 'gate_up' must have size\(dim=1\) divisible by 256 \(gate and up are each whole 128-column"),
        (lambda: ops.fp8_block_swiglu_backward_quantize_rowcol(torch.randn(64, 256), torch.randn(64, 128)),
         r"argument 'gate_up' must have size\(dim=0\) divisible by 128"),
        (lambda: ops.fp8_block_swiglu_quantize_rowcol(torch.empty(0, 256)),
         r"argument 'gate_up' must be non-empty"),
    ],
    ids=["odd-width", "3d", "int", "grad-shape", "grad-dtype", "fused-width", "fused-rows", "fused-empty"],
)
def test_bad_input_names_the_op_and_argument(call, match):
    with pytest.raises(RuntimeError, match=r"deepwell\.\w+: " + match):
        call()


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gpu_activation_matches_cpu(dtype):
    for rows, f, offset in ((1000, 704, 0), (37, 100, 0), (64, 128, 1)):  # vector, odd width, misaligned
        gate_up, dh = _gate_up(rows, f, dtype, seed=rows), _dh(rows, f, dtype)
        gate_up[1, 3], dh[2, 5] = float("nan"), float("inf")
        g_cuda = torch.zeros(gate_up.numel() + offset, dtype=dtype, device="cuda")[offset:].view_as(gate_up)
        g_cuda.copy_(gate_up)
        assert same_bits(ops.swiglu(g_cuda).cpu(), ops.swiglu(gate_up))
        assert same_bits(ops.swiglu_backward(g_cuda, dh.cuda()).cpu(), ops.swiglu_backward(gate_up, dh))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gpu_fused_quantizers_match_cpu_and_the_two_pass_way(dtype):
    # 4096 x 5632: more walk steps than CTAs (1408 against at most 8 a SM), so each CTA's copies
    # run ahead into its next tile (swiglu.cuh's ring); offset 1: inputs off 16-byte alignment, the
    # register path.
    for rows, f, offset in ((256, 384, 0), (1024, 1408, 0), (4096, 5632, 0), (256, 384, 1)):
        gate_up, dh = _hostile(rows, f, dtype, seed=rows), _dh(rows, f, dtype)
        gc = torch.empty(gate_up.numel() + offset, dtype=dtype, device="cuda")[offset:].view_as(gate_up)
        dc = torch.empty(dh.numel() + offset, dtype=dtype, device="cuda")[offset:].view_as(dh)
        gc.copy_(gate_up), dc.copy_(dh)
        fused = ops.fp8_block_swiglu_quantize_rowcol(gc)
        _rowcol_equal(fused, ops.fp8_block_quantize_rowcol(ops.swiglu(gc)))
        _rowcol_equal([t.cpu() for t in fused], ops.fp8_block_swiglu_quantize_rowcol(gate_up))
        back = ops.fp8_block_swiglu_backward_quantize_rowcol(gc, dc)
        _rowcol_equal(back, ops.fp8_block_quantize_rowcol(ops.swiglu_backward(gc, dc)))
        _rowcol_equal([t.cpu() for t in back], ops.fp8_block_swiglu_backward_quantize_rowcol(gate_up, dh))


def _every_16_bit_gate(dtype):
    """gate_up (512, 256), f = 128, whose gates are every 16-bit pattern of `dtype` once (zeros,
    subnormals, the values whose e^-g overflows, underflows or lands on a subnormal, NaN, Inf), ups
    random."""
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(512, 128)
    return torch.cat([gates, _dh(512, 128, dtype, seed=3)], dim=1)


def _exp_boundaries():
    """fp32 gates g around exp_f32(-g)'s range ends (-g > 88.72284: Inf; -g < -103.97208: 0;
    between -103.97 and -87.34 a subnormal result), every ulp near each end, and a sweep of
    [-110, 110]: gate_up (512, 256)."""
    ends = torch.tensor([-88.72284, 103.97208, 87.33655], dtype=torch.float32)
    near = (ends.view(torch.int32)[:, None] + torch.arange(-64, 64, dtype=torch.int32)).view(torch.float32)
    sweep = torch.linspace(-110.0, 110.0, 512 * 128 - near.numel(), dtype=torch.float32)
    gates = torch.cat([near.flatten(), sweep]).reshape(512, 128)
    return torch.cat([gates, _dh(512, 128, torch.float32, seed=3)], dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bfloat16", "float16", "float32 exp ends"])
def test_gpu_every_gate_value_matches_cpu(case):
    """exp_f32 and the sigmoid on the GPU against the CPU reference over every 16-bit gate value
    (and fp32's range ends): the activation, its gradient, and both fused quantizers, bit for bit.
    The quantizers see the finite gates only, so that the blocks' scales stay finite."""
    gate_up = _exp_boundaries() if case.startswith("float32") else _every_16_bit_gate(getattr(torch, case))
    dh = _dh(512, 128, gate_up.dtype, seed=4)
    gc, dc = gate_up.cuda(), dh.cuda()
    assert same_bits(ops.swiglu(gc).cpu(), ops.swiglu(gate_up))
    assert same_bits(ops.swiglu_backward(gc, dc).cpu(), ops.swiglu_backward(gate_up, dh))
    finite = gate_up.masked_fill(~gate_up.isfinite(), 0.0)
    fc = finite.cuda()
    _rowcol_equal([t.cpu() for t in ops.fp8_block_swiglu_quantize_rowcol(fc)], ops.fp8_block_swiglu_quantize_rowcol(finite))
    _rowcol_equal([t.cpu() for t in ops.fp8_block_swiglu_backward_quantize_rowcol(fc, dc)],
                  ops.fp8_block_swiglu_backward_quantize_rowcol(finite, dh))


@pytest.mark.gpu
def test_gpu_accuracy_is_at_least_torchs():
    """Against float64, deepwell's bf16 activation and gradient are no worse than eager torch's bf16
    chain (which rounds silu(g) before the product) and within one bf16 rounding."""
    gate_up, dh = _gate_up(4096, 1408, device="cuda"), _dh(4096, 1408, device="cuda")
    want_h, want_d, _ = _float64(gate_up, dh)
    x = gate_up.clone().requires_grad_()
    g, u = x.chunk(2, dim=-1)
    eager = F.silu(g) * u
    (eager_d,) = torch.autograd.grad(eager, x, dh)

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    ours = (err(ops.swiglu(gate_up), want_h), err(ops.swiglu_backward(gate_up, dh), want_d))
    theirs = (err(eager, want_h), err(eager_d, want_d))
    assert ours[0] <= theirs[0] * 1.01 and ours[1] <= theirs[1] * 1.01, (ours, theirs)
    assert max(ours) < 4e-3, ours
