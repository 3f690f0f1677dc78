"""`CompileOptions.attention="fp8"`: the graph's `F.scaled_dot_product_attention` calls that
`deepwell.fp8_attention` can compute are rewritten into it; the plan's attention rows say which,
and why the others stay torch's SDPA.

`fp8_attention` is FlashAttention-3's FP8 forward numerics EMULATED (quantize, dequantize, fp32
attention; docs/NUMERICS.md "FP8 attention"), with a bf16 backward (torch's exact SDPA gradients on
the unquantized q, k, v): a contract for a fast kernel, slower than torch's SDPA. The user asks for
it; the policy never picks it. A call is rewritten only where the op computes the same function as
the SDPA call up to FP8 rounding: no attn_mask, no dropout, no grouped-query broadcast, constant
is_causal and scale, static 4-d shapes, one float dtype, head size <= 256, and Tq == Tk when causal.
"""

from __future__ import annotations

import torch

from ..ops.fp8_attention import MAX_HEAD_DIM
from ..plan.attention import AttentionSite
from .attention import _SDPA, _SDPA_ARGS, _arg, _value

KERNEL = "deepwell fp8_attention (emulated: quantize, dequantize, fp32 attention; bf16 backward)"
WHY = ("attention='fp8' asked: FlashAttention-3's FP8 forward numerics (Q, K, V, P in E4M3), computed by exact "
       "emulation (emulated, slower than torch's SDPA); bf16 backward: torch's exact SDPA gradients (straight-through)")


def why_not(node: torch.fx.Node) -> str | None:
    """Why `node` cannot run as `fp8_attention` (None: it can)."""
    if node.op != "call_function" or node.target not in _SDPA:
        return "not an F.scaled_dot_product_attention call (fp8_attention replaces only those)"
    if _arg(node, _SDPA_ARGS, "attn_mask") is not None:
        return "it has an attn_mask (fp8_attention takes none)"
    dropout = _arg(node, _SDPA_ARGS, "dropout_p", 0.0)
    if isinstance(dropout, torch.fx.Node) or dropout:
        return "it has dropout (fp8_attention has none)"
    if _arg(node, _SDPA_ARGS, "enable_gqa", False):
        return "grouped-query attention (fp8_attention takes k, v with q's heads)"
    causal, scale = _arg(node, _SDPA_ARGS, "is_causal", False), _arg(node, _SDPA_ARGS, "scale")
    if not isinstance(causal, bool) or not (scale is None or isinstance(scale, (int, float))):
        return "is_causal or scale is not a constant of the graph"
    q, k, v = (_value(_arg(node, _SDPA_ARGS, n)) for n in ("query", "key", "value"))
    if q is None or k is None or v is None or not all(t.dim() == 4 for t in (q, k, v)):
        return "q, k, v are not all 4-d (batch, heads, tokens, head_dim)"
    if not all(isinstance(d, int) for t in (q, k, v) for d in t.shape):
        return "symbolic shapes"
    if len({q.dtype, k.dtype, v.dtype}) > 1 or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (fp8_attention takes one of float32, bfloat16, float16)"
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or k.shape != v.shape:
        return "q, k, v shapes differ in batch, heads or head size"
    if q.shape[3] > MAX_HEAD_DIM:
        return f"head size {q.shape[3]} > {MAX_HEAD_DIM}"
    if causal and q.shape[2] != k.shape[2]:
        return f"causal with {q.shape[2]} queries and {k.shape[2]} keys (fp8_attention's causal mask takes Tq == Tk)"
    return None


def mark(sites: list[AttentionSite], nodes: list[torch.fx.Node]) -> None:
    """Writes each site's kernel and why under attention="fp8" (`nodes`: the sites' graph nodes)."""
    for site, node in zip(sites, nodes, strict=True):
        reason = why_not(node)
        if reason is None:
            site.kernel, site.why = KERNEL, WHY
        else:
            site.why = f"attention='fp8' asked but kept: {reason}; {site.why}"


def rewrite(gm: torch.fx.GraphModule) -> int:
    """Points every SDPA call `why_not` accepts at `torch.ops.deepwell.fp8_attention`; returns how many."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA or why_not(node) is not None:
            continue
        args = tuple(_arg(node, _SDPA_ARGS, name) for name in ("query", "key", "value"))
        node.target = torch.ops.deepwell.fp8_attention.default
        node.args = (*args, _arg(node, _SDPA_ARGS, "is_causal", False), _arg(node, _SDPA_ARGS, "scale"))
        node.kwargs = {}
        n += 1
    if n:
        gm.recompile()
    return n
