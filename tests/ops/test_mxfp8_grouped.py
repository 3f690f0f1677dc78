"""Blackwell's native MXFP8 grouped experts (deepwell/ops/mxfp8_grouped.py), on the CPU: the scale
layouts against per-group `swizzle_scales`, the whole autograd path against the grouped emulation
with `torch._scaled_grouped_mm` replaced by a float64 decoder of those layouts, torch's own shape
and stride checks through its fake kernel, the first-use check, and Rust's choice of the backend.
The kernel itself needs an sm_100 GPU, which these machines do not have."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from deepwell import _native
from deepwell.ops import mxfp8_grouped as mg
from deepwell.ops.swizzle import swizzle_scales
from _util import decoding_scaled_grouped_mm

gl = importlib.import_module("deepwell.ops.grouped_linear")  # the module, not the function
E8 = torch.float8_e8m0fnu


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def _scales(*shape, seed=0) -> torch.Tensor:
    """Random E8M0 scales (exponents 100..150, no NaN code)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 151, shape, generator=g, dtype=torch.uint8).view(E8)


def _offsets(sizes) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)


def test_expert_scales_tile_each_expert_on_its_own():
    s = _scales(3, 256, 8)
    out = mg.expert_scales(s)
    assert out.shape == (3, 256 * 8) and out.dtype == E8
    for e in range(3):
        assert torch.equal(out[e].view(torch.uint8), swizzle_scales(s[e]).view(torch.uint8))


def test_row_group_scales_start_each_group_on_a_tile():
    """Groups of any size, an empty one among them: group g's tiling at row sum ceil128(earlier)."""
    sizes = [5, 0, 133, 200, 1]
    s = _scales(sum(sizes), 8, seed=1)
    out = mg.row_group_scales(s, _offsets(sizes))
    rows = sum(sizes) + 128 * len(sizes)  # as torchao's layout: 128 spare rows per group
    assert out.shape == (rows, 8) and out.dtype == E8 and out.is_contiguous()
    want = torch.zeros(rows * 8, dtype=torch.uint8)
    start = first = 0
    for m in sizes:
        if m:
            tiled = swizzle_scales(s[start:start + m]).view(torch.uint8)
            want[first * 8:first * 8 + tiled.numel()] = tiled
        start, first = start + m, first + _ceil(m, 128)
    assert torch.equal(out.view(torch.uint8).reshape(-1), want)


def test_column_group_scales_tile_each_groups_columns_after_the_last():
    """Token groups of 32, 0, 96 and 192 (1, 0, 3, 6 scale columns) over 200 rows: group g's
    tiling of its columns (padded to 4) from byte ceil128(rows) * sum ceil4(earlier columns)."""
    tokens = [32, 0, 96, 192]
    rows, cols = 200, sum(tokens) // 32
    s = _scales(rows, cols, seed=2)
    out = mg.column_group_scales(s, _offsets(tokens))
    tall = _ceil(rows, 128)
    assert out.shape == (tall, cols + 4 * len(tokens)) and out.dtype == E8
    want = torch.zeros(out.numel(), dtype=torch.uint8)
    col = first = 0
    for t in tokens:
        k = t // 32
        if k:
            tiled = swizzle_scales(s[:, col:col + k]).view(torch.uint8)
            want[first * tall:first * tall + tiled.numel()] = tiled
        col, first = col + k, first + _ceil(k, 4)
    assert torch.equal(out.view(torch.uint8).reshape(-1), want)


def _problem(sizes=(64, 0, 96, 32), k=256, n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=g).to(torch.bfloat16)
    w = (torch.randn(len(sizes), n, k, generator=g) * 0.05).to(torch.bfloat16)
    dy = torch.randn(sum(sizes), n, generator=g).to(torch.bfloat16)
    return x, w, _offsets(sizes), dy


def _run(fn, x, w, offsets, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, offsets)
    y.backward(dy)
    return y, x.grad, w.grad


def test_the_native_path_computes_the_grouped_emulation(monkeypatch):
    """Forward, dgrad and wgrad through GroupedMxfp8, with the grouped GEMM decoded from the
    layouts in float64, equal the grouped emulation's (same operands; they differ in the sums'
    precision and order only): a wrong layout, transpose or scale would be off by whole factors."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", decoding_scaled_grouped_mm)
    x, w, offsets, dy = _problem()
    native = _run(mg.GroupedMxfp8.apply, x, w, offsets, dy)
    emulated = _run(lambda *a: gl._GroupedEmulated.apply(*a, "mxfp8"), x, w, offsets, dy)
    for name, a, b in zip(("y", "dx", "dw"), native, emulated):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        err = float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())
        assert err < 4e-3, (name, err)
    assert torch.equal(native[2][1], torch.zeros_like(native[2][1]))  # the empty expert's gradient


def test_torchs_fake_kernel_accepts_every_operand():
    """torch._scaled_grouped_mm's own checks (dtypes, row / column-major strides, 16-byte strides,
    the experts' scale shapes, int32 offsets) pass for all three passes, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, offsets, dy = _problem()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx, fw = (mode.from_tensor(t).requires_grad_() for t in (x, w))
        y = mg.GroupedMxfp8.apply(fx, fw, mode.from_tensor(offsets))
        dx, dw = torch.autograd.grad(y, (fx, fw), mode.from_tensor(dy))
    assert (y.shape, dx.shape, dw.shape) == (dy.shape, x.shape, w.shape)


def test_first_use_check_trusts_a_matching_kernel_and_refuses_a_wrong_or_failing_one(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_grouped_mm", decoding_scaled_grouped_mm)
    assert mg.trusted_on.__wrapped__("cpu", gl._GroupedEmulated)

    def transposed_scales(a, b, scale_a, scale_b, **kw):  # a kernel reading the weights' scales wrong
        wrong = scale_b.view(torch.uint8).flip(-1).view(E8) if b.dim() == 3 else scale_b
        return decoding_scaled_grouped_mm(a, b, scale_a, wrong, **kw)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", transposed_scales)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not mg.trusted_on.__wrapped__("cpu", gl._GroupedEmulated)
    assert any("differ from the exact emulation" in str(w.message) for w in caught)

    def refuses(*_, **__):  # a kernel this device does not take
        raise RuntimeError("MXFP8 grouped GEMM is only supported on SM100")

    monkeypatch.setattr(torch, "_scaled_grouped_mm", refuses)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not mg.trusted_on.__wrapped__("cpu", gl._GroupedEmulated)
    assert any("fails (MXFP8 grouped GEMM is only supported on SM100); MXFP8 experts run emulated there"
               in str(w.message) for w in caught)


def test_rust_takes_the_native_grouped_gemm_only_where_it_can_run():
    """sm_100 with torch's kernel, groups padded to 32 and 128-multiple features: mxfp8_grouped;
    without any of the three, the per-expert loop of native GEMMs; the CPU and this torch off sm_100
    never claim it."""
    def backend(**kw):
        req = {"recipe": "mxfp8", "arch": "sm_100a", "aligned": True, "tiled": True, "torch_mxfp8_grouped": True}
        return _native.call("grouped_backend", {**req, **kw})

    assert (backend()["backend"], backend()["emulated"]) == ("mxfp8_grouped", False)
    for off in ("aligned", "tiled", "torch_mxfp8_grouped"):
        assert backend(**{off: False})["backend"] == "per_expert_loop", off
    assert backend(arch="sm_90a")["backend"] == "emulated_grouped"
    assert not mg.available_on(torch.device("cpu"))
    assert gl.backend_on("mxfp8", "cpu", True, True) == "emulated_grouped"
    with pytest.raises(ValueError, match="field 'tiled'"):
        backend(tiled="yes")
