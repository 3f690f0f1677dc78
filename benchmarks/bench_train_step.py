"""Tokens/s of a full training step (forward, backward, AdamW) of a ~1B-parameter LLaMA-style model
on the GPU: `torch.compile` (Inductor, bf16) vs `torch.compile(backend="deepwell")` with
precision="auto", in one process; plus `deepwell.dryrun`'s predicted peak memory vs
`torch.cuda.max_memory_allocated()`, and the planner's share of compile time. torchao's float8
training (tensorwise and rowwise recipes, LM head in bf16) runs in the same process when torchao is
installed (skipped with a note otherwise). For every run, `kernels ms` is the GPU's kernel time per
step (torch.profiler): a step much longer than its kernels is bound by the host's launches.

Model: d=2048, 16 layers, 16 heads, SwiGLU 5632, vocab 32000, bf16 parameters, AdamW (fused);
batch 4 x seq 2048 = 8192 tokens per step, cross-entropy on random targets.

    python benchmarks/bench_train_step.py [--quick]   (--quick: 4 layers)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import deepwell
import deepwell.plan.backend
from torch.profiler import ProfilerActivity, profile

from _common import environment, header, time_ms, torchao_float8, torchao_version, write_json
from deepwell.models import Llama

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH = 32000, 2048, 16, 5632, 2048, 4


def make_model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(VOCAB, DIM, layers, HEADS, HIDDEN, max_seq=SEQ).to(device="cuda", dtype=torch.bfloat16)


def kernel_ms(step, steps: int = 3) -> float:
    """GPU kernel time per step, summed over the profiler's device events."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / steps / 1e3


def run(model, compiled, tokens, targets, steps: int, warmup: int = 3):
    """(first-call seconds, ms per step, peak bytes, kernel ms per step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        logits = compiled(tokens)
        loss = F.cross_entropy(logits.view(-1, VOCAB).float(), targets.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ms = time_ms(step, warmup=warmup, iters=steps, reps=1)
    peak = torch.cuda.max_memory_allocated()
    return first, ms, peak, kernel_ms(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    layers = 4 if args.quick else 16
    env = environment()
    header(f"bench_train_step: LLaMA d={DIM} x {layers} layers, {BATCH}x{SEQ} tokens, AdamW", env)
    deepwell.plan.backend.ensure_registered()
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    n_tokens = BATCH * SEQ
    rows = []

    model = make_model(layers)
    n_params = sum(p.numel() for p in model.parameters())
    torch._dynamo.reset()
    first, ms, peak, kms = run(model, torch.compile(model), tokens, targets, args.steps)
    rows.append({"what": "torch.compile bf16", "step_ms": ms, "tokens_per_s": n_tokens / ms * 1e3, "first_call_s": first,
                 "peak_bytes": peak, "kernel_ms": kms})
    del model
    torch.cuda.empty_cache()

    if torchao_version() is None:
        print("torchao is not installed: its float8 rows are skipped (pip install torchao)")
    for ao_recipe in ("tensorwise", "rowwise") if torchao_version() else ():
        model = torchao_float8(make_model(layers), ao_recipe)
        torch._dynamo.reset()
        first, ms, peak, kms = run(model, torch.compile(model), tokens, targets, args.steps)
        rows.append({"what": f"torchao float8 {ao_recipe}", "step_ms": ms, "tokens_per_s": n_tokens / ms * 1e3,
                     "first_call_s": first, "peak_bytes": peak, "kernel_ms": kms, "torchao": torchao_version()})
        del model
        torch.cuda.empty_cache()

    model = make_model(layers)
    torch._dynamo.reset()
    ir = deepwell.capture(model, (tokens,))
    plan = deepwell.autoplan(ir, hw=deepwell.probe(), precision="auto")
    engine = deepwell.compile(ir, plan=plan)
    estimate = deepwell.dryrun(engine)
    planning_before = deepwell.plan.backend.STATS["planning_s"]
    first, ms, peak, kms = run(model, engine, tokens, targets, args.steps)
    planning = deepwell.plan.backend.STATS["planning_s"] - planning_before
    recipes = sorted({s.recipe for s in plan.sites})
    rows.append({"what": f"deepwell auto ({'/'.join(recipes)})", "step_ms": ms, "tokens_per_s": n_tokens / ms * 1e3,
                 "first_call_s": first, "peak_bytes": peak, "kernel_ms": kms, "predicted_peak_bytes": estimate.peak_bytes,
                 "predicted_step_ms": estimate.step_ms, "predicted_speedup": estimate.speedup, "planning_s": planning})

    base = rows[0]["tokens_per_s"]
    print(f"{n_params / 1e9:.2f}B parameters; plan: {len(plan.sites)} GEMM sites, recipes {recipes}")
    print(f"{'run':<32} {'step ms':>8} {'kernels ms':>10} {'tokens/s':>10} {'vs bf16':>8} {'peak GiB':>9} {'first call s':>12}")
    for r in rows:
        print(f"{r['what']:<32} {r['step_ms']:8.1f} {r['kernel_ms']:10.1f} {r['tokens_per_s']:10.0f} "
              f"{r['tokens_per_s'] / base:8.2f} {r['peak_bytes'] / 2**30:9.2f} {r['first_call_s']:12.1f}")
    dw = rows[-1]
    err = dw["predicted_peak_bytes"] / dw["peak_bytes"] - 1
    print(f"dryrun: predicted peak {dw['predicted_peak_bytes'] / 2**30:.2f} GiB vs measured {dw['peak_bytes'] / 2**30:.2f} GiB "
          f"({err * 100:+.1f}%); predicted step {dw['predicted_step_ms']:.1f} ms ({dw['predicted_speedup']:.2f}x bf16)")
    print(estimate)
    print(f"planning {dw['planning_s'] * 1e3:.1f} ms of a {dw['first_call_s']:.1f} s first call "
          f"({dw['planning_s'] / dw['first_call_s'] * 100:.2f}% of compile time)")
    print("wrote", write_json("bench_train_step" + ("-quick" if args.quick else ""), env, rows, {"layers": layers, "params": n_params}))


if __name__ == "__main__":
    main()
