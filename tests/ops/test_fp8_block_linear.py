"""deepwell.fp8_block_linear: scaled_linear in fp8_block on x's two FP8 copies made by one
`fp8_block_quantize_rowcol` pass (by the op, or given; or the row copy alone, the backward making
the column copy), saving x's column copy for the backward instead of x. Every output and gradient
must be bit-identical to scaled_linear(..., "fp8_block") and its backward, whichever copies arrive
made, on every path (emulated, sm_90's native arguments through the CPU model, the GPU), for
ordinary and extreme inputs; autograd must keep the column codes and their scales, not x; layers
sharing one quantization must equal separate layers; the backend's `fp8_block_codes` option must
run its sites that way, each shared input quantized once, and give the eager layers' bits."""

from __future__ import annotations

import pytest
import torch

import deepwell
from _util import deepwell_calls as _deepwell_calls
from _util import linear_runs, same_bits, saved_activation_bytes

ops = torch.ops.deepwell
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _x(shape, case, gen, dtype=torch.bfloat16):
    """Inputs x's two quantizations must handle: ordinary, all zeros, subnormal-sized, a saturating
    outlier, +Inf, NaN (each extreme in one 1x128 block of each orientation)."""
    x = torch.randn(shape, generator=gen)
    flat = x.view(-1, shape[-1])
    if case == "zeros":
        x.zero_()
    elif case == "tiny":
        x *= 1e-39
    elif case == "outlier":
        flat[5, 7] = 3e38 if dtype != torch.float16 else 6e4
    elif case == "inf":
        flat[1, 2] = float("inf")
    elif case == "nan":
        flat[3, 4] = float("nan")
    return x.to(dtype)


def _given(x, w, b, recipe, copies):
    """fp8_block_linear given x's copies made beforehand: "both", or "rows" (the backward makes the
    column copy from x)."""
    codes = ops.fp8_block_quantize_rowcol(x.detach().reshape(-1, x.shape[-1]), True, True, copies)
    return ops.fp8_block_linear(x, w, b, recipe, *(codes if copies == "both" else codes[:2]))[0]


def _both(x, n, recipe, device, gen, bias=True):
    """(y, dx, dW[, db]) of scaled_linear, then of fp8_block_linear quantizing x itself, given both
    copies and given the row copy alone, same inputs."""
    k = x.shape[-1]
    x = x.to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(x.dtype).to(device)
    b = torch.randn(n, generator=gen).to(x.dtype).to(device) if bias else None
    dy = torch.randn(*x.shape[:-1], n, generator=gen).to(x.dtype).to(device)
    runs = (lambda *a: ops.scaled_linear(*a, recipe, None), lambda *a: deepwell.fp8_block_linear(*a, recipe),
            lambda *a: _given(*a, recipe, "both"), lambda *a: _given(*a, recipe, "rows"))
    return linear_runs(runs, x, w, b, dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,n", [((2, 128, 256), 384), ((256, 512), 128), ((384, 128), 256)])
@pytest.mark.parametrize("case", ["ordinary", "zeros", "tiny", "outlier", "inf", "nan"])
def test_bit_identical_to_scaled_linear(device, shape, n, case, gen):
    """On the GPU the native path (cuBLASLt's block-scaled GEMMs or deepwell's FP8 GEMM, as the
    dispatch table picks per pass); on the CPU the exact emulation."""
    recipe = "fp8_block"
    plain, *others = _both(_x(shape, case, gen), n, recipe, device, gen)
    for other in others:
        for i, (a, b) in enumerate(zip(plain, other)):
            assert same_bits(a.cpu(), b.cpu()), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["ordinary", "outlier", "nan"])
def test_native_sm90_arguments_on_the_cpu(dtype, case, gen):
    """sm_90's operands (M-major scales, the layouts cuBLASLt reads) through the CPU model of its GEMM."""
    plain, *others = _both(_x((2, 128, 128), case, gen, dtype), 256, "fp8_block@sm_90", "cpu", gen, bias=False)
    for other in others:
        for i, (a, b) in enumerate(zip(plain, other)):
            assert same_bits(a, b), i


def test_autograd_keeps_the_column_codes_not_x(gen):
    """Saved for backward: x^T's (k, m) E4M3 codes and their (m/128, k) fp32 scales, never x (the row
    copy is the forward's alone)."""
    m, k = 512, 256
    x = torch.randn(m, k, generator=gen).bfloat16().requires_grad_()
    lin = torch.nn.Linear(k, 128, dtype=torch.bfloat16)
    saved = saved_activation_bytes(lambda t: deepwell.fp8_block_linear(t, lin.weight, lin.bias), x, lin)
    plain = saved_activation_bytes(lambda t: ops.scaled_linear(t, lin.weight, lin.bias, "fp8_block", None), x, lin)
    assert plain == m * k * 2  # x in bf16
    assert saved == m * k * 1 + (m // 128) * k * 4


@pytest.mark.parametrize("device", DEVICES)
def test_layers_sharing_one_quantization(device, gen):
    """Two layers reading one x through fp8_block_linear on one rowcol of x: outputs and
    every gradient (dx summed over both) bit-identical to two scaled_linear calls."""
    x = torch.randn(3, 128, 256, generator=gen).bfloat16().to(device)
    ws = [(torch.randn(n, 256, generator=gen) / 16).bfloat16().to(device) for n in (384, 128)]
    dys = [torch.randn(3, 128, w.shape[0], generator=gen).bfloat16().to(device) for w in ws]
    results = []
    for shared in (False, True):
        xl = x.clone().requires_grad_()
        wl = [w.clone().requires_grad_() for w in ws]
        if shared:
            codes = ops.fp8_block_quantize_rowcol(xl.detach().reshape(-1, 256), True, True)
            ys = [ops.fp8_block_linear(xl, w, None, "fp8_block", *codes)[0] for w in wl]
        else:
            ys = [ops.scaled_linear(xl, w, None, "fp8_block", None) for w in wl]
        grads = torch.autograd.grad(ys, [xl, *wl], dys)
        results.append([*ys, *grads])
    for i, (a, b) in enumerate(zip(*results)):
        assert same_bits(a.cpu(), b.cpu()), i


@pytest.mark.parametrize("device", DEVICES)
def test_inside_a_weight_reuse_scope(device, gen):
    """Inside deepwell.microbatches() the weight's operands come from the weight cache, as
    scaled_linear's do: the same bits on a hit, and a weight changed in place between calls (the
    optimizer's step) is quantized again, never read stale."""
    x = torch.randn(256, 128, generator=gen).bfloat16().to(device)
    w = (torch.randn(256, 128, generator=gen) / 12).bfloat16().to(device)
    dy = torch.randn(256, 256, generator=gen).bfloat16().to(device)

    def run(fn):
        xl = x.clone().requires_grad_()
        y = fn(xl, w)
        return (y, *torch.autograd.grad(y, (xl,), dy))

    def plain(a, b):
        return ops.scaled_linear(a, b, None, "fp8_block", None)

    w_before, w_after = w.clone(), w * -0.5
    with deepwell.microbatches():
        first = run(deepwell.fp8_block_linear)
        again = run(deepwell.fp8_block_linear)
        w.copy_(w_after)  # the optimizer's in-place step
        after = run(deepwell.fp8_block_linear)
    want_after = run(plain)
    w.copy_(w_before)
    want_first = run(plain)
    for a, b, c in zip(first, again, want_first):
        assert same_bits(a.cpu(), c.cpu()) and same_bits(b.cpu(), c.cpu())
    for a, b in zip(after, want_after):
        assert same_bits(a.cpu(), b.cpu())
    assert not same_bits(first[0].cpu(), after[0].cpu())


class _TwoHeads(torch.nn.Module):
    """a and b read one x (as q/k/v or gate/up do); c reads their sum (one bf16 rounding of the fp32
    sum, compiled or not: nothing but the deepwell ops can differ between the two)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(256, 256) for _ in range(3))

    def forward(self, x):
        return self.c(self.a(x) + self.b(x))


def _compiled(model, codes: bool | None):
    policy = deepwell.PrecisionPolicy(precision="fp8_block", first_last_bf16=False, min_features=128)
    options = {"policy": policy} if codes is None else {"policy": policy, "fp8_block_codes": codes}
    torch._dynamo.reset()
    return torch.compile(model, backend="deepwell", options=options)


@pytest.mark.parametrize("device", DEVICES)
def test_the_backend_is_bit_identical_to_the_eager_layers(device, gen):
    """With `fp8_block_codes`, the compiled model against fp8_block_linear called eagerly on one
    quantization per shared input: y and every gradient bit for bit, and its deepwell calls are the
    rowcol passes (a and b share x's; c has its own), the three forwards on the codes and their
    backwards, no scaled_linear."""
    model = _TwoHeads().to(device, torch.bfloat16)
    x = torch.randn(2, 128, 256, generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(2, 128, 256, generator=gen).to(device, torch.bfloat16)
    leaves = (x, *model.parameters())
    compiled = _compiled(model, True)
    got = compiled(x)
    got = (got, *torch.autograd.grad(got, leaves, dy))
    assert [s.recipe for s in deepwell.last_plan().sites] == ["fp8_block"] * 3
    calls = _deepwell_calls(lambda: torch.autograd.grad(compiled(x), leaves, dy))
    assert calls.count("fp8_block_quantize_rowcol") == 2
    assert calls.count("fp8_block_linear") == 3 and calls.count("fp8_block_linear_backward") == 3
    assert "scaled_linear" not in calls and "scaled_linear_backward" not in calls

    codes = ops.fp8_block_quantize_rowcol(x.detach().reshape(-1, 256), True, True)
    a = ops.fp8_block_linear(x, model.a.weight, model.a.bias, "fp8_block", *codes)[0]
    b = ops.fp8_block_linear(x, model.b.weight, model.b.bias, "fp8_block", *codes)[0]
    want = deepwell.fp8_block_linear(a + b, model.c.weight, model.c.bias)
    want = (want, *torch.autograd.grad(want, leaves, dy))
    for i, (p, q) in enumerate(zip(got, want)):
        assert same_bits(p, q), i
    torch._dynamo.reset()


def test_the_backend_option_off_keeps_scaled_linear(gen):
    """`fp8_block_codes=False`: every site scaled_linear (x recomputed in the backward), the same
    values as with the option on to FP8 rounding."""
    model = _TwoHeads().bfloat16()
    x = torch.randn(256, 256, generator=gen).bfloat16().requires_grad_()
    ys = []
    for codes in (False, True):
        compiled = _compiled(model, codes)
        compiled(x).float().sum().backward()
        calls = _deepwell_calls(lambda: ys.append(compiled(x)) or ys[-1].float().sum().backward())
        assert ("scaled_linear" in calls) != codes and ("fp8_block_linear" in calls) == codes
    torch._dynamo.reset()
    assert ((ys[0].float() - ys[1].float()).norm() / ys[1].float().norm()).item() < 1e-2


def test_the_default_is_on_in_one_process_and_with_several(monkeypatch):
    """The copies are the default under torch.distributed with several processes too (FSDP2 steps
    measured no slower with them, `CompileOptions.fp8_block_codes`); the memory trace's
    default follows, and the option still turns them off."""
    from deepwell.plan.memory import codes_of

    policy = deepwell.PrecisionPolicy(precision="fp8_block", first_last_bf16=False, min_features=128)
    plan = deepwell.autoplan(deepwell.capture(_TwoHeads(), (torch.randn(256, 256),)), policy=policy)
    assert deepwell.CompileOptions().fp8_block_codes is True and len(codes_of(plan)) == 3
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert deepwell.CompileOptions().fp8_block_codes is True and len(codes_of(plan)) == 3
    assert codes_of(plan, deepwell.CompileOptions(fp8_block_codes=False)) == {}


def test_the_backend_skips_token_counts_the_column_blocks_do_not_divide(gen):
    """x^T's 1x128 blocks run along the tokens: a site with 200 tokens stays scaled_linear."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).bfloat16()
    compiled = _compiled(model, True)
    x = torch.randn(200, 256, generator=gen).bfloat16()
    compiled(x)
    calls = _deepwell_calls(lambda: compiled(x))
    assert calls.count("scaled_linear") == 2 and "fp8_block_linear" not in calls
    torch._dynamo.reset()


def test_errors_name_the_op_and_argument(gen):
    x, w = torch.randn(256, 128), torch.randn(128, 128)
    codes = ops.fp8_block_quantize_rowcol(x, True, True)
    rows, rows_s, cols, cols_s = codes
    op = ops.fp8_block_linear
    with pytest.raises(RuntimeError, match=r"fp8_block_linear: argument 'recipe' must be 'fp8_block'.*\"fp8_tensor\""):
        op(x, w, None, "fp8_tensor", *codes)
    with pytest.raises(RuntimeError, match=r"fp8_block_linear: argument 'recipe' must be 'fp8_block'.*\"fp8_tensor\""):
        op(x, w, None, "fp8_tensor")
    with pytest.raises(RuntimeError, match=r"fp8_block_linear: argument 'x_scale_inv' must have shape \[1, 256\]"):
        op(x, w, None, "fp8_block", rows, rows_s.t(), cols, cols_s)
    with pytest.raises(RuntimeError, match=r"fp8_block_linear: argument 'x_codes_t' must have shape \[128, 256\]"):
        op(x, w, None, "fp8_block", rows, rows_s, rows, cols_s)
    for given in ((rows[:200], rows_s[:, :200], cols[:, :200], cols_s[:1]), (rows[:200], rows_s[:, :200]), ()):
        with pytest.raises(RuntimeError, match=r"fp8_block_linear: argument 'x' must have a token count"):
            op(torch.randn(200, 128), w, None, "fp8_block", *given)
    with pytest.raises(RuntimeError, match=r"fp8_block_linear: argument 'x_scale_inv' must have shape \[1, 256\]"):
        op(x, w, None, "fp8_block", rows, rows_s.t())
    with pytest.raises(RuntimeError, match=r"fp8_block_linear: argument 'x_codes' must have dtype"):
        op(x, w, None, "fp8_block", rows.float(), rows_s)
    dy = torch.randn(256, 128)
    with pytest.raises(RuntimeError, match=r"fp8_block_linear_backward: argument 'x_scale_inv_t' must have shape \[2, 128\]"):
        ops.fp8_block_linear_backward(dy, cols, cols_s.t(), w, "fp8_block", True, True)
    with pytest.raises(RuntimeError, match=r"fp8_block_linear_backward: argument 'x_codes_t' must have dtype"):
        ops.fp8_block_linear_backward(dy, cols.float(), cols_s, w, "fp8_block", True, True)
    with pytest.raises(RuntimeError, match=r"grad_out has 128 features .* but weight has out_features 64"):
        ops.fp8_block_linear_backward(torch.randn(128, 128), cols, cols_s, torch.randn(64, 128), "fp8_block", True, True)
    with pytest.raises(RuntimeError, match=r"fp8_block_quantize_rowcol: argument 'x' must"):
        ops.fp8_block_quantize_rowcol(torch.randn(200, 128), True, True)


@pytest.mark.parametrize("given,missing", [
    ({"x_codes": 0}, "x_scale_inv"),
    ({"x_scale_inv": 1}, "x_codes"),
    ({"x_codes": 0, "x_scale_inv": 1, "x_codes_t": 2}, "x_scale_inv_t"),
    ({"x_codes": 0, "x_scale_inv": 1, "x_scale_inv_t": 3}, "x_codes_t"),
    ({"x_codes_t": 2, "x_scale_inv_t": 3}, "x_codes"),
])
def test_a_copy_of_x_comes_whole_and_the_columns_with_the_rows(given, missing):
    """Each copy of x is its codes and their scales together, and the column copy comes only with
    the row copy: any other combination of the optional operands raises, naming one that is missing."""
    x, w = torch.randn(256, 128), torch.randn(128, 128)
    codes = ops.fp8_block_quantize_rowcol(x, True, True)
    kwargs = {name: codes[i] for name, i in given.items()}
    with pytest.raises(RuntimeError, match=rf"deepwell.fp8_block_linear: argument '{missing}' must be given with"):
        ops.fp8_block_linear(x, w, None, "fp8_block", **kwargs)


@pytest.mark.parametrize("copies", ["none", "both", "rows"])
def test_the_fake_kernel_gives_the_real_outputs_shapes(copies, gen):
    """Traced on fake tensors, every combination of given copies returns y and outputs 1-2 of the
    real call's shapes and dtypes (the column copy the op made, or empty tensors)."""
    x, w = torch.randn(2, 128, 256, generator=gen), torch.randn(384, 256, generator=gen)
    codes = ops.fp8_block_quantize_rowcol(x.reshape(-1, 256), True, True)
    given = {"none": (), "both": codes, "rows": codes[:2]}[copies]
    real = ops.fp8_block_linear(x, w, None, "fp8_block", *given)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.fp8_block_linear(*(mode.from_tensor(t) for t in (x, w)), None, "fp8_block",
                                    *(mode.from_tensor(t) for t in given))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
