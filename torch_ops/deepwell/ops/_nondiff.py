"""Autograd for the quantizer ops, which are not differentiable: backprop through one raises a clear
error instead of torch's "an autograd kernel was not registered" warning and a silently missing
gradient.

The error is raised by an opaque op in the *backward graph* rather than while building it: torch.compile
traces the backward of every graph whose outputs require grad (even if backward never runs), so raising
at trace time would make compiling a forward that merely quantizes a requires-grad tensor fail. The op
runs (and raises) only when a backward actually reaches the quantizer, in eager and compiled code alike.
"""

from __future__ import annotations

import torch

#: Where to go instead: the differentiable quantized GEMMs.
_HINT = (
    "quantized codes and scales carry no gradient; use deepwell.scaled_linear / mxfp8_linear for a "
    "differentiable quantized GEMM, or detach() the input if no gradient should flow through it"
)


#: op -> what to say instead of `_HINT` (set by `register(..., hint=...)`).
_HINTS: dict[str, str] = {}


def message(op: str) -> str:
    return f"deepwell.{op} is not differentiable: {_HINTS.get(op, _HINT)}"


@torch.library.custom_op("deepwell_internal::not_differentiable", mutates_args=())
def _not_differentiable(like: torch.Tensor, op: str) -> torch.Tensor:
    raise RuntimeError(message(op))


@_not_differentiable.register_fake
def _(like, op):
    return torch.empty_like(like)


def register(*ops: str, hint: str | None = None) -> None:
    """Registers the raising autograd formula for each `torch.ops.deepwell.<op>`; `hint` replaces
    the quantizers' advice in the message."""
    for op in ops:
        if hint is not None:
            _HINTS[op] = hint
        _register(op)


def register_once_differentiable(op: str, backward, setup_context) -> None:
    """Registers `backward` (with `setup_context`) as the autograd formula of
    `torch.ops.deepwell.<op>`, and makes its backward op `<op>_backward` raise on a second
    derivative (double backward) instead of returning a silently missing one."""
    torch.library.register_autograd(f"deepwell::{op}", backward, setup_context=setup_context)
    register(f"{op}_backward", hint=f"second derivatives (double backward) through deepwell.{op} are not supported")


def _register(op: str) -> None:
    def setup_context(ctx, inputs, output):
        # Metadata only: saving the inputs would keep them alive until backward for nothing.
        ctx.like = [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in inputs]

    def backward(ctx, *grads):
        out = []
        for need, meta in zip(ctx.needs_input_grad, ctx.like):
            if need and meta is not None:
                shape, dtype, device = meta
                out.append(_not_differentiable(torch.empty(shape, dtype=dtype, device=device), op))
            else:
                out.append(None)
        return tuple(out)

    torch.library.register_autograd(f"deepwell::{op}", backward, setup_context=setup_context)
