"""One-line entry points on top of the `deepwell` torch.compile backend."""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter

import torch

from .compiler import backend
from .compiler.engine import Engine, autoplan, capture
from .core.policy import PrecisionPolicy
from .nn.attention import attention_report
from .nn.attention import swap_attention as swap_attention_modules
from .nn.moe import DeepwellMoE
from .nn.moe_model import swap_hf_moe
from .plan.options import CompileOptions


def optimize(
    model,
    precision: str | None = None,
    policy: PrecisionPolicy | None = None,
    verbose: bool | None = None,
    swap_moe: bool = True,
    swap_attention: bool = True,
    keep_attention_weights: bool = False,
    cudagraphs: bool | None = None,
    fp8_block_codes: bool | None = None,
    fused_mlp: bool | None = None,
    graph_ops: bool | None = None,
    recompute_codes: bool | None = None,
    attention: str | None = None,
    options: CompileOptions | None = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    global_batch: int | None = None,
    **compile_kw,
):
    """`torch.compile(model, backend="deepwell")` with deepwell's options: every linear on a
    parameter runs in the recipe the Rust planner picks for it (`precision="auto"`: the device's
    fastest native recipe), the rest is fused by Inductor. The keywords are `CompileOptions` fields
    (plan/options.py says what each does; `verbose=True` prints the plan, `cudagraphs=True` replays
    the compiled graphs as CUDA graphs, `mode="reduce-overhead"`), applied over `options` where
    given (not None). `attention="fp8"` runs each eligible `scaled_dot_product_attention` as
    `deepwell.fp8_attention`: FP8 forward numerics, EMULATED (slower than torch's SDPA), bf16 backward.

    With `swap_moe` (default) the Hugging Face MoE blocks of `model` (Mixtral, Qwen2/3-MoE,
    DeepSeek-V3) are first replaced, in place, by equivalent `deepwell.DeepwellMoE` modules whose
    experts run as grouped GEMMs in the options' precision (planned by Rust for the "experts" role).

    With `swap_attention` (default) every `torch.nn.MultiheadAttention` is replaced, in place and
    sharing its parameters, by `deepwell.nn.DeepwellMultiheadAttention`, which runs
    `scaled_dot_product_attention` instead of the explicit softmax that training with the default
    `need_weights=True` computes; and Hugging Face models configured with eager attention are
    switched to "sdpa" (nn/attention.py). The one behavioural difference: the swapped modules
    return `(output, None)` unless a call passes `need_weights=True` explicitly;
    `keep_attention_weights=True` swaps no attention module (`verbose=True` reports what was
    swapped and what was kept, and why).

    A training shape (`seq_len` with `batch_size`, one process's micro-batch, and/or `global_batch`,
    default batch_size) plans the model up front instead of at its first call: `capture` on a
    made-up (batch_size, seq_len) batch of token ids (token-id models: compiler/engine.py
    `example_tokens`), `autoplan` for seq_len x global_batch tokens; the result then carries that
    Engine as `deepwell_engine`, which `deepwell.dryrun` reads."""
    backend.ensure_registered()  # a source checkout has no entry point naming the backend
    options = (options or CompileOptions()).replace(
        precision=precision, policy=policy, verbose=verbose, cudagraphs=cudagraphs, fp8_block_codes=fp8_block_codes,
        fused_mlp=fused_mlp, graph_ops=graph_ops, recompute_codes=recompute_codes,
        attention=attention)
    swapped = 0
    if swap_attention and isinstance(model, torch.nn.Module):
        # Before torch.compile: Dynamo then traces the SDPA branch, not the explicit one.
        swap_attention_modules(model, keep_attention_weights=keep_attention_weights)
        if options.verbose:
            for line in attention_report(model, keep_attention_weights).lines():
                print(f"deepwell.optimize: attention: {line}")
    if swap_moe and isinstance(model, torch.nn.Module):
        swapped = swap_hf_moe(model, recipe="auto", policy=options.precision_policy(), verbose=options.verbose)
        if options.verbose and swapped:
            print(f"deepwell.optimize: {swapped} Hugging Face MoE blocks -> deepwell.DeepwellMoE")
    engine = ir = None
    if seq_len is not None or batch_size is not None or global_batch is not None:
        ir = capture(model, seq_len=seq_len, batch_size=batch_size)
        seq = ir.example_inputs[0].shape[1]
        plan = autoplan(ir, seq_len=seq, global_batch=global_batch or ir.example_inputs[0].shape[0],
                        precision=options.precision, policy=options.policy, arch=options.arch)
        options = options.replace(plan=plan)
    compiled = torch.compile(model, backend="deepwell", options=options, **compile_kw)
    if ir is not None and isinstance(compiled, torch.nn.Module):
        engine = Engine(ir, options.plan, compiled, options)
        compiled.deepwell_engine = engine  # what deepwell.dryrun reads of an optimize() result
        if options.verbose:
            print(summary(model, options.plan, swapped, keep_attention_weights))
    if isinstance(compiled, torch.nn.Module) and any(p.dim() == 2 for p in model.parameters()):
        _warn_if_nothing_is_planned(compiled, model, swapped if options.verbose and engine is None else None,
                                    keep_attention_weights)
    return compiled


def summary(model: torch.nn.Module, plan, swapped: int = 0, keep_attention_weights: bool = False) -> str:
    """What `optimize` did to `model`, by kind: GEMM sites by recipe, MoE blocks, attention (the
    plan's attention sites by kernel, and the modules swapped or kept)."""
    recipes = Counter(s.runs_in for s in plan.sites)
    kernels = Counter(a.kernel for a in plan.attention)
    fp8 = any(k.startswith("deepwell") for k in kernels)
    rewritten = "some rewritten to deepwell.fp8_attention, emulated" if fp8 else "not rewritten: torch runs them"
    moe = sum(isinstance(m, DeepwellMoE) for m in model.modules())
    report = attention_report(model, keep_attention_weights)
    # nn.MultiheadAttention (and the drop-in, its subclass) are in the report's lines.
    other = sum(type(m).__name__.endswith(("Attention", "SelfAttention")) and not isinstance(m, torch.nn.MultiheadAttention)
                for m in model.modules())
    lines = [
        f"deepwell.optimize: {len(plan.sites)} GEMM sites on parameters (nn.Linear, HF Conv1D, matmuls) planned for "
        f"{plan.arch}: " + ", ".join(f"{n} {r}" for r, n in sorted(recipes.items())),
        f"  MoE blocks: {moe} deepwell.DeepwellMoE" + (f" ({swapped} swapped in from Hugging Face)" if swapped else ""),
        f"  attention sites: {len(plan.attention)}" + (f" ({rewritten}) by kernel: " if kernels else "")
        + ", ".join(f"{n} {k}" for k, n in sorted(kernels.items())),
    ] + [f"  attention: {line}" for line in report.lines()]
    if other or not report.lines():
        lines.append(f"  attention: {other} modules kept (their projections are GEMM sites above; the attention itself "
                     "stays PyTorch's, e.g. scaled_dot_product_attention)")
    return "\n".join(lines)


def _warn_if_nothing_is_planned(compiled: torch.nn.Module, model: torch.nn.Module | None = None,
                               swapped: int | None = None, keep_attention_weights: bool = False) -> None:
    """Warns once if the first call planned no graph: Dynamo skipped the frame (a graph break
    inside a loop makes it run the whole forward eagerly), so no GEMM runs in low precision. The
    backend itself cannot say so: it is never called for a skipped frame. With `swapped` (verbose),
    prints the `summary` of the first call's plans."""
    def before(module, args, kwargs):
        handles["graphs"] = backend.STATS["graphs"]
        handles["plans"] = len(backend.PLANS)

    def after(module, args, kwargs, output):
        for h in handles.pop("hooks"):
            h.remove()
        if swapped is not None and len(backend.PLANS) > handles["plans"]:
            plans = backend.PLANS[handles["plans"]:]
            merged = dataclasses.replace(plans[-1], sites=[s for p in plans for s in p.sites],
                                         attention=[a for p in plans for a in p.attention])
            print(summary(model, merged, swapped, keep_attention_weights))
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
    """The seeds' alias: `optimize` with MXFP8 (native on sm_100/sm_120, emulated elsewhere);
    `seq_len=` / `batch_size=` / `global_batch=` plan it up front (see `optimize`), for `dryrun`."""
    return optimize(model, precision=precision, **kw)
