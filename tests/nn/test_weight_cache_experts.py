"""The MoE experts' weight operands through the weight cache (`fp8_block_expert_weight`, behind
deepwell's FP8 grouped GEMMs; `mxfp8_expert_weight`, behind torch's MXFP8 grouped GEMM on
Blackwell), against the slow, obviously correct path under every way the stacked weights can
change: the same proofs as tests/nn/test_weight_cache.py gives the dense layers.

The reference quantizes a fresh copy of the weights on every call (`w.clone()`: a new storage, so
nothing can be reused). `_GroupedFp8Block` runs on the CPU (its ops' references) and, where there is
a GPU, on deepwell's FP8 grouped GEMMs (bf16 there, as a model trains): the cache's rules do not
depend on the device, but its operands feed different kernels. `GroupedMxfp8` runs with
`torch._scaled_grouped_mm` replaced by the float64 decoder of its layouts that
tests/ops/test_mxfp8_grouped.py uses too (tests/_util.py; no Blackwell GPU here).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

import deepwell
from _util import decoding_scaled_grouped_mm, same_bits
from test_weight_cache import OPTIMIZERS, WRITES, WRITES_BYPASSING_THE_COUNTER

ops = torch.ops.deepwell
gl = importlib.import_module("deepwell.ops.grouped_linear")  # the module (the package exports the function)
mg = importlib.import_module("deepwell.ops.mxfp8_grouped")
#: The grouped layer of each recipe whose experts' weights come through the cache.
LAYERS = {"fp8_block": gl._GroupedFp8Block, "mxfp8": mg.GroupedMxfp8}
E, N, K = 3, 128, 256
OFFSETS = torch.tensor([0, 128, 128, 384], dtype=torch.int32)  # whole 128-row groups, one empty
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}


@pytest.fixture(params=list(LAYERS))
def recipe(request, monkeypatch):
    """Each recipe's grouped layer; MXFP8's torch grouped GEMM read back by the float64 decoder."""
    if request.param == "mxfp8":
        monkeypatch.setattr(torch, "_scaled_grouped_mm", decoding_scaled_grouped_mm)
    return request.param


class Experts(torch.nn.Module):
    """One grouped layer of `recipe`; `fresh=True` is the reference."""

    def __init__(self, fresh: bool = False, seed: int = 0, device: str = "cpu", recipe: str = "fp8_block"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(E, N, K, generator=g) / K**0.5
        self.w = torch.nn.Parameter(w.to(device, DTYPES[device]))
        self.fresh, self.layer = fresh, LAYERS[recipe]
        self.offsets = OFFSETS.to(device)

    def forward(self, x):
        return self.layer.apply(x, self.w.clone() if self.fresh else self.w, self.offsets)


def _train(model, make_opt, steps: int, scope: bool):
    """Losses, input gradients and final weights with 2 micro-batches per step."""
    g = torch.Generator().manual_seed(1)
    opt = make_opt(list(model.parameters()))
    out = []
    for _ in range(steps):
        with deepwell.microbatches() if scope else contextlib.nullcontext():
            for _ in range(2):
                x = torch.randn(int(OFFSETS[-1]), K, generator=g).to(model.w.device, model.w.dtype).requires_grad_()
                loss = model(x).square().mean()
                loss.backward()  # dgrad (x needs a gradient) and wgrad
                out += [loss.detach(), x.grad]
        opt.step()
        opt.zero_grad()
    return out, model.w.detach().clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_expert_training_matches_the_uncached_path(name, device, recipe):
    if recipe == "mxfp8" and device == "cuda":
        pytest.skip("torch's MXFP8 grouped GEMM needs a Blackwell GPU; the decoder runs on the CPU")
    steps = 3
    reference = _train(Experts(fresh=True, device=device, recipe=recipe), OPTIMIZERS[name], steps, scope=False)
    for scope in (False, True):
        before = deepwell.weight_cache_info()
        (outs, w), (ref_outs, ref_w) = _train(Experts(device=device, recipe=recipe), OPTIMIZERS[name], steps, scope), reference
        after = deepwell.weight_cache_info()
        assert all(same_bits(a, b) for a, b in zip(outs, ref_outs)) and same_bits(w, ref_w), (name, scope)
        # In a scope each step quantizes the weights once, both operands; the other three passes
        # (backward 1, forward and backward 2) reuse them. Outside one nothing is reused.
        assert after["misses"] - before["misses"] == (steps if scope else 4 * steps)
        assert after["hits"] - before["hits"] == (3 * steps if scope else 0)
        assert after["entries"] == 0


def _check_write(write, scope: bool, recipe: str):
    """Forward, write, forward and backward: each pass sees the written weights."""
    model = Experts(recipe=recipe)
    x = torch.randn(int(OFFSETS[-1]), K, requires_grad=True)
    fresh = lambda: LAYERS[recipe].apply(x, model.w.detach().clone(), OFFSETS)  # noqa: E731
    with deepwell.microbatches() if scope else contextlib.nullcontext():
        y0 = model(x)
        assert same_bits(y0, fresh())
        write(model.w)
        y1 = model(x)
        assert same_bits(y1, fresh()) and not same_bits(y1, y0)
        y1.sum().backward()  # dx reads W^T's operand: it follows the write too
        dx, x.grad = x.grad, None
    fresh().sum().backward()
    assert same_bits(dx, x.grad)


@pytest.mark.parametrize("scope", [False, True], ids=["default", "microbatches"])
@pytest.mark.parametrize("write", WRITES, ids=list(WRITES))
def test_every_write_to_the_expert_weights_is_seen(write, scope, recipe):
    _check_write(WRITES[write], scope, recipe)


@pytest.mark.parametrize("write", WRITES_BYPASSING_THE_COUNTER, ids=list(WRITES_BYPASSING_THE_COUNTER))
def test_writes_bypassing_the_version_counter_are_seen_outside_a_scope(write, recipe):
    _check_write(WRITES_BYPASSING_THE_COUNTER[write], scope=False, recipe=recipe)


def _mx(w):
    """MXFP8 codes along the last dim and each expert's scales tiled on their own."""
    data, scale = ops.mxfp8_quantize(w, -1, "rceil", "e4m3")
    return data, mg.expert_scales(scale)


@pytest.mark.parametrize("device", DEVICES)
def test_the_operands_are_the_quantizers_bit_for_bit(device):
    w = torch.randn(E, N, K, dtype=torch.bfloat16, device=device)
    cases = [(ops.fp8_block_expert_weight, "fprop", ops.fp8_block_quantize(w, 128, 128)),
             (ops.fp8_block_expert_weight, "dgrad", ops.fp8_block_quantize_transposed(w.reshape(E * N, K))),
             (ops.mxfp8_expert_weight, "fprop", _mx(w)),
             (ops.mxfp8_expert_weight, "dgrad", _mx(w.transpose(1, 2)))]
    for op, want, (data, scale) in cases:
        for scope in (False, True):
            with deepwell.microbatches() if scope else contextlib.nullcontext():
                got = op(w, want)
                got = op(w, want)  # in a scope: the cached one
            assert same_bits(got[0], data) and same_bits(got[1], scale), (op, want, scope)
    # The two recipes' operands of one weight are separate entries of the cache.
    with deepwell.microbatches():
        assert ops.fp8_block_expert_weight(w, "fprop")[0].dtype == torch.float8_e4m3fn
        assert ops.mxfp8_expert_weight(w, "fprop")[1].dtype == torch.float8_e8m0fnu


@pytest.mark.parametrize("op", ["fp8_block_expert_weight", "mxfp8_expert_weight"])
@pytest.mark.parametrize("args,match", [
    ((torch.randn(N, K), "fprop"), r"argument 'weight' must be 3-d \(experts, out_features, in_features\), got a 2-d"),
    ((torch.randn(E, 96, K), "fprop"), r"argument 'weight' must have size\(dim=1\) divisible by 128"),
    ((torch.randn(E, N, 64), "dgrad"), r"argument 'weight' must have size\(dim=2\) divisible by 128"),
    ((torch.randn(E, N, K), "both"), r"argument 'want' must be \"fprop\" or \"dgrad\", got \"both\""),
    ((torch.zeros(E, N, K, dtype=torch.int32), "fprop"), r"argument 'weight' must have dtype torch.float32"),
])
def test_bad_arguments_name_the_op_and_argument(op, args, match):
    with pytest.raises(RuntimeError, match=f"deepwell.{op}: " + match):
        getattr(ops, op)(*args)
    with pytest.raises(RuntimeError, match=f"deepwell.{op}: " + match):
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:  # the fake kernel says the same
            getattr(ops, op)(mode.from_tensor(args[0]), args[1])
