"""The `deepwell_graph` twins of deepwell's ops and the backend pass that makes compiled graphs call
them (torch_ops/deepwell/compiler/graph_ops.py): the same kernels and fake kernels without the Python
autograd layer, so a compiled model trains to the same bits with and without the pass, and every
deepwell op of its forward and backward graphs is a twin. CPU (the emulated recipes); the GPU case
runs the native kernels the same way."""

from __future__ import annotations

import pytest
import torch

import deepwell
from deepwell import _native
from deepwell.compiler import graph_ops
from deepwell.models import Llama
from _util import adamw_steps

ops, twins = torch.ops.deepwell, torch.ops.deepwell_graph
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_every_kernel_rust_registers_has_a_twin_of_the_same_schema_without_autograd():
    names = {spec["op"] for spec in _native.kernel_table()}
    assert names == graph_ops.twinned() and len(names) > 30
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in names:
        a, b = getattr(ops, name).default._schema, getattr(twins, name).default._schema
        assert str(a).split("::", 1)[1] == str(b).split("::", 1)[1]
        assert has(f"deepwell::{name}", "Autograd") and not has(f"deepwell_graph::{name}", "Autograd")
        assert has(f"deepwell_graph::{name}", "CPU")


@pytest.mark.parametrize("device", DEVICES)
def test_a_twin_computes_the_same_bits(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 384, generator=g).mul(3).to(device=device, dtype=torch.bfloat16)
    w = torch.randn(512, 384, generator=g).to(device=device, dtype=torch.bfloat16)
    for want, got in zip(ops.fp8_block_quantize_rowcol(x, True, True), twins.fp8_block_quantize_rowcol(x, True, True)):
        assert torch.equal(want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want,
                           got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got)
    want = ops.scaled_linear(x, w, None, "fp8_tensor", None)
    assert torch.equal(want, twins.scaled_linear(x, w, None, "fp8_tensor", None))


def test_a_twins_fake_kernel_is_its_deepwell_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(256, 384, dtype=torch.bfloat16)
        w = torch.empty(512, 384, dtype=torch.bfloat16)
        want, got = [[(t.shape, t.dtype, t.stride())
                      for t in (op.scaled_linear(x, w, None, "fp8_block", None), *op.fp8_block_quantize_rowcol(x, True, True))]
                     for op in (ops, twins)]
    assert got == want and got[0] == ((256, 512), torch.bfloat16, (512, 1))
    with pytest.raises(RuntimeError, match="scaled_linear"):  # the twin's checks are the op's
        with FakeTensorMode():
            twins.scaled_linear(torch.empty(256, 384, dtype=torch.bfloat16), torch.empty(512, 128), None, "fp8_block", None)


def _namespaces_called(run) -> dict[str, int]:
    """How many calls of each deepwell namespace's ops `run()` made (the profiler sees them all)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    names = [e.name.partition("::")[0] for e in prof.events()]
    return {ns: names.count(ns) for ns in ("deepwell", "deepwell_graph")}


def _train(graph_ops_on: bool, precision: str, device: str = "cpu", steps: int = 2):
    """Losses and final weights of `steps` AdamW steps of a 2-layer Llama compiled by the backend,
    and the namespaces of the deepwell ops its last step called."""
    torch.manual_seed(0)
    model = Llama(1000, 512, 2, 8, 1024, max_seq=64).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="deepwell", options={"precision": precision, "graph_ops": graph_ops_on})
    tokens = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    # Uncached: the test counts the pass's work, which a graph loaded from Inductor's or
    # AOTAutograd's cache (keyed on the pass's uuid) already carries without running it.
    return adamw_steps(compiled, model, tokens, steps, _namespaces_called)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp8_tensor", "fp8_block"])
def test_training_through_the_twins_gives_the_same_bits(precision, device):
    before = graph_ops.STATS["retargeted"]
    losses, weights, called = _train(True, precision, device)
    retargeted = graph_ops.STATS["retargeted"] - before
    assert retargeted > 0  # forward and backward graphs both had deepwell ops
    assert called["deepwell"] == 0 and called["deepwell_graph"] > 0  # at run time, only the twins
    ref_losses, ref_weights, ref_called = _train(False, precision, device)
    assert ref_called["deepwell_graph"] == 0 and ref_called["deepwell"] == called["deepwell_graph"]
    assert graph_ops.STATS["retargeted"] - before == retargeted  # graph_ops=False: the pass did not run
    assert torch.equal(losses, ref_losses)
    for w, r in zip(weights, ref_weights):
        assert torch.equal(w, r)


def test_the_pass_retargets_only_deepwell_kernels_and_runs_a_users_pass_after():
    seen = []

    def user_pass(graph):
        seen.append(sorted({str(n.target) for n in graph.nodes if n.op == "call_function"}))

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    q = graph.call_function(ops.fp8_tensor_quantize.default, (x, "e4m3"))
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    graph.output((q, y))
    graph_ops.GraphOps(then=user_pass)(graph)
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [twins.fp8_tensor_quantize.default, torch.ops.aten.relu.default]
    assert seen and "deepwell_graph.fp8_tensor_quantize.default" in seen[0]
    # Inductor's graph cache keys on uuid(): stable, and None where a chained pass has no key.
    assert graph_ops.GraphOps().uuid() == graph_ops.GraphOps().uuid() is not None
    assert graph_ops.GraphOps(then=user_pass).uuid() is None


def test_unknown_backend_option_still_names_graph_ops():
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(8, 8), backend="deepwell", options={"graph_op": True})
    with pytest.raises(Exception, match="graph_ops"):
        compiled(torch.randn(2, 8))
