"""The main job's training part: a small byte-level LLaMA-style model trained on real text (the
Python standard library's own sources, deepwell.train.data) with deepwell.Trainer through the
`deepwell` torch.compile backend; then a resume from the run's middle checkpoint (checked to
continue the loss curve bit for bit on the CPU), an export round trip, and the per-recipe parity
table (deepwell.train.parity).

On a GPU, precision "auto" (the device's fastest native recipe: fp8_block on Hopper, mxfp8 on
Blackwell, bf16 elsewhere) and a larger model. On the CPU nothing is native, so the job asks for
mxfp8, which runs as exact emulation, to show the quantized path.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..artifact.export import export, load, planned_eager
from ..compiler import backend
from ..distributed.units import world_size
from ..train import parity
from ..train.data import ByteCorpus, TokenBatches, heldout_batches


def _steps_losses(trainer) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in trainer.history if "loss" in r}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def train_demo(device: torch.device, steps: int = 120, precision: str | None = None, out: str = "deepwell_run",
               parity_steps: int = 40, eval_batches: int = 8, tensor_parallel: int | None = None,
               fp8_all_gather: bool = False, sequence_parallel: bool = False) -> dict:
    """Runs the training part of the main job; returns {"losses", "heldout", "resumed_equal", ...}.
    `tensor_parallel`: the tensor degree under torchrun (None: the planner's); `fp8_all_gather`:
    autoplan's option of that name (FSDP2 gathers fp8_block weights as FP8 codes); `sequence_parallel`
    too (the residual stream split along the sequence over the tensor ranks)."""
    backend.ensure_registered()
    precision = precision or ("auto" if device.type == "cuda" else "mxfp8")
    out_dir = Path(out)
    start = time.perf_counter()
    corpus = ByteCorpus.stdlib()
    config = parity.ModelConfig.for_device(device)
    print(f"\ntraining: {corpus}")
    print(
        f"model: LLaMA-style, byte-level, {config.layers} layers, d={config.dim}, SwiGLU {config.hidden}, "
        f"{config.batch}x{config.seq_len} tokens/step, {config.dtype}; AdamW, warmup + cosine, clip 1.0; precision={precision!r}"
    )
    engine = parity.build_engine(config, precision, device, seed=0, verbose=True, tensor_parallel=tensor_parallel,
                                 fp8_all_gather=fp8_all_gather, sequence_parallel=sequence_parallel)
    params = sum(p.numel() for p in engine.model.parameters())
    print(f"{params / 1e6:.2f}M parameters; outputs in {out_dir}/")
    heldout = heldout_batches(corpus.heldout, config.batch, config.seq_len, eval_batches)
    deterministic = device.type == "cpu"  # the Trainer's default: deterministic kernels on the CPU
    half = max(steps // 2, 1)
    trainer = parity.make_trainer(
        engine, steps, log_every=max(steps // 20, 1), eval_every=max(steps // 4, 1), checkpoint_dir=out_dir / "checkpoints",
        checkpoint_every=half, log_dir=out_dir / "train",
    )
    trainer.fit(TokenBatches(corpus.train, config.batch, config.seq_len, seed=0), heldout)
    losses = _steps_losses(trainer)
    evals = [(r["step"], r["eval_loss"]) for r in trainer.history if "eval_loss" in r]
    # Each step's own rate (its time between CUDA events on a GPU); the first log interval's steps
    # compile.
    rates = [r["tokens_per_s"] for r in trainer.history if "tokens_per_s" in r and r["step"] > trainer.log_every]
    k = max(steps // 10, 1)
    print(f"train loss {_mean(list(losses.values())[:k]):.3f} (first {k} steps) -> {_mean(list(losses.values())[-k:]):.3f} (last {k})")
    print("held-out loss " + ", ".join(f"step {s}: {v:.3f}" for s, v in evals))
    if rates:
        print(f"tokens/s: {statistics.median(rates):,.0f} (median over steps {trainer.log_every + 1}..{steps}; the first {trainer.log_every} compile)")

    # Resume from the middle checkpoint into fresh optimizer and data-loader objects.
    mid = out_dir / "checkpoints" / f"step_{half:08d}"
    resumed = parity.make_trainer(engine, steps, log_every=max(steps // 20, 1), log_dir=out_dir / "resumed",
                                  progress=False, plot=False)
    resumed.fit(TokenBatches(corpus.train, config.batch, config.seq_len, seed=0), resume=mid)
    again = _steps_losses(resumed)
    tail = [s for s in losses if s > half]
    equal = all(again[s] == losses[s] for s in tail)
    diff = max((abs(again[s] - losses[s]) for s in tail), default=0.0)
    print(f"resumed from {mid}: steps {half + 1}..{steps} " + ("bit-identical to the first run" if equal else f"differ by up to {diff:.2e}")
          + ("" if deterministic else " (GPU: atomics make the last bits vary)"))

    if world_size() > 1:
        # export() reads whole weights and the parity runs train one model per recipe: both are
        # one-process tools (run the job without torchrun for them).
        print("export and parity: skipped under torchrun (one-process tools; run python -m deepwell for them)")
        print(f"training part took {time.perf_counter() - start:.0f} s")
        return {"losses": losses, "heldout": evals, "resumed_equal": equal, "export_equal": None, "parity": []}

    # Export, load, and compare logits on one held-out batch.
    artifact = export(engine, out_dir / "export", overwrite=True)  # the run directory is the job's own
    loaded = load(artifact, device=device)
    tokens = heldout[0][:, :-1].to(device)
    with torch.no_grad():
        got, want, compiled = loaded(tokens), planned_eager(engine)(tokens), engine(tokens)
    same = torch.equal(got, want)
    print(
        f"export: {artifact} ({len(loaded.deepwell_artifact['quantized_sites'])} sites pre-quantized); loaded logits "
        + ("bit-identical to" if same else f"differ by up to {(got - want).abs().max().item():.2e} from")
        + f" the trained model's with its plan run eagerly; max |diff| vs the compiled engine {(got - compiled).abs().max().item():.2e}"
    )

    results = []
    if parity_steps > 0:
        print(f"\nparity: the same model per recipe, {parity_steps} steps each, same data and initial weights")
        results = parity.run(corpus, config, parity_steps, device, eval_batches=max(eval_batches // 2, 1),
                             out_dir=out_dir / "parity", progress=True)
        print(parity.table(results, device))
    print(f"\nwrote {out_dir}/: train/metrics.jsonl, train/loss.png, checkpoints/, resumed/metrics.jsonl, export/"
          + (", parity/parity.png, parity/parity.md" if results else ""))
    print(f"training part took {time.perf_counter() - start:.0f} s")
    return {"losses": losses, "heldout": evals, "resumed_equal": equal, "export_equal": same, "parity": results}
