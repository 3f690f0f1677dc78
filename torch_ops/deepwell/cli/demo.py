"""The main job's training part: a small byte-level LLaMA-style model trained on real text (the
Python standard library's own sources, deepwell.train.data) with deepwell.Trainer through the
`deepwell` torch.compile backend; then a resume from the run's middle checkpoint (checked to
continue the loss curve bit for bit in deterministic mode, the default, on the CPU and the GPU), an
export round trip, and the per-recipe parity table (deepwell.train.parity). The printed resume line
and summary.json say which mode ran.

On a GPU, precision "auto" (the device's fastest native recipe: fp8_block on Hopper, mxfp8 on
Blackwell, bf16 elsewhere) and a larger model. On the CPU nothing is native, so the job asks for
mxfp8, which runs as exact emulation, to show the quantized path.
"""

from __future__ import annotations

import copy
import json
import re
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

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


def _steps(n: int) -> str:
    return f"{n} step{'s' if n != 1 else ''}"


#: The job's run directories under --out: run-1, run-2, ...
_RUN = re.compile(r"run-([0-9]+)")


def fresh_run_dir(out: str | Path) -> Path:
    """A new directory `out`/run-N (N one past the highest there) for this run's outputs. Each run
    writes its own: checkpoints keep the newest few steps, and an earlier run's higher steps in a
    shared directory would otherwise be the ones kept, deleting this run's before it resumes from
    them. Nothing already under `out` is touched. Under torchrun rank 0 creates it and the others
    use the name it broadcasts."""
    out = Path(out)
    path = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        n = max((int(m.group(1)) for p in out.iterdir() if (m := _RUN.fullmatch(p.name))), default=0)
        while path is None:  # another job may take the number first
            n += 1
            try:
                (out / f"run-{n}").mkdir()
                path = out / f"run-{n}"
            except FileExistsError:
                continue
    if dist.is_initialized():
        shared = [str(path) if path is not None else None]
        dist.broadcast_object_list(shared, src=0)
        path = Path(shared[0])
    return path


def mode_line(deterministic: bool) -> str:
    """The job's line saying which kernels it runs (deepwell.train.determinism)."""
    if deterministic:
        return ("mode: deterministic kernels (with the seeds and the data position a checkpoint holds, the resume below "
                "must continue bit for bit); --no-deterministic runs the faster kernels")
    return ("mode: non-deterministic kernels (atomic adds, timed kernel choices: a resumed run's last bits may differ); "
            "--deterministic makes resume bit for bit")


def resume_result(equal: bool, diff: float, deterministic: bool) -> str:
    """How the resumed steps compare with the first run's, and under which mode."""
    if deterministic:
        return ("bit-identical to the first run (deterministic: resumed bit-identical)" if equal else
                f"differ by up to {diff:.2e} from the first run although both ran deterministic kernels (a bug: "
                "deterministic mode promises bit-identical steps)")
    return ("bit-identical to the first run (non-deterministic kernels: not guaranteed, --deterministic guarantees it)"
            if equal else f"differ by up to {diff:.2e} (non-deterministic kernels: atomic adds make the last bits vary; "
            "--deterministic makes resume bit for bit)")


def write_summary(out_dir: Path, summary: dict) -> Path | None:
    """`out_dir`/summary.json: the job's settings, its mode and the resume and export checks (rank 0
    writes it; None on the other ranks)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    path = out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def _relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    """||y - reference|| / ||reference|| over all the logits, in float64."""
    y, reference = y.double(), reference.double()
    return ((y - reference).norm() / reference.norm()).item()


@torch.no_grad()
def _eager_logits(engine, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The trained model's logits run eagerly in `dtype`, unquantized (a copy: the engine keeps its own)."""
    model = copy.deepcopy(engine.model).to(dtype).eval()
    return model(tokens).float()


def train_demo(device: torch.device, steps: int = 120, precision: str | None = None, out: str = "deepwell_run",
               parity_steps: int = 40, eval_batches: int = 8, tensor_parallel: int | None = None,
               fp8_all_gather: bool = False, sequence_parallel: bool = False, noise_seeds: int = 3,
               deterministic: bool = True) -> dict:
    """Runs the training part of the main job; returns {"losses", "heldout", "resumed_equal", ...}.
    `deterministic`: every Trainer of the job (the run, its resume and the parity runs) runs
    deterministic kernels (deepwell.train.determinism), so the resume check must find the resumed
    steps bit-identical; False: the faster kernels, whose last bits vary from run to run.
    `tensor_parallel`: the tensor degree under torchrun (None: the planner's); `fp8_all_gather`:
    autoplan's option of that name (FSDP2 gathers fp8_block weights as FP8 codes); `sequence_parallel`
    too (the residual stream split along the sequence over the tensor ranks). `noise_seeds`: seeds
    the parity run's bf16 baseline trains at (its spread over seeds judges the recipes' gaps).
    Outputs go to a fresh `out`/run-N directory (`fresh_run_dir`)."""
    backend.ensure_registered()
    precision = precision or ("auto" if device.type == "cuda" else "mxfp8")
    out_dir = fresh_run_dir(out)
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
    print(f"{params / 1e6:.2f}M parameters; outputs in {out_dir}/ (each run of the job writes a new run-N directory)")
    print(mode_line(deterministic))
    heldout = heldout_batches(corpus.heldout, config.batch, config.seq_len, eval_batches)
    half = max(steps // 2, 1)
    trainer = parity.make_trainer(
        engine, steps, log_every=max(steps // 20, 1), eval_every=max(steps // 4, 1), checkpoint_dir=out_dir / "checkpoints",
        checkpoint_every=half, log_dir=out_dir / "train", deterministic=deterministic,
    )
    trainer.fit(TokenBatches(corpus.train, config.batch, config.seq_len, seed=0), heldout)
    losses = _steps_losses(trainer)
    evals = [(r["step"], r["eval_loss"]) for r in trainer.history if "eval_loss" in r]
    # Each step's own rate (its time between CUDA events on a GPU); the first log interval's steps
    # compile.
    rates = [r["tokens_per_s"] for r in trainer.history if "tokens_per_s" in r and r["step"] > trainer.log_every]
    k = max(steps // 10, 1)
    print(f"train loss {_mean(list(losses.values())[:k]):.3f} (first {_steps(k)}) -> {_mean(list(losses.values())[-k:]):.3f} (last {_steps(k)})")
    print("held-out loss " + ", ".join(f"step {s}: {v:.3f}" for s, v in evals))
    if rates:
        compiling = "the first step compiles" if trainer.log_every == 1 else f"the first {trainer.log_every} compile"
        kernels = "deterministic" if deterministic else "non-deterministic"
        print(f"tokens/s: {statistics.median(rates):,.0f} (median over steps {trainer.log_every + 1}..{steps}; {compiling}; "
              f"{kernels} kernels)")

    # Resume from the middle checkpoint into fresh optimizer and data-loader objects.
    mid = out_dir / "checkpoints" / f"step_{half:08d}"
    resumed = parity.make_trainer(engine, steps, log_every=max(steps // 20, 1), log_dir=out_dir / "resumed",
                                  progress=False, plot=False, deterministic=deterministic)
    resumed.fit(TokenBatches(corpus.train, config.batch, config.seq_len, seed=0), resume=mid)
    again = _steps_losses(resumed)
    tail = [s for s in losses if s > half]
    equal = all(again[s] == losses[s] for s in tail)
    diff = max((abs(again[s] - losses[s]) for s in tail), default=0.0)
    outcome = resume_result(equal, diff, deterministic)
    print(f"resumed from {mid}: steps {half + 1}..{steps} {outcome}")
    summary = {
        "device": str(device), "precision": precision, "steps": steps, "deterministic": deterministic,
        "mode": "deterministic" if deterministic else "non-deterministic",
        "heldout": evals,
        "resume": {"from": str(mid), "steps": [half + 1, steps], "bit_identical": equal, "max_abs_diff": diff,
                   "result": outcome},
    }
    result = {"losses": losses, "heldout": evals, "resumed_equal": equal, "resume_max_diff": diff,
              "deterministic": deterministic, "export_equal": None, "parity": []}

    if world_size() > 1:
        # export() reads whole weights and the parity runs train one model per recipe: both are
        # one-process tools (run the job without torchrun for them).
        print("export and parity: skipped under torchrun (one-process tools; run python -m deepwell for them)")
        write_summary(out_dir, {**summary, "export_equal": None})
        print(f"training part took {time.perf_counter() - start:.0f} s")
        return result

    # Export, load, and compare logits on one held-out batch.
    artifact = export(engine, out_dir / "export")  # a fresh run directory: nothing to overwrite
    loaded = load(artifact, device=device)
    tokens = heldout[0][:, :-1].to(device)
    with torch.no_grad():
        got, want, compiled = loaded(tokens), planned_eager(engine)(tokens), engine(tokens)
    same = torch.equal(got, want)
    print(
        f"export: {artifact} ({len(loaded.deepwell_artifact['quantized_sites'])} sites pre-quantized); loaded logits "
        + ("bit-identical to" if same else f"differ by up to {(got - want).abs().max().item():.2e} from")
        + " the trained model's with its plan run eagerly"
    )
    # Logits reach ~10 in magnitude, so an absolute difference between two low-precision runs says
    # little; each run's distance from an fp32 forward of the same weights, beside plain bf16's,
    # says how far it is from exact and whether that is more than bf16 alone costs.
    exact = _eager_logits(engine, tokens, torch.float32)
    errors = {"compiled engine": compiled, "its plan run eagerly": want, "loaded export": got,
              "plain bf16 eager": _eager_logits(engine, tokens, torch.bfloat16)}
    print("logits vs an fp32 forward of the same weights, relative error ||y - y_fp32|| / ||y_fp32||: "
          + ", ".join(f"{name} {_relative_error(y, exact):.2e}" for name, y in errors.items()))

    results = []
    if parity_steps > 0:
        more = noise_seeds - 1
        print(f"\nparity: the same model per recipe, {_steps(parity_steps)} each, same data and initial weights"
              + (f"; the bf16 recipe also at {more} more seed{'s' if more > 1 else ''}, for the seed noise" if more else ""))
        results = parity.run(corpus, config, parity_steps, device, eval_batches=max(eval_batches // 2, 1),
                             out_dir=out_dir / "parity", progress=True, noise_seeds=noise_seeds, deterministic=deterministic)
        print(parity.table(results, device))
    write_summary(out_dir, {**summary, "export_equal": same})
    print(f"\nwrote {out_dir}/: summary.json, train/metrics.jsonl, train/loss.png, checkpoints/, resumed/metrics.jsonl, export/"
          + (", parity/parity.png, parity/parity.md" if results else ""))
    print(f"training part took {time.perf_counter() - start:.0f} s")
    return {**result, "export_equal": same, "parity": results}
