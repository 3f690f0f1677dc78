"""CompileOptions.attention="fp8": the backend rewrites the SDPA calls fp8_attention can compute
(compiler/fp8_attention.py), the plan says so ("emulated") and why it kept the others."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import deepwell
from deepwell.compiler import backend, fp8_attention
from deepwell.models import Llama


def _llama(seed=0):
    torch.manual_seed(seed)
    return Llama(256, 128, 1, 2, 256, max_seq=64)


def _run(model, attention, tokens):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="deepwell", options={"precision": "bf16", "attention": attention})
    return compiled(tokens), backend.last_plan()


def test_option_is_validated():
    with pytest.raises(ValueError, match="'attention' must be 'bf16' or 'fp8', got 'fp16'"):
        deepwell.CompileOptions(attention="fp16")
    assert deepwell.CompileOptions().attention == "bf16"


def test_fp8_rewrites_llama_attention_and_the_plan_says_emulated():
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    model = _llama()
    ref, plan_bf16 = _run(model, "bf16", tokens)
    assert all(a.kernel != fp8_attention.KERNEL for a in plan_bf16.attention)
    out, plan = _run(model, "fp8", tokens)
    assert [a.kernel for a in plan.attention] == [fp8_attention.KERNEL]
    assert "emulated" in plan.table() and "bf16 backward" in plan.table()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 5e-2  # FP8 attention changes the logits, at FP8 level
    out.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


class _Masked(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) + F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_calls_it_cannot_compute_are_kept_with_the_reason():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 8, 64, generator=g), torch.randn(1, 2, 8, 64, generator=g)
    v, mask = torch.randn(1, 2, 8, 64, generator=g), torch.zeros(8, 8)
    torch._dynamo.reset()
    f = torch.compile(_Masked(), backend="deepwell", options={"attention": "fp8"})
    f(q, k, v, mask)
    masked, other = backend.last_plan().attention
    assert masked.kernel != fp8_attention.KERNEL and "attention='fp8' asked but kept: it has an attn_mask" in masked.why
    assert other.kernel == fp8_attention.KERNEL


def test_optimize_passes_the_option(capsys):
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    model = deepwell.optimize(_llama(), precision="bf16", attention="fp8", verbose=True)
    model(tokens)
    assert [a.kernel for a in backend.last_plan().attention] == [fp8_attention.KERNEL]
    assert "deepwell fp8_attention (emulated" in capsys.readouterr().out
