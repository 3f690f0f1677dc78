"""torch.library.opcheck on every sample call of every op (schema, fake tensor, autograd
registration, AOT dispatch), and eager vs torch.compile(fullgraph=True) giving identical bits."""

from __future__ import annotations

import pytest
import torch

from _util import same_bits
from op_cases import cases

CASES = [(name, i) for name, calls in cases().items() for i in range(len(calls))]


# torch's SchemaCheckMode compares inputs with torch.allclose, which has no CPU kernel for the fp8
# and e8m0 dtypes; for ops that take such inputs, test_schema's two properties (no input mutated,
# no output aliasing an input) are checked by test_schema_properties below instead.
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)
_ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _tensors(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("name,i", CASES)
def test_opcheck(name, i):
    args, kwargs = cases()[name][i]
    fp8_inputs = any(t.dtype in _FP8 for t in _tensors(args, kwargs))
    utils = tuple(u for u in _ALL_UTILS if not (fp8_inputs and u == "test_schema"))
    torch.library.opcheck(getattr(torch.ops.deepwell, name).default, args, kwargs, test_utils=utils)


@pytest.mark.parametrize("name,i", CASES)
def test_schema_properties(name, i):
    """Functional ops: inputs are bitwise unchanged and no output shares storage with an input."""
    args, kwargs = cases()[name][i]
    inputs = _tensors(args, kwargs)
    before = [t.clone() for t in inputs]
    outs = getattr(torch.ops.deepwell, name).default(*args, **kwargs)
    for t, b in zip(inputs, before):
        assert same_bits(t, b), f"{name} mutated an input"
    ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    for o in _outputs(outs):
        assert o.untyped_storage().data_ptr() not in ptrs, f"{name} returned an alias of an input"


def _outputs(x):
    return x if isinstance(x, (tuple, list)) else (x,)


@pytest.mark.parametrize("name,i", CASES)
def test_eager_equals_compiled(name, i):
    args, kwargs = cases()[name][i]
    op = getattr(torch.ops.deepwell, name).default

    def f(*a):
        return op(*a, **kwargs)

    torch._dynamo.reset()
    eager = _outputs(f(*args))
    compiled = _outputs(torch.compile(f, fullgraph=True, backend="inductor")(*args))
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        assert same_bits(e, c), name


def test_quantize_inside_a_compiled_graph_with_other_ops(gen):
    """The ops compose with Inductor-generated code around them."""
    x = torch.randn(8, 64, generator=gen)

    def f(x):
        d, s = torch.ops.deepwell.mxfp8_quantize(x * 2.0 + 1.0)
        return torch.ops.deepwell.mxfp8_dequantize(d, s, out_dtype=torch.float32).sum(-1)

    torch._dynamo.reset()
    assert same_bits(f(x), torch.compile(f, fullgraph=True)(x))
