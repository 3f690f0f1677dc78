"""deepwell's `grouped_mm` (torch_ops/deepwell/ops/grouped_mm.py): torch._grouped_mm, through the
`deepwell_moe::grouped_mm` custom op where the installed torch's fake kernel refuses the dtype
(torch 2.11: fp32). The op must give torch._grouped_mm's bits, forward and gradients, and trace
under torch.compile whatever the installed torch's fake kernel accepts. CI's torch takes fp32, so
the fallback is forced here (FAKE_TAKES) to test it on every torch."""

from __future__ import annotations

import pytest
import torch

import deepwell
from deepwell.ops import grouped_mm as gm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SIZES = [5, 0, 13, 2]


def _rows(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(sum(SIZES), 24, generator=g).to(device, dtype)
    b = (torch.randn(len(SIZES), 24, 16, generator=g) / 5).to(device, dtype)
    ends = torch.tensor(SIZES, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    return a, b, ends


@pytest.fixture
def forced(monkeypatch):
    """Every dtype through the custom op, as on a torch whose fake kernel takes bf16 only."""
    monkeypatch.setattr(gm, "FAKE_TAKES", {dt: False for dt in gm.FAKE_TAKES})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_gives_torchs_bits_forward_and_backward(device, dtype):
    a, b, ends = _rows(device, dtype)
    dy = torch.randn(a.shape[0], b.shape[2], generator=torch.Generator().manual_seed(1)).to(device, dtype)
    outs = []
    for fn in (lambda a, b: torch._grouped_mm(a, b, offs=ends), lambda a, b: gm.grouped_mm_op(a, b, ends)):
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        y = fn(a_, b_)
        y.backward(dy)
        outs.append((y, a_.grad, b_.grad))
    for ref, got in zip(*outs):
        assert torch.equal(ref, got)
    assert torch.all(outs[1][2][1] == 0)  # the empty group's weight gradient is exactly zero


@pytest.mark.parametrize("device", DEVICES)
def test_k_grouped_form(device):
    a, b, ends = _rows(device, torch.float32)
    dy = torch.randn(a.shape[0], b.shape[2], generator=torch.Generator().manual_seed(2)).to(device)
    ref = torch._grouped_mm(a.t(), dy, offs=ends)
    assert ref.shape == (len(SIZES), 24, 16)
    assert torch.equal(gm.grouped_mm_op(a.t(), dy, ends), ref)


def test_opcheck():
    a, b, ends = _rows("cpu", torch.float32)
    torch.library.opcheck(gm.grouped_mm_op, (a.requires_grad_(), b.requires_grad_(), ends))
    torch.library.opcheck(gm.grouped_mm_op, (a.detach().t(), torch.randn(a.shape[0], 16), ends))


def test_bad_forms_are_refused():
    a, b, ends = _rows("cpu", torch.float32)
    with pytest.raises(RuntimeError, match=r"deepwell_moe::grouped_mm: expected a 2-d and b 3-d .* got 3-d and 3-d"):
        gm.grouped_mm_op(b, b, ends)


def test_the_installed_torch_is_probed():
    assert set(gm.FAKE_TAKES) == {torch.float32, torch.float16, torch.bfloat16}
    assert gm.FAKE_TAKES[torch.bfloat16]  # every torch with _grouped_mm traces bf16


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_grouped_linear_compiles_fullgraph_through_the_op(forced, recipe):
    """grouped_linear in fp32 (the bf16 recipe computes in x's dtype; fp8_block's grouped emulation
    multiplies fp32 on the CPU) traces with the fallback, and gives eager's values and gradients."""
    g = torch.Generator().manual_seed(3)
    sizes = [128, 0, 256, 128] if recipe == "fp8_block" else SIZES
    off = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(sum(sizes), 128, generator=g)
    w = torch.randn(len(sizes), 128, 128, generator=g) / 12
    dy = torch.randn(sum(sizes), 128, generator=g)
    fn = lambda x, w: deepwell.grouped_linear(x, w, off, recipe, groups_aligned=True)  # noqa: E731
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = f(x_, w_)
        y.backward(dy)
        results.append((y, x_.grad, w_.grad))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_forced_calls_go_through_the_op(forced, monkeypatch):
    calls = []
    op = gm.grouped_mm_op
    monkeypatch.setattr(gm, "grouped_mm_op", lambda *args: calls.append(args[0].dtype) or op(*args))
    a, b, ends = _rows("cpu", torch.float32)
    off = torch.cat([torch.zeros(1, dtype=torch.int32), ends])
    deepwell.grouped_linear(a, b.transpose(-2, -1).contiguous(), off, "bf16")
    assert calls == [torch.float32]
