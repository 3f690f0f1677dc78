"""The GEMM detector tests/ops/test_cuda_kernels.py picks each op's tolerance with, checked on the CPU:
it must see the GEMM of every op that has one (else that op's GPU comparison would demand identical
bits) and none in the quantizers and layout ops (else their bit-exactness would go unchecked)."""

from __future__ import annotations

import re

import pytest
import torch

import deepwell  # noqa: F401 (registers torch.ops.deepwell)
from gemm_calls import cpu_call_with_gemms
from op_cases import cases

ops = torch.ops.deepwell
#: Op names of the families that multiply matrices (linear layers, GEMMs, fused MLPs, attention).
HAS_GEMM = re.compile(r"linear|gemm|wgrad|_mlp|attention")


def _models_another_gpu(args, kwargs) -> bool:
    """A recipe naming a GPU to model ('recipe@sm_XX'): the CUDA comparison never runs it."""
    return any(isinstance(a, str) and "@" in a for a in (*args, *kwargs.values()))


CASES = [(name, i) for name, calls in cases().items() for i, (args, kwargs) in enumerate(calls)
         if not _models_another_gpu(args, kwargs)]


@pytest.mark.parametrize("name,i", CASES)
def test_gemm_seen_exactly_in_gemm_ops(name, i):
    args, kwargs = cases()[name][i]
    _, gemm = cpu_call_with_gemms(getattr(ops, name).default, *args, **kwargs)
    assert gemm == bool(HAS_GEMM.search(name)), f"{name}: GEMM seen {gemm}"


def test_the_ops_the_old_table_missed_are_seen():
    for name in ("fp8_tensor_linear", "fp8_block_linear"):  # on x's row copy alone, each
        rows_only = [c for c in cases()[name] if c[0][4:5] != () and c[0][6:7] in ((), (None,))]
        args, kwargs = rows_only[0]
        assert cpu_call_with_gemms(getattr(ops, name).default, *args, **kwargs)[1], name
