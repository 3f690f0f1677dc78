"""`swiglu_experts`: the routed experts' FFN. Where both projections run deepwell's FP8 grouped
GEMMs, the fused way (the activation quantized inside SwiGLU, forward and backward) computes the
same bits as the two-pass way (two `grouped_linear`s around `swiglu`): output and every gradient,
any subset of inputs needing one, empty groups included. The ops have CPU references, so the CPU
runs the fused autograd Function itself; the GPU runs it inside DeepwellMoE."""

from __future__ import annotations

import pytest
import torch

import deepwell
from _util import same_bits
from deepwell.ops import swiglu_experts as se
from deepwell.ops.grouped_linear import _GroupedFp8Block

ops = torch.ops.deepwell


def _problem(sizes, d=256, f=384, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(sizes)
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), d, generator=g).bfloat16()
    w1 = (torch.randn(e, 2 * f, d, generator=g) / 16).bfloat16()
    w2 = (torch.randn(e, d, f, generator=g) / 16).bfloat16()
    dy = torch.randn(sum(sizes), d, generator=g).bfloat16()
    return [t.to(device) for t in (x, w1, w2, offsets, dy)]


def _two_pass(x, w1, w2, offsets):
    """The unfused way on the same FP8 grouped GEMMs: grouped_linear's Function, swiglu, again."""
    return _GroupedFp8Block.apply(ops.swiglu(_GroupedFp8Block.apply(x, w1, offsets)), w2, offsets)


def _run(fn, x, w1, w2, offsets, dy, needs):
    leaves = [t.detach().clone().requires_grad_(n) for t, n in zip((x, w1, w2), needs)]
    y = fn(*leaves, offsets)
    grads = torch.autograd.grad(y, [t for t in leaves if t.requires_grad], dy)
    return y.detach(), grads


@pytest.mark.parametrize(
    "needs", [(True, True, True), (False, True, True), (True, False, False), (False, False, True)],
    ids=["all", "weights", "x", "down-only"],
)
def test_fused_experts_compute_the_two_pass_bits(needs):
    x, w1, w2, offsets, dy = _problem([128, 0, 256, 128])
    y, grads = _run(se._SwigluExpertsFp8Block.apply, x, w1, w2, offsets, dy, needs)
    y2, grads2 = _run(_two_pass, x, w1, w2, offsets, dy, needs)
    assert same_bits(y, y2)
    assert len(grads) == len(grads2) == sum(needs)
    for a, b in zip(grads, grads2):
        assert same_bits(a, b)
    # An expert without rows gets an exact zero weight gradient.
    if needs[1]:
        assert not grads[int(needs[0])][1].any()


def test_the_fused_way_is_taken_only_where_both_gemms_are_deepwells():
    x, w1, w2, _, _ = _problem([128])
    fp8 = ("fp8_block", "fp8_block")
    assert not se.fused_on(x, w1, w2, fp8, True)  # the CPU runs fp8_block as the grouped emulation
    assert not se.fused_on(x, w1, w2, ("bf16", "fp8_block"), True)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        xc, w1c, w2c = x.cuda(), w1.cuda(), w2.cuda()
        assert se.fused_on(xc, w1c, w2c, fp8, True)
        assert not se.fused_on(xc, w1c, w2c, fp8, False)  # groups not padded to 128
        assert not se.fused_on(xc, w1c[:, :200], w2c, fp8, True)  # F not whole 128-blocks


@pytest.mark.gpu
def test_gpu_moe_block_takes_the_fused_way_with_the_two_pass_bits(monkeypatch):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("deepwell's FP8 grouped GEMMs are sm_90a kernels")
    torch.manual_seed(0)
    moe = deepwell.DeepwellMoE(512, 384, 8, top_k=2, recipe="fp8_block").cuda().bfloat16()
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    calls = []
    fused_apply = se._SwigluExpertsFp8Block.apply
    monkeypatch.setattr(se._SwigluExpertsFp8Block, "apply", lambda *a: calls.append(1) or fused_apply(*a))

    def step():
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        y = moe(xi)
        y.backward(dy)
        return [y.detach(), xi.grad, *(p.grad for p in (moe.experts.gate_up_proj, moe.experts.down_proj))]

    fused = step()
    assert calls, "DeepwellMoE did not take the fused way"
    monkeypatch.setattr(se, "fused_on", lambda *a: False)
    two_pass = step()
    for a, b in zip(fused, two_pass):
        assert same_bits(a, b)
