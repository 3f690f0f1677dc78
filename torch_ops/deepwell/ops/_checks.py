"""Argument checks of the fake (meta) kernels, mirroring rust/ops/src/check.rs so that tracing with
fake tensors fails with the same messages as the real kernels."""

from __future__ import annotations

import unicodedata

import torch
from torch._subclasses.fake_tensor import is_fake

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def fail(op: str, arg: str, expected: str, got) -> None:
    raise RuntimeError(f"deepwell.{op}: argument '{arg}' must {expected}, got {got}")


def shape_str(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def non_empty(op: str, arg: str, t: torch.Tensor, min_dim: int = 1) -> None:
    if t.dim() < min_dim:
        fail(op, arg, f"have at least {min_dim} dimension(s)", f"a {t.dim()}-d tensor")
    if t.numel() == 0:
        fail(op, arg, "be non-empty", f"shape {shape_str(t.shape)}")


def dtype_in(op: str, arg: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        fail(op, arg, "have dtype " + " or ".join(str(d) for d in allowed), t.dtype)


def out_dtype(op: str, dtype) -> torch.dtype:
    d = torch.bfloat16 if dtype is None else dtype
    if d not in FLOAT_INPUTS:
        fail(op, "out_dtype", "be torch.float32, torch.bfloat16 or torch.float16", d)
    return d


def same_device(op: str, *tensors: tuple[str, torch.Tensor]) -> None:
    """Every (arg, tensor) on the first one's device. The Rust kernels check this too, but a call with
    any meta argument dispatches to the fake kernel (the Meta key wins over CPU/CUDA), so without
    this check a cpu/meta mix returned uninitialised CPU memory."""
    (first, t0), *rest = tensors
    for arg, t in rest:
        if t.device != t0.device:
            fail(op, arg, f"be on {t0.device} like '{first}'", t.device)


def dim(op: str, arg: str, d: int, ndim: int) -> int:
    i = d + ndim if d < 0 else d
    if not 0 <= i < ndim:
        fail(op, arg, f"be in [{-ndim}, {ndim - 1}] for a {ndim}-d tensor", d)
    return i


def divisible(op: str, arg: str, t: torch.Tensor, d: int, block: int, why: str) -> None:
    if t.shape[d] % block != 0:
        fail(op, arg, f"have size(dim={d}) divisible by {block} ({why})", f"shape {shape_str(t.shape)}")


def features(op: str, arg: str, t: torch.Tensor, weight_arg: str, weight: torch.Tensor, side: str, n: int) -> None:
    """`arg`'s last dim (its features) is the weight's `side`, "in_features" (then the message shows
    the weight's shape too) or "out_features", of size n: the mismatch message the Rust ops give."""
    if t.shape[-1] == n:
        return
    weight_shape = f" (shape {shape_str(weight.shape)})" if side == "in_features" else ""
    raise RuntimeError(
        f"deepwell.{op}: {arg} has {t.shape[-1]} features (shape {shape_str(t.shape)}) but {weight_arg} has "
        f"{side} {n}{weight_shape}"
    )


def shape_eq(op: str, arg: str, t: torch.Tensor, expected) -> None:
    if tuple(t.shape) != tuple(expected):
        fail(op, arg, f"have shape {shape_str(expected)}", shape_str(t.shape))


def group_offsets(op: str, offsets: torch.Tensor, total: int, of: str, multiple: int = 1) -> None:
    """The values of a grouped op's (G + 1,) offsets (`group_bounds`), read on CPU tensors only: on
    CUDA reading them is a host sync, so there they are the caller's contract (the docstrings say
    what breaking it does); under torch.compile and on fake tensors there are no values to read."""
    if offsets.device.type != "cpu" or torch.compiler.is_compiling() or is_fake(offsets):
        return
    group_bounds(op, offsets.tolist(), total, of, multiple)


def group_bounds(op: str, o: list[int], total: int, of: str, multiple: int = 1) -> None:
    """Offsets on the host: each group's start row, then the end. They must run from 0 to `total`
    (`of` names it, e.g. "the rows of x") without decreasing, each a multiple of `multiple` where
    the caller promised aligned groups: the contract of rust/ops/src/ops/fp8_gemm/reference.rs
    `check_offsets`, with its message."""
    monotone = all(a <= b for a, b in zip(o, o[1:]))
    aligned = all(v % multiple == 0 for v in o)
    if not o or o[0] != 0 or o[-1] != total or not monotone or not aligned:
        blocks = f", in multiples of {multiple}" if multiple > 1 else ""
        fail(op, "offsets", f"run from 0 to {of} ({total}) without decreasing{blocks}", o)


def choice(op: str, arg: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        fail(op, arg, "be one of " + ", ".join(repr(c) for c in choices), quoted(value))


_QUOTED_MAX = 64


def quoted(s: str) -> str:
    """Mirrors `check::quoted`: double quotes, `"` and `\\` escaped, control characters (Unicode Cc)
    as `\\u{..}`, cut after 64 characters so a huge argument does not make a huge message."""
    out = []
    for c in s[:_QUOTED_MAX]:
        if c in '"\\':
            out.append("\\" + c)
        elif unicodedata.category(c) == "Cc":
            out.append(f"\\u{{{ord(c):x}}}")
        else:
            out.append(c)
    more = f"... ({len(s)} characters)" if len(s) > _QUOTED_MAX else ""
    return '"' + "".join(out) + '"' + more


def expert_weight(op: str, weight, want: str, why: tuple[str, str]) -> tuple[int, int, int]:
    """The checks of the experts' weight-operand ops (as the Rust op makes them): `want` a pass,
    `weight` (E, N, K) floats with N and K multiples of 128 (`why`: what needs each); (E, N, K)."""
    if want not in ("fprop", "dgrad"):
        fail(op, "want", 'be "fprop" or "dgrad"', quoted(want))
    if weight.dim() != 3:
        fail(op, "weight", "be 3-d (experts, out_features, in_features)", f"a {weight.dim()}-d tensor")
    dtype_in(op, "weight", weight, FLOAT_INPUTS)
    non_empty(op, "weight", weight, 3)
    divisible(op, "weight", weight, 1, 128, why[0])
    divisible(op, "weight", weight, 2, 128, why[1])
    return tuple(weight.shape)
