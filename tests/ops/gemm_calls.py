"""Which deepwell op calls run a GEMM, read off the call itself: the CPU references reach aten's
matrix products through the dispatcher, which the profiler records. tests/ops/test_cuda_kernels.py
compares such ops within GEMM_RTOL (the two devices accumulate in different orders and round the
output differently) and every other op bit for bit, so a new GEMM op needs no table entry."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

#: Norm-wise relative tolerance between the CUDA and CPU results of an op with GEMMs: the same
#: quantized operands on both devices (tests/ops/test_linear.py checks both against the float64 model).
GEMM_RTOL = 5e-3

#: aten's matrix products (any overload): what a CPU reference calls to multiply.
GEMM_ATEN = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
             "aten::_scaled_mm", "aten::_scaled_mm_v2", "aten::_grouped_mm", "aten::einsum", "aten::dot")
#: aten's attention kernels (every scaled_dot_product_* forward and backward): matrix products inside.
ATTENTION_ATEN = "scaled_dot_product"


def cpu_call_with_gemms(fn, *args, **kwargs):
    """(fn(*args, **kwargs), whether it ran one of aten's matrix products)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn(*args, **kwargs)
    return out, any(e.name in GEMM_ATEN or ATTENTION_ATEN in e.name for e in prof.events())
