"""deepwell.fp8_attention, the emulated FP8 attention (docs/NUMERICS.md "FP8 attention"): its
operands are the fp8_block quantizer's bits, its output the contract's (a float64 reference of the
same definition) and within FP8 rounding of exact attention, its gradients torch SDPA's exactly."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import deepwell  # noqa: F401

fa = importlib.import_module("deepwell.ops.fp8_attention")  # the module (deepwell.ops.fp8_attention is also the op's wrapper)


def _qkv(b, h, tq, tk, d, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, tq, d, generator=g) * scale).to(dtype)
    k = (torch.randn(b, h, tk, d, generator=g) * scale).to(dtype)
    v = torch.randn(b, h, tk, d, generator=g).to(dtype)
    return q, k, v


def _pad2(x):
    """x (m, n) zero-padded to multiples of 128 in both dims (what rowcol takes)."""
    return F.pad(x, (0, -x.shape[1] % 128, 0, -x.shape[0] % 128))


def _deq(codes, scale_inv):
    return (codes.double().unflatten(-1, (-1, 128)) * scale_inv.double().unsqueeze(-1)).flatten(-2)


def _operands_by_rowcol(q, k, v):
    """Dequantized Q, K (T, D) and V (Tk, D) per (b, h), in float64, from fp8_block_quantize_rowcol's
    row copy (Q, K) and column copy (V): the other quantizer op, not the one fp8_attention calls."""
    rc = torch.ops.deepwell.fp8_block_quantize_rowcol
    b, h, tq, d = q.shape
    tk = k.shape[2]
    out = [torch.empty(b, h, tq, d, dtype=torch.float64), torch.empty(b, h, tk, d, dtype=torch.float64),
           torch.empty(b, h, tk, d, dtype=torch.float64)]
    raw = {}
    for i in range(b):
        for j in range(h):
            qr, qs, _, _ = rc(_pad2(q[i, j]))
            kr, ks, _, _ = rc(_pad2(k[i, j]))
            _, _, vc, vs = rc(_pad2(v[i, j]))
            raw[i, j] = (qr[:tq], qs[:tq], kr[:tk], ks[:tk], vc[:d], vs[:d])
            out[0][i, j] = _deq(qr, qs)[:tq, :d]
            out[1][i, j] = _deq(kr, ks)[:tk, :d]
            out[2][i, j] = _deq(vc, vs)[:d, :tk].t()
    return out, raw


def reference(q, k, v, is_causal=False, scale=None):
    """The contract in float64 (P's E4M3 cast from its fp32 rounding)."""
    (qd, kd, vd), _ = _operands_by_rowcol(q, k, v)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = qd @ kd.transpose(-1, -2) * scale
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p_hat = (p.float() * 256).to(torch.float8_e4m3fn).double() / 256
    return p_hat @ vd / p.sum(-1, keepdim=True)


def exact(q, k, v, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("d,t", [(64, 200), (192, 130)])
def test_operands_are_the_quantizers_bits(d, t):
    q, k, v = _qkv(2, 2, t, t, d, seed=1)
    ops = fa.quantized_operands(q, k, v)
    _, raw = _operands_by_rowcol(q, k, v)
    for (i, j), (qr, qs, kr, ks, vc, vs) in raw.items():
        assert torch.equal(ops["q"][0][i, j].view(torch.uint8), qr.view(torch.uint8))
        assert torch.equal(ops["q"][1][i, j], qs) and torch.equal(ops["k"][1][i, j], ks)
        assert torch.equal(ops["k"][0][i, j].view(torch.uint8), kr.view(torch.uint8))
        assert torch.equal(ops["v_t"][0][i, j].view(torch.uint8), vc.view(torch.uint8))
        assert torch.equal(ops["v_t"][1][i, j], vs)


CASES = [(64, 200, 200, True), (64, 200, 200, False), (128, 128, 128, True), (128, 77, 300, False), (96, 33, 33, True)]


@pytest.mark.parametrize("d,tq,tk,causal", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_contract_and_exact_attention(d, tq, tk, causal, dtype):
    q, k, v = _qkv(2, 3, tq, tk, d, dtype, seed=d + tq)
    out = torch.ops.deepwell.fp8_attention(q, k, v, causal)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    # The contract: fp32 accumulation and the output's rounding to dtype are all that differ.
    assert rel(out, reference(q, k, v, causal)) < (5e-3 if dtype == torch.bfloat16 else 1e-4)
    # FP8 level: E4M3 has 3 mantissa bits (relative rounding error up to 2^-4 per element).
    assert rel(out, exact(q, k, v, causal)) < 8e-2


def test_scale_argument():
    q, k, v = _qkv(1, 2, 40, 40, 64, torch.float32, seed=3)
    out = torch.ops.deepwell.fp8_attention(q, k, v, False, 0.05)
    assert rel(out, reference(q, k, v, False, 0.05)) < 1e-4
    assert rel(out, torch.ops.deepwell.fp8_attention(q, k, v)) > 1e-3  # the default 1/8 is not 0.05


def test_chunks_give_the_same_bits(monkeypatch):
    q, k, v = _qkv(1, 2, 300, 300, 64, seed=4)
    whole = torch.ops.deepwell.fp8_attention(q, k, v, True)
    monkeypatch.setattr(fa, "CHUNK_ELEMENTS", 2 * 300 * 7)  # 7 query rows a chunk, a tail of 6
    assert torch.equal(torch.ops.deepwell.fp8_attention(q, k, v, True), whole)


def test_zeros():
    z = torch.zeros(1, 2, 50, 64, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.deepwell.fp8_attention(z, z, z, True), z)
    _, _, v = _qkv(1, 2, 50, 50, 64, seed=5)
    out = torch.ops.deepwell.fp8_attention(z, z, v)  # uniform probabilities: the mean of V's codes
    assert rel(out, exact(z, z, v)) < 5e-2
    assert rel(out, reference(z, z, v)) < 5e-3


def test_large_magnitudes():
    q, k, v = _qkv(1, 2, 64, 64, 64, torch.float32, seed=6)
    big_v = v * 1e4
    out = torch.ops.deepwell.fp8_attention(q, k, big_v, True)
    assert rel(out, exact(q, k, big_v, True)) < 8e-2
    peaked = torch.ops.deepwell.fp8_attention(q * 30, k * 30, v, True)  # scores ~1e3: near one-hot rows
    assert torch.isfinite(peaked).all()
    assert rel(peaked, reference(q * 30, k * 30, v, True)) < 1e-4


def test_nan_propagates_to_its_rows():
    q, k, v = _qkv(1, 2, 40, 40, 64, torch.float32, seed=7)
    q[0, 1, 5, 3] = float("nan")
    out = torch.ops.deepwell.fp8_attention(q, k, v)
    assert torch.isnan(out[0, 1, 5]).all()
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[0, 1, :5]).all() and torch.isfinite(out[0, 1, 6:]).all()
    k[0, 0, 10, 0] = float("nan")  # a key every later query sees when causal
    out = torch.ops.deepwell.fp8_attention(q, k, v, True)
    assert torch.isfinite(out[0, 0, :10]).all() and torch.isnan(out[0, 0, 10:]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_are_sdpas(dtype, causal):
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 70, 70, 64, dtype, seed=8))
    out = torch.ops.deepwell.fp8_attention(q, k, v, causal)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), grad)
    for a, b in zip(got, ref):
        assert a.dtype == dtype and torch.equal(a, b)


def test_compiled_equals_eager():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 64, 64, 64, seed=10))
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: torch.ops.deepwell.fp8_attention(q, k, v, True), fullgraph=True)
    eager, compiled = torch.ops.deepwell.fp8_attention(q, k, v, True), f(q, k, v)
    assert torch.equal(eager, compiled)
    ge = torch.autograd.grad(eager.sum(), (q, k, v))
    gc = torch.autograd.grad(compiled.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(ge, gc))


def _bad():
    q, k, v = _qkv(1, 2, 8, 8, 64)
    return [
        ((q[0], k, v, False), "argument 'q' must be 4-d"),
        ((q, k.float(), v, False), "argument 'k' must have q's dtype"),
        ((q, k[:, :1], v[:, :1], False), "argument 'k' must be .batch, heads, keys, head_dim. = .1, 2, keys, 64."),
        ((q, k, v[..., :32], False), "argument 'v' must have k's shape"),
        ((q, k[:, :, :5], v[:, :, :5], True), "argument 'k' must have q's 8 tokens when is_causal"),
        ((*_qkv(1, 1, 4, 4, 320), False), "argument .q. must have a head size .last dim. of at most 256, got 320"),
        ((q.to(torch.int32), k, v, False), "argument 'q'"),
    ]


@pytest.mark.parametrize("i", range(7))
def test_bad_inputs_name_the_argument(i):
    args, message = _bad()[i]
    with pytest.raises(RuntimeError, match="deepwell.fp8_attention: " + message):
        torch.ops.deepwell.fp8_attention(*args)


@pytest.mark.slow
def test_long_sequence_in_chunks():
    q, k, v = _qkv(1, 2, 4096, 4096, 128, seed=11)
    out = torch.ops.deepwell.fp8_attention(q, k, v, True)
    assert fa.CHUNK_ELEMENTS // (2 * 4096) < 4096  # it ran in chunks
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert rel(out, ref) < 8e-2


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("d,tq,tk,causal", [(64, 200, 200, True), (128, 77, 300, False), (128, 1024, 1024, True)])
def test_gpu_matches_the_contract_and_sdpas_gradients(d, tq, tk, causal):
    q, k, v = _qkv(2, 3, tq, tk, d, seed=12)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    cpu_ops, gpu_ops = fa.quantized_operands(q, k, v), fa.quantized_operands(qc.detach(), kc.detach(), vc.detach())
    for name in cpu_ops:  # the quantizer's bits are the same on both devices (docs/NUMERICS.md "FP8 block")
        assert torch.equal(gpu_ops[name][0].cpu().view(torch.uint8), cpu_ops[name][0].view(torch.uint8))
        assert torch.equal(gpu_ops[name][1].cpu(), cpu_ops[name][1])
    out = torch.ops.deepwell.fp8_attention(qc, kc, vc, causal)
    # fp32 GEMMs on the GPU (TF32 where the process enables it) against the float64 contract.
    assert rel(out.cpu(), reference(q, k, v, causal)) < 1e-2
    assert rel(out.cpu(), exact(q, k, v, causal)) < 8e-2
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(13)).to(out.dtype).cuda()
    got = torch.autograd.grad(out, (qc, kc, vc), grad)
    ref = torch.autograd.grad(F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal), (qc, kc, vc), grad)
    for a, b in zip(got, ref):  # the same SDPA backward; flash's dq sums with atomics, so not always the same bits
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
