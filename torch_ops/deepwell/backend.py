"""The `deepwell` torch.compile backend: `torch.compile(model, backend="deepwell")`.

Registered only through the `torch_dynamo_backends` entry point (setup.py), so the name works
without `import deepwell`. For each graph Dynamo captures it
1. summarises every linear on a parameter weight (`torch.nn.functional.linear`): the owning
   module's qualified name and type, role, in/out features and tokens per call;
2. asks the Rust planner for a decision per site (deepwell.plan; the policy from the options);
3. rewrites the sites whose recipe is not bf16 into `torch.ops.deepwell.scaled_linear` (autograd
   registered: the backward GEMMs follow the same recipe), leaving bf16 sites as they are;
4. hands the graph to Inductor (`compile_fx`), which fuses everything around the deepwell ops.

Options (`torch.compile(..., options={...})` or `deepwell.optimize(model, ...)`): `precision`
("auto", "mxfp8", "nvfp4", "fp8_block", "bf16"), `policy` (a deepwell.PrecisionPolicy; its
precision wins over `precision`), `verbose` (print the plan; also DEEPWELL_PRINT_PLAN=1), `plan`
(a fixed deepwell.Plan from `deepwell.autoplan`: sites are looked up by name instead of planned)
with `fallback` ("safe": a site the plan lacks runs bf16; "error": it raises).
A graph break splits the model into graphs planned separately (each has its own first and last site).
"""

from __future__ import annotations

import os
import re
import time

import torch

import deepwell  # noqa: F401  (the ops and their fake kernels exist before tracing)

from .plan import Plan, Site, plan_sites, role_of
from .policy import LayerDecision, PrecisionPolicy

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)

#: Every plan made in this process, newest last (`deepwell.last_plan()`), with planning time.
PLANS: list[Plan] = []
STATS = {"graphs": 0, "planning_s": 0.0}


def _module_path(source_name: str) -> tuple[str, str] | None:
    """("layers.0.attn.wq", "weight") from Dynamo's source name of a parameter placeholder
    (`L['self']._modules['layers']._modules['0']..._parameters['weight']`), else None."""
    param = re.search(r"_parameters\['([^']+)'\]$", source_name)
    if param is None:
        return None
    return ".".join(re.findall(r"_modules\['([^']+)'\]", source_name)), param.group(1)


def _weight_site(node: torch.fx.Node) -> Site | None:
    """The site of a linear node whose weight is a parameter placeholder (None otherwise)."""
    x, w = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    if not isinstance(w, torch.fx.Node) or w.op != "placeholder":
        return None
    grapharg = w.meta.get("grapharg")
    path = _module_path(grapharg.source.name) if grapharg is not None else None
    wv, xv = w.meta.get("example_value"), x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
    if path is None or wv is None or xv is None or wv.dim() != 2:
        return None
    stack = list(node.meta.get("nn_module_stack", {}).values())
    module_type = stack[-1][1].__name__ if stack and isinstance(stack[-1][1], type) else "Linear"
    out_f, in_f = (int(d) for d in wv.shape)
    tokens = int(xv.numel() // max(in_f, 1)) if all(isinstance(d, int) for d in xv.shape) else 0
    return Site(path[0], module_type, role_of(path[0], module_type), in_f, out_f, tokens, device=str(wv.device))


def capture_sites(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, Site]]:
    """Every linear-on-a-parameter node of the graph and its summary, in graph order."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _LINEARS:
            site = _weight_site(node)
            if site is not None:
                found.append((node, site))
    return found


def rewrite(gm: torch.fx.GraphModule, found: list[tuple[torch.fx.Node, Site]]) -> int:
    """Replaces every non-bf16 site with deepwell.scaled_linear; returns how many."""
    n = 0
    for node, site in found:
        if site.recipe == "bf16":
            continue
        x, w = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.ops.deepwell.scaled_linear.default, (x, w, bias, site.recipe, None))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
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


def _from_fixed_plan(found: list, fixed: Plan, fallback: str) -> Plan:
    """Each site's decision looked up by name in a plan made beforehand (deepwell.compile)."""
    by_name = {s.name: s.decision for s in fixed.sites}
    for _, site in found:
        decision = by_name.get(site.name)
        if decision is None:
            if fallback != "safe":
                raise RuntimeError(f"deepwell backend: site {site.name!r} is not in the plan (fallback={fallback!r})")
            decision = LayerDecision("bf16", False, "not in the plan: bf16 (fallback='safe')", "Fallback")
        site.decision = decision
    return Plan(fixed.arch, fixed.policy, [s for _, s in found])


def plan_graph(gm: torch.fx.GraphModule, options: dict | None = None) -> tuple[Plan, list]:
    """The plan of one captured graph (no rewriting)."""
    options = options or {}
    found = capture_sites(gm)
    if options.get("plan") is not None:
        return _from_fixed_plan(found, options["plan"], options.get("fallback", "safe")), found
    plan = plan_sites([s for _, s in found], _policy(options), options.get("arch"))
    return plan, found


def backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """The Dynamo backend (see the module docs)."""
    from torch._inductor.compile_fx import compile_fx

    options = dict(options or {})
    known = {"precision", "policy", "verbose", "arch", "plan", "fallback"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"deepwell backend: unknown options {sorted(unknown)} ({', '.join(sorted(known))})")
    start = time.perf_counter()
    plan, found = plan_graph(gm, options)
    rewrite(gm, found)
    STATS["graphs"] += 1
    STATS["planning_s"] += time.perf_counter() - start
    PLANS.append(plan)
    if options.get("verbose") or os.environ.get("DEEPWELL_PRINT_PLAN") == "1":
        print(plan.table())
    return compile_fx(gm, example_inputs)


def last_plan() -> Plan | None:
    """The plan of the most recently compiled graph."""
    return PLANS[-1] if PLANS else None


def ensure_registered() -> None:
    """Registers the backend under "deepwell" when its entry point is not installed (a source
    checkout on PYTHONPATH: development, the GPU machine). Guarded, because registering a name
    the entry point also provides makes Dynamo fail with "duplicate name"."""
    if "deepwell" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(backend, "deepwell")
