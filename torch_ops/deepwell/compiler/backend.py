"""The `deepwell` torch.compile backend: `torch.compile(model, backend="deepwell")`.

Registered only through the `torch_dynamo_backends` entry point (setup.py), so the name works
without `import deepwell`. For each graph Dynamo captures it
1. summarises every GEMM of an activation with a parameter weight (`F.linear`, `x @ w.t()`,
   `torch.mm`/`torch.addmm` with `w.t()`, `x @ w` with w (in, out)): the owning module's qualified
   name and type, role, in/out features and tokens per call;
2. asks the Rust planner for a decision per site (deepwell.plan.sites; the policy from the options)
   and writes each site's strategy into the plan (`Site.codes`, from `CompileOptions.codes_for`;
   `Site.fused_mlp`, from `CompileOptions.mark_fused`, for the SwiGLU MLPs capture found);
   lists the graph's attention in the plan (`Plan.attention`, compiler/attention.py: what torch runs
   each with, and why; attention is not rewritten unless the user asks for `attention="fp8"`:
   compiler/fp8_attention.py, emulated);
3. rewrites the sites whose recipe is not bf16 into the op their strategy names
   (`torch.ops.deepwell.scaled_linear`, or the recipe's `fp8_*_linear` on x's codes made once per
   input: both copies, or the row copy alone; autograd registered: the backward GEMMs follow the same recipe), leaving bf16
   sites as they are, then fuses the three sites of each MLP the plan fuses into one
   `fp8_block_swiglu_mlp` (compiler/fuse_mlp.py);
4. hands the graph to Inductor (`compile_fx`), which fuses everything around the deepwell ops,
   letting AOTAutograd's partitioner recompute the cheap producers of the deepwell ops' inputs in
   the backward instead of saving them (`plan.memory.partitioner_options`);
5. under `fallback="safe"` or `"error"` (option `guardrails`: the interval), returns for a graph
   with quantized sites a `compiler.guard.GuardedGraph` around that compilation: statistics of the
   sites every N calls from an observed twin compiled at the first of them, a per-site fallback to
   bf16 (or an error) when the Rust rule trips, the graph then planned and compiled again.

Options: a `deepwell.CompileOptions` (plan/options.py: each option, its default and why), or a
dict of its fields, as `torch.compile(..., options=...)` or through `deepwell.optimize(model, ...)`.
A graph break splits the model into graphs planned separately (each has its own first and last site).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import re
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .. import ops  # noqa: F401  (the ops and their fake kernels exist before tracing)

from .. import _env
from ..core.policy import LayerDecision
from ..core.recipes import arch_info, family
from ..nn.moe_hf import SUPPORTED
from ..nn.weight_cache import allow_reuse
from ..ops.fp8_tensor import amax_of
from ..plan.memory import partitioner_options
from ..plan.options import CompileOptions, Fallback
from ..plan.sites import Codes, Plan, Site, plan_sites, role_of
from . import guard
from . import fp8_attention
from .attention import capture_attention, dotted
from .fuse_mlp import fuse_mlp, swiglu_groups
from .graph_ops import GraphOps

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
_MATMULS = (operator.matmul, torch.matmul, torch.mm)
_TRANSPOSES = (torch.t, torch.ops.aten.numpy_T, torch.ops.aten.numpy_T.default, torch.ops.aten.t.default)

#: Every plan made in this process, newest last (`deepwell.last_plan()`), with planning time.
PLANS: list[Plan] = []
STATS = {"graphs": 0, "planning_s": 0.0, "fused_mlps": 0}


@dataclass(eq=False)  # compared and hashed by identity: one object per site of a graph
class Gemm:
    """One GEMM site of a graph: the node computing it and what `scaled_linear` needs in its place."""

    node: torch.fx.Node
    site: Site
    x: torch.fx.Node
    weight: torch.fx.Node
    bias: object
    #: the parameter is (in, out) (`x @ w`): scaled_linear gets its transpose.
    weight_is_k_by_n: bool = False
    #: (x, y): the nodes of the site's input and of the deepwell op computing it, once rewritten.
    rewritten: tuple | None = None
    #: (gate, up, down): the SwiGLU MLP's three sites when this is one of them (`swiglu_groups`).
    mlp: tuple | None = None


def _module_path(source_name: str) -> tuple[str, str] | None:
    """("layers.0.attn.wq", "weight") from Dynamo's source name of a parameter placeholder
    (`L['self']._modules['layers']._modules['0']..._parameters['weight']`), else None."""
    param = re.search(r"_parameters\['([^']+)'\]$", source_name)
    if param is None:
        return None
    return ".".join(re.findall(r"_modules\['([^']+)'\]", source_name)), param.group(1)


def _parameter(node) -> tuple[str, str] | None:
    """(module path, parameter name) when `node` is a parameter placeholder."""
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    grapharg = node.meta.get("grapharg")
    return _module_path(grapharg.source.name) if grapharg is not None else None


def _transposed_parameter(node) -> torch.fx.Node | None:
    """The parameter placeholder `p` when `node` is `p.t()` / `p.T` / `torch.t(p)` (Dynamo spells
    `p.T` as `getattr(p, "T")` on torch 2.11 and as `aten.numpy_T(p)` later)."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    is_t = (
        (node.op == "call_method" and node.target == "t")
        or (node.op == "call_function" and node.target in _TRANSPOSES)
        or (node.op == "call_function" and node.target is getattr and node.args[1:] in (("T",), ("mT",)))
    )
    return node.args[0] if is_t and _parameter(node.args[0]) is not None else None


def _site(node: torch.fx.Node, x, w: torch.fx.Node, k_by_n: bool) -> Site | None:
    """The summary of a GEMM of x with the 2-D parameter w ((out, in), or (in, out) when k_by_n)."""
    module, param = _parameter(w)
    wv = w.meta.get("example_value")
    xv = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
    if wv is None or xv is None or wv.dim() != 2 or xv.dim() < 1:
        return None
    name = module if param == "weight" else f"{module}.{param}".lstrip(".")
    stack = list(node.meta.get("nn_module_stack", {}).values())
    module_type = stack[-1][1].__name__ if stack and isinstance(stack[-1][1], type) else "Parameter"
    out_f, in_f = (int(d) for d in (reversed(wv.shape) if k_by_n else wv.shape))
    tokens = int(xv.numel() // max(in_f, 1)) if all(isinstance(d, int) for d in xv.shape) else 0
    role = role_of(name, module_type)
    return Site(name, module_type, role, in_f, out_f, tokens, device=str(wv.device), dtype=str(xv.dtype))


def _gemm(node: torch.fx.Node) -> Gemm | None:
    """A linear / matmul / mm / addmm of an activation with a parameter weight, else None."""
    if node.op != "call_function":
        return None
    args, kw = node.args, node.kwargs
    if node.target in _LINEARS:
        x, w = args[0], args[1] if len(args) > 1 else kw.get("weight")
        bias, k_by_n = args[2] if len(args) > 2 else kw.get("bias"), False
        if _parameter(w) is None:
            return None
    elif node.target in _MATMULS or (node.target is torch.addmm and not ({"alpha", "beta"} & set(kw))):
        bias, (x, y) = (args[0], args[1:3]) if node.target is torch.addmm else (None, args[:2])
        if len(args) != (3 if node.target is torch.addmm else 2):
            return None
        w = _transposed_parameter(y)
        k_by_n = w is None
        w = y if k_by_n else w
        if _parameter(w) is None:
            return None
    else:
        return None
    site = _site(node, x, w, k_by_n)
    return None if site is None else Gemm(node, site, x, w, bias, k_by_n)


def capture_sites(gm: torch.fx.GraphModule) -> list[Gemm]:
    """Every GEMM of the graph on a parameter weight, in graph order; the three sites of each SwiGLU
    MLP the fused op could compute know their group (`Gemm.mlp`, `Site.swiglu`)."""
    found = [g for g in map(_gemm, gm.graph.nodes) if g is not None]
    for group in swiglu_groups(found):
        for g in group:
            g.mlp, g.site.swiglu = group, tuple(m.site.name for m in group)
    return found


def hf_moe_blocks(gm: torch.fx.GraphModule) -> list[str]:
    """Qualified names of the Hugging Face MoE blocks (nn/moe_hf.py SUPPORTED) the graph traced
    through. Dynamo hands the backend their expert loops already unrolled into plain GEMMs, which it
    cannot turn back into a DeepwellMoE; `deepwell.optimize` swaps the blocks before tracing."""
    found = {}
    for node in gm.graph.nodes:
        for fqn, kind in node.meta.get("nn_module_stack", {}).values():
            if getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1]) in SUPPORTED:
                found[dotted(fqn)] = None
    return list(found)


def _warn_hf_moe(gm: torch.fx.GraphModule) -> None:
    blocks = hf_moe_blocks(gm)
    if blocks:
        warnings.warn(
            f"deepwell backend: the graph runs {len(blocks)} Hugging Face MoE block(s) ({', '.join(blocks[:3])}"
            f"{', ...' if len(blocks) > 3 else ''}) as traced expert loops; call deepwell.optimize(model) (or "
            "deepwell.swap_hf_moe(model) before torch.compile) to run them as DeepwellMoE's grouped GEMMs",
            stacklevel=2,
        )


def _codes(g: Gemm, options: CompileOptions) -> Codes:
    """The site's strategy (`CompileOptions.codes_for`), except that a site whose weight is a tensor
    subclass runs `scaled_linear`, the only op that reads one: DTensors (tensor parallelism: its
    sharding rules, ops/sharding.py) and FSDP2's FP8-gathered weights (distributed/fp8_weights.py)."""
    codes = options.codes_for(g.site.recipe, g.site.tokens)
    if codes is Codes.X or not isinstance(g.x, torch.fx.Node):
        return Codes.X
    w = g.weight.meta.get("example_value") if isinstance(g.weight, torch.fx.Node) else None
    return Codes.X if is_traceable_wrapper_subclass(w) else codes


def _quantize_once(graph: torch.fx.Graph, x: torch.fx.Node, k: int, recipe: str, rows_only: bool = False) -> tuple:
    """Nodes of x's FP8 codes from one quantizing pass over x seen as (tokens, k), which every site
    of the recipe family that reads x (q/k/v, gate/up) shares, its column copy saved once for their
    backwards. As the family's `fp8_*_linear` takes them after its recipe, in its argument order:
    fp8_block (`fp8_block_quantize_rowcol`, scales M-major): (x_codes, x_scale_inv, x_codes_t,
    x_scale_inv_t), the row copy and its scales, the column copy (x^T in 1x128 blocks along the
    tokens) and its scales. fp8_tensor (`fp8_tensor_quantize_rowcol`): (x_codes, x_scale_inv,
    x_codes_t, x_amax), the codes, the scale, the codes transposed and x's amax; the amax is a
    torch reduction in the graph, which Inductor fuses into x's producer (RMSNorm, SwiGLU), so the
    quantizer reads x once instead of twice.

    `rows_only` (`Codes.RECOMPUTED`, the `recompute_codes` option): the row copy alone
    (`copies="rows"`), x_codes_t (and x_scale_inv_t) None; fp8_tensor passes the amax, for the
    backward's copy. The sites' backwards make the column copy from x. In the joint graph
    AOTAutograd traces, those calls depend on x alone, and the layers reading one x make the same
    call: its CSE merges them into one. Its min-cut partitioner then either saves that call's
    output or runs it in the backward from tensors it keeps, whichever saves fewer bytes. For a
    norm's or SwiGLU's output (recomputed from the residual stream, or from gate and up) and for
    attention's output (kept for attention's backward), running it again saves nothing more: it
    runs in the backward (tests/compiler/test_recompute_codes.py checks both graphs). With both
    copies fp8_tensor's amax is left out (None): the quantizer read it already."""
    # Detached: the codes carry no gradient; x's comes back through the sites' own backwards.
    x2 = graph.call_method("reshape", (graph.call_method("detach", (x,)), -1, k))
    copies = "rows" if rows_only else "both"

    def items(q, indices):
        return tuple(None if i is None else graph.call_function(operator.getitem, (q, i)) for i in indices)

    if recipe == "fp8_block":
        q = graph.call_function(torch.ops.deepwell.fp8_block_quantize_rowcol.default, (x2, True, True, copies))
        return items(q, (0, 1, None, None) if rows_only else (0, 1, 2, 3))
    amax = graph.call_function(amax_of, (x2,))
    q = graph.call_function(torch.ops.deepwell.fp8_tensor_quantize_rowcol.default, (x2, "e4m3", amax, copies))
    if rows_only:
        return (*items(q, (0, 2, None)), amax)
    return (*items(q, (0, 2, 1)), None)


def _linear_call(graph: torch.fx.Graph, g: Gemm, x, w, bias, codes=None) -> torch.fx.Node:
    """The node computing the site's y in its recipe: `scaled_linear`, or (`codes`: x's codes from
    `_quantize_once`) its family's `fp8_*_linear` on them, positional, and y its output 0. An
    fp8_tensor site also gets W's amax as a graph node (`weight_amax`): reduced once per step, read
    by both the forward's cast of W and the backward's transposing cast, where each would reduce W
    again."""
    ops = torch.ops.deepwell
    if codes is None:
        return graph.call_function(ops.scaled_linear.default, (x, w, bias, g.site.recipe, None))
    if family(g.site.recipe) == "fp8_block":
        node = graph.call_function(ops.fp8_block_linear.default, (x, w, bias, g.site.recipe, *codes))
    else:
        x_codes, x_scale, x_codes_t, x_amax = codes
        w_amax = graph.call_function(amax_of, (graph.call_method("detach", (w,)),))
        args = (x, w, bias, g.site.recipe, x_codes, x_scale, x_codes_t, w_amax, x_amax)
        node = graph.call_function(ops.fp8_tensor_linear.default, args)
    return graph.call_function(operator.getitem, (node, 0))


def rewrite(gm: torch.fx.GraphModule, found: list[Gemm]) -> int:
    """Replaces every non-bf16 site by its op, as its strategy (`Site.codes`, which `plan_graph`
    writes) says: `scaled_linear`, or the recipe's `fp8_*_linear` on x's codes made once per input
    (`_quantize_once`: both copies, or the row copy alone); returns how many. A site's operands may be
    earlier sites (a stack of linears): they are read through `replaced`, never from the erased
    nodes the sites were captured with."""
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    found = sorted(found, key=lambda g: order[g.node])  # a shared input is quantized before its first reader
    codes_of: dict[tuple, tuple] = {}  # (x, recipe family) -> x's codes

    def current(a):
        return replaced.get(a, a) if isinstance(a, torch.fx.Node) else a

    n = 0
    for g in found:
        if g.site.recipe == "bf16":
            continue
        x, weight, bias = current(g.x), current(g.weight), current(g.bias)
        with gm.graph.inserting_before(g.node):
            w = gm.graph.call_method("t", (weight,)) if g.weight_is_k_by_n else weight
            codes = None
            if g.site.codes is not Codes.X:
                key = (g.x, family(g.site.recipe))
                if key not in codes_of:
                    codes_of[key] = _quantize_once(gm.graph, x, g.site.in_features, key[1],
                                                   g.site.codes is Codes.RECOMPUTED)
                codes = codes_of[key]
            new = _linear_call(gm.graph, g, x, w, bias, codes)
        new.meta = dict(g.node.meta)
        g.rewritten = (x, new)
        g.node.replace_all_uses_with(new)
        replaced[g.node] = new
        operands = list(g.node.args)
        gm.graph.erase_node(g.node)
        for t in operands:  # a `w.t()` only this GEMM read
            if isinstance(t, torch.fx.Node) and t.op != "placeholder" and not t.users and _transposed_parameter(t) is not None:
                gm.graph.erase_node(t)
        n += 1
    gm.graph.lint()
    gm.recompile()
    return n


def _shared_decision(site: Site, fixed: Plan) -> LayerDecision | None:
    """The decision for a site named relative to a block. FSDP2 breaks the model's graph at every
    sharded block, and Dynamo reuses one compiled block graph for every layer with that code, so a
    site like `attention.wq` runs for `layers.0.attention.wq`, `layers.1.attention.wq`, ...: one
    decision must serve them all. Where the plan gave them different recipes (the policy's
    first/last rule), the graph runs the most precise one (bf16), never less precision than planned."""
    same = [
        s for s in fixed.sites
        if s.name.endswith("." + site.name) and (s.in_features, s.out_features) == (site.in_features, site.out_features)
    ]
    if not same or any(s.decision is None for s in same):
        return None
    recipes = sorted({s.decision.recipe for s in same})
    if len(recipes) == 1:
        d = same[0].decision
        return dataclasses.replace(d, reason=f"{d.reason} (one graph for {len(same)} blocks)")
    reason = (
        f"one graph for {len(same)} blocks planned as {'/'.join(recipes)} "
        f"({', '.join(s.name for s in same if s.decision.recipe == 'bf16')} bf16): bf16 for all"
    )
    return LayerDecision("bf16", False, reason, "SharedGraph")


def _from_fixed_plan(found: list, fixed: Plan, fallback: Fallback) -> Plan:
    """Each site's decision looked up by name in a plan made beforehand (deepwell.compile); a name
    relative to a block (a per-block graph under FSDP2) through `_shared_decision`."""
    by_name = {s.name: s.decision for s in fixed.sites}
    for site in (g.site for g in found):
        decision = by_name.get(site.name) or _shared_decision(site, fixed)
        if decision is None:
            if fallback is not Fallback.SAFE:
                raise RuntimeError(f"deepwell backend: site {site.name!r} is not in the plan (fallback={fallback.value!r})")
            decision = LayerDecision("bf16", False, "not in the plan: bf16 (fallback='safe')", "Fallback")
        site.decision = decision
    return Plan(fixed.arch, fixed.policy, [g.site for g in found])


def _warn_unused_precision(plan: Plan, options: CompileOptions) -> None:
    """A recipe the user named (not "auto", not bf16) that no site of the graph runs: say so, with
    the plan's reasons grouped, rather than compile a model that silently ignores the request.
    (One warning per distinct message: Python's default filter shows each once.)"""
    asked = plan.policy.precision
    if options.plan is not None or asked in ("auto", "bf16") or not plan.sites:
        return
    if any(family(s.recipe) == family(asked) for s in plan.sites):
        return
    reasons = Counter(s.decision.reason if s.decision else "not planned" for s in plan.sites)
    why = "; ".join(f"{n} site{'s' if n > 1 else ''}: {r}" for r, n in reasons.most_common())
    warnings.warn(f"deepwell backend: precision={asked!r} was asked for, but none of this graph's {len(plan.sites)} GEMM sites "
                  f"runs it ({why})", stacklevel=2)


class NothingQuantized(Warning):
    """The notice that a compiled graph runs every GEMM unquantized. Not a UserWarning: nothing
    was asked for that did not happen (precision="auto" promises no recipe); it tells a user who
    expected FP8 why there is none. Filter it by this category."""


#: Whether this process has shown the NothingQuantized notice (once: every graph of a model, and
#: every model, would say the same).
_NOTICED = {"nothing_quantized": False}


def _notice_nothing_quantized(plan: Plan, options: CompileOptions) -> None:
    """Under precision="auto", a graph none of whose sites is quantized: one line saying why (auto's
    choice on this device, or the plan's reasons grouped) and how to see the plan, once per process.
    A named recipe no site runs is `_warn_unused_precision`'s; bf16 asked for is what it is."""
    if (_NOTICED["nothing_quantized"] or options.plan is not None or plan.policy.precision != "auto"
            or not plan.sites or any(s.recipe != "bf16" for s in plan.sites)):
        return
    info = arch_info(plan.arch)
    if info.get("auto") == "bf16":
        why = f"{info.get('auto_reason') or 'auto resolves to bf16 on ' + plan.arch}; name a recipe (precision='mxfp8', ...) to run one, emulated where not native"
    else:
        reasons = Counter(s.decision.reason if s.decision else "not planned" for s in plan.sites)
        why = "; ".join(f"{n} site{'s' if n > 1 else ''}: {r}" for r, n in reasons.most_common())
    _NOTICED["nothing_quantized"] = True
    warnings.warn(f"deepwell backend: none of this graph's {len(plan.sites)} GEMM sites is quantized ({why}); "
                  "see the plan with options={'verbose': True} or DEEPWELL_PRINT_PLAN=1", NothingQuantized, stacklevel=2)


def plan_graph(gm: torch.fx.GraphModule, options: CompileOptions | dict | None = None,
               forced: Callable[[Gemm], LayerDecision | None] | None = None) -> tuple[Plan, list]:
    """The plan of one captured graph, each site's strategy included (no rewriting). `forced(g)`,
    called on each planned site, may replace its decision (the guardrails' fallbacks)."""
    options = CompileOptions.of(options)
    found = capture_sites(gm)
    if options.plan is not None:
        plan = _from_fixed_plan(found, options.plan, options.fallback)
    else:
        plan = plan_sites([g.site for g in found], options.precision_policy(), options.arch)
    for g in found:
        decision = forced(g) if forced is not None else None
        if decision is not None:
            g.site.decision = decision
        g.site.codes = _codes(g, options)
    options.mark_fused(plan.sites)
    nodes: list = []
    plan.attention = capture_attention(gm, plan.arch, nodes)
    if options.attention == "fp8":
        fp8_attention.mark(plan.attention, nodes)
    return plan, found


def _compile_fx(gm: torch.fx.GraphModule, example_inputs, options: CompileOptions, rewritten: int):
    """Inductor on the rewritten graph, with the options' Inductor settings."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # CUDA graphs take away the host's cost per op (deepwell's ops cost 21-87 us each on the host;
    # docs/DESIGN.md "Data flow of"). Their warm-up runs
    # allocate from the graphs' private pool, where a weight cache entry would be a live tensor the
    # graphs do not track: reuse goes off for the process.
    inductor = {"triton.cudagraphs": True} if options.cudagraphs else {}
    if inductor:
        allow_reuse(False)
    if options.graph_ops:
        inductor["post_grad_custom_post_pass"] = GraphOps(inductor_config.post_grad_custom_post_pass)
    with torch._functorch.config.patch(partitioner_options(rewritten)):
        return compile_fx(gm, example_inputs, config_patches=inductor)


def _report(plan: Plan, rewritten: int, fused: int, options: CompileOptions) -> None:
    PLANS.append(plan)
    if options.verbose or _env.print_plan():
        print(plan.table())
        print(f"deepwell backend: {rewritten} GEMM sites rewritten; {fused} SwiGLU MLP(s) fused into fp8_block_swiglu_mlp")


def _rewrite(gm: torch.fx.GraphModule, found: list[Gemm], options: CompileOptions) -> tuple[int, int]:
    """`rewrite`, then `fuse_mlp` on the MLPs whose sites the plan fuses (`Site.fused_mlp`); returns
    (sites rewritten, MLPs fused). A planned MLP the rewritten graph does not hold as expected stays
    three sites, and its sites say so (the plan is what runs). Under attention="fp8", first the SDPA
    calls `fp8_attention.mark` marked."""
    if options.attention == "fp8":
        fp8_attention.rewrite(gm)
    rewritten = rewrite(gm, found)
    planned = list(dict.fromkeys(g.mlp for g in found if g.site.fused_mlp))
    fused = fuse_mlp(gm, planned)
    for group in set(planned) - set(fused):
        for g in group:
            g.site.fused_mlp = False
    return rewritten, len(fused)


def _guard_hook(gm: torch.fx.GraphModule, example_inputs, records: dict) -> Callable:
    """`plan_graph`'s `forced` for a guarded graph: each quantized site's record (by its weight
    parameter, held weakly), into `records`, and bf16 for the sites whose guardrail fell back."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    weights = {name: weakref.ref(t) for name, t in zip(placeholders, example_inputs) if isinstance(t, torch.Tensor)}

    def forced(g: Gemm) -> LayerDecision | None:
        ref = weights.get(g.weight.name) if isinstance(g.weight, torch.fx.Node) else None
        record = guard.record_for(ref() if ref is not None else None, g.site.name, g.site.decision or LayerDecision("bf16", False, "", ""))
        if record is None:
            return None
        records[g.site.name] = record
        return guard.fallback_decision(record) if guard.fallen_back(record) else None

    return forced


def backend(gm: torch.fx.GraphModule, example_inputs, options: CompileOptions | dict | None = None, **kwargs):
    """The Dynamo backend (see the module docs)."""
    options = CompileOptions.of(options)
    start = time.perf_counter()
    # Graphs on sharded weights (FSDP2, tensor parallelism: DTensors) stay unguarded: their statistics
    # would be DTensors, and a fallback decided per rank could leave the ranks' graphs different.
    sharded = any(is_traceable_wrapper_subclass(t) for t in example_inputs if isinstance(t, torch.Tensor))
    guarded = options.fallback is not Fallback.NONE and not sharded
    original = copy.deepcopy(gm) if guarded else None  # what a guarded graph's later compilations start from
    records: dict = {}
    forced = _guard_hook(gm, example_inputs, records) if guarded else None
    plan, found = plan_graph(gm, options, forced)
    _warn_hf_moe(gm)
    _warn_unused_precision(plan, options)
    _notice_nothing_quantized(plan, options)
    rewritten, fused = _rewrite(gm, found, options)
    STATS["graphs"] += 1
    STATS["planning_s"] += time.perf_counter() - start
    STATS["fused_mlps"] += fused
    _report(plan, rewritten, fused, options)
    compiled = _compile_fx(gm, example_inputs, options, rewritten)
    if not records:
        return compiled
    context = torch._guards.TracingContext.try_get()

    def build(observed: bool) -> tuple:
        """A variant compiled later (compiler/guard.py "Compiling later")."""
        g = copy.deepcopy(original)
        fakes = [n.meta["example_value"] for n in g.graph.nodes if n.op == "placeholder"]
        now: dict = {}
        plan, found = plan_graph(g, options, _guard_hook(original, [w() for w in weights], now))
        n, fused = _rewrite(g, found, options)
        rows = guard.add_stats_output(g, [(f.site.name, *f.rewritten) for f in found if f.rewritten]) if observed else []
        if not observed:
            _report(plan, n, fused, options)
        with torch._guards.tracing(context):
            return plan, _compile_fx(g, fakes, options, n), now, rows

    weights = [weakref.ref(t) if isinstance(t, torch.Tensor) else (lambda: None) for t in example_inputs]
    return guard.GuardedGraph(build, options.fallback, options.guardrails, (plan, compiled, records, []))


def last_plan() -> Plan | None:
    """The plan of the most recently compiled graph."""
    return PLANS[-1] if PLANS else None


def ensure_registered() -> None:
    """Registers the backend under "deepwell" when its entry point is not installed (a source
    checkout on PYTHONPATH: development, the GPU machine). Guarded, because registering a name
    the entry point also provides makes Dynamo fail with "duplicate name"."""
    if "deepwell" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(backend, "deepwell")
