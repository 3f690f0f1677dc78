"""Loss parity of FP8 attention, on the CPU or a GPU: the main job's small LLaMA (deepwell.parity's
ModelConfig, the standard library's sources as bytes) trained under
`torch.compile(backend="deepwell")` with `attention="bf16"` (torch's SDPA) and `attention="fp8"`
(`deepwell.fp8_attention`: FP8 forward numerics EMULATED, bf16 backward; docs/NUMERICS.md
"FP8 attention"), from the same initial weights on the same batches, at several seeds. Every GEMM
stays unquantized in both arms (precision="bf16"), so the gap is attention's alone.

Prints each arm's held-out loss per seed, the gap in % per seed and on the mean, and the bf16 arm's
spread over seeds (a gap no larger than it is within seed noise); writes JSON to benchmarks/results/.
The issue's target: a gap <= 1% of bf16's held-out loss. On the CPU the model is float32, so the
"bf16" arm's attention is float32 SDPA (unquantized), the reference the FP8 arm is held to.

    python benchmarks/parity_attention.py [--steps 150] [--seeds 0,1] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import deepwell  # noqa: F401  (registers the ops)
from deepwell.compiler import backend
from deepwell.train.data import ByteCorpus, TokenBatches, heldout_batches
from deepwell.train.optim import AdamW
from deepwell.train.parity import ModelConfig
from deepwell.train.schedule import WarmupCosine
from deepwell.train.trainer import next_token_loss

from _common import environment, header, write_json

ARMS = ("bf16", "fp8")


def train(config: ModelConfig, corpus: ByteCorpus, heldout, attention: str, seed: int, steps: int,
          device: torch.device, lr: float = 3e-3) -> dict:
    """One arm at one seed: the main job's Trainer settings (AdamW 0.9/0.95, weight decay 0.1, 10%
    warmup then cosine to 10%, gradients clipped at 1.0), written out as a plain loop."""
    torch._dynamo.reset()
    model = config.build(device, seed)
    compiled = torch.compile(model, backend="deepwell", options={"precision": "bf16", "attention": attention})
    opt = AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = WarmupCosine(warmup_steps=max(steps // 10, 1), min_ratio=0.1).with_steps(steps)
    batches = TokenBatches(corpus.train, config.batch, config.seq_len, seed=seed)
    losses, start = [], time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * schedule(step)
        loss = next_token_loss(compiled, next(batches).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        held = sum(next_token_loss(compiled, b.to(device)).item() for b in heldout) / len(heldout)
    plan = backend.last_plan()
    kernels = sorted({a.kernel for a in plan.attention}) if plan is not None else []
    return {"attention": attention, "seed": seed, "steps": steps, "heldout": held,
            "final_train": sum(losses[-max(steps // 10, 1):]) / max(steps // 10, 1),
            "seconds": time.perf_counter() - start, "kernels": kernels, "losses": losses}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (at least 2 for the seed spread)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--tag", default="", help="a tag in the JSON's name (a partial run: one seed of several)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="training text read from the standard library")
    p.add_argument("--combine", default="", help="comma-separated JSONs of tagged partial runs: their rows, summarised "
                   "and written as one untagged result")
    args = p.parse_args(argv)
    if args.combine:
        return combine(args.combine.split(","))
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    device = torch.device(args.device)
    backend.ensure_registered()
    env = environment("cpu" if device.type == "cpu" else "cuda")
    header("FP8 attention (emulated) loss parity vs bf16 attention", env)
    config = ModelConfig.for_device(device)
    corpus = ByteCorpus.stdlib(max_bytes=args.max_bytes)
    heldout = heldout_batches(corpus.heldout, config.batch, config.seq_len, args.eval_batches)
    print(f"# model: dim {config.dim}, {config.layers} layers, {config.heads} heads (head size {config.dim // config.heads}), "
          f"{config.batch}x{config.seq_len} tokens/step, {config.dtype}; {args.steps} steps; seeds {seeds}")
    rows = []
    for seed in seeds:
        for arm in ARMS:
            r = train(config, corpus, heldout, arm, seed, args.steps, device)
            rows.append(r)
            print(f"seed {seed} attention={arm:<4} held-out {r['heldout']:.4f}  final train {r['final_train']:.4f}  "
                  f"{r['seconds']:.0f} s  [{'; '.join(r['kernels'])}]", flush=True)
    summary = summarise(rows, seeds, args.steps, config)
    for r in rows:
        r["losses"] = [round(x, 5) for x in r["losses"]]
    path = write_json("parity_attention" + (f"-{args.tag}" if args.tag else ""), env, rows, {"summary": summary})
    print(f"wrote {path}")
    return summary


def combine(paths: list[str]) -> dict:
    """The rows of partial runs (one seed each, run side by side), summarised and written as one result."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    rows = [r for run in runs for r in run["rows"]]
    seeds = sorted({r["seed"] for r in rows})
    config, steps = runs[0]["summary"]["config"], runs[0]["summary"]["steps"]
    summary = summarise(rows, seeds, steps, argparse.Namespace(**config))
    path = write_json("parity_attention", runs[0]["env"], rows, {"summary": {**summary, "combined_from": paths}})
    print(f"wrote {path}")
    return summary


def summarise(rows: list[dict], seeds: list[int], steps: int, config) -> dict:
    """The per-seed gaps, the mean gap and the bf16 seed spread of `rows`, printed as a table."""
    by = {(r["attention"], r["seed"]): r["heldout"] for r in rows}
    gaps = [100 * (by["fp8", s] - by["bf16", s]) / by["bf16", s] for s in seeds]
    mean = {a: sum(by[a, s] for s in seeds) / len(seeds) for a in ARMS}
    spread = max(by["bf16", s] for s in seeds) - min(by["bf16", s] for s in seeds)
    summary = {"gap_pct_per_seed": gaps, "gap_pct_mean": 100 * (mean["fp8"] - mean["bf16"]) / mean["bf16"],
               "heldout_mean": mean, "bf16_seed_spread": spread, "bf16_seed_spread_pct": 100 * spread / mean["bf16"],
               "target_gap_pct": 1.0, "config": vars(config), "steps": steps, "seeds": seeds}
    print("\n| seed | bf16 held-out | fp8 held-out | gap |\n|---|---|---|---|")
    for s, g in zip(seeds, gaps):
        print(f"| {s} | {by['bf16', s]:.4f} | {by['fp8', s]:.4f} | {g:+.2f}% |")
    print(f"| mean | {mean['bf16']:.4f} | {mean['fp8']:.4f} | {summary['gap_pct_mean']:+.2f}% |")
    print(f"bf16 seed spread: {spread:.4f} ({summary['bf16_seed_spread_pct']:.2f}%); target gap <= 1%: "
          f"{'met' if max(abs(g) for g in gaps) <= 1.0 else 'NOT met'}")
    return summary


if __name__ == "__main__":
    main()
