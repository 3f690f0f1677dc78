"""The deepwell backend's SwiGLU MLP fusion (compiler/backend.py). `swiglu_groups` finds, in the
captured graph, the three sites of each MLP the fused op could compute (structure only; the plan's
strategy, `CompileOptions.mark_fused`, says which run fused: `Site.fused_mlp`); `fuse_mlp` replaces
those the plan fuses on the graph `rewrite` leaves.

There an fp8_block MLP `w_down(silu(w_gate(x)) * w_up(x))` is three `fp8_block_linear` calls on
x's codes (both copies): gate and up on x's shared codes, down on h = silu(a) * b quantized by its own rowcol pass
(`_quantize_once(h)`). `fp8_block_swiglu_mlp` computes the same in one op: gate and up as one GEMM,
SwiGLU written straight into the down projection's FP8 operands (h never goes to memory in x's
dtype nor is read again to be quantized), and the mirror of that in the backward. Its numerics are
close to the three calls', not bit-identical (its dx is one fp32 sum inside one GEMM; its SwiGLU is
deepwell's exact-fp32 one, not Inductor's).

Fused only where the op computes everything the graph reads: nothing but the MLP reads a, b,
silu(a) or h, whose values the op keeps to itself. Never with the backend's `recompute_codes`,
whose sites run on row copies alone (`fp8_block_linear` without x's column copy): the fused op
saves its codes.
"""

from __future__ import annotations

import operator

import torch

from ..core.recipes import family

_SILU = (torch.nn.functional.silu, torch.ops.aten.silu.default)
_MUL = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)


def _call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _method(node, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name


def _site(y) -> torch.fx.Node | None:
    """The `fp8_block_linear` call whose output 0 is `y`, as `rewrite` writes an fp8_block site on
    both of x's copies: (x, weight, bias, recipe, 4 codes), positional, y its only reader; else
    None."""
    if not (_call(y, (operator.getitem,)) and y.args[1] == 0):
        return None
    site = y.args[0]
    if not (_call(site, (torch.ops.deepwell.fp8_block_linear.default,)) and len(site.args) == 8):
        return None
    return site if site.args[6] is not None and set(site.users) == {y} else None


def _silu(node) -> bool:
    return _call(node, _SILU) and len(node.args) == 1 and not node.kwargs.get("inplace", False)


def _mul(node) -> bool:
    return (_method(node, "mul") or _call(node, _MUL)) and len(node.args) == 2 and not node.kwargs


def _h_quantization(down: torch.fx.Node, h: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes of `_quantize_once(h)` (getitems, rowcol, reshape, detach) when the down site
    `down` alone reads them, else None: the fused op makes h's codes itself, these go."""
    items = list(down.args[4:8])
    if not all(_call(i, (operator.getitem,)) and set(i.users) == {down} for i in items):
        return None
    q = items[0].args[0]
    if not _call(q, (torch.ops.deepwell.fp8_block_quantize_rowcol.default,)) or set(q.users) != set(items):
        return None
    if [i.args for i in items] != [(q, k) for k in range(4)]:
        return None
    reshape = q.args[0]
    if not (_method(reshape, "reshape") and len(reshape.users) == 1):
        return None
    detach = reshape.args[0]
    if not (_method(detach, "detach") and detach.args == (h,) and len(detach.users) == 1):
        return None
    return [*items, q, reshape, detach]


def _shape(node: torch.fx.Node):
    value = node.meta.get("example_value")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _match(down: torch.fx.Node):
    """(a, b, silu, h, h's quantization) when `down` is the y of a fusable MLP's down projection;
    a, b and `down` are sites' outputs 0 (`_site`)."""
    down_site = _site(down)
    if down_site is None or down_site.args[2] is not None or family(down_site.args[3]) != "fp8_block":
        return None
    h = down_site.args[0]
    if not _mul(h):
        return None
    quantization = _h_quantization(down_site, h)
    if quantization is None or set(h.users) != {down_site, quantization[-1]}:
        return None
    for s, b in (h.args, h.args[::-1]):  # silu(a) * b or b * silu(a)
        if _silu(s) and _site(s.args[0]) and _site(b) and s.args[0] is not b:
            a = s.args[0]
            break
    else:
        return None
    gate, up = _site(a), _site(b)
    same_input = all(p is q for p, q in zip((gate.args[0], *gate.args[4:]), (up.args[0], *up.args[4:])))
    no_bias = gate.args[2] is None and up.args[2] is None
    if not (same_input and no_bias and gate.args[3] == up.args[3] == down_site.args[3]):
        return None
    if _shape(a) is None or _shape(a) != _shape(b):  # w_gate and w_up of one shape
        return None
    if set(a.users) != {s} or set(s.users) != {h} or set(b.users) != {h}:
        return None
    return a, b, s, h, quantization


def swiglu_groups(found: list) -> list[tuple]:
    """(gate, up, down) of the captured sites (the backend's `Gemm`s, before `rewrite`) that compute
    an MLP `down(silu(gate(x)) * up(x))` as `fp8_block_swiglu_mlp` could: gate and up read one x and
    have one shape, no site has a bias, and nothing but the MLP reads gate's or up's output, the
    silu or the product (the fused op keeps those values to itself). Any recipe: whether a group
    runs fused is the plan's strategy."""
    by_node = {g.node: g for g in found}
    groups = []
    for down in found:
        h = down.x
        if down.bias is not None or not _mul(h) or set(h.users) != {down.node}:
            continue
        for s, b in (h.args, h.args[::-1]):  # silu(a) * b or b * silu(a)
            gate = by_node.get(s.args[0]) if _silu(s) else None
            up = by_node.get(b) if isinstance(b, torch.fx.Node) else None
            if gate is None or up is None or gate is up or gate.x is not up.x:
                continue
            shape = (gate.site.in_features, gate.site.out_features)
            if gate.bias is not None or up.bias is not None or shape != (up.site.in_features, up.site.out_features):
                continue
            if set(gate.node.users) == {s} and set(s.users) == {h} and set(up.node.users) == {h}:
                groups.append((gate, up, down))
                break
    return groups


def fuse_mlp(gm: torch.fx.GraphModule, groups: list[tuple]) -> list[tuple]:
    """Replaces each MLP of `groups` ((gate, up, down) sites the plan fuses, as `rewrite` left them:
    `Gemm.rewritten`) by `fp8_block_swiglu_mlp` (its output 0; 1-3 are what its backward saves) and
    erases the nodes it replaces: the gate, up and down sites, silu, the product and h's
    quantization. Returns the groups fused: all of them, unless the rewritten graph does not hold
    the MLP as `rewrite` writes a planned one (then the caller's plan must say so)."""
    fused_groups = []
    for group in groups:
        planned_gate, planned_up, planned_down = group
        down = planned_down.rewritten[1]
        match = _match(down)
        if match is None or (match[0], match[1]) != (planned_gate.rewritten[1], planned_up.rewritten[1]):
            continue
        a, b, s, h, quantization = match
        gate, up, down_site = _site(a), _site(b), _site(down)
        x_and_codes, recipe = (gate.args[0], *gate.args[4:]), down_site.args[3]
        with gm.graph.inserting_before(down_site):
            args = (*x_and_codes, gate.args[1], up.args[1], down_site.args[1], recipe)
            fused = gm.graph.call_function(torch.ops.deepwell.fp8_block_swiglu_mlp.default, args)
            y = gm.graph.call_function(operator.getitem, (fused, 0))
        fused.meta = {k: v for k, v in down.meta.items() if k not in ("example_value", "val", "tensor_meta")}
        y.meta = dict(down.meta)
        down.replace_all_uses_with(y)
        for node in (down, down_site, *quantization, h, s, a, gate, b, up):  # each one's readers erased before it
            gm.graph.erase_node(node)
        fused_groups.append(group)
    if fused_groups:
        gm.graph.lint()
        gm.recompile()
    return fused_groups
