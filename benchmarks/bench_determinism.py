"""What deterministic mode (deepwell.Trainer's `deterministic`, the main job's default) costs on the
GPU, and what it buys: the main job's GPU model (`ModelConfig.for_device("cuda")`: byte-level
LLaMA, d=1024, 8 layers, SwiGLU 2816, 16 x 512 tokens a step, bf16) planned with the device's
native recipe (fp8_block on Hopper, mxfp8 on Blackwell), trained by the Trainer with the main job's
settings (AdamW fused, warmup + cosine, clip 1.0), once per mode, in one process.

Each mode trains twice from the same initial weights and batches (a fresh engine each time; the
second compile hits Inductor's caches): `step ms` is the median of the second run's steps after the
first `--warmup` (each step's own time between CUDA events, the Trainer's `step_s`), `vs fast` its
ratio to the non-deterministic mode's, and `runs agree` whether the two runs' losses are
bit-identical (else their largest difference): what a resume from a checkpoint sees too.

    python benchmarks/bench_determinism.py [--steps 40] [--warmup 10] [--precision auto]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import deepwell.compiler.backend
from _common import environment, header, write_json
from deepwell.train import ByteCorpus, TokenBatches
from deepwell.train.parity import ModelConfig, build_engine, make_trainer


def _run(corpus, config, precision: str, steps: int, deterministic: bool) -> tuple[list[float], list[float]]:
    """(losses, step seconds) of one run of `steps` steps from seed 0."""
    engine = build_engine(config, precision, torch.device("cuda"), seed=0)
    trainer = make_trainer(engine, steps, log_every=steps, progress=False, plot=False, deterministic=deterministic)
    trainer.fit(TokenBatches(corpus.train, config.batch, config.seq_len, seed=0))
    records = [r for r in trainer.history if "loss" in r]
    return [r["loss"] for r in records], [r["step_s"] for r in records]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the timing (default 10)")
    p.add_argument("--precision", default="auto", help="the plan's precision (default auto: the device's native recipe)")
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error(f"--warmup must be below --steps, got {args.warmup} and {args.steps}")
    deepwell.compiler.backend.ensure_registered()
    env = environment()
    header("deterministic mode: step time and run-to-run bits (deepwell.Trainer, the main job's GPU model)", env)
    corpus = ByteCorpus.stdlib()
    config = ModelConfig.for_device(torch.device("cuda"))
    tokens = config.batch * config.seq_len
    rows = []
    for deterministic in (False, True):
        (first, _), (second, seconds) = (_run(corpus, config, args.precision, args.steps, deterministic) for _ in range(2))
        ms = 1e3 * statistics.median(seconds[args.warmup:])
        diff = max(abs(a - b) for a, b in zip(first, second))
        rows.append({"mode": "deterministic" if deterministic else "non-deterministic", "step_ms": ms,
                     "tokens_per_s": tokens / ms * 1e3, "runs_bit_identical": first == second, "max_loss_diff": diff})
    fast = rows[0]["step_ms"]
    print(f"{'mode':<20}{'step ms':>10}{'tokens/s':>12}{'vs fast':>9}  runs agree")
    for r in rows:
        r["vs_fast"] = r["step_ms"] / fast
        agree = "bit-identical" if r["runs_bit_identical"] else f"differ by up to {r['max_loss_diff']:.2e}"
        print(f"{r['mode']:<20}{r['step_ms']:>10.2f}{r['tokens_per_s']:>12,.0f}{r['vs_fast']:>8.2f}x  {agree}")
    path = write_json("bench_determinism", env, rows,
                      {"model": {"dim": config.dim, "layers": config.layers, "hidden": config.hidden, "tokens": tokens},
                       "precision": args.precision, "steps": args.steps, "warmup": args.warmup})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
