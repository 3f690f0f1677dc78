"""The attention sites of a captured graph (plan/attention.py: what each runs and costs), found as
Dynamo leaves them:
- calls of `F.scaled_dot_product_attention` (`torch._C._nn.scaled_dot_product_attention`; Hugging
  Face "sdpa" attention, deepwell's Llama, DeepwellMultiheadAttention's branch);
- `F.multi_head_attention_forward`, which Dynamo keeps as one call for `nn.MultiheadAttention`
  (SDPA under need_weights=False, explicit otherwise), and `nn.MultiheadAttention` submodules left
  as `call_module` nodes;
- explicit attention: a matmul of two activations, elementwise steps (scale, mask, casts), a
  softmax over the last dimension, optional casts and dropout, and a matmul of the probabilities
  with a third activation (Hugging Face eager attention; nn.MultiheadAttention's baddbmm / softmax /
  bmm where Dynamo traces into it).
Nothing is rewritten here; under `CompileOptions.attention="fp8"` compiler/fp8_attention.py rewrites
the SDPA calls it can.
"""

from __future__ import annotations

import operator
import re
from collections import Counter

import torch
import torch.nn.functional as F

from ..plan.attention import AttentionSite, Form, decide

_SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MHA_ARGS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias", "bias_k",
             "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
             "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
             "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")
_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax)
_MATMULS = (operator.matmul, torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.bmm)
_MATMUL_METHODS = ("matmul", "bmm", "__matmul__")
#: Elementwise steps between the scores and the softmax (scale, additive or filled mask); one with a
#: second tensor operand applies a mask.
_ELEMENTWISE_FNS = (operator.mul, operator.truediv, operator.add, operator.sub, torch.mul, torch.div, torch.add,
                    torch.where, torch.masked_fill)
_ELEMENTWISE_METHODS = ("mul", "div", "add", "sub", "masked_fill", "__mul__", "__truediv__", "__add__")
#: Steps between the scores and the softmax or the softmax and the PV matmul that change no value
#: but the dtype or the layout (and dropout, matched apart).
_CASTS = ("to", "float", "half", "bfloat16", "type_as", "type", "contiguous")
_DROPOUTS = (F.dropout, torch.dropout)


def dotted(fqn: str) -> str:
    """"layers.0.moe" from Dynamo's module path (`L['self'].layers[0].moe`,
    `L['self']._modules['layers']._modules['0']...`, `L['args'][0].model...` for a forward that a
    decorator wraps)."""
    path = re.sub(r"^L\['[^']*'\](\[\d+\])*\.?", "", fqn)
    path = re.sub(r"\.?_modules\['([^']+)'\]|\['([^']+)'\]|\[(\d+)\]", lambda m: "." + next(g for g in m.groups() if g), path)
    return path.lstrip(".")


def _arg(node: torch.fx.Node, names: tuple, name: str, default=None):
    i = names.index(name)
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _value(a):
    """The example tensor of a graph node (None where there is none)."""
    v = a.meta.get("example_value", a.meta.get("val")) if isinstance(a, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _size(n) -> int:
    """A static size, 0 for a symbolic one."""
    return int(n) if isinstance(n, int) else 0


def _module(node: torch.fx.Node) -> tuple[str, str, bool]:
    """(qualified name, type name, from transformers) of the innermost module running `node`."""
    stack = list(node.meta.get("nn_module_stack", {}).values())
    if not stack:
        return "", "", False
    fqn, kind = stack[-1]
    name = getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1])
    return dotted(fqn), name, str(getattr(kind, "__module__", "")).startswith("transformers")


def _flag(a) -> bool:
    """A graph argument as a bool: a constant's value; a tensor or node counts as set."""
    return bool(a) if not isinstance(a, torch.fx.Node) else True


def _sdpa(node: torch.fx.Node) -> AttentionSite | None:
    q, k = (_value(_arg(node, _SDPA_ARGS, n)) for n in ("query", "key"))
    if q is None or k is None or q.dim() < 2:
        return None
    lead = [_size(d) for d in q.shape[:-2]]
    batch_heads = 1
    for d in lead:
        batch_heads *= d
    dropout = _arg(node, _SDPA_ARGS, "dropout_p", 0.0)
    return AttentionSite(
        "", "", Form.SDPA, batch_heads, _size(q.shape[-2]), _size(k.shape[-2]), _size(q.shape[-1]),
        causal=_flag(_arg(node, _SDPA_ARGS, "is_causal", False)), dtype=str(q.dtype), device=str(q.device),
        batch=lead[0] if len(lead) == 2 else None, heads=lead[1] if len(lead) == 2 else None,
        kv_heads=_size(k.shape[1]) if k.dim() == 4 and k.shape[1] != q.shape[1] else None,
        masked=_arg(node, _SDPA_ARGS, "attn_mask") is not None, dropout=_flag(dropout) if dropout else False)


def _mha(q, k, heads: int, need_weights: bool, is_causal: bool, key_padding_mask, attn_mask, dropout: bool,
         batch_first: bool = False, extra_keys: int = 0) -> AttentionSite | None:
    """nn.MultiheadAttention's attention from its query (L, N, E) (or (N, L, E) batch_first, or
    unbatched (L, E)) and key; torch hands SDPA is_causal only without a key_padding_mask and
    without need_weights (F.multi_head_attention_forward)."""
    if q is None or k is None or not isinstance(heads, int) or heads < 1:
        return None
    batched = q.dim() == 3
    t_axis = 1 if batched and batch_first else 0
    batch = _size(q.shape[1 - t_axis]) if batched else 1
    causal = bool(is_causal) and key_padding_mask is None and not need_weights
    return AttentionSite(
        "", "MultiheadAttention", Form.EXPLICIT if need_weights else Form.SDPA, batch * heads,
        _size(q.shape[t_axis]), _size(k.shape[t_axis]) + extra_keys, _size(q.shape[-1]) // heads, causal=causal,
        dtype=str(q.dtype), device=str(q.device), batch=batch, heads=heads,
        masked=not causal and (key_padding_mask is not None or attn_mask is not None), dropout=dropout)


def _mha_call(node: torch.fx.Node) -> AttentionSite | None:
    """`F.multi_head_attention_forward(...)` as Dynamo keeps it."""
    q, k = (_value(_arg(node, _MHA_ARGS, n)) for n in ("query", "key"))
    extra = int(_arg(node, _MHA_ARGS, "bias_k") is not None) + int(bool(_arg(node, _MHA_ARGS, "add_zero_attn", False)))
    dropout = bool(_arg(node, _MHA_ARGS, "dropout_p", 0.0)) and bool(_arg(node, _MHA_ARGS, "training", True))
    return _mha(q, k, _arg(node, _MHA_ARGS, "num_heads"), bool(_arg(node, _MHA_ARGS, "need_weights", True)),
                _arg(node, _MHA_ARGS, "is_causal", False), _arg(node, _MHA_ARGS, "key_padding_mask"),
                _arg(node, _MHA_ARGS, "attn_mask"), dropout, extra_keys=extra)


def _mha_module(gm: torch.fx.GraphModule, node: torch.fx.Node) -> AttentionSite | None:
    """An nn.MultiheadAttention left as a `call_module` node."""
    m = gm.get_submodule(node.target)
    if not isinstance(m, torch.nn.MultiheadAttention):
        return None
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal")

    def arg(name, default=None):
        i = names.index(name)
        return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)

    # DeepwellMultiheadAttention's need_weights defaults to None (False); nn.MultiheadAttention's to True.
    need = arg("need_weights", None if type(m).__name__ == "DeepwellMultiheadAttention" else True)
    extra = int(m.bias_k is not None) + int(m.add_zero_attn)
    site = _mha(_value(arg("query")), _value(arg("key")), m.num_heads, bool(need), arg("is_causal", False),
                arg("key_padding_mask"), arg("attn_mask"), bool(m.dropout) and m.training, m.batch_first, extra)
    if site is not None:
        site.name, site.module_type = str(node.target), type(m).__name__
    return site


def _is(node, fns: tuple, methods: tuple = ()) -> bool:
    return isinstance(node, torch.fx.Node) and (
        (node.op == "call_function" and node.target in fns) or (node.op == "call_method" and node.target in methods))


def _is_matmul(node) -> bool:
    if _is(node, _MATMULS, _MATMUL_METHODS):
        return len(node.args) == 2 and all(_value(a) is not None and not _is_parameter(a) for a in node.args)
    # baddbmm(mask, q, kᵀ): nn.MultiheadAttention's scores with an attn_mask.
    return _is(node, (torch.baddbmm,)) and len(node.args) == 3 and all(_value(a) is not None for a in node.args[1:])


def _is_parameter(node) -> bool:
    grapharg = node.meta.get("grapharg") if node.op == "placeholder" else None
    return grapharg is not None and "_parameters[" in grapharg.source.name


def _scores(softmax: torch.fx.Node) -> tuple[torch.fx.Node, bool] | None:
    """The matmul producing the softmax's input through elementwise steps, and whether one of those
    steps applied a tensor (a mask), else None."""
    node, masked = softmax.args[0], False
    for _ in range(8):
        if _is_matmul(node):
            return node, masked or _is(node, (torch.baddbmm,))
        shape = _value(node).shape if _value(node) is not None else None
        if _is(node, (), _CASTS) or _is(node, _DROPOUTS, ("dropout",)):
            node = node.args[0]
        elif _is(node, _ELEMENTWISE_FNS, _ELEMENTWISE_METHODS):
            tensors = [a for a in node.args if _value(a) is not None]
            same = [a for a in tensors if _value(a).shape == shape and _value(a).is_floating_point()]
            if not same:
                return None
            masked |= len(tensors) > 1
            node = next((a for a in same if _is_matmul(a)), same[0])
        else:
            return None
    return None


def _pv(softmax: torch.fx.Node) -> torch.fx.Node | None:
    """The matmul reading the probabilities (as its first operand) through casts and dropout; other
    readers (the weights a module also returns) are allowed."""
    node = softmax
    for _ in range(6):
        users = list(node.users)
        pv = next((u for u in users if _is_matmul(u) and u.args[0] is node), None)
        if pv is not None:
            return pv
        steps = [u for u in users if (_is(u, (), _CASTS) or _is(u, _DROPOUTS, ("dropout",))) and u.args[0] is node]
        if len(steps) != 1:
            return None
        node = steps[0]
    return None


def _explicit(softmax: torch.fx.Node) -> AttentionSite | None:
    """A matmul -> softmax -> matmul chain through `softmax`, else None."""
    p = _value(softmax)
    if p is None or p.dim() < 3 or not softmax.args:
        return None
    dim = softmax.kwargs.get("dim", softmax.args[1] if len(softmax.args) > 1 else None)
    if dim not in (-1, p.dim() - 1):
        return None
    found, pv = _scores(softmax), _pv(softmax)
    if found is None or pv is None:
        return None
    qk, masked = found
    q = _value(qk.args[-2])
    out = _value(pv)
    if q is None or out is None:
        return None
    lead = [_size(d) for d in p.shape[:-2]]
    batch_heads = 1
    for d in lead:
        batch_heads *= d
    dropout = any(_is(n, _DROPOUTS, ("dropout",)) and n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
                  for n in _chain(softmax, pv))
    return AttentionSite(
        "", "", Form.EXPLICIT, batch_heads, _size(p.shape[-2]), _size(p.shape[-1]), _size(q.shape[-1]), causal=False,
        dtype=str(q.dtype), device=str(q.device), batch=lead[0] if len(lead) == 2 else None,
        heads=lead[1] if len(lead) == 2 else None, masked=masked, dropout=bool(dropout))


def _chain(start: torch.fx.Node, end: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes between `start` and `end` along the path `_pv` followed (each the first operand of
    the next)."""
    nodes, node = [], end.args[0]
    while isinstance(node, torch.fx.Node) and node is not start:
        nodes.append(node)
        node = node.args[0] if node.args else None
    return nodes


def capture_attention(gm: torch.fx.GraphModule, arch: str, nodes: list | None = None) -> list[AttentionSite]:
    """Every attention of the graph, in graph order, each with the kernel it runs with on `arch`;
    `nodes`, when given, receives each site's graph node, in the same order."""
    found = []
    for node in gm.graph.nodes:
        site = None
        if node.op == "call_function" and node.target in _SDPA:
            site = _sdpa(node)
        elif node.op == "call_function" and node.target is F.multi_head_attention_forward:
            site = _mha_call(node)
        elif node.op == "call_module":
            site = _mha_module(gm, node)
        elif _is(node, _SOFTMAX, ("softmax",)):
            site = _explicit(node)
        if site is None:
            continue
        name, kind, hf = _module(node)
        if node.op != "call_module":
            site.name, site.module_type = name, kind or site.module_type
        found.append(decide(site, arch, hf))
        if nodes is not None:
            nodes.append(node)
    seen = Counter()
    for s in found:  # a module's second, third, ... attention
        seen[s.name] += 1
        if seen[s.name] > 1:
            s.name = f"{s.name}#{seen[s.name]}"
    return found
