"""`python -m deepwell.parity`: the same model trained once per recipe (bf16, fp8_block, mxfp8,
nvfp4) from the same initial weights on the same batches, with one plot of the loss curves and a
table of each recipe's final losses and their gap to bf16.

Every run starts from `torch.manual_seed(seed)`, builds the model, plans it with the recipe as the
policy's precision, and trains it with the same Trainer settings on the same TokenBatches stream;
the held-out loss is measured on the same fixed windows. "final train" is the mean train loss of the
last tenth of the steps (one step's loss is one batch's, noisy); the gap is to bf16's. On the CPU
every recipe is emulated (exact quantization, fp32 GEMMs) and the "bf16" run of an fp32 model
computes its unquantized sites in fp32: the table says so.

A gap between two runs is only a difference of recipes when it is larger than what changing the
seed alone does: `noise_seeds` trains the bf16 baseline at that many seeds (initial weights, batch
order) and the table prints their held-out losses and marks every gap no larger than their spread
(max - min) "within noise". On an H200 bf16 alone spans 1.974-2.052 over seeds 0/1/2, wider than
most recipes' gaps.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..compiler import backend
from ..compiler.engine import autoplan, capture, compile
from ..core.policy import PrecisionPolicy
from ..distributed.units import world_size
from ..models import Llama
from .data import ByteCorpus, TokenBatches, heldout_batches
from .optim import AdamW, fusable
from .plots import parity_curves
from .schedule import WarmupCosine
from .trainer import Trainer

RECIPES = ("bf16", "fp8_block", "mxfp8", "nvfp4")


@dataclass
class ModelConfig:
    """A byte-level LLaMA-style model and its training shape (deepwell.models.Llama)."""

    dim: int = 256
    layers: int = 4
    heads: int = 4
    hidden: int = 768
    seq_len: int = 128
    batch: int = 8
    dtype: str = "float32"
    #: The policy's min_features: 0 quantizes the small model's GEMMs too (they are below the default
    #: 512, where quantizing costs more time than it saves; here the point is the numerics).
    min_features: int = 0

    @classmethod
    def for_device(cls, device: torch.device, size: str = "small") -> "ModelConfig":
        if size == "tiny":
            return cls(dim=128, layers=1, heads=2, hidden=256, seq_len=32, batch=4)
        if device.type == "cuda":
            return cls(dim=1024, layers=8, heads=16, hidden=2816, seq_len=512, batch=16, dtype="bfloat16", min_features=512)
        return cls()

    def build(self, device: torch.device, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = Llama(256, self.dim, self.layers, self.heads, self.hidden, max_seq=self.seq_len)
        return model.to(device=device, dtype=getattr(torch, self.dtype))


def build_engine(config: ModelConfig, recipe: str, device: torch.device, seed: int = 0, verbose: bool = False,
                 tensor_parallel: int | None = None, fp8_all_gather: bool = False, sequence_parallel: bool = False):
    """The model built from `seed`, captured, planned with `recipe` (and `tensor_parallel`, autoplan's
    forced tensor degree, and its `fp8_all_gather` and `sequence_parallel` options) and compiled
    (deepwell.compile)."""
    model = config.build(device, seed)
    data = world_size() // (tensor_parallel or 1)  # the data ranks (a tensor degree not dividing: autoplan raises)
    if data and config.batch % data:
        raise ValueError(f"deepwell: a batch of {config.batch} rows cannot be split over {data} data-parallel processes")
    # One data rank's micro-batch: the plan's memory figures are per rank (the Trainer splits each batch).
    example = torch.zeros(config.batch // max(data, 1), config.seq_len, dtype=torch.long, device=device)
    ir = capture(model, (example,))
    policy = PrecisionPolicy(precision=recipe, min_features=config.min_features)
    plan = autoplan(ir, policy=policy, tensor_parallel=tensor_parallel, fp8_all_gather=fp8_all_gather,
                    sequence_parallel=sequence_parallel)
    if verbose:
        print(plan.table())
    return compile(ir, plan=plan)


def make_trainer(engine, steps: int, lr: float = 3e-3, **kw) -> Trainer:
    """The Trainer settings the main job and the parity runs share: AdamW (betas 0.9/0.95, weight
    decay 0.1), 10% linear warmup then cosine to 10%, gradients clipped at 1.0."""
    return Trainer.from_engine(
        engine,
        optimizer=lambda params: AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fusable(params)),
        lr_schedule=WarmupCosine(warmup_steps=max(steps // 10, 1), min_ratio=0.1),
        max_steps=steps,
        **kw,
    )


@dataclass
class RecipeResult:
    recipe: str
    runs_as: str
    quantized_sites: int
    sites: int
    losses: list[float] = field(repr=False)
    final_train: float = 0.0
    heldout: float = 0.0
    #: The held-out loss at each seed (seed, seed + 1, ...; the first is `heldout`): more than one for
    #: the bf16 baseline of a run with `noise_seeds` > 1.
    heldout_seeds: list[float] = field(default_factory=list)

    @property
    def spread(self) -> float | None:
        """max - min of the held-out loss over seeds (None with one seed)."""
        return max(self.heldout_seeds) - min(self.heldout_seeds) if len(self.heldout_seeds) > 1 else None


def _runs_as(engine) -> str:
    quantized = [s for s in engine.plan.sites if s.recipe != "bf16"]
    if not quantized:
        return engine.plan.sites[0].runs_in if engine.plan.sites else "bf16"
    return f"{quantized[0].recipe} {'emulated' if any(s.decision.emulated for s in quantized) else 'native'}"


def _train(corpus: ByteCorpus, config: ModelConfig, steps: int, device: torch.device, recipe: str, seed: int,
           heldout, progress: bool, deterministic: bool | None = None) -> RecipeResult:
    engine = build_engine(config, recipe, device, seed)
    if progress:
        print(f"parity: {recipe} ({_runs_as(engine)}), seed {seed}, {steps} steps")
    trainer = make_trainer(engine, steps, log_every=max(steps // 5, 1), progress=progress, seed=seed,
                           deterministic=deterministic)
    trainer.fit(TokenBatches(corpus.train, config.batch, config.seq_len, seed=seed), heldout)
    losses = [r["loss"] for r in trainer.history if "loss" in r]
    tail = losses[-max(len(losses) // 10, 1):]
    quantized = sum(s.recipe != "bf16" for s in engine.plan.sites)
    result = RecipeResult(recipe, _runs_as(engine), quantized, len(engine.plan.sites), losses,
                          sum(tail) / len(tail), trainer.history[-1]["eval_loss"])
    result.heldout_seeds = [result.heldout]
    return result


def run(corpus: ByteCorpus, config: ModelConfig, steps: int, device: torch.device, recipes=RECIPES, seed: int = 0,
        eval_batches: int = 4, out_dir: str | os.PathLike | None = None, progress: bool = True,
        noise_seeds: int = 1, deterministic: bool | None = None) -> list[RecipeResult]:
    """Trains one model per recipe at `seed`, and the bf16 baseline also at seeds seed + 1 ..
    seed + noise_seeds - 1 (its seed spread, against which the table judges the gaps); writes
    parity.png, parity.md and parity.json to `out_dir`. `deterministic`: the Trainer's (None: its
    default for the device)."""
    heldout = heldout_batches(corpus.heldout, config.batch, config.seq_len, eval_batches)
    results = []
    for recipe in recipes:
        result = _train(corpus, config, steps, device, recipe, seed, heldout, progress, deterministic)
        if recipe == "bf16":
            for other in range(seed + 1, seed + noise_seeds):
                result.heldout_seeds.append(
                    _train(corpus, config, steps, device, recipe, other, heldout, progress, deterministic).heldout)
        results.append(result)
    if out_dir is not None:
        write(results, Path(out_dir), device, steps)
    return results


def _baseline_name(base: RecipeResult | None) -> str:
    """What the bf16 recipe's run computes in: "bf16", or "fp32" for an fp32 model (its
    unquantized GEMMs are the model's own)."""
    return base.runs_as.split(" ")[0] if base is not None else "bf16"


def table(results: list[RecipeResult], device: torch.device) -> str:
    """The markdown table of final losses and gaps to the bf16 recipe's run (the first bf16 row),
    each gap marked "within noise" when no larger than that run's spread over seeds."""
    base = next((r for r in results if r.recipe == "bf16"), None)
    name = _baseline_name(base)
    spread = base.spread if base is not None else None
    rows = [f"| recipe | runs as | quantized sites | final train loss | held-out loss | held-out gap vs {name} |", "|---|---|---|---|---|---|"]
    for r in results:
        gap = "—"
        if base is not None and r is not base:
            d = r.heldout - base.heldout
            gap = f"{d:+.4f} ({100 * d / base.heldout:+.2f}%)" + ("" if spread is None else ", within noise" if abs(d) <= spread else ", beyond noise")
        rows.append(f"| {r.recipe} | {r.runs_as} | {r.quantized_sites} of {r.sites} | {r.final_train:.4f} | {r.heldout:.4f} | {gap} |")
    rows.append("")
    if spread is not None:
        seeds = ", ".join(f"{v:.4f}" for v in base.heldout_seeds)
        rows.append(f"Seed noise: the {name} baseline's held-out loss over {len(base.heldout_seeds)} seeds (initial weights and batch "
                    f"order) is {seeds}, a spread of {spread:.4f} ({100 * spread / base.heldout:.2f}%); a gap no larger than "
                    "that is \"within noise\": these steps cannot tell the recipes apart.")
    elif base is not None:
        rows.append(f"One seed: the gaps include seed noise of unmeasured size (train the {name} baseline at more seeds to measure it).")
    if device.type == "cpu":
        rows.append(f"On the CPU every recipe is emulated (bit-exact quantization, fp32 GEMMs); the recipe named bf16 leaves this "
                    f"{name} model's GEMMs unquantized, so the baseline computes in {name}.")
    return "\n".join(rows)


def write(results: list[RecipeResult], out: Path, device: torch.device, steps: int) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    title = f"loss per recipe, same data and initial weights ({steps} steps, {device.type})"
    paths = {"plot": parity_curves({r.recipe: r.losses for r in results}, out / "parity.png", title)}
    (out / "parity.md").write_text(table(results, device) + "\n")
    (out / "parity.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    paths.update(table=str(out / "parity.md"), data=str(out / "parity.json"))
    return paths


def main(argv: list[str] | None = None) -> list[RecipeResult]:
    p = argparse.ArgumentParser(prog="python -m deepwell.parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="training steps per recipe (default 100 on the CPU, 300 on a GPU)")
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated recipes (default {','.join(RECIPES)})")
    p.add_argument("--size", choices=("tiny", "small"), default="small", help="tiny: a 1-layer d=128 model (seconds on the CPU)")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda[:N]")
    p.add_argument("--out", default="deepwell_parity", help="directory for parity.png, parity.md, parity.json")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the batch order and stochastic rounding")
    p.add_argument("--noise-seeds", type=int, default=3,
                   help="seeds the bf16 baseline trains at (seed, seed+1, ...), whose spread marks gaps within noise (default 3; 1: no spread)")
    args = p.parse_args(argv)
    recipes = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        p.error(f"--recipes: expected some of {', '.join(RECIPES)}, got {args.recipes!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}, but torch sees no CUDA device")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device))
    steps = args.steps if args.steps is not None else (300 if device.type == "cuda" else 100)
    if steps < 1:
        p.error("--steps must be at least 1")
    if args.noise_seeds < 1:
        p.error("--noise-seeds must be at least 1")
    backend.ensure_registered()
    corpus = ByteCorpus.stdlib()
    print(corpus)
    config = ModelConfig.for_device(device, args.size)
    results = run(corpus, config, steps, device, recipes, args.seed, out_dir=args.out, noise_seeds=args.noise_seeds)
    print(table(results, device))
    print(f"wrote {args.out}/parity.png, parity.md, parity.json")
    return results
