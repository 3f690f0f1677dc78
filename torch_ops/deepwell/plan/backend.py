"""The `deepwell` torch.compile backend: `torch.compile(model, backend="deepwell")`.

Registered only through the `torch_dynamo_backends` entry point (setup.py), so the name works
without `import deepwell`. For each graph Dynamo captures it
1. summarises every GEMM of an activation with a parameter weight (`F.linear`, `x @ w.t()`,
   `torch.mm`/`torch.addmm` with `w.t()`, `x @ w` with w (in, out)): the owning module's qualified
   name and type, role, in/out features and tokens per call;
2. asks the Rust planner for a decision per site (deepwell.plan.sites; the policy from the options);
3. rewrites the sites whose recipe is not bf16 into `torch.ops.deepwell.scaled_linear` (autograd
   registered: the backward GEMMs follow the same recipe), leaving bf16 sites as they are, then
   (option `fused_mlp`) fuses each fp8_block SwiGLU MLP's three sites into one
   `fp8_block_swiglu_mlp` (plan/fuse_mlp.py);
4. hands the graph to Inductor (`compile_fx`), which fuses everything around the deepwell ops,
   letting AOTAutograd's partitioner recompute the cheap producers of the deepwell ops' inputs in
   the backward instead of saving them (`_partitioner_options`).

Options (`torch.compile(..., options={...})` or `deepwell.optimize(model, ...)`): `precision`
("auto", "mxfp8", "nvfp4", "fp8_block", "bf16"), `policy` (a deepwell.PrecisionPolicy; its
precision wins over `precision`), `verbose` (print the plan; also DEEPWELL_PRINT_PLAN=1), `plan`
(a fixed deepwell.Plan from `deepwell.autoplan`: sites are looked up by name instead of planned)
with `fallback` ("safe": a site the plan lacks runs bf16; "error": it raises), `cudagraphs` (True:
replay each graph as a CUDA graph, Inductor's CUDA graph trees: what `mode="reduce-overhead"` gives
torch.compile, which does not take both a mode and options), `fp8_block_codes` (True: each input
of fp8_block sites is quantized once, both copies, for all the sites reading it, and its column copy
saved for their backwards, `fp8_block_linear_from_codes`; False: `scaled_linear` per site, its
input recomputed in the backward; default `fp8_block_codes_default()`), `fused_mlp` (True:
`w_down(silu(w_gate(x)) * w_up(x))` with its three sites fp8_block on x's codes runs as one
`fp8_block_swiglu_mlp`, plan/fuse_mlp.py; default `FUSED_MLP`, False: three sites), `graph_ops`
(True: the compiled graphs call `deepwell_graph` ops, without the Python autograd layer,
plan/graph_ops.py; default `GRAPH_OPS`), `recompute_codes` (True: the sites on x's codes keep
quantizing x once for all its readers, but the forward writes only the row copy and the backward
makes the column copy from x instead of the forward saving it, `fp8_*_linear_from_rows`; default
`RECOMPUTE_CODES`, False).
A graph break splits the model into graphs planned separately (each has its own first and last site).
"""

from __future__ import annotations

import dataclasses
import operator
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import deepwell  # noqa: F401  (the ops and their fake kernels exist before tracing)

from .. import _env
from ..nn.weight_cache import allow_reuse
from ..ops.fp8_tensor import amax_of
from .fuse_mlp import fuse_mlp
from .graph_ops import GraphOps
from .policy import LayerDecision, PrecisionPolicy
from .sites import Plan, Site, plan_sites, role_of

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
_MATMULS = (operator.matmul, torch.matmul, torch.mm)
_TRANSPOSES = (torch.t, torch.ops.aten.numpy_T, torch.ops.aten.numpy_T.default, torch.ops.aten.t.default)

#: The `fp8_block_codes` option's default: whether fp8_block sites save x's FP8 column copy for the
#: backward (`fp8_block_linear_from_codes`) instead of letting the partitioner recompute x.
FP8_BLOCK_CODES = True


def fp8_block_codes_default() -> bool:
    """The `fp8_block_codes` option where the options leave it out: `FP8_BLOCK_CODES`, in one process
    and under torch.distributed alike. One lease of 2 H100s had measured FSDP2 steps slower with the
    copies (114-123 ms against 98-106 ms); a later lease (torch 2.11, bench_parallel 2x8, FSDP2,
    runs interleaved) measured them faster, 96.8 and 98.0 ms (medians 95.4 / 96.0) against 99.9 ms
    (median 99.5) with the recompute: the slowdown was that lease's, not the copies'
    (benchmarks/results/bench_parallel-1b-diag-*.log)."""
    return FP8_BLOCK_CODES


#: The `recompute_codes` option's default: off, x's codes are saved for the backward. On, the
#: memory is torchao's (the codes are 1 byte per element of every GEMM input; x itself is recomputed
#: by the partitioner or kept anyway) and the step pays for x's recompute and a second pass over x
#: (docs/BASELINES.md "deepwell on the H200").
RECOMPUTE_CODES = False

#: The `graph_ops` option's default: compiled graphs call the `deepwell_graph` twins of deepwell's ops.
GRAPH_OPS = True

#: The `fused_mlp` option's default: off. Measured on the H100 (torch 2.11) the fused
#: MLP ran no faster than the three sites (0.95B step 86.3 against 86.5 ms, 8B layers 153.5 against
#: 152.8): its fused SwiGLU quantizers cost what Inductor's SwiGLU and the rowcol pass cost, and it
#: joins gate's and up's FP8 weights by copies (docs/BASELINES.md "deepwell on the H100").
FUSED_MLP = False


#: Every plan made in this process, newest last (`deepwell.last_plan()`), with planning time.
PLANS: list[Plan] = []
STATS = {"graphs": 0, "planning_s": 0.0, "fused_mlps": 0}


@dataclass
class Gemm:
    """One GEMM site of a graph: the node computing it and what `scaled_linear` needs in its place."""

    node: torch.fx.Node
    site: Site
    x: torch.fx.Node
    weight: torch.fx.Node
    bias: object
    #: the parameter is (in, out) (`x @ w`): scaled_linear gets its transpose.
    weight_is_k_by_n: bool = False


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
    """Every GEMM of the graph on a parameter weight, in graph order."""
    return [g for g in map(_gemm, gm.graph.nodes) if g is not None]


def hf_moe_blocks(gm: torch.fx.GraphModule) -> list[str]:
    """Qualified names of the Hugging Face MoE blocks (nn/moe_hf.py SUPPORTED) the graph traced
    through. Dynamo hands the backend their expert loops already unrolled into plain GEMMs, which it
    cannot turn back into a DeepwellMoE; `deepwell.optimize` swaps the blocks before tracing."""
    from ..nn.moe_hf import SUPPORTED

    found = {}
    for node in gm.graph.nodes:
        for fqn, kind in node.meta.get("nn_module_stack", {}).values():
            if getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1]) in SUPPORTED:
                found[_dotted(fqn)] = None
    return list(found)


def _dotted(fqn: str) -> str:
    """"layers.0.moe" from Dynamo's module path (`L['self'].layers[0].moe`,
    `L['self']._modules['layers']._modules['0']...`)."""
    path = re.sub(r"^L\['[^']*'\]\.?", "", fqn)
    path = re.sub(r"\.?_modules\['([^']+)'\]|\['([^']+)'\]|\[(\d+)\]", lambda m: "." + next(g for g in m.groups() if g), path)
    return path.lstrip(".")


def _warn_hf_moe(gm: torch.fx.GraphModule) -> None:
    blocks = hf_moe_blocks(gm)
    if blocks:
        warnings.warn(
            f"deepwell backend: the graph runs {len(blocks)} Hugging Face MoE block(s) ({', '.join(blocks[:3])}"
            f"{', ...' if len(blocks) > 3 else ''}) as traced expert loops; call deepwell.optimize(model) (or "
            "deepwell.swap_hf_moe(model) before torch.compile) to run them as DeepwellMoE's grouped GEMMs",
            stacklevel=2,
        )


def _saves_codes(g: Gemm, fp8_block_codes: bool) -> bool:
    """Whether the site runs on x's FP8 codes, made once per input and saved for the backward instead
    of x: fp8_tensor sites always (`fp8_tensor_linear_from_codes`), fp8_block sites with
    `fp8_block_codes` and a token count the column copy's 1x128 blocks divide
    (`fp8_block_linear_from_codes`); never on weights that are tensor subclasses, which only
    `scaled_linear` reads: DTensors (tensor parallelism: its sharding rules, ops/sharding.py) and
    FSDP2's FP8-gathered weights (plan/fp8_weights.py)."""
    family = g.site.recipe.partition("@")[0]
    if family == "fp8_block":
        if not (fp8_block_codes and g.site.tokens > 0 and g.site.tokens % 128 == 0):
            return False
    elif family != "fp8_tensor":
        return False
    if not isinstance(g.x, torch.fx.Node):
        return False
    w = g.weight.meta.get("example_value") if isinstance(g.weight, torch.fx.Node) else None
    return not is_traceable_wrapper_subclass(w)


def _quantize_once(graph: torch.fx.Graph, x: torch.fx.Node, k: int, family: str, rows_only: bool = False) -> tuple:
    """Nodes of x's FP8 codes from one quantizing pass over x seen as (tokens, k), which every site
    of the recipe family that reads x (q/k/v, gate/up) shares, its column copy saved once for their
    backwards.
    fp8_tensor (`fp8_tensor_quantize_rowcol`): the codes, the codes transposed and the scale; x's
    amax is a torch reduction in the graph, which Inductor fuses into x's producer (RMSNorm,
    SwiGLU), so the quantizer reads x once instead of twice. fp8_block
    (`fp8_block_quantize_rowcol`, scales M-major): the row copy and its scales, the column copy
    (x^T in 1x128 blocks along the tokens) and its scales.

    `rows_only` (the `recompute_codes` option): the row copy alone (`copies="rows"`), which the
    sites' `fp8_*_linear_from_rows` read; fp8_block: (codes, scales), fp8_tensor: (codes, scale,
    amax), the amax for the backward's copy. Their backwards make the column copy from x. In the
    joint graph AOTAutograd traces, those calls depend on x alone, and the layers reading one x make
    the same call: its CSE merges them into one. Its min-cut partitioner then either saves that
    call's output or runs it in the backward from tensors it keeps, whichever saves fewer bytes. For
    a norm's or SwiGLU's output (recomputed from the residual stream, or from gate and up) and for
    attention's output (kept for attention's backward), running it again saves nothing more: it runs
    in the backward (tests/compile/test_recompute_codes.py checks both graphs)."""
    # Detached: the codes carry no gradient; x's comes back through the sites' own backwards.
    x2 = graph.call_method("reshape", (graph.call_method("detach", (x,)), -1, k))
    copies = "rows" if rows_only else "both"
    if family == "fp8_block":
        q = graph.call_function(torch.ops.deepwell.fp8_block_quantize_rowcol.default, (x2, True, True, copies))
        return tuple(graph.call_function(operator.getitem, (q, i)) for i in ((0, 1) if rows_only else range(4)))
    amax = graph.call_function(amax_of, (x2,))
    q = graph.call_function(torch.ops.deepwell.fp8_tensor_quantize_rowcol.default, (x2, "e4m3", amax, copies))
    if rows_only:
        return graph.call_function(operator.getitem, (q, 0)), graph.call_function(operator.getitem, (q, 2)), amax
    return tuple(graph.call_function(operator.getitem, (q, i)) for i in range(3))


def _linear_call(graph: torch.fx.Graph, g: Gemm, x, w, bias, codes=None, rows_only: bool = False) -> torch.fx.Node:
    """The node computing the site's y in its recipe (`codes`: x's codes from `_quantize_once`, with
    `rows_only` the row copy alone). An fp8_tensor site also gets W's amax as a graph node
    (`weight_amax`): reduced once per step, read by both the forward's cast of W and the backward's
    transposing cast, where each would reduce W again."""
    family = g.site.recipe.partition("@")[0]
    ops = torch.ops.deepwell
    if codes is not None and family == "fp8_block":
        op = ops.fp8_block_linear_from_rows if rows_only else ops.fp8_block_linear_from_codes
        return graph.call_function(op.default, (x, *codes, w, bias, g.site.recipe))
    if codes is not None:
        w_amax = graph.call_function(amax_of, (graph.call_method("detach", (w,)),))
        if rows_only:
            x_codes, x_scale, x_amax = codes
            args = (x, x_codes, x_scale, w, bias, g.site.recipe, w_amax, x_amax)
            return graph.call_function(ops.fp8_tensor_linear_from_rows.default, args)
        args = (x, *codes, w, bias, g.site.recipe, w_amax)
        return graph.call_function(ops.fp8_tensor_linear_from_codes.default, args)
    return graph.call_function(ops.scaled_linear.default, (x, w, bias, g.site.recipe, None))


def rewrite(gm: torch.fx.GraphModule, found: list[Gemm], fp8_block_codes: bool | None = None,
            recompute_codes: bool = False) -> int:
    """Replaces every non-bf16 site with deepwell.scaled_linear (fp8_tensor, and fp8_block with
    `fp8_block_codes`: the recipe's `*_linear_from_codes` on x's codes, made once per input;
    `_saves_codes`; None: `fp8_block_codes_default()`; with `recompute_codes` the sites read the
    row copy alone and their backwards make the column copy, `_quantize_once`); returns how many. A
    site's operands may be earlier sites (a stack of linears): they are read through `replaced`,
    never from the erased nodes the sites were captured with."""
    if fp8_block_codes is None:
        fp8_block_codes = fp8_block_codes_default()
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
            if _saves_codes(g, fp8_block_codes):
                key = (g.x, g.site.recipe.partition("@")[0])
                if key not in codes_of:
                    codes_of[key] = _quantize_once(gm.graph, x, g.site.in_features, key[1], recompute_codes)
                codes = codes_of[key]
            new = _linear_call(gm.graph, g, x, w, bias, codes, recompute_codes)
        new.meta = dict(g.node.meta)
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


def _policy(options: dict) -> PrecisionPolicy:
    policy = options.get("policy")
    if policy is None:
        return PrecisionPolicy(precision=options.get("precision", "auto"))
    if not isinstance(policy, PrecisionPolicy):
        raise TypeError(f"deepwell backend: options['policy'] must be a deepwell.PrecisionPolicy, got {type(policy)}")
    return policy


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


def _from_fixed_plan(found: list, fixed: Plan, fallback: str) -> Plan:
    """Each site's decision looked up by name in a plan made beforehand (deepwell.compile); a name
    relative to a block (a per-block graph under FSDP2) through `_shared_decision`."""
    by_name = {s.name: s.decision for s in fixed.sites}
    for site in (g.site for g in found):
        decision = by_name.get(site.name) or _shared_decision(site, fixed)
        if decision is None:
            if fallback != "safe":
                raise RuntimeError(f"deepwell backend: site {site.name!r} is not in the plan (fallback={fallback!r})")
            decision = LayerDecision("bf16", False, "not in the plan: bf16 (fallback='safe')", "Fallback")
        site.decision = decision
    return Plan(fixed.arch, fixed.policy, [g.site for g in found])


def _warn_unused_precision(plan: Plan, options: dict) -> None:
    """A recipe the user named (not "auto", not bf16) that no site of the graph runs: say so, with
    the plan's reasons grouped, rather than compile a model that silently ignores the request.
    (One warning per distinct message: Python's default filter shows each once.)"""
    asked = plan.policy.precision
    family = asked.partition("@")[0]
    if options.get("plan") is not None or family in ("auto", "bf16") or not plan.sites:
        return
    if any(s.recipe.partition("@")[0] == family for s in plan.sites):
        return
    reasons = Counter(s.decision.reason if s.decision else "not planned" for s in plan.sites)
    why = "; ".join(f"{n} site{'s' if n > 1 else ''}: {r}" for r, n in reasons.most_common())
    warnings.warn(f"deepwell backend: precision={asked!r} was asked for, but none of this graph's {len(plan.sites)} GEMM sites "
                  f"runs it ({why})", stacklevel=2)


def plan_graph(gm: torch.fx.GraphModule, options: dict | None = None) -> tuple[Plan, list]:
    """The plan of one captured graph (no rewriting)."""
    options = options or {}
    found = capture_sites(gm)
    if options.get("plan") is not None:
        return _from_fixed_plan(found, options["plan"], options.get("fallback", "safe")), found
    plan = plan_sites([g.site for g in found], _policy(options), options.get("arch"))
    return plan, found


def backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """The Dynamo backend (see the module docs)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    options = dict(options or {})
    known = {"precision", "policy", "verbose", "arch", "plan", "fallback", "cudagraphs", "fp8_block_codes", "fused_mlp",
             "graph_ops", "recompute_codes"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"deepwell backend: unknown options {sorted(unknown)} ({', '.join(sorted(known))})")
    start = time.perf_counter()
    plan, found = plan_graph(gm, options)
    _warn_hf_moe(gm)
    _warn_unused_precision(plan, options)
    rewritten = rewrite(gm, found, options.get("fp8_block_codes"), options.get("recompute_codes", RECOMPUTE_CODES))
    fused = fuse_mlp(gm) if options.get("fused_mlp", FUSED_MLP) else 0
    STATS["graphs"] += 1
    STATS["planning_s"] += time.perf_counter() - start
    STATS["fused_mlps"] += fused
    PLANS.append(plan)
    if options.get("verbose") or _env.print_plan():
        print(plan.table())
        print(f"deepwell backend: {rewritten} GEMM sites rewritten; {fused} SwiGLU MLP(s) fused into fp8_block_swiglu_mlp")
    # CUDA graphs take away the host's cost per op (deepwell's ops cost 21-87 us each on the host;
    # docs/DESIGN.md "Data flow of"). Their warm-up runs
    # allocate from the graphs' private pool, where a weight cache entry would be a live tensor the
    # graphs do not track: reuse goes off for the process.
    inductor = {"triton.cudagraphs": True} if options.get("cudagraphs") else {}
    if inductor:
        allow_reuse(False)
    if options.get("graph_ops", GRAPH_OPS):
        inductor["post_grad_custom_post_pass"] = GraphOps(inductor_config.post_grad_custom_post_pass)
    with torch._functorch.config.patch(_partitioner_options(rewritten)):
        return compile_fx(gm, example_inputs, config_patches=inductor)


def _partitioner_options(rewritten: int) -> dict:
    """AOTAutograd partitioner settings for a graph with `rewritten` deepwell GEMMs.

    By default the partitioner never recomputes a tensor that a non-fusible backward op reads
    (`ban_recompute_materialized_backward`): recomputing it would write it out again anyway. Every
    deepwell GEMM's backward reads its bf16 input x (it quantizes x along the tokens for wgrad), so
    the normed activations and SwiGLU outputs feeding them were saved from forward to backward in
    bf16, 2 bytes per element, although each is one fused pointwise kernel away from tensors the
    backward keeps anyway (the residual stream and the norm's rstd; SwiGLU's two inputs). Lifting
    the ban lets the min-cut partitioner recompute them in the backward, which is the trade torchao's
    float8 casts get: same saved set as its Inductor-visible casts (benchmarks/bench_train_step.py
    measures both; tests/compile/test_backend.py proves the saved bytes never exceed bf16's). The other bans
    stay: reductions, long fusible chains and GEMMs are never recomputed."""
    return {"ban_recompute_materialized_backward": False} if rewritten else {}


def last_plan() -> Plan | None:
    """The plan of the most recently compiled graph."""
    return PLANS[-1] if PLANS else None


def ensure_registered() -> None:
    """Registers the backend under "deepwell" when its entry point is not installed (a source
    checkout on PYTHONPATH: development, the GPU machine). Guarded, because registering a name
    the entry point also provides makes Dynamo fail with "duplicate name"."""
    if "deepwell" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(backend, "deepwell")
