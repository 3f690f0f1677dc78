"""The op catalogue is consistent: every torch.ops.deepwell op has a schema that matches the Rust
kernel's spec, a CPU kernel, a fake kernel, and sample cases for opcheck."""

from __future__ import annotations

import torch

from deepwell import _native
from deepwell.ops.fp8_attention import PYTHON_KERNELS
from op_cases import cases


def deepwell_ops() -> list[str]:
    names = torch._C._dispatch_get_all_op_names()
    return sorted(n.split("::", 1)[1] for n in names if n.startswith("deepwell::"))


def test_catalogue_is_not_empty():
    assert len(deepwell_ops()) >= 8


def test_every_op_has_cases_a_fake_and_a_cpu_kernel():
    table = {(k["op"], k["key"]) for k in _native.kernel_table()}
    for name in deepwell_ops():
        op = getattr(torch.ops.deepwell, name).default
        assert name in cases(), f"{name} has no opcheck case in tests/ops/op_cases.py"
        fake = torch._library.simple_registry.singleton.find(op.name()).fake_impl.kernel
        assert fake is not None, f"{name} has no fake kernel (torch.library.register_fake)"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"), f"{name} has no CPU kernel"
        # fp8_attention's kernels are torch code (an emulation): registered from Python, not Rust.
        assert (name, "CPU") in table or name in PYTHON_KERNELS, f"{name} has no Rust CPU kernel"
        # register_fake installs a Python meta kernel: tracing with fake tensors must work.
        from torch._subclasses.fake_tensor import FakeTensorMode

        args, kwargs = cases()[name][0]
        with FakeTensorMode(allow_non_fake_inputs=True):
            op(*args, **kwargs)


def test_rust_specs_match_python_schemas():
    for k in _native.kernel_table():
        schema = getattr(torch.ops.deepwell, k["op"]).default._schema
        spelling = {"Optional[Tensor]": "Tensor?", "Optional[ScalarType]": "ScalarType?", "Optional[int]": "int?"}
        got = [[a.name, spelling.get(str(a.real_type), str(a.real_type))] for a in schema.arguments]
        want = [[n, t] for n, t in k["args"]]
        assert got == want, f"{k['op']}: schema {got} vs Rust spec {want}"
        assert len(schema.returns) == k["returns"], k["op"]


def test_every_op_has_a_benchmark():
    """docs/DESIGN.md "Conventions": each op is measured by some script in benchmarks/."""
    import glob
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    text = "".join(open(p).read() for p in glob.glob(os.path.join(root, "bench_*.py")))
    missing = [name for name in deepwell_ops() if f"ops.{name}(" not in text]
    assert not missing, f"ops without a benchmark: {missing}"
