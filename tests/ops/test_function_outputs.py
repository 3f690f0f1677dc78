"""deepwell's torch.autograd.Function classes under torch.compile (ops/_function.py).

A Function whose forward returns a tensor made by a self-returning op (`t.to(t.dtype)`,
`.contiguous()` of a contiguous tensor) gets zero gradients for every input under torch.compile on
torch 2.11, silently (torch 2.15 is fixed). Found on the H100 (torch 2.11): DeepwellMoE's emulated
experts (fp8_block off sm_90, mxfp8 off Blackwell, every recipe on the CPU) trained nothing when
compiled. Two guards: the rule read from the source (so CI's torch, which has no bug to show, still
catches a forward that breaks it), and each Function's gradients compiled against eager, in the
dtypes where the cast is a no-op (which fail on torch 2.11 if the rule is broken)."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest
import torch

import deepwell

PACKAGE = pathlib.Path(deepwell.__file__).parent
# Tensor methods that may hand back their own input.
SELF_RETURNING = {"to", "contiguous", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda"}


def _functions():
    """(file, class, forward) of every torch.autograd.Function subclass in the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and any(ast.unparse(b).endswith("autograd.Function") for b in cls.bases):
                fwd = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
                if fwd is not None:
                    yield path.relative_to(PACKAGE), cls.name, fwd


def test_the_package_has_functions_to_check():
    names = {name for _, name, _ in _functions()}
    assert {"_GroupedEmulated", "_Combine", "_Dispatch", "GroupedMxfp8"} <= names


def test_no_forward_returns_a_self_returning_op():
    bad = []
    for path, name, fwd in _functions():
        for ret in (n for n in ast.walk(fwd) if isinstance(n, ast.Return) and n.value is not None):
            values = ret.value.elts if isinstance(ret.value, ast.Tuple) else [ret.value]
            for v in values:
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in SELF_RETURNING:
                    bad.append(f"{path}:{ret.lineno} {name}.forward returns {ast.unparse(v)}")
    assert not bad, "use deepwell.ops._function.cast instead:\n" + "\n".join(bad)


def _grads(fn, inputs, dy, compiled):
    f = torch.compile(fn, fullgraph=True, backend="eager") if compiled else fn
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = f(*leaves)
    out.backward(dy)
    return [out.detach()] + [t.grad for t in leaves]


def _same_compiled(fn, inputs, dy):
    torch._dynamo.reset()
    eager, compiled = _grads(fn, inputs, dy, False), _grads(fn, inputs, dy, True)
    for e, c in zip(eager, compiled):
        assert c is not None and torch.equal(e, c)
        assert e.abs().sum() > 0  # a gradient that trains something


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dispatch_and_combine(dtype):
    """float64 takes the torch path of moe_combine, whose fp32-or-wider sum needed no cast."""
    g = torch.Generator().manual_seed(0)
    experts = torch.tensor([[0, 2], [1, 2], [2, 0]], dtype=torch.int32)
    row_of_slot, slot_of_row, _ = deepwell.moe_permute_index(experts, torch.zeros_like(experts, dtype=torch.bool), 3)
    x = torch.randn(3, 8, generator=g, dtype=dtype)
    weights = torch.rand(3, 2, generator=g, dtype=dtype)

    def fn(x, weights):
        rows = deepwell.moe_dispatch(x, slot_of_row, row_of_slot) * 2
        return deepwell.moe_combine(rows, weights, row_of_slot, slot_of_row)

    _same_compiled(fn, (x, weights), torch.randn(3, 8, generator=g, dtype=dtype))


CASES = [("cpu", "fp8_block", torch.float32), ("cpu", "mxfp8", torch.float32)]
if torch.cuda.is_available():
    # On the GPU the emulation multiplies bf16: the cast to bf16 x is the no-op (mxfp8 off Blackwell).
    CASES.append(("cuda", "mxfp8", torch.bfloat16))


@pytest.mark.parametrize("device,recipe,dtype", CASES)
def test_emulated_grouped_linear(device, recipe, dtype):
    """The grouped exact emulation multiplies fp32 on the CPU and bf16 on a GPU, so its cast back to
    x's dtype is the no-op there. (torch 2.11's _grouped_mm cannot trace fp32 at all: it goes
    through deepwell_moe::grouped_mm there.)"""
    gl = importlib.import_module("deepwell.ops.grouped_linear")
    if gl.backend_on(recipe, device, True, True) != "emulated_grouped":
        pytest.skip(f"{recipe} is not emulated on this {device}")
    g = torch.Generator().manual_seed(1)
    off = torch.tensor([0, 128, 128, 384], dtype=torch.int32, device=device)
    x = torch.randn(384, 128, generator=g).to(device, dtype)
    w = (torch.randn(3, 128, 128, generator=g) / 12).to(device, dtype)
    dy = torch.randn(384, 128, generator=g).to(device, dtype)
    _same_compiled(lambda x, w: deepwell.grouped_linear(x, w, off, recipe, groups_aligned=True), (x, w), dy)
