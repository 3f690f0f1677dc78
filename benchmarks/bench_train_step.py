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

`--rounds R` (R >= 2) keeps every run's model alive after its own measurement, then times them
again in R rounds, each round starting one run later (every run takes every place in the order):
the GPU's clocks drift with how long and how hard it has run (on an H200 the same GEMM kernel took
7% longer in a saturated run than in a host-bound one), and runs measured one after another in
separate windows carry that drift into their ratios. The rounds give each run's median step and its
step time over bf16's and torchao's in the same round (median and range over rounds). The rounds
run before any profiler session (`--kernels`' host times too), and a run's peak memory is its own:
what the runs kept alive hold is subtracted. Every run stays on the GPU at once (~5.3 GiB of
weights and AdamW states each at 0.95B): an 80 GB GPU may not hold five 8B runs.

`--kernels N` also prints each run's N longest kernels, the host's time to launch a step (measured
before any profiler session: one leaves CUDA's activity tracing attached, which slows every later
launch) and each deepwell op's host time from Rust's spans. `--cudagraphs` runs every model in CUDA
graphs (mode="reduce-overhead"; deepwell's `cudagraphs=True`).

    python benchmarks/bench_train_step.py [--quick] [--model 1b|8b] [--layers N] [--torchao tensorwise,rowwise]
        [--precisions auto,fp8_tensor,auto+codes,auto+recompute,auto+requantize,auto+fused,fp8_tensor+autograd] [--kernels N] [--cudagraphs]
        [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import deepwell
import deepwell.compiler.backend
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


def run(model, compiled, tokens, targets, steps: int, warmup: int = 3, host: bool = False,
        others: int = 0, kernels: bool = True) -> tuple[dict, object]:
    """One run's row and its step function: first-call seconds, ms per step, tokens/s, peak bytes
    (less `others`, the bytes earlier runs kept alive for `--rounds` hold), with `kernels` the
    kernel time (`add_kernels`), (first loss, last loss, steps), and with `host` the host's time
    per step and per deepwell op (`host_ms`). Every run takes the same number of steps on the same
    batch from the same weights, so the last losses are comparable (the recipe's accuracy next to
    its speed); the rounds' steps come after the loss is read."""
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
    peak = torch.cuda.max_memory_allocated() - others
    row = {"step_ms": ms, "step_ms_median": statistics.median(each), "step_ms_each": each,
           "tokens_per_s": tokens.numel() / ms * 1e3, "first_call_s": first, "peak_bytes": peak}
    if host:
        row["host_ms"], row["host_ops"] = host_ms(step)
    if kernels:
        add_kernels(row, step)
    row["loss"] = (losses[0].item(), losses[-1].item(), len(losses))
    return row, step


def add_kernels(row: dict, step) -> None:
    """The row's kernel ms per step, by kind and the longest kernels (`kernel_ms`: a profiler
    session, after which every launch of the process is slower; `--rounds` runs it last)."""
    kms, kinds, per_kernel = kernel_ms(step)
    row.update({"kernel_ms": kms, "kernel_kinds": kinds, "top_kernels": per_kernel[:40]})


def round_order(runs: list, r: int) -> list:
    """The runs in round r's order: starting at run r (mod their number), so that over as many
    rounds as runs every run takes every place once."""
    start = r % len(runs)
    return runs[start:] + runs[:start]


def rounds(steppers: list[tuple[str, object]], n: int, steps: int) -> dict[str, list[float]]:
    """Each run's mean step ms in each of `n` rounds (`round_order`) of `steps` timed steps, after
    2 warm-up steps."""
    means: dict[str, list[float]] = {what: [] for what, _ in steppers}
    for r in range(n):
        for what, step in round_order(steppers, r):
            each = step_times_ms(step, warmup=2, steps=steps)
            means[what].append(sum(each) / len(each))
    return means


def _ratio(v: tuple[float, float, float] | None) -> str:
    return f"{v[0]:.3f}x ({v[1]:.3f}-{v[2]:.3f})" if v else ""


def print_rounds(means: dict[str, list[float]], base: str, peer: str | None) -> dict[str, dict]:
    """The rounds' table: each run's median step over the rounds, and its speed over `base`'s and
    `peer`'s (torchao) in the same round, median [min-max] over rounds; returns it per run."""
    n = len(means[base])
    print(f"{n} interleaved rounds (each run's mean step in each round; ratios paired within a round):")
    print(f"{'run':<40} {'median ms':>9} {'range ms':>13}  {'vs bf16 (range)':>22}  {'vs torchao (range)':>22}")
    out = {}
    for what, ms in means.items():
        vs = {}
        for name, ref in (("vs_bf16", base), ("vs_torchao", peer)):
            if ref is not None:
                ratios = sorted(b / a for a, b in zip(ms, means[ref]))
                vs[name] = (statistics.median(ratios), ratios[0], ratios[-1])
        out[what] = {"round_ms": ms, "median_ms": statistics.median(ms), **vs}
        print(f"{what:<40} {statistics.median(ms):9.1f} {min(ms):6.1f}-{max(ms):<6.1f}  "
              f"{_ratio(vs.get('vs_bf16')):>22}  {_ratio(vs.get('vs_torchao')):>22}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", choices=sorted(MODELS), default="1b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--torchao", default="tensorwise,rowwise", help="torchao float8 recipes to run ('' for none)")
    p.add_argument("--precisions", default="auto,fp8_tensor",
                   help="deepwell precisions to run (auto first); 'NAME+codes' / 'NAME+recompute' compile with "
                        "fp8_block_codes=True / False, 'NAME+fused' / 'NAME+unfused' with fused_mlp=True / False, "
                        "'NAME+autograd' with graph_ops=False (the graphs call deepwell ops through their autograd layer), "
                        "'NAME+requantize' with recompute_codes=True (x's codes made again in the backward)")
    p.add_argument("--kernels", type=int, default=0, help="print each run's N longest kernels per step")
    p.add_argument("--cudagraphs", action="store_true",
                   help="every run replays CUDA graphs: mode='reduce-overhead', deepwell's cudagraphs=True")
    p.add_argument("--rounds", type=int, default=0,
                   help="keep every run alive and time them again in R interleaved rounds (R >= 2)")
    args = p.parse_args()
    if args.rounds == 1:
        p.error("--rounds takes 2 or more (one round is the runs' own measurement)")
    if args.rounds and args.cudagraphs:
        # CUDA graph trees give all compiled models of a device one memory pool; interleaving their
        # replays is not something this benchmark has verified, so it does not offer it.
        p.error("--rounds does not run with --cudagraphs")
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
    deepwell.compiler.backend.ensure_registered()
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    rows = []

    kept = []  # (row, step, model, compiled) of every run, for --rounds
    # With --rounds, each run's profiler session waits until after the rounds (see add_kernels).
    measure = {"host": bool(args.kernels), "kernels": not args.rounds}

    def done(row, step, *alive) -> None:
        """Records the run's row; keeps it alive for the rounds, or frees it."""
        rows.append(row)
        if args.rounds:
            kept.append((row, step, *alive))
        torch.cuda.empty_cache()

    def held() -> int:
        """Bytes the runs kept alive hold (none without --rounds)."""
        return torch.cuda.memory_allocated() if kept else 0

    # Dynamo's caches are reset once, before the first run: a reset between runs would make the
    # kept runs compile again in the rounds (each compiled model guards on its own module).
    torch._dynamo.reset()
    others = held()
    model = make_model(spec, layers)
    n_params = sum(p.numel() for p in model.parameters())
    compiled = torch.compile(model, mode=mode)
    row, step = run(model, compiled, tokens, targets, args.steps, others=others, **measure)
    done({"what": "torch.compile bf16", **row}, step, model, compiled)
    del model, compiled, step

    if torchao_version() is None:
        print("torchao is not installed: its float8 rows are skipped (pip install torchao)")
    for ao_recipe in [r for r in args.torchao.split(",") if r] if torchao_version() else ():
        if not args.rounds:
            torch._dynamo.reset()
        others = held()
        model = torchao_float8(make_model(spec, layers), ao_recipe)
        compiled = torch.compile(model, mode=mode)
        row, step = run(model, compiled, tokens, targets, args.steps, others=others, **measure)
        done({"what": f"torchao float8 {ao_recipe}", **row, "torchao": torchao_version()}, step, model, compiled)
        del model, compiled, step

    deepwell_rows = []
    for name in [p for p in args.precisions.split(",") if p]:
        precision, _, how = name.partition("+")
        codes = {"": None, "codes": True, "recompute": False, "requantize": None, "fused": None, "unfused": None,
                 "autograd": None}[how]
        fused = {"fused_mlp": how == "fused"} if how in ("fused", "unfused") else {}
        fused.update({"graph_ops": False} if how == "autograd" else {})
        fused.update({"recompute_codes": True} if how == "requantize" else {})
        if not args.rounds:
            torch._dynamo.reset()
        others = held()
        model = make_model(spec, layers)
        ir = deepwell.capture(model, (tokens,))
        plan = deepwell.autoplan(ir, hw=deepwell.probe(), precision=precision)
        engine = deepwell.compile(ir, plan=plan, cudagraphs=args.cudagraphs, fp8_block_codes=codes, **fused)
        estimate = deepwell.dryrun(engine)
        planning_before = deepwell.compiler.backend.STATS["planning_s"]
        row, step = run(model, engine, tokens, targets, args.steps, others=others, **measure)
        planning = deepwell.compiler.backend.STATS["planning_s"] - planning_before
        recipes = sorted({s.recipe for s in plan.sites})
        mlp_note = {None: "", True: ", MLP fused", False: ", MLP unfused"}[fused.get("fused_mlp")]
        mlp_note += ", ops via autograd" if how == "autograd" else ""
        mlp_note += ", x codes made again in the backward" if how == "requantize" else ""
        codes_note = {None: "", True: ", x codes saved", False: ", x recomputed"}[codes] + mlp_note
        row = {"what": f"deepwell {precision} ({'/'.join(recipes)}{codes_note})", **row,
               "predicted_peak_bytes": estimate.peak_bytes, "predicted_step_ms": estimate.step_ms,
               "predicted_speedup": estimate.speedup, "planning_s": planning, "precision": precision,
               "sites": {r: sum(s.recipe == r for s in plan.sites) for r in recipes}}
        done(row, step, model, engine)
        deepwell_rows.append((row, plan, estimate))
        del model, engine, step

    interleaved = None
    if args.rounds:
        peer = next((r["what"] for r in rows if r["what"] == "torchao float8 tensorwise"), None)
        means = rounds([(row["what"], step) for row, step, *_ in kept], args.rounds, args.steps)
        for row, step, *_ in kept:
            add_kernels(row, step)
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
    if args.rounds:
        interleaved = print_rounds(means, rows[0]["what"], peer)
    print(f"planning {dw['planning_s'] * 1e3:.1f} ms of a {dw['first_call_s']:.1f} s first call "
          f"({dw['planning_s'] / dw['first_call_s'] * 100:.2f}% of compile time)")
    suffix = ("" if args.model == "1b" else f"-{args.model}") + ("-quick" if args.quick else "")
    name = "bench_train_step" + suffix + ("-cudagraphs" if args.cudagraphs else "")
    name += f"-rounds{args.rounds}" if args.rounds else ""
    extra = {"model": args.model, "dim": dim, "hidden": hidden, "layers": layers, "params": n_params,
             "rounds": interleaved}
    print("wrote", write_json(name, env, rows, extra))


if __name__ == "__main__":
    main()
