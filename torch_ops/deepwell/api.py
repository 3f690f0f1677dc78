"""One-line entry points on top of the `deepwell` torch.compile backend."""

from __future__ import annotations

import warnings

import torch

from .compiler import backend
from .core.policy import PrecisionPolicy
from .nn.moe_model import swap_hf_moe
from .plan.options import CompileOptions


def optimize(
    model,
    precision: str | None = None,
    policy: PrecisionPolicy | None = None,
    verbose: bool | None = None,
    swap_moe: bool = True,
    cudagraphs: bool | None = None,
    fp8_block_codes: bool | None = None,
    fused_mlp: bool | None = None,
    graph_ops: bool | None = None,
    recompute_codes: bool | None = None,
    options: CompileOptions | None = None,
    **compile_kw,
):
    """`torch.compile(model, backend="deepwell")` with deepwell's options: every linear on a
    parameter runs in the recipe the Rust planner picks for it (`precision="auto"`: the device's
    fastest native recipe), the rest is fused by Inductor. The keywords are `CompileOptions` fields
    (plan/options.py says what each does; `verbose=True` prints the plan, `cudagraphs=True` replays
    the compiled graphs as CUDA graphs, `mode="reduce-overhead"`), applied over `options` where
    given (not None).

    With `swap_moe` (default) the Hugging Face MoE blocks of `model` (Mixtral, Qwen2/3-MoE,
    DeepSeek-V3) are first replaced, in place, by equivalent `deepwell.DeepwellMoE` modules whose
    experts run as grouped GEMMs in the options' precision (planned by Rust for the "experts" role)."""
    options = (options or CompileOptions()).replace(
        precision=precision, policy=policy, verbose=verbose, cudagraphs=cudagraphs, fp8_block_codes=fp8_block_codes,
        fused_mlp=fused_mlp, graph_ops=graph_ops, recompute_codes=recompute_codes)
    if swap_moe and isinstance(model, torch.nn.Module):
        swapped = swap_hf_moe(model, recipe="auto", policy=options.precision_policy(), verbose=options.verbose)
        if options.verbose and swapped:
            print(f"deepwell.optimize: {swapped} Hugging Face MoE blocks -> deepwell.DeepwellMoE")
    compiled = torch.compile(model, backend="deepwell", options=options, **compile_kw)
    if isinstance(compiled, torch.nn.Module) and any(p.dim() == 2 for p in model.parameters()):
        _warn_if_nothing_is_planned(compiled)
    return compiled


def _warn_if_nothing_is_planned(compiled: torch.nn.Module) -> None:
    """Warns once if the first call planned no graph: Dynamo skipped the frame (a graph break
    inside a loop makes it run the whole forward eagerly), so no GEMM runs in low precision. The
    backend itself cannot say so: it is never called for a skipped frame."""
    def before(module, args, kwargs):
        handles["graphs"] = backend.STATS["graphs"]

    def after(module, args, kwargs, output):
        for h in handles.pop("hooks"):
            h.remove()
        if backend.STATS["graphs"] == handles["graphs"]:
            warnings.warn(
                "deepwell.optimize: the first call compiled no graph, so nothing was planned and the model ran "
                "in eager precision. Dynamo skips a frame with a graph break inside a for/while loop; "
                "torch._dynamo.explain(model)(*inputs) lists the breaks.",
                stacklevel=2,
            )

    handles: dict = {}
    handles["hooks"] = [
        compiled.register_forward_pre_hook(before, with_kwargs=True),
        compiled.register_forward_hook(after, with_kwargs=True),
    ]


def optimize_for_blackwell(model, precision: str = "mxfp8", **kw):
    """The seeds' alias: `optimize` with MXFP8 (native on sm_100/sm_120, emulated elsewhere)."""
    return optimize(model, precision=precision, **kw)
