"""Tokens/s of a full training step (forward, backward, AdamW) of a ~1B-parameter LLaMA-style model
on the GPU: `torch.compile` (Inductor, bf16) vs `torch.compile(backend="deepwell")` with
precision="auto", in one process; plus `deepwell.dryrun`'s predicted peak memory vs
`torch.cuda.max_memory_allocated()`, and the planner's share of compile time. torchao's float8
training (tensorwise and rowwise recipes, LM head in bf16) runs in the same process when torchao is
installed (skipped with a note otherwise). For every run, `kernels ms` is the GPU's kernel time per
step (torch.profiler): a step much longer than its kernels is bound by the host's launches. Each
timed step gets its own CUDA event (none waited on before the last): `step ms` is their mean,
`median` their median, and a run whose slowest step passes 1.5x its median prints every step's time
(a recompile or a host pause inside the window, which the mean alone hides).

Models (`--model`): "1b": d=2048, 16 layers, 16 heads, SwiGLU 5632 (0.95B); "8b": LLaMA-3-8B's
layer shape (d=4096, 32 heads, SwiGLU 14336) with `--layers` of them (default 8, what fits beside
four runs' compile caches; the full 32 do not fit with AdamW states on one 80 GB GPU). Vocab 32000,
bf16 parameters, AdamW (fused); batch 4 x seq 2048 = 8192 tokens per step, cross-entropy on random
targets. Each run's kernel time is also split by kind (GEMMs, deepwell's quantizers, attention,
Inductor's fused kernels, optimizer, other), so a gap can be attributed.

`--kernels N` also prints each run's N longest kernels, the host's time to launch a step (measured
before any profiler session: one leaves CUDA's activity tracing attached, which slows every later
launch) and each deepwell op's host time from Rust's spans. `--cudagraphs` runs every model in CUDA
graphs (mode="reduce-overhead"; deepwell's `cudagraphs=True`).

    python benchmarks/bench_train_step.py [--quick] [--model 1b|8b] [--layers N] [--torchao tensorwise,rowwise]
        [--precisions auto,fp8_tensor,auto+codes,auto+recompute,auto+fused] [--kernels N] [--cudagraphs]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import deepwell
import deepwell.plan.backend
from torch.profiler import ProfilerActivity, profile

from _common import (environment, first_call_s, header, step_times_ms, torchao_float8, torchao_version,
                     write_json)
from deepwell.models import Llama

VOCAB, SEQ, BATCH = 32000, 2048, 4
#: A timed step this many times the run's median is printed with the run's every step time.
SLOW_STEP = 1.5
CUDAGRAPHS = False  # --cudagraphs: each step begins a new CUDA graph trees iteration
#: name -> (dim, heads, SwiGLU hidden, default layers)
MODELS = {"1b": (2048, 16, 5632, 16), "8b": (4096, 32, 14336, 8)}

#: kernel kinds by name, first match wins: cuBLAS/cuBLASLt GEMMs (nvjet, sm90_xmma, cutlass), deepwell's
#: NVRTC kernels, flash/cuDNN attention, Inductor's Triton kernels, the fused optimizer.
KINDS = (
    ("attention", ("flash", "fmha", "cudnn", "attention")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "sm90_", "wgmma")),
    ("deepwell", ("deepwell::",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("inductor", ("triton_",)),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def make_model(spec: tuple[int, int, int], layers: int) -> torch.nn.Module:
    dim, heads, hidden = spec
    torch.manual_seed(0)
    return Llama(VOCAB, dim, layers, heads, hidden, max_seq=SEQ).to(device="cuda", dtype=torch.bfloat16)


def kernel_ms(step, steps: int = 3) -> tuple[float, dict[str, float], list[tuple[str, float, float]]]:
    """GPU kernel time per step, summed over the profiler's device events, split by kind, and per
    kernel name as (name, ms per step, calls per step), longest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    per_kernel = []
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            k = kind_of(e.key)
            ms = e.self_device_time_total / steps / 1e3
            kinds[k] = kinds.get(k, 0.0) + ms
            per_kernel.append((e.key, ms, e.count / steps))
    per_kernel.sort(key=lambda r: -r[1])
    return sum(kinds.values()), kinds, per_kernel


def host_ms(step, steps: int = 3) -> tuple[float, dict[str, tuple[float, float]]]:
    """The host's side of a step, measured before any profiler ran (a torch.profiler session leaves
    CUDA's activity tracing attached, which slows every later launch): ms from a step's call to its
    return with the launch queue never drained (a step whose host time reaches its kernel time
    leaves the GPU idle), and each deepwell op's host time from Rust's own spans
    (rust/ops/src/host_time.rs: inclusive of the aten calls and launches it makes) as
    name -> (ms per step, calls per step)."""
    from deepwell import _native

    torch.cuda.synchronize()
    _native.call("host_time", {"enable": True})
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = (time.perf_counter() - t0) / steps * 1e3
    torch.cuda.synchronize()
    spans = _native.call("host_time")
    _native.call("host_time", {"enable": False})
    names = {spec["op"] for spec in _native.call("kernel_table")}  # the ops' own spans, not their parts
    ops = {f"deepwell::{name}": (secs / steps * 1e3, n / steps)
           for name, (secs, n, *_) in spans.items() if name in names}
    return host, ops


def print_kernels(what: str, per_kernel, n: int) -> None:
    """The run's n longest kernels per step (--kernels N): where a kind's milliseconds go."""
    print(f"top {n} kernels per step, {what}:")
    for name, ms, calls in per_kernel[:n]:
        print(f"  {ms:7.2f} ms {calls:6.0f}x  {kind_of(name):<9} {name[:110]}")


def run(model, compiled, tokens, targets, steps: int, warmup: int = 3, host: bool = False) -> dict:
    """One run's row: first-call seconds, ms per step, tokens/s, peak bytes, kernel ms per step (by
    kind, and the longest kernels), (first loss, last loss, steps), and with `host` the host's time
    per step and per deepwell op (`host_ms`). Every run takes the same number of steps on the same
    batch from the same weights, so the last losses are comparable (the recipe's accuracy next to
    its speed)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    losses = []

    def step():
        if CUDAGRAPHS:
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: earlier outputs may be overwritten
        logits = compiled(tokens)
        loss = F.cross_entropy(logits.view(-1, VOCAB).float(), targets.view(-1))
        losses.append(loss.detach())  # no sync: read after the timed steps
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first = first_call_s(step)
    each = step_times_ms(step, warmup=warmup, steps=steps)
    ms = sum(each) / len(each)
    peak = torch.cuda.max_memory_allocated()
    row = {"step_ms": ms, "step_ms_median": statistics.median(each), "step_ms_each": each,
           "tokens_per_s": tokens.numel() / ms * 1e3, "first_call_s": first, "peak_bytes": peak}
    if host:
        row["host_ms"], row["host_ops"] = host_ms(step)
    kms, kinds, per_kernel = kernel_ms(step)
    row.update({"kernel_ms": kms, "kernel_kinds": kinds, "top_kernels": per_kernel[:40]})
    row["loss"] = (losses[0].item(), losses[-1].item(), len(losses))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", choices=sorted(MODELS), default="1b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--torchao", default="tensorwise,rowwise", help="torchao float8 recipes to run ('' for none)")
    p.add_argument("--precisions", default="auto,fp8_tensor",
                   help="deepwell precisions to run (auto first); 'NAME+codes' / 'NAME+recompute' compile with "
                        "fp8_block_codes=True / False, 'NAME+fused' / 'NAME+unfused' with fused_mlp=True / False")
    p.add_argument("--kernels", type=int, default=0, help="print each run's N longest kernels per step")
    p.add_argument("--cudagraphs", action="store_true",
                   help="every run replays CUDA graphs: mode='reduce-overhead', deepwell's cudagraphs=True")
    args = p.parse_args()
    global CUDAGRAPHS
    CUDAGRAPHS = args.cudagraphs
    mode = "reduce-overhead" if args.cudagraphs else None
    dim, heads, hidden, default_layers = MODELS[args.model]
    spec = (dim, heads, hidden)
    layers = args.layers or (4 if args.quick else default_layers)
    env = environment()
    graphs = ", CUDA graphs" if args.cudagraphs else ""
    header(f"bench_train_step: LLaMA d={dim} x {layers} layers (SwiGLU {hidden}), {BATCH}x{SEQ} tokens, "
           f"AdamW{graphs}", env)
    deepwell.plan.backend.ensure_registered()
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    rows = []

    model = make_model(spec, layers)
    n_params = sum(p.numel() for p in model.parameters())
    torch._dynamo.reset()
    rows.append({"what": "torch.compile bf16", **run(model, torch.compile(model, mode=mode), tokens, targets,
                                                      args.steps, host=bool(args.kernels))})
    del model
    torch.cuda.empty_cache()

    if torchao_version() is None:
        print("torchao is not installed: its float8 rows are skipped (pip install torchao)")
    for ao_recipe in [r for r in args.torchao.split(",") if r] if torchao_version() else ():
        model = torchao_float8(make_model(spec, layers), ao_recipe)
        torch._dynamo.reset()
        row = run(model, torch.compile(model, mode=mode), tokens, targets, args.steps, host=bool(args.kernels))
        rows.append({"what": f"torchao float8 {ao_recipe}", **row, "torchao": torchao_version()})
        del model
        torch.cuda.empty_cache()

    deepwell_rows = []
    for name in [p for p in args.precisions.split(",") if p]:
        precision, _, how = name.partition("+")
        codes = {"": None, "codes": True, "recompute": False, "fused": None, "unfused": None}[how]
        fused = {"fused_mlp": how == "fused"} if how in ("fused", "unfused") else {}
        model = make_model(spec, layers)
        torch._dynamo.reset()
        ir = deepwell.capture(model, (tokens,))
        plan = deepwell.autoplan(ir, hw=deepwell.probe(), precision=precision)
        engine = deepwell.compile(ir, plan=plan, cudagraphs=args.cudagraphs, fp8_block_codes=codes, **fused)
        estimate = deepwell.dryrun(engine)
        planning_before = deepwell.plan.backend.STATS["planning_s"]
        row = run(model, engine, tokens, targets, args.steps, host=bool(args.kernels))
        planning = deepwell.plan.backend.STATS["planning_s"] - planning_before
        recipes = sorted({s.recipe for s in plan.sites})
        mlp_note = {None: "", True: ", MLP fused", False: ", MLP unfused"}[fused.get("fused_mlp")]
        codes_note = {None: "", True: ", x codes saved", False: ", x recomputed"}[codes] + mlp_note
        row = {"what": f"deepwell {precision} ({'/'.join(recipes)}{codes_note})", **row,
               "predicted_peak_bytes": estimate.peak_bytes, "predicted_step_ms": estimate.step_ms,
               "predicted_speedup": estimate.speedup, "planning_s": planning, "precision": precision,
               "sites": {r: sum(s.recipe == r for s in plan.sites) for r in recipes}}
        rows.append(row)
        deepwell_rows.append((row, plan, estimate))
        del model, engine
        torch.cuda.empty_cache()

    base = rows[0]["tokens_per_s"]
    for r in rows if args.kernels else ():
        print_kernels(r["what"], r["top_kernels"], args.kernels)
        print(f"  host: {r['host_ms']:.1f} ms to launch a step (its kernels {r['kernel_ms']:.1f} ms, "
              f"step {r['step_ms']:.1f} ms)")
        for name, (ms, calls) in sorted(r["host_ops"].items(), key=lambda kv: -kv[1][0]):
            print(f"  {ms:7.2f} ms {calls:6.0f}x  host, {name} ({ms / calls * 1e3:.0f} us per call)")
    print(f"kernel ms per step by kind ({', '.join(k for k, _ in KINDS)}, other):")
    for r in rows:
        print(f"  {r['what']:<32} " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(r["kernel_kinds"].items())))
    dw, plan, estimate = deepwell_rows[0]
    print(f"{n_params / 1e9:.2f}B parameters; {dw['precision']} plan: {len(plan.sites)} GEMM sites, {dw['sites']}")
    steps_run = rows[0]["loss"][2]
    print(f"{'run':<32} {'step ms':>8} {'median':>7} {'kernels ms':>10} {'tokens/s':>10} {'vs bf16':>8} "
          f"{'peak GiB':>9} {'first call s':>12} {f'loss step 1 -> {steps_run}':>20}")
    for r in rows:
        first_loss, last_loss, _ = r["loss"]
        print(f"{r['what']:<32} {r['step_ms']:8.1f} {r['step_ms_median']:7.1f} {r['kernel_ms']:10.1f} "
              f"{r['tokens_per_s']:10.0f} {r['tokens_per_s'] / base:8.2f} {r['peak_bytes'] / 2**30:9.2f} "
              f"{r['first_call_s']:12.1f} {first_loss:9.4f} -> {last_loss:.4f}")
    for r in rows:  # a single slow step moves the mean of a short window: say so beside the table
        if max(r["step_ms_each"]) > SLOW_STEP * r["step_ms_median"]:
            print(f"  {r['what']}: timed steps (ms) " + " ".join(f"{t:.0f}" for t in r["step_ms_each"]))
    for r, _, _ in deepwell_rows:
        err = r["predicted_peak_bytes"] / r["peak_bytes"] - 1
        print(f"dryrun, {r['what']}: predicted peak {r['predicted_peak_bytes'] / 2**30:.2f} GiB vs measured "
              f"{r['peak_bytes'] / 2**30:.2f} GiB ({err * 100:+.1f}%); predicted step {r['predicted_step_ms']:.1f} ms "
              f"({r['predicted_speedup']:.2f}x bf16)")
    print(estimate)
    print(f"planning {dw['planning_s'] * 1e3:.1f} ms of a {dw['first_call_s']:.1f} s first call "
          f"({dw['planning_s'] / dw['first_call_s'] * 100:.2f}% of compile time)")
    suffix = ("" if args.model == "1b" else f"-{args.model}") + ("-quick" if args.quick else "")
    name = "bench_train_step" + suffix + ("-cudagraphs" if args.cudagraphs else "")
    extra = {"model": args.model, "dim": dim, "hidden": hidden, "layers": layers, "params": n_params}
    print("wrote", write_json(name, env, rows, extra))


if __name__ == "__main__":
    main()
