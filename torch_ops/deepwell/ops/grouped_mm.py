"""`grouped_mm(a, b, offs)`: `torch._grouped_mm` for every float dtype, under torch.compile too.

torch._grouped_mm's eager kernels take fp32, fp16 and bf16 (one CUTLASS kernel for bf16 on sm_90 /
sm_100, a loop over the groups otherwise), but the fake (meta) kernel of some torch releases takes
bf16 only: torch 2.11's refuses fp32 ("Expected inputs of BF16 type"), so a compiled graph whose
experts run in fp32 failed to trace there (torch 2.15's fake kernel takes all three). Where the
installed torch's fake kernel refuses the dtype, the call goes through `deepwell_moe::grouped_mm`,
a custom op with its own fake kernel and autograd whose body is the same torch._grouped_mm: the
same numbers, and a graph that traces.

Two of torch._grouped_mm's forms are used (the only ones the op accepts):
- a (M, K) with rows cut into groups by `offs` (the groups' end rows), b (G, K, N): out (M, N);
- a (N, T) and b (T, K), both cut along T by `offs`: out (G, N, K), a K-grouped weight gradient.
"""

from __future__ import annotations

import torch


def _fake_takes(dtype: torch.dtype) -> bool:
    """Whether the installed torch's fake kernel of torch._grouped_mm takes `dtype` operands."""
    a = torch.empty(8, 16, dtype=dtype, device="meta")
    b = torch.empty(2, 16, 16, dtype=dtype, device="meta")
    try:
        torch._grouped_mm(a, b, offs=torch.empty(2, dtype=torch.int32, device="meta"))
    except (RuntimeError, NotImplementedError):  # refused, or no meta kernel at all: neither traces
        return False
    return True


# Probed once at import: a constant to Dynamo.
FAKE_TAKES = {dt: _fake_takes(dt) for dt in (torch.float32, torch.float16, torch.bfloat16)}


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs=offs), through the custom op where torch's fake kernel refuses
    a's dtype."""
    if FAKE_TAKES.get(a.dtype, True):
        return torch._grouped_mm(a, b, offs=offs)
    return grouped_mm_op(a, b, offs)


def _out_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> tuple[int, ...]:
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0], b.shape[2])
    if a.dim() == 2 and b.dim() == 2:
        return (offs.shape[0], a.shape[0], b.shape[1])
    raise RuntimeError(
        f"deepwell_moe::grouped_mm: expected a 2-d and b 3-d (row groups) or both 2-d (K groups), got "
        f"{a.dim()}-d and {b.dim()}-d"
    )


@torch.library.custom_op("deepwell_moe::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    _out_shape(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm_op.register_fake
def _(a, b, offs):
    return a.new_empty(_out_shape(a, b, offs))


def _setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    """torch's own formulas for torch._grouped_mm's row-grouped form: da = grad b^T per group,
    db[g] = a_g^T grad_g (a K-grouped product)."""
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()  # torch._grouped_mm refuses broadcast (stride-0) gradients
    if b.dim() != 3:
        raise RuntimeError("deepwell_moe::grouped_mm: only the row-grouped form (a 2-d, b 3-d) is differentiable")
    da = grouped_mm_op(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    db = grouped_mm_op(a.t(), grad, offs) if ctx.needs_input_grad[1] else None
    return da, db, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup)
