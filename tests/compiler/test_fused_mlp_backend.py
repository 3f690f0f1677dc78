"""The deepwell backend's SwiGLU MLP fusion (compiler/fuse_mlp.py, option `fused_mlp`): each fp8_block
`w_down(silu(w_gate(x)) * w_up(x))` becomes one `fp8_block_swiglu_mlp` with nothing of the three
sites left behind; outputs and gradients stay within FP8 noise of the unfused graph (not bit-identical:
one fp32 dx sum, deepwell's SwiGLU) and as close to float64 as it is; patterns the op cannot stand
for (a bias, an intermediate read elsewhere) stay unfused; dryrun's memory trace (plan/memory.py)
counts what the fused op saves."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import deepwell
from deepwell.compiler import backend as dw_backend
from deepwell.models import Llama
from deepwell.models.llama import FeedForward
from deepwell.plan.memory import codes_of, saved_activation_bytes
from _util import deepwell_calls as _deepwell_calls

ops = torch.ops.deepwell
D, FFN, TOKENS = 256, 384, 256
POLICY = deepwell.PrecisionPolicy(precision="fp8_block", first_last_bf16=False, min_features=128)


class _TwoMLPs(torch.nn.Module):
    """Two LLaMA FeedForwards on a residual stream: every GEMM site is an MLP's."""

    def __init__(self):
        super().__init__()
        self.ff1, self.ff2 = FeedForward(D, FFN), FeedForward(D, FFN)

    def forward(self, x):
        x = x + self.ff1(x)
        return x + self.ff2(x)


class _Variant(torch.nn.Module):
    """One MLP that the fusion must leave alone: w1 with a bias, h also returned, or silu(a) read
    again; "plain" is the fusable control."""

    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.w1 = torch.nn.Linear(D, FFN, bias=case == "bias")
        self.w3, self.w2 = torch.nn.Linear(D, FFN, bias=False), torch.nn.Linear(FFN, D, bias=False)

    def forward(self, x):
        s = F.silu(self.w1(x))
        h = s * self.w3(x)
        y = self.w2(h)
        if self.case == "h_returned":
            return y, h
        if self.case == "silu_reread":
            return y + s.sum(-1, keepdim=True)
        return y


def _seeded(make, gen):
    """`make()` with nn.Linear's own initialisation, drawn from the test's generator."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return make()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _graph_counts(model, x, **options) -> dict:
    """Counts of the rewritten graph's deepwell ops and SwiGLU nodes (backend's own rewrite, fusion or
    not, without Inductor), and the MLPs its plan fuses (`plan`)."""
    counts = {}

    def spy(gm, example_inputs, **kw):
        compile_options = deepwell.CompileOptions(policy=options.get("policy", POLICY), fp8_block_codes=True,
                                                  fused_mlp=options.get("fused_mlp", True))
        plan, found = dw_backend.plan_graph(gm, compile_options)
        counts["fused"] = dw_backend._rewrite(gm, found, compile_options)[1]
        counts["plan"] = plan.fused_mlps()
        targets = [n.target for n in gm.graph.nodes]
        counts.update(
            mlp=targets.count(ops.fp8_block_swiglu_mlp.default),
            sites=targets.count(ops.fp8_block_linear.default),
            rowcol=targets.count(ops.fp8_block_quantize_rowcol.default),
            silu=targets.count(torch.nn.functional.silu),
        )
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=spy)(x)
    torch._dynamo.reset()
    return counts


def test_each_mlp_is_one_fused_op_within_fp8_noise_of_the_unfused_graph(gen, monkeypatch, capsys):
    """Compiled by the backend with and without `fused_mlp`: the graph Inductor gets has one
    fp8_block_swiglu_mlp per MLP and none of the three sites (nor h's rowcol), which is what runs
    forward and backward; y and every gradient within 2e-2 of the unfused graph and within 1.02x of
    its error against the float64 model (itself under 0.1: FP8's noise); the fused op never
    appears with fused_mlp=False. (y and ff2's gradients come out equal; dx differs by its one
    rounding, and ff1's weight gradients, which read that dx through FP8 again, by ~1.5%.)"""
    import torch._inductor.compile_fx as inductor

    graphs = {}  # the graph module the backend hands Inductor -> its targets (compile_fx may call itself)
    compile_fx = inductor.compile_fx

    def record(gm, *args, **kwargs):
        graphs.setdefault(gm, [n.target for n in gm.graph.nodes])
        return compile_fx(gm, *args, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", record)
    reference = _seeded(_TwoMLPs, gen).double()
    x = torch.randn(2, TOKENS // 2, D, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, TOKENS // 2, D, generator=gen, dtype=torch.float64)

    def run(model, x):
        x = x.clone().requires_grad_()
        y = model(x)
        return [y.detach(), *torch.autograd.grad(y, [x, *model.parameters()], dy.to(y.dtype))]

    want = run(reference, x)
    got, calls = {}, {}
    for fused in (False, True):
        model = copy.deepcopy(reference).bfloat16()
        torch._dynamo.reset()
        before = dw_backend.STATS["fused_mlps"]
        compiled = torch.compile(model, backend="deepwell", options={"policy": POLICY, "fused_mlp": fused, "verbose": True})
        got[fused] = run(compiled, x.bfloat16())
        assert dw_backend.STATS["fused_mlps"] - before == (2 if fused else 0)
        assert f"{2 if fused else 0} SwiGLU MLP(s) fused" in capsys.readouterr().out
        calls[fused] = _deepwell_calls(lambda: run(compiled, x.bfloat16()))
    torch._dynamo.reset()

    unfused, fused = graphs.values()
    assert unfused.count(ops.fp8_block_swiglu_mlp.default) == 0 and unfused.count(ops.fp8_block_linear.default) == 6
    assert fused.count(ops.fp8_block_swiglu_mlp.default) == 2 and fused.count(ops.fp8_block_linear.default) == 0
    assert fused.count(ops.fp8_block_quantize_rowcol.default) == 2 and unfused.count(ops.fp8_block_quantize_rowcol.default) == 4
    assert torch.nn.functional.silu not in fused
    assert calls[True].count("fp8_block_swiglu_mlp") == 2 and calls[True].count("fp8_block_swiglu_mlp_backward") == 2
    assert "fp8_block_linear" not in calls[True] and "fp8_block_swiglu_mlp" not in calls[False]

    names = ["y", "dx", *(n for n, _ in reference.named_parameters())]
    for name, f, u, w in zip(names, got[True], got[False], want):
        assert _rel(f, u) < 2e-2, name
        assert _rel(f, w) < 0.1 and _rel(f, w) < 1.02 * _rel(u, w), name


def test_the_llama_mlps_are_fused_and_their_nodes_erased():
    """deepwell.models.Llama under the plan's defaults (first and last site bf16: neither is an MLP's):
    one fused op per layer, its three sites on codes and h's rowcol gone, the attention's kept."""
    torch.manual_seed(0)
    model = Llama(1000, D, 2, 4, FFN, max_seq=128)
    tokens = torch.randint(0, 1000, (2, 128))
    policy = deepwell.PrecisionPolicy(precision="fp8_block", min_features=128)
    on = _graph_counts(model, tokens, policy=policy)
    off = _graph_counts(model, tokens, policy=policy, fused_mlp=False)
    assert on["fused"] == on["mlp"] == 2 and off["mlp"] == 0
    assert off["sites"] - on["sites"] == 3 * 2 and off["rowcol"] - on["rowcol"] == 2
    assert on["silu"] == 0 and off["silu"] == 2


@pytest.mark.parametrize("case", ["plain", "bias", "h_returned", "silu_reread"])
def test_only_the_pattern_the_op_computes_is_fused(case, gen):
    """A bias on a site, or h or silu(a) read outside the MLP, keeps the three sites (the op has no
    bias and keeps its intermediates to itself); the plan says which MLP runs fused."""
    model = _seeded(lambda: _Variant(case), gen).bfloat16()
    x = torch.randn(TOKENS, D, generator=gen).bfloat16()
    counts = _graph_counts(model, x)
    fusable = case == "plain"
    assert counts["mlp"] == counts["fused"] == int(fusable)
    assert counts["sites"] == (0 if fusable else 3)
    assert counts["plan"] == ({("w1", "w3", "w2")} if fusable else set())


def test_the_memory_trace_counts_what_the_fused_op_saves(gen):
    """dryrun's trace of the MLPs the plan fuses: per MLP x's column codes and scales, gate_up (tokens x 2F in
    bf16, the largest saved tensor), h's column codes and scales; the same total as the unfused
    sites' (a and b in bf16 for SwiGLU's backward, h's column copy), where a or b is the largest.
    deepwell.dryrun predicts that total."""
    model = _seeded(_TwoMLPs, gen).bfloat16()
    x = torch.randn(2, TOKENS // 2, D, generator=gen).bfloat16()
    ir = deepwell.capture(model, (x,))
    plan = deepwell.autoplan(ir, policy=POLICY)
    codes = codes_of(plan)
    engine = deepwell.compile(ir, plan=plan, fused_mlp=True)
    mlps = engine.plan.fused_mlps()
    assert len(codes) == 6 and len(mlps) == 2
    assert deepwell.compile(ir, plan=plan, fused_mlp=False).plan.fused_mlps() == set()
    per_mlp = (TOKENS * D + TOKENS // 128 * D * 4) + TOKENS * 2 * FFN * 2 + (FFN * TOKENS + TOKENS // 128 * FFN * 4)
    fused = saved_activation_bytes(model, (x,), True, codes=codes, mlps=mlps)
    unfused = saved_activation_bytes(model, (x,), True, codes=codes)
    assert fused[:2] == (2 * per_mlp, TOKENS * 2 * FFN * 2)
    assert unfused[:2] == (2 * per_mlp, TOKENS * FFN * 2)
    assert deepwell.dryrun(deepwell.compile(ir, plan=plan, fused_mlp=True)).activations == 2 * per_mlp


def test_off_by_default(gen):
    """The option's default is off (`CompileOptions.fused_mlp`: measured no faster than the three sites,
    docs/BASELINES.md "deepwell on the H100"): compiled without it, no MLP is fused; with it, each is."""
    model = _seeded(_TwoMLPs, gen).bfloat16()
    x = torch.randn(TOKENS, D, generator=gen).bfloat16()
    assert deepwell.CompileOptions().fused_mlp is False
    for options, want in (({"policy": POLICY}, 0), ({"policy": POLICY, "fused_mlp": True}, 2)):
        before = dw_backend.STATS["fused_mlps"]
        torch._dynamo.reset()
        torch.compile(model, backend="deepwell", options=options)(x)
        assert dw_backend.STATS["fused_mlps"] - before == want
    torch._dynamo.reset()
