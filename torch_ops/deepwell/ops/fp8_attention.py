"""FP8 attention, EMULATED: the numerics of FlashAttention-3's FP8 forward (arXiv:2407.08608 §3.3:
block-quantized Q, K, V and probabilities fed to FP8 tensor-core GEMMs) as a contract, computed
by quantizing with deepwell's bit-exact fp8_block quantizer, dequantizing and running the attention
in fp32. It is a reference that a fast Hopper kernel can later be checked against, not a fast
path: it is slower than torch's bf16 SDPA. The backward is bf16: the gradients of torch's exact
attention on the unquantized q, k, v (a straight-through estimator for the FP8 forward).

Rules: docs/NUMERICS.md "FP8 attention". The kernels are device-agnostic torch code (registered
here for CPU and CUDA), calling the Rust quantizer `fp8_block_quantize`.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from . import _checks
from ._library import GRAPH_LIB, LIB, define

define("fp8_attention(Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None) -> Tensor")
define(
    "fp8_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None) "
    "-> (Tensor dq, Tensor dk, Tensor dv)"
)

#: The ops of this file, whose kernels are Python (the registry's Rust kernel table lacks them).
PYTHON_KERNELS = ("fp8_attention", "fp8_attention_backward")
#: The largest head size (FlashAttention-3's FP8 kernels take up to 256).
MAX_HEAD_DIM = 256
#: The quantizer's block length: D (Q, K) and the keys (V) are zero-padded to a multiple of it.
BLOCK = 128
#: P is scaled by 2^8 before its E4M3 cast (docs/NUMERICS.md "FP8 attention": 256 is the largest
#: power of two <= 448, so P <= 1 never saturates, and P down to 2^-14 stays in E4M3's normal range).
P_SCALE = 256.0
#: The fp32 elements of one chunk's scores (64 MiB): the chunk's scores, probabilities and their
#: quantized copy then stay near 256 MB at any T.
CHUNK_ELEMENTS = 16 * 1024 * 1024


def _check(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.dtype_in(op, name, t, _checks.FLOAT_INPUTS)
        if t.dim() != 4:
            _checks.fail(op, name, "be 4-d (batch, heads, tokens, head_dim)", f"a {t.dim()}-d tensor")
        _checks.non_empty(op, name, t, 4)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            _checks.fail(op, name, f"have q's dtype {q.dtype}", t.dtype)
    _checks.same_device(op, ("q", q), ("k", k), ("v", v))
    b, h, _, d = q.shape
    if tuple(k.shape[:2]) != (b, h) or k.shape[3] != d:
        expected = f"be (batch, heads, keys, head_dim) = ({b}, {h}, keys, {d}) like q"
        _checks.fail(op, "k", expected, _checks.shape_str(k.shape))
    if tuple(v.shape) != tuple(k.shape):
        _checks.fail(op, "v", f"have k's shape {_checks.shape_str(k.shape)}", _checks.shape_str(v.shape))
    if d > MAX_HEAD_DIM:
        _checks.fail(op, "q", f"have a head size (last dim) of at most {MAX_HEAD_DIM}", d)
    if is_causal and q.shape[2] != k.shape[2]:
        _checks.fail(op, "k", f"have q's {q.shape[2]} tokens when is_causal (top-left aligned mask)", k.shape[2])


def _pad(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x zero-padded along `dim` (-1 or -2) to a multiple of BLOCK: zeros change no amax and no dot product."""
    extra = -x.shape[dim] % BLOCK
    if not extra:
        return x
    return F.pad(x, (0, extra) if dim == -1 else (0, 0, 0, extra))


def quantized_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, tuple]:
    """The FP8 operands (codes, scale_inv) of the contract, from `fp8_block_quantize` (1x128 blocks):
    "q", "k" (B, H, T, Dp) along the head dim, Dp = D zero-padded to a multiple of 128; "v_t"
    (B, H, D, Tkp), V transposed, along the keys (Tk zero-padded likewise)."""
    quant = torch.ops.deepwell.fp8_block_quantize
    return {
        "q": quant(_pad(q, -1).contiguous(), 1, BLOCK, True),
        "k": quant(_pad(k, -1).contiguous(), 1, BLOCK, True),
        "v_t": quant(_pad(v.transpose(-1, -2), -1).contiguous(), 1, BLOCK, True),
    }


def _dequantize(codes: torch.Tensor, scale_inv: torch.Tensor, n: int) -> torch.Tensor:
    """e4m3(codes) * scale_inv in fp32 of the first `n` columns (the rest is padding): exact, a
    power-of-two scale times an E4M3 value."""
    return codes[..., :n].float() * scale_inv.repeat_interleave(BLOCK, dim=-1)[..., :n]


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale: float | None = None):
    _check("fp8_attention", q, k, v, is_causal)
    b, h, tq, d = q.shape
    tk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ops = quantized_operands(q, k, v)
    qd, kd = _dequantize(*ops["q"], d), _dequantize(*ops["k"], d)  # the padding is zeros
    vd = _dequantize(*ops["v_t"], tk).transpose(-1, -2)  # (B, H, Tk, D), fp32
    out = torch.empty(b, h, tq, d, dtype=q.dtype, device=q.device)
    rows = max(1, CHUNK_ELEMENTS // max(b * h * tk, 1))
    keys = torch.arange(tk, device=q.device)
    for i0 in range(0, tq, rows):
        i1 = min(i0 + rows, tq)
        s = torch.matmul(qd[:, :, i0:i1], kd.transpose(-1, -2)) * scale  # (B, H, rows, Tk) fp32
        if is_causal:
            s.masked_fill_(keys > torch.arange(i0, i1, device=q.device)[:, None], float("-inf"))
        p = s.sub_(s.amax(dim=-1, keepdim=True)).exp_()
        l = p.sum(dim=-1, keepdim=True)
        # P̂ · 2^8 = e4m3(P · 2^8); the 2^-8 goes into the division (a power of two: the same bits).
        p_hat = p.mul_(P_SCALE).to(torch.float8_e4m3fn).float()
        out[:, :, i0:i1] = torch.matmul(p_hat, vd).div_(l * P_SCALE).to(q.dtype)
    return out


def _backward_kernel(grad, q, k, v, is_causal=False, scale=None):
    """SDPA's vjp on the unquantized inputs: what torch's exact attention's backward gives. A custom
    op's kernel runs below autograd (torch.library's autograd wrapper excludes the autograd keys), so the
    kernel includes them again to differentiate torch's SDPA."""
    keys = torch._C.DispatchKey
    with contextlib.ExitStack() as stack:
        for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        stack.enter_context(torch.enable_grad())
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=scale)
        grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    # Contiguous, as the fake kernel says (torch's CPU flash backward returns (B, T, H, D)-strided grads).
    return tuple(g.contiguous() for g in grads)


for _lib in (LIB, GRAPH_LIB):
    for _key in ("CPU", "CUDA"):
        _lib.impl("fp8_attention", _forward, _key)
        _lib.impl("fp8_attention_backward", _backward_kernel, _key)


@torch.library.register_fake("deepwell::fp8_attention")
def _fake(q, k, v, is_causal=False, scale=None):
    _check("fp8_attention", q, k, v, is_causal)
    return q.new_empty(q.shape)


@torch.library.register_fake("deepwell::fp8_attention_backward")
def _backward_fake(grad, q, k, v, is_causal=False, scale=None):
    op = "fp8_attention_backward"
    _check(op, q, k, v, is_causal)
    _checks.shape_eq(op, "grad", grad, q.shape)
    _checks.same_device(op, ("grad", grad), ("q", q))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output) -> None:
    q, k, v, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = torch.ops.deepwell.fp8_attention_backward(grad.contiguous(), q, k, v, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


def _backward_setup(ctx, inputs, output) -> None:
    pass  # its backward only refuses


def _backward_backward(ctx, *grads):
    raise RuntimeError(
        "deepwell.fp8_attention_backward: double backward (second derivatives of attention) is not implemented"
    )


torch.library.register_autograd("deepwell::fp8_attention", _backward, setup_context=_setup)
torch.library.register_autograd(
    "deepwell::fp8_attention_backward", _backward_backward, setup_context=_backward_setup
)


def fp8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """Scaled dot-product attention with FlashAttention-3's FP8 forward numerics, EMULATED
    (quantize, dequantize, fp32 attention: docs/NUMERICS.md "FP8 attention"); not a fast path.

    q (B, H, Tq, D), k and v (B, H, Tk, D), of one float dtype and device, D <= 256; `is_causal`
    masks keys j > i (Tq == Tk); `scale` defaults to 1/sqrt(D). Q and K are fp8_block-quantized
    (1x128 blocks along D), V along the keys, the probabilities to E4M3 at a fixed scale of 2^8; the
    output is fp32, cast to q's dtype. The backward is bf16: torch's exact SDPA gradients on the
    unquantized q, k, v (a straight-through estimator).

    Returns:
        (B, H, Tq, D) in q's dtype.
    """
    return torch.ops.deepwell.fp8_attention(q, k, v, is_causal, scale)
