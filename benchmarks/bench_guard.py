"""What the compiled sites' run-time guardrails cost a training step (compiler/guard.py): the 0.95B
LLaMA-style step of bench_train_step.py (d=2048, 16 layers, batch 4 x seq 2048, AdamW fused) under
`torch.compile(backend="deepwell")`, precision="auto", with the guard off (fallback="none"), on at
its default interval (fallback="safe", statistics every 16 calls) and on at every call (interval
1: each step runs the observed variant, the cost of one observed step), next to stock Inductor in
bf16, in one process. Steps are timed in rounds (bench_train_step.py `rounds`: each round starts one
run later, so the GPU's clock drift spreads over every run), each round 32 steps (two observed
steps of the default interval), after warm-up steps that include the first observed call (where
the observed variant compiles). The target: guard on at interval 16 within 1% of guard off.

    python benchmarks/bench_guard.py [--rounds 3] [--steps 32] [--layers 16]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import deepwell
from _common import environment, first_call_s, header, step_times_ms, write_json
from bench_train_step import BATCH, MODELS, SEQ, VOCAB, make_model, round_order
from deepwell.compiler import guard

#: run name -> CompileOptions fields (None: stock Inductor in bf16)
RUNS = {
    "inductor bf16": None,
    "deepwell guard off": {"fallback": "none"},
    "deepwell guard on (interval 16)": {"fallback": "safe", "guardrails": {"interval": 16}},
    "deepwell guard on (interval 1)": {"fallback": "safe", "guardrails": {"interval": 1}},
}


def stepper(options: dict | None, layers: int, tokens, targets):
    """(model, step function) of one run; its first call compiled."""
    model = make_model(MODELS["1b"][:3], layers)
    compiled = (torch.compile(model) if options is None
                else torch.compile(model, backend="deepwell", options={"precision": "auto", **options}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        logits = compiled(tokens)
        F.cross_entropy(logits.view(-1, VOCAB).float(), targets.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=32, help="timed steps per run and round (a multiple of 16)")
    p.add_argument("--layers", type=int, default=MODELS["1b"][3])
    args = p.parse_args()
    deepwell.compiler.backend.ensure_registered()
    env = environment()
    header("compiled guardrails: training step with the guard off and on (0.95B LLaMA-style)", env)
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)

    rows, steppers, models = [], [], {}
    for name, options in RUNS.items():
        model, step = stepper(options, args.layers, tokens, targets)
        first = first_call_s(step)
        step_times_ms(step, warmup=0, steps=17)  # past call 16: the observed variant is compiled
        graphs = guard.graphs_of(model)
        rows.append({"run": name, "first_call_s": first, "guarded_graphs": len(graphs),
                     "observed_compiled": all(gr.observed is not None for gr in graphs) if graphs else None})
        steppers.append((name, step))
        models[name] = model
    means: dict[str, list[float]] = {name: [] for name, _ in steppers}
    for r in range(args.rounds):
        for name, step in round_order(steppers, r):
            each = step_times_ms(step, warmup=2, steps=args.steps)
            means[name].append(sum(each) / len(each))

    off = means["deepwell guard off"]
    print(f"{'run':<34} {'step ms':>9} {'tokens/s':>10} {'vs guard off (median, range over rounds)':>42} {'vs bf16':>8}")
    for row in rows:
        m = means[row["run"]]
        ratios = [a / b for a, b in zip(m, off)]
        bf16 = statistics.median(a / b for a, b in zip(m, means["inductor bf16"]))
        row.update({"step_ms_rounds": m, "step_ms": statistics.median(m), "tokens_per_s": BATCH * SEQ / statistics.median(m) * 1e3,
                    "vs_guard_off": [statistics.median(ratios), min(ratios), max(ratios)], "vs_bf16": bf16})
        records = guard.records_of(models[row["run"]])
        row["fallbacks"] = {n: r.events for n, r in records.items() if guard.fallen_back(r)}
        row["guarded_sites"] = len(records)
        vs_off = f"{statistics.median(ratios):.4f}x ({min(ratios):.4f}-{max(ratios):.4f})"
        print(f"{row['run']:<34} {row['step_ms']:>9.2f} {row['tokens_per_s']:>10.0f} {vs_off:>42} {bf16:>7.3f}x")
    on16 = rows[2]
    print(f"guard on (interval 16) costs {100 * (on16['vs_guard_off'][0] - 1):+.2f}% of a step (target <= 1%); "
          f"{on16['guarded_sites']} guarded sites in {on16['guarded_graphs']} graph(s); fallbacks: {on16['fallbacks'] or 'none'}")
    print("wrote", write_json("bench_guard", env, rows, {"rounds": args.rounds, "steps": args.steps, "layers": args.layers}))


if __name__ == "__main__":
    main()
