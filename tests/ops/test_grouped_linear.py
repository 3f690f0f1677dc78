"""deepwell.grouped_linear: per-expert `x @ W_e.T` over contiguous row groups, forward, dgrad and
wgrad, in every recipe: against a float64 per-group loop (unquantized) and against the dense
`deepwell.scaled_linear` applied group by group (quantized recipes: the same Rust passes); zero-row
experts, one expert holding every row, and groups that are not whole blocks."""

from __future__ import annotations

import importlib

import pytest
import torch

import deepwell

SPLITS = {
    "uneven": [5, 0, 13, 2],
    "one_expert": [0, 0, 20, 0],
    "empty_ends": [0, 7, 9, 0],
}


def _offsets(sizes):
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(sizes, d, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(len(sizes), n, d, generator=g) / d**0.5).to(dtype).requires_grad_()
    return x, w, _offsets(sizes)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unquantized_matches_a_float64_loop(split, dtype):
    sizes = SPLITS[split]
    x, w, off = _inputs(sizes, 24, 16, dtype)
    y = deepwell.grouped_linear(x, w, off, "bf16")
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    parts = [x64[off[e]:off[e + 1]] @ w64[e].T for e in range(len(sizes))]
    y64 = torch.cat(parts)
    y64.backward(dy.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, **tol)
    for e, s in enumerate(sizes):
        if s == 0:
            assert torch.all(w.grad[e] == 0)  # an expert without rows gets exactly zero


RECIPES = ["fp8_block", "mxfp8", "nvfp4"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("split", ["aligned", "one_expert", "ragged"])
def test_quantized_equals_scaled_linear_per_group(recipe, split):
    block = {"fp8_block": 128, "mxfp8": 32, "nvfp4": 16}[recipe]
    sizes = {"aligned": [block, 0, 2 * block], "one_expert": [0, 3 * block, 0], "ragged": [block + 3, 5, 0]}[split]
    d = n = 128
    x, w, off = _inputs(sizes, d, n, torch.bfloat16, seed=3)
    y = deepwell.grouped_linear(x, w, off, recipe)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
    deepwell.manual_seed(7)
    y.backward(dy)
    deepwell.manual_seed(7)
    for e, s in enumerate(sizes):
        lo, hi = off[e].item(), off[e + 1].item()
        if s == 0:
            assert torch.all(w.grad[e] == 0)
            continue
        xe, we = x.detach()[lo:hi].clone().requires_grad_(), w.detach()[e].clone().requires_grad_()
        ye = deepwell.scaled_linear(xe, we, None, recipe)
        ye.backward(dy[lo:hi])
        assert torch.equal(y[lo:hi], ye)
        if recipe != "nvfp4":  # nvfp4's stochastic rounding draws a seed per call: compare closely only
            assert torch.equal(x.grad[lo:hi], xe.grad) and torch.equal(w.grad[e], we.grad)
        else:
            torch.testing.assert_close(x.grad[lo:hi].float(), xe.grad.float(), rtol=0.3, atol=0.3)
    # And close to the unquantized layer (the recipe's error, not a wrong group).
    ref = deepwell.grouped_linear(x.detach().float(), w.detach().float(), off, "bf16")
    err = (y.float() - ref).norm() / ref.norm()
    assert err < {"fp8_block": 0.05, "mxfp8": 0.05, "nvfp4": 0.2}[recipe]


def test_compiles_fullgraph():
    x, w, off = _inputs([5, 0, 13, 2], 128, 128, torch.float32)
    for recipe in ("bf16", "fp8_block"):
        eager = deepwell.grouped_linear(x, w, off, recipe)
        torch._dynamo.reset()
        compiled = torch.compile(deepwell.grouped_linear, fullgraph=True)(x, w, off, recipe)
        torch.testing.assert_close(eager, compiled, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(recipe="int4"), "argument 'recipe' must be one of"),
        (dict(off=torch.zeros(3, dtype=torch.int32)), "argument 'offsets' must have shape [5], got [3]"),
        (dict(off=torch.zeros(5)), "argument 'offsets' must have dtype torch.int32"),
        (dict(x=torch.zeros(4, 7)), "x has 7 features (shape [4, 7]) but weight has in_features 128"),
        (dict(recipe="mxfp8", w=torch.zeros(4, 100, 128)), "have size(dim=1) divisible by 32"),
    ],
)
def test_bad_arguments(args, message):
    a = dict(x=torch.zeros(4, 128), w=torch.zeros(4, 64, 128), off=torch.zeros(5, dtype=torch.int32), recipe="bf16")
    a.update(args)
    with pytest.raises(RuntimeError) as err:
        deepwell.grouped_linear(a["x"], a["w"], a["off"], a["recipe"])
    assert str(err.value).startswith("deepwell.grouped_linear: ") and message in str(err.value)


@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_grouped_emulation_equals_the_per_expert_loop(recipe):
    """Aligned groups of an emulated recipe run as one grouped GEMM per pass over the dense layer's
    operands: the loop's results up to the GEMMs' accumulation order."""
    gl = importlib.import_module("deepwell.ops.grouped_linear")  # the module, not the function

    block = {"fp8_block": 128, "mxfp8": 32}[recipe]
    assert gl.backend_on(recipe, "cpu", True) == "emulated_grouped"
    sizes = [2 * block, 0, block, 3 * block]
    x, w, off = _inputs(sizes, 256, 128, torch.float32, seed=5)  # fp32 in and out: only the sums' order differs
    dy = torch.randn(sum(sizes), 128, generator=torch.Generator().manual_seed(6))
    outs = []
    for aligned in (True, False):
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = deepwell.grouped_linear(xi, wi, off, recipe, groups_aligned=aligned)
        y.backward(dy)
        outs.append((y, xi.grad, wi.grad))
    (y1, dx1, dw1), (y2, dx2, dw2) = outs
    for a, b in ((y1, y2), (dx1, dx2), (dw1, dw2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.all(dw1[1] == 0)


def _fp8_block_grouped_vs_loop(device, sizes, d, n):
    """deepwell's FP8 grouped path and the per-expert loop of scaled_linear on the same inputs:
    (y, dx, dw) of each."""
    gl = importlib.import_module("deepwell.ops.grouped_linear")
    x, w, off = _inputs(sizes, d, n, torch.bfloat16, seed=8)
    x, w, off = x.detach().to(device), w.detach().to(device), off.to(device)
    dy = torch.randn(sum(sizes), n, generator=torch.Generator().manual_seed(9)).bfloat16().to(device)
    outs = []
    for run in (lambda a, b: gl._GroupedFp8Block.apply(a, b, off), lambda a, b: gl._grouped_scaled_linear(a, b, off, "fp8_block")):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = run(xi, wi)
        y.backward(dy)
        outs.append((y, xi.grad, wi.grad))
    return outs


def test_fp8_block_grouped_equals_the_per_expert_loop_on_cpu():
    """The FP8 grouped path quantizes exactly as the loop does (x, dy rows along K; W per expert in
    128x128 tiles, W^T's tiles W's codes transposed; dy^T, x^T along each expert's tokens) and, on
    the CPU, both multiply the dequantized operands in fp32 group by group: the same bits, on one
    BLAS thread. With 16 (the H100 host's CPU) the two paths' fp32 GEMMs (the reference's strided
    K slice, the loop's own rows) were each repeatable but summed in different orders: one dw
    element of 131072 one bf16 step apart (benchmarks/results/wgrad-threads-*)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (y1, dx1, dw1), (y2, dx2, dw2) = _fp8_block_grouped_vs_loop("cpu", [256, 0, 128, 384], 256, 128)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2) and torch.equal(dw1, dw2)
    assert torch.all(dw1[1] == 0)


def test_fp8_block_grouped_dispatch_is_rusts():
    gl = importlib.import_module("deepwell.ops.grouped_linear")
    assert gl.backend_on("fp8_block", "cpu", True) == "emulated_grouped"
    assert gl.backend_on("fp8_block", "cpu", False) == "per_expert_loop"
    assert gl.backend_on("bf16", "cpu", False) == "grouped_mm"


@pytest.mark.gpu
def test_gpu_fp8_block_grouped_matches_the_per_expert_loop():
    """On sm_90 grouped_linear runs deepwell's FP8 grouped GEMMs for fp8_block; the loop runs
    cuBLASLt per expert on the same codes: equal up to the GEMMs' accumulation order."""
    gl = importlib.import_module("deepwell.ops.grouped_linear")
    if gl.backend_on("fp8_block", "cuda", True) != "fp8_block_grouped":
        pytest.skip("deepwell's FP8 grouped GEMMs run on sm_90 only")
    outs = _fp8_block_grouped_vs_loop("cuda", [512, 0, 128, 1280, 256], 1024, 768)
    for a, b in zip(*outs):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 5e-3, err
    torch._dynamo.reset()
    x, w, off = _inputs([256, 128, 0, 384], 512, 256, torch.bfloat16, seed=2)
    x, w, off = x.detach().cuda(), w.detach().cuda(), off.cuda()
    eager = deepwell.grouped_linear(x, w, off, "fp8_block", groups_aligned=True)
    compiled = torch.compile(deepwell.grouped_linear, fullgraph=True)(x, w, off, "fp8_block", groups_aligned=True)
    assert torch.equal(eager, compiled)
