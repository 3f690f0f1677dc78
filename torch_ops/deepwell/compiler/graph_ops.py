"""Compiled graphs call deepwell's kernels without the Python autograd layer.

Every differentiable deepwell op has its autograd formula in Python (`torch.library.register_autograd`),
and even the quantizers have one (ops/_nondiff.py: a clear error instead of a missing gradient).
The dispatcher therefore calls into Python on every call of a `torch.ops.deepwell` op, to check
grad mode and redispatch below autograd: ~8.5 us of host time a call on the H200's host (2.4 ms of
the 64.4 ms it took to launch a 0.95B fp8_tensor step, 286 calls), ~22 us on the CPU box. Inside a
graph that AOTAutograd has already split into forward and backward there is nothing left for that
layer to do. So after AOTAutograd, this pass (Inductor's `post_grad_custom_post_pass`) points every
`deepwell::<op>` node of the forward and backward graphs at `deepwell_graph::<op>`: the same
schema, the same fake kernel and the same Rust kernels (rust/ops/src/register.rs registers each
kernel under both namespaces), and no autograd formula, so the dispatcher goes straight to the
kernel. Outputs are the same bits (tests/compiler/test_graph_ops.py).
"""

from __future__ import annotations

import functools
import hashlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import _native


@functools.cache
def twinned() -> frozenset[str]:
    """The ops whose kernels Rust registers (under both namespaces): only these are retargeted."""
    return frozenset(spec["op"] for spec in _native.kernel_table())


class GraphOps(CustomGraphPass):
    """Retargets `deepwell::<op>` call nodes to `deepwell_graph::<op>`, then runs `then` (the custom
    pass the user had configured, if any). Counts what it retargeted in `STATS`."""

    def __init__(self, then=None):
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        names = twinned()
        for node in graph.nodes:
            target = node.target
            if (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
                    and target.namespace == "deepwell" and target._opname in names):
                node.target = getattr(getattr(torch.ops.deepwell_graph, target._opname), target._overloadname)
                STATS["retargeted"] += 1
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        # Inductor's FX graph cache keys on this: the pass's source, and the chained pass's key
        # (None, a graph that cannot be cached, where the chained pass has no key).
        with open(__file__, "rb") as f:
            key = hashlib.sha256(f.read()).hexdigest()
        if self.then is None:
            return key
        then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else None
        return None if then is None else (key, then)


#: Nodes retargeted so far in this process (the tests' proof the pass ran).
STATS = {"retargeted": 0}
