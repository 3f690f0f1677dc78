"""The run-time guardrails of compiled models (compiler/guard.py): a quantized site whose weight is
poisoned falls back to bf16 alone, within 2 * interval calls, says so and trains on; healthy
training keeps every site quantized; fallback="error" raises and fallback="none" compiles as
without guardrails; each graph of a graph break keeps its own guard; the options are checked."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import deepwell
from deepwell.compiler import backend as dw_backend
from deepwell.compiler import guard

D, TOKENS = 256, 64
#: inp and out bf16 by name, so that each graph of a graph break keeps one mxfp8 site.
POLICY = deepwell.PrecisionPolicy(precision="mxfp8", min_features=0, first_last_bf16=False,
                                  name_overrides={"inp": "bf16", "out": "bf16"})


class Net(torch.nn.Module):
    """inp (bf16 by policy) -> a and b side by side (mxfp8) -> out (bf16): a
    poisoned `a` makes only a's output non-finite, b's input staying finite."""

    def __init__(self, graph_break: bool = False):
        super().__init__()
        self.inp, self.a, self.b, self.out = (torch.nn.Linear(D, D) for _ in range(4))
        self.graph_break = graph_break

    def forward(self, x):
        h = torch.relu(self.inp(x))
        ya = self.a(h)
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.out(ya + self.b(h))


def _compiled(net, **options):
    torch._dynamo.reset()
    return torch.compile(net, backend="deepwell", options={"policy": POLICY, **options})


def _net_and_model(seed, **options):
    """A fresh `Net` (its weights drawn after `torch.manual_seed(seed)`) and its compiled model."""
    torch.manual_seed(seed)
    net = Net()
    return net, _compiled(net, **options)


def _set_weight(layer, at, value):
    """Writes `value` into `layer.weight[at]` outside autograd: a site poisoned, or repaired."""
    with torch.no_grad():
        layer.weight[at] = value


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(TOKENS, D, generator=g) for _ in range(n)]


def _train(model, net, data, opt):
    """One step per batch; a non-finite loss skips the optimizer step (as the Trainer does)."""
    losses = []
    for x in data:
        loss = model(x).square().mean()
        loss.backward()
        if math.isfinite(loss.item()):
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _running(net):
    return {n: r.active_recipe for n, r in guard.records_of(net).items()}


@pytest.mark.parametrize("poison", [math.inf, math.nan])
def test_a_poisoned_site_falls_back_alone_within_two_intervals_and_training_goes_on(poison):
    net, model = _net_and_model(0, guardrails={"interval": 2})
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    assert all(math.isfinite(v) for v in _train(model, net, _data(3), opt))
    assert _running(net) == {"a.weight": "mxfp8", "b.weight": "mxfp8"}

    clean = net.a.weight.detach().clone()
    _set_weight(net.a, (5, 7), poison)
    with pytest.warns(UserWarning, match=r"GEMM site 'a' falls back from mxfp8 to bf16 \(.*non-finite output"):
        calls = 0
        while _running(net)["a.weight"] == "mxfp8":
            assert calls < 4, "no fallback within 2 * interval calls"
            _train(model, net, _data(1, seed=10 + calls), opt)
            calls += 1
    assert _running(net) == {"a.weight": "bf16", "b.weight": "mxfp8"}
    with torch.no_grad():
        net.a.weight.copy_(clean)  # the weight repaired: the site trains on in bf16
    losses = _train(model, net, _data(4, seed=20), opt)
    assert all(math.isfinite(v) for v in losses)

    # The graph runs a unquantized and b still in mxfp8: its output is the eager model's with b's
    # GEMM through deepwell's op.
    plan = deepwell.last_plan()
    by = {s.name: s for s in plan.sites}
    assert by["a"].recipe == "bf16" and by["a"].decision.rule == "Guardrail" and "non-finite output" in by["a"].decision.reason
    assert by["b"].recipe == "mxfp8" and by["inp"].recipe == "bf16"
    x = _data(1, seed=30)[0]
    with torch.no_grad():
        h = torch.relu(net.inp(x))
        want = net.out(net.a(h) + torch.ops.deepwell.scaled_linear(h, net.b.weight, net.b.bias, "mxfp8", None))
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    record = next(r for r in deepwell.policy_report() if r.name == "a" and r is guard.records_of(net)["a.weight"])
    assert record.recipe == "mxfp8" and record.active_recipe == "bf16" and "non-finite output values" in record.events[0]


def test_healthy_training_keeps_every_site_quantized():
    net, model = _net_and_model(1, guardrails={"interval": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        losses = _train(model, net, _data(8, seed=2), torch.optim.SGD(net.parameters(), lr=1e-3))
    assert all(math.isfinite(v) for v in losses)
    (g,) = guard.graphs_of(net)
    assert g.calls == 8 and g.observed is not None and g.forced == set()
    assert _running(net) == {"a.weight": "mxfp8", "b.weight": "mxfp8"}


def test_the_observed_call_computes_what_the_plain_one_does():
    """The statistics are extra outputs: the model's outputs and gradients are bit for bit the
    plain variant's (so where the statistics calls fall changes no numerics)."""
    net, model = _net_and_model(2, guardrails={"interval": 2})
    x = _data(1, seed=3)[0]
    outs, grads = [], []
    for _ in range(2):  # call 1 plain, call 2 observed
        y = model(x)
        y.square().mean().backward()
        outs.append(y.detach())
        grads.append([p.grad.clone() for p in net.parameters()])
        net.zero_grad(set_to_none=True)
    (g,) = guard.graphs_of(net)
    assert g._pending is not None and g.rows == ["a", "b"]
    assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*grads))


def test_each_graph_of_a_graph_break_keeps_its_own_guard():
    torch.manual_seed(3)
    net = Net(graph_break=True)
    model = _compiled(net, guardrails={"interval": 1})
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    _train(model, net, _data(1), opt)
    graphs = guard.graphs_of(net)
    assert len(graphs) == 2 and sorted(sorted(g.records) for g in graphs) == [["a"], ["b"]]
    _set_weight(net.a, (0, 0), math.inf)
    with pytest.warns(UserWarning, match="'a' falls back"):
        _train(model, net, _data(2, seed=4), opt)
    by = {next(iter(g.records)): g for g in graphs}
    assert by["a"].forced == {"a"} and by["b"].forced == set() and by["b"].watching


def test_fallback_error_raises_naming_the_site():
    net, model = _net_and_model(4, fallback="error", guardrails={"interval": 1})
    _set_weight(net.b, (1, 2), math.nan)
    with pytest.raises(RuntimeError, match=r"guardrail of GEMM site 'b' \(mxfp8\) at call 1: .*fallback='error'"):
        for x in _data(3):
            model(x)


def test_fallback_none_compiles_without_guard():
    net, model = _net_and_model(5, fallback="none", guardrails={"interval": 1})
    _set_weight(net.a, (0, 0), math.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for x in _data(3):
            assert not torch.isfinite(model(x)).all()
    assert guard.graphs_of(net) == [] and guard.records_of(net) == {}
    assert deepwell.last_plan().sites[1].recipe == "mxfp8"


def test_a_graph_compiled_after_a_fallback_starts_in_bf16():
    """The fallback belongs to the weight: the no_grad graph Dynamo compiles later plans the site bf16."""
    net, model = _net_and_model(6, guardrails={"interval": 1})
    _set_weight(net.a, (0, 0), math.inf)
    with pytest.warns(UserWarning, match="'a' falls back"):
        for x in _data(2):
            model(x).sum().backward()
    with torch.no_grad():
        model(_data(1)[0])
    assert len(guard.graphs_of(net)) == 2 and all(g.forced == {"a"} for g in guard.graphs_of(net))
    assert {s.name: s.recipe for s in deepwell.last_plan().sites}["a"] == "bf16"


@pytest.mark.parametrize(
    "guardrails,says",
    [
        ({"interval": 0}, "'interval' must be a positive int, got 0"),
        ({"interval": 2.5}, "'interval' must be a positive int, got 2.5"),
        ({"interval": True}, "'interval' must be a positive int, got True"),
        ({"saturation_threshold": 2.0}, "'saturation_threshold' must be a number in"),
        (16, "'guardrails' must be a deepwell.GuardrailConfig"),
    ],
)
def test_bad_guardrail_options_name_the_field(guardrails, says):
    with pytest.raises(ValueError, match=says):
        deepwell.CompileOptions(guardrails=guardrails)


def test_the_default_is_the_guarded_safe_fallback():
    opts = deepwell.CompileOptions()
    assert opts.fallback.value == "safe" and opts.guardrails == deepwell.GuardrailConfig(interval=16)
    assert deepwell.CompileOptions(guardrails=deepwell.GuardrailConfig(interval=4)).guardrails.interval == 4
    assert dw_backend.CompileOptions.of({"fallback": "none"}).fallback.value == "none"


@pytest.mark.gpu
def test_on_the_gpu_the_statistics_reach_pinned_memory_behind_an_event():
    torch.manual_seed(7)
    net = Net().cuda().to(torch.bfloat16)
    model = _compiled(net, guardrails={"interval": 2})
    x = torch.randn(TOKENS, D, device="cuda", dtype=torch.bfloat16)
    model(x), model(x)  # call 2 observed
    (g,) = guard.graphs_of(net)
    call, host, event, rows = g._pending
    assert call == 2 and host.device.type == "cpu" and host.is_pinned() and event is not None and rows == ["a", "b"]
    torch.cuda.synchronize()
    assert g.poll() == [] and g._pending is None
    _set_weight(net.a, (0, 0), math.inf)
    with pytest.warns(UserWarning, match="'a' falls back"):
        for _ in range(4):  # calls 3-6: 4 observes the inf, 6 reads it
            model(x)
            torch.cuda.synchronize()
    assert _running(net) == {"a.weight": "bf16", "b.weight": "mxfp8"}
    _set_weight(net.a, (0, 0), 0.0)
    assert torch.isfinite(model(x)).all()


def test_a_graph_with_symbolic_shapes_stays_symbolic_after_a_fallback():
    """The later compilations run on the graph's fake inputs in Dynamo's tracing context: the
    re-planned graph serves every token count, without recompiling."""
    torch.manual_seed(8)
    net = Net()
    torch._dynamo.reset()
    model = torch.compile(net, backend="deepwell", dynamic=True, options={"policy": POLICY, "guardrails": {"interval": 1}})
    with torch.no_grad():
        net.a.weight[0, 0] = math.inf
        with pytest.warns(UserWarning, match="'a' falls back"):
            for rows in (32, 64):
                model(torch.randn(rows, D))
        net.a.weight[0, 0] = 0.0
        (g,) = guard.graphs_of(net)
        plain = g.plain
        for rows in (32, 96, 160):
            x = torch.randn(rows, D)
            h = torch.relu(net.inp(x))
            want = net.out(net.a(h) + torch.ops.deepwell.scaled_linear(h, net.b.weight, net.b.bias, "mxfp8", None))
            torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert guard.graphs_of(net) == [g] and g.plain is plain and g.forced == {"a"}
