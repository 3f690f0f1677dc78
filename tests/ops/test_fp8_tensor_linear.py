"""deepwell.fp8_tensor_linear: scaled_linear in fp8_tensor that saves x's FP8 codes instead of x
(made by the op, or given; or the row codes alone, the backward making the transposed codes).
Every output and gradient must be bit-identical to scaled_linear(..., "fp8_tensor") and its
backward, whichever codes arrive made, on every path (emulated, sm_90's native arguments through the CPU model, the GPU), for
any shape; autograd must keep the codes (1 byte per element), not x; the backend and
deepwell.Linear must use it for fp8_tensor sites."""

from __future__ import annotations

import pytest
import torch

import deepwell
from _util import deepwell_calls as _deepwell_calls
from _util import linear_runs, same_bits, saved_activation_bytes

ops = torch.ops.deepwell
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _given(x, w, b, recipe, copies):
    """fp8_tensor_linear given x's codes made beforehand from its amax: "both", or "rows" (the
    backward makes the transposed codes from x and the forward's amax)."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    amax = deepwell.ops.fp8_tensor.amax_of(x2)
    codes, codes_t, scale = ops.fp8_tensor_quantize_rowcol(x2, "e4m3", amax, copies)
    if copies == "both":
        return ops.fp8_tensor_linear(x, w, b, recipe, codes, scale, codes_t)[0]
    return ops.fp8_tensor_linear(x, w, b, recipe, codes, scale, x_amax=amax)[0]


def _both(shape, n, recipe, device, gen, dtype=torch.bfloat16, bias=True):
    """(y, dx, dW[, db]) of scaled_linear, then of fp8_tensor_linear quantizing x itself, given both
    copies and given the row codes alone."""
    k = shape[-1]
    x = torch.randn(shape, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    dy = torch.randn(*shape[:-1], n, generator=gen).to(dtype).to(device)
    runs = (lambda *a: ops.scaled_linear(*a, recipe, None), lambda *a: deepwell.fp8_tensor_linear(*a, recipe),
            lambda *a: _given(*a, recipe, "both"), lambda *a: _given(*a, recipe, "rows"))
    return linear_runs(runs, x, w, b, dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,n", [((4, 50, 96), 64), ((256, 512), 384), ((3, 7), 5), ((130, 48), 32)])
def test_bit_identical_to_scaled_linear(device, shape, n, gen):
    """M = 200 and 3: wgrad's K (the token count) not a multiple of 16 runs emulated on sm_90; the
    others native there. On the CPU all emulated."""
    plain, *others = _both(shape, n, "fp8_tensor", device, gen)
    for other in others:
        for a, b in zip(plain, other):
            assert same_bits(a.cpu(), b.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_sm90_arguments_on_the_cpu(dtype, gen):
    plain, *others = _both((2, 64, 128), 96, "fp8_tensor@sm_90", "cpu", gen, dtype=dtype, bias=False)
    for other in others:
        for a, b in zip(plain, other):
            assert same_bits(a, b)


def test_autograd_keeps_the_codes_not_x(gen):
    """Saved for backward: the (k, m) E4M3 codes and the 0-d scale (plus the weight), never x."""
    x = torch.randn(512, 256, generator=gen).bfloat16().requires_grad_()
    lin = torch.nn.Linear(256, 128, dtype=torch.bfloat16)
    saved = saved_activation_bytes(lambda t: deepwell.fp8_tensor_linear(t, lin.weight, lin.bias), x, lin)
    plain = saved_activation_bytes(lambda t: ops.scaled_linear(t, lin.weight, lin.bias, "fp8_tensor", None), x, lin)
    assert plain == 512 * 256 * 2  # x in bf16
    assert saved == 512 * 256 * 1 + 4  # its codes and the scale


@pytest.mark.parametrize("recipe", ["fp8_tensor", "fp8_block"])
def test_the_memory_trace_runs_code_saving_sites_as_the_backend_does(recipe):
    """dryrun's trace (plan/memory.py `saved_codes`) quantizes each input once however many sites
    read it (q/k/v, w1/w3: 4 quantizations for 7 sites per block; fp8_block under the backend's
    `fp8_block_codes`), computes what `scaled_linear(..., recipe)` computes, and so saves the codes
    the backward keeps: more than the plain GEMMs' stand-in, by at most the codes' bytes (the bf16
    inputs they replace are no longer kept). The sites' forwards are nn.Linear's again afterwards."""
    from deepwell.models import Llama
    from deepwell.plan.memory import codes_of, saved_codes
    from deepwell.plan.memory import saved_activation_bytes as traced

    torch.manual_seed(0)
    d, f, layers, t = 256, 512, 2, 2 * 128
    model = Llama(256, d, layers, 4, f, max_seq=128).bfloat16()
    tokens = torch.randint(0, 256, (2, 128))
    ir = deepwell.capture(model, (tokens,))
    plan = deepwell.autoplan(ir, policy=deepwell.PrecisionPolicy(precision=recipe, min_features=128,
                                                                 first_last_bf16=False))
    if recipe == "fp8_block":
        assert codes_of(plan, deepwell.CompileOptions(fp8_block_codes=False)) == {}
    codes = codes_of(plan, deepwell.CompileOptions(fp8_block_codes=True))
    assert len(codes) == 7 * layers
    quantize, linear = f"{recipe}_quantize_rowcol", f"{recipe}_linear"
    with saved_codes(model, codes):
        calls = _deepwell_calls(lambda: model(tokens))
        got = model(tokens)
    assert calls.count(quantize) == 4 * layers
    assert calls.count(linear) == 7 * layers
    assert all("forward" not in model.get_submodule(name).__dict__ for name in codes)
    sites = [model.get_submodule(name) for name in codes]
    for m in sites:
        m.forward = lambda x, m=m: ops.scaled_linear(x, m.weight, m.bias, recipe, None)
    want = model(tokens)
    for m in sites:
        del m.forward
    assert same_bits(got, want)
    plain = traced(model, ir.example_inputs, True)[0]
    with_codes = traced(model, ir.example_inputs, True, codes=codes)[0]
    # The codes (1 byte per element) and their scales: one per tensor, or one per 128 elements.
    scales = 4 * 4 * layers if recipe == "fp8_tensor" else layers * t * (3 * d + f) * 4 // 128
    assert 0 < with_codes - plain <= layers * t * (3 * d + f) + scales


def test_deepwell_linear_and_backend_use_it(gen):
    lin = deepwell.Linear(128, 64, recipe="fp8_tensor", guardrails=False).bfloat16()
    x = torch.randn(32, 128, generator=gen).bfloat16()
    assert _deepwell_calls(lambda: lin(x)) == ["fp8_tensor_linear"]
    assert same_bits(lin(x), ops.scaled_linear(x, lin.weight, lin.bias, "fp8_tensor", None))

    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512)).bfloat16()
    policy = deepwell.PrecisionPolicy(precision="fp8_tensor", first_last_bf16=False)
    compiled = torch.compile(model, backend="deepwell", options={"policy": policy})
    x = torch.randn(64, 512, generator=gen).bfloat16().requires_grad_()
    compiled(x).float().sum().backward()  # compiles (tracing calls the ops on fake tensors)
    out = []
    calls = _deepwell_calls(lambda: out.append(compiled(x)) or out[0].float().sum().backward())
    y = out[0]
    assert [s.recipe for s in deepwell.last_plan().sites] == ["fp8_tensor", "fp8_tensor"]
    assert calls.count("fp8_tensor_quantize_rowcol") == 2 and calls.count("fp8_tensor_linear") == 2
    assert "scaled_linear" not in calls
    assert calls.count("fp8_tensor_linear_backward") == 2
    h = torch.nn.functional.gelu(ops.scaled_linear(x.detach(), model[0].weight, model[0].bias, "fp8_tensor", None))
    ref = ops.scaled_linear(h, model[2].weight, model[2].bias, "fp8_tensor", None)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_the_backend_is_bit_identical_to_the_eager_layers(device, gen):
    """The backend's fp8_tensor sites (x's amax a torch reduction in the graph, which Inductor fuses
    into x's producer; dy's in the backward's) against `fp8_tensor_linear` called eagerly, whose
    quantizers reduce their own amax: y and every gradient bit for bit. Two stacked layers, so the
    second one's x is the first one's output and nothing else differs between the two runs."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 192), torch.nn.Linear(192, 128)).to(device, torch.bfloat16)
    x = torch.randn(3, 64, 256, generator=gen).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(3, 64, 128, generator=gen).to(device, torch.bfloat16)
    policy = deepwell.PrecisionPolicy(precision="fp8_tensor", first_last_bf16=False, min_features=64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="deepwell", options={"policy": policy})
    leaves = (x, *model.parameters())
    got = compiled(x)
    got = (got, *torch.autograd.grad(got, leaves, dy))
    assert [s.recipe for s in deepwell.last_plan().sites] == ["fp8_tensor", "fp8_tensor"]
    h = deepwell.fp8_tensor_linear(x, model[0].weight, model[0].bias)
    want = deepwell.fp8_tensor_linear(h, model[1].weight, model[1].bias)
    want = (want, *torch.autograd.grad(want, leaves, dy))
    for i, (a, b) in enumerate(zip(got, want)):
        assert same_bits(a, b), i
    torch._dynamo.reset()


def test_errors_name_the_op_and_argument(gen):
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    with pytest.raises(RuntimeError, match=r"fp8_tensor_linear: argument 'recipe' must be 'fp8_tensor'.*\"fp8_block\""):
        ops.fp8_tensor_linear(x, w, None, "fp8_block")
    _, codes, scale = ops.fp8_tensor_linear(x, w, None)
    dy = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match=r"fp8_tensor_linear_backward: argument 'x_codes_t' must have shape \[32, 4\]"):
        ops.fp8_tensor_linear_backward(dy, codes.t(), scale, w, "fp8_tensor", True, True)
    with pytest.raises(RuntimeError, match=r"fp8_tensor_linear_backward: argument 'x_codes_t' must have dtype"):
        ops.fp8_tensor_linear_backward(dy, codes.float(), scale, w, "fp8_tensor", True, True)
    with pytest.raises(RuntimeError, match=r"grad_out has 16 features .* but weight has out_features 8"):
        ops.fp8_tensor_linear_backward(torch.randn(2, 16), codes, scale, torch.randn(8, 32), "fp8_tensor", True, True)
    for amax, match in ((torch.ones(1), r"'grad_amax' must have shape \[\]"),
                        (torch.ones((), dtype=torch.float64), r"'grad_amax' must have dtype torch.float32")):
        with pytest.raises(RuntimeError, match=r"fp8_tensor_linear_backward: argument " + match):
            ops.fp8_tensor_linear_backward(dy, codes, scale, w, "fp8_tensor", True, True, amax)


@pytest.mark.parametrize("device", DEVICES)
def test_layers_sharing_one_quantization(device, gen):
    """Two layers reading one x through fp8_tensor_linear on one quantization of x:
    outputs and every gradient (dx summed over both) bit-identical to two scaled_linear calls."""
    x = torch.randn(3, 40, 64, generator=gen).bfloat16().to(device)
    ws = [(torch.randn(n, 64, generator=gen) / 8).bfloat16().to(device) for n in (48, 32)]
    dys = [torch.randn(3, 40, w.shape[0], generator=gen).bfloat16().to(device) for w in ws]
    results = []
    for shared in (False, True):
        xl = x.clone().requires_grad_()
        wl = [w.clone().requires_grad_() for w in ws]
        if shared:
            codes, codes_t, scale = ops.fp8_tensor_quantize_rowcol(xl.detach().reshape(-1, 64), "e4m3")
            ys = [ops.fp8_tensor_linear(xl, w, None, "fp8_tensor", codes, scale, codes_t)[0] for w in wl]
        else:
            ys = [ops.scaled_linear(xl, w, None, "fp8_tensor", None) for w in wl]
        grads = torch.autograd.grad(ys, [xl, *wl], dys)
        results.append([*ys, *grads])
    for a, b in zip(*results):
        assert same_bits(a.cpu(), b.cpu())


def test_backend_quantizes_a_shared_input_once(gen):
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(512, 512) for _ in range(3))

        def forward(self, x):
            return self.c(self.a(x) * torch.sigmoid(self.b(x)))

    model = TwoHeads().bfloat16()
    policy = deepwell.PrecisionPolicy(precision="fp8_tensor", first_last_bf16=False)
    compiled = torch.compile(model, backend="deepwell", options={"policy": policy})
    x = torch.randn(64, 512, generator=gen).bfloat16().requires_grad_()
    compiled(x).float().sum().backward()
    out = []
    calls = _deepwell_calls(lambda: out.append(compiled(x)) or out[0].float().sum().backward())
    assert calls.count("fp8_tensor_quantize_rowcol") == 2  # a and b share x's codes; c has its own
    assert calls.count("fp8_tensor_linear") == 3
    assert calls.count("fp8_tensor_linear_backward") == 3
    want = ops.scaled_linear(
        ops.scaled_linear(x, model.a.weight, model.a.bias, "fp8_tensor", None)
        * torch.sigmoid(ops.scaled_linear(x, model.b.weight, model.b.bias, "fp8_tensor", None)),
        model.c.weight, model.c.bias, "fp8_tensor", None,
    )
    # Inductor computes a * sigmoid(b) in fp32 before the one bf16 rounding, eager rounds twice; the
    # next layer's FP8 quantization turns those last-bit differences into whole code steps.
    assert ((out[0].float() - want.float()).norm() / want.float().norm()).item() < 3e-2


def _weight_cases(n, k, gen):
    """Weights a layer's W's amax must handle: ordinary, all zeros, a saturating outlier, +Inf, NaN."""
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    outlier, inf, nan = w.clone(), w.clone(), w.clone()
    outlier[1, 2] = 3e38
    inf[0, 0] = float("inf")
    nan[2, 1] = float("nan")
    return {"ordinary": w, "zeros": torch.zeros_like(w), "outlier": outlier, "inf": inf, "nan": nan}


def _weight_amax_run(x, w, dy, recipe, weight_amax, copies):
    """y, dx, dW of one fp8_tensor_linear layer given W's amax (or None), and x's codes as `copies`
    says: "none" (the op quantizes x), "both" or "rows"."""
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    codes, codes_t, scale = ops.fp8_tensor_quantize_rowcol(xl.detach().reshape(-1, x.shape[-1]), "e4m3")
    given = {"none": (), "both": (codes, scale, codes_t), "rows": (codes, scale)}[copies]
    y = ops.fp8_tensor_linear(xl, wl, None, recipe, *given, weight_amax=weight_amax)[0]
    return (y, *torch.autograd.grad(y, (xl, wl), dy))


@pytest.mark.parametrize("device,recipe", [("cpu", "fp8_tensor@sm_90"),
                                           pytest.param("cuda", "fp8_tensor", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", ["ordinary", "zeros", "outlier", "inf", "nan"])
@pytest.mark.parametrize("copies", ["none", "both", "rows"])
def test_a_given_weight_amax_gives_the_ops_own_results(device, recipe, case, copies, gen):
    """`weight_amax` = amax_of(W), as the backend's graph gives it: y, dx and dW bit-identical to the
    layer reducing W's amax itself, on the paths that read it (sm_90's native arguments through the
    CPU model, the GPU). Teeth: the argument is really read. A wrong amax (an eighth of W's: the
    scale grows 8x and W's largest values saturate) raises on the CPU, which checks the value, and
    changes y on the GPU, which trusts it (a power-of-two multiple of the true amax larger than it
    would give the same y there, the scale being a power of two)."""
    w = _weight_cases(48, 64, gen)[case].to(device)
    x = torch.randn(2, 40, 64, generator=gen).bfloat16().to(device)
    dy = torch.randn(2, 40, 48, generator=gen).bfloat16().to(device)
    own = _weight_amax_run(x, w, dy, recipe, None, copies)
    given = _weight_amax_run(x, w, dy, recipe, deepwell.ops.fp8_tensor.amax_of(w), copies)
    for i, (a, b) in enumerate(zip(own, given)):
        assert same_bits(a.cpu(), b.cpu()), i
    if case == "ordinary" and device == "cpu":
        with pytest.raises(RuntimeError, match=r"argument 'weight_amax' must be the amax of 'weight'"):
            _weight_amax_run(x, w, dy, recipe, deepwell.ops.fp8_tensor.amax_of(w) / 8, copies)
    elif case == "ordinary":
        wrong = _weight_amax_run(x, w, dy, recipe, deepwell.ops.fp8_tensor.amax_of(w) / 8, copies)
        assert not same_bits(own[0].cpu(), wrong[0].cpu())


def test_weight_amax_errors_name_the_op_and_argument(gen):
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    codes, codes_t, scale = ops.fp8_tensor_quantize_rowcol(x, "e4m3")
    for bad, match in ((torch.ones(1), r"'weight_amax' must have shape \[\]"),
                       (torch.ones((), dtype=torch.float64), r"'weight_amax' must have dtype torch.float32")):
        for given in ((), (codes, scale), (codes, scale, codes_t)):
            with pytest.raises(RuntimeError, match=r"fp8_tensor_linear: argument " + match):
                ops.fp8_tensor_linear(x, w, None, "fp8_tensor", *given, weight_amax=bad)
            with pytest.raises(RuntimeError, match=r"fp8_tensor_linear: argument " + match.replace("weight", "x")):
                ops.fp8_tensor_linear(x, w, None, "fp8_tensor", *given, x_amax=bad)
        with pytest.raises(RuntimeError, match=r"fp8_tensor_linear_backward: argument " + match):
            ops.fp8_tensor_linear_backward(torch.randn(4, 16), codes_t.view(torch.uint8), scale, w, "fp8_tensor",
                                           True, True, None, bad)
    with pytest.raises(RuntimeError, match=r"fp8_tensor_linear: argument 'x_codes' must have shape \[4, 32\]"):
        ops.fp8_tensor_linear(x, w, None, "fp8_tensor", codes_t, scale)
    with pytest.raises(RuntimeError, match=r"fp8_tensor_linear: argument 'x_codes_t' must have shape \[32, 4\]"):
        ops.fp8_tensor_linear(x, w, None, "fp8_tensor", codes, scale, codes)
    with pytest.raises(RuntimeError, match=r"fp8_tensor_linear: argument 'x_scale_inv' must have shape \[\]"):
        ops.fp8_tensor_linear(x, w, None, "fp8_tensor", codes, scale.reshape(1))


@pytest.mark.parametrize("given,missing", [
    ({"x_codes": 0}, "x_scale_inv"),
    ({"x_scale_inv": 2}, "x_codes"),
    ({"x_codes_t": 1}, "x_codes"),
    ({"x_scale_inv": 2, "x_codes_t": 1}, "x_codes"),
])
def test_the_codes_come_with_their_scale_and_the_columns_with_the_rows(given, missing):
    """x's row codes come with the scale, and the transposed codes only with the row codes: any other
    combination of the optional operands raises, naming one that is missing."""
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    codes = ops.fp8_tensor_quantize_rowcol(x, "e4m3")
    kwargs = {name: codes[i] for name, i in given.items()}
    with pytest.raises(RuntimeError, match=rf"deepwell.fp8_tensor_linear: argument '{missing}' must be given with"):
        ops.fp8_tensor_linear(x, w, None, "fp8_tensor", **kwargs)


@pytest.mark.parametrize("copies", ["none", "both", "rows"])
def test_the_fake_kernel_gives_the_real_outputs_shapes(copies, gen):
    """Traced on fake tensors, every combination of given codes returns y and outputs 1-2 of the real
    call's shapes and dtypes (the transposed codes and scale the op made, or empty tensors)."""
    x, w = torch.randn(2, 40, 48, generator=gen), torch.randn(32, 48, generator=gen)
    codes, codes_t, scale = ops.fp8_tensor_quantize_rowcol(x.reshape(-1, 48), "e4m3")
    given = {"none": (), "both": (codes, scale, codes_t), "rows": (codes, scale)}[copies]
    real = ops.fp8_tensor_linear(x, w, None, "fp8_tensor", *given)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.fp8_tensor_linear(*(mode.from_tensor(t) for t in (x, w)), None, "fp8_tensor",
                                     *(mode.from_tensor(t) for t in given))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
