"""The main job (`python -m deepwell`, `--help` for its options): print the library and hardware
deepwell found; quantize real tensors (an nn.Linear weight and a heavy-tailed activation) in every
format, on the GPU when there is one, with the error statistics of each (ms = quantize + dequantize,
median of 5 timed runs after a warm-up); then train a small byte-level LLaMA-style model on the
standard library's sources with deepwell.Trainer through the `deepwell` torch.compile backend,
resume it from a checkpoint, export it, and compare the recipes (deepwell.cli.demo). Deterministic
kernels by default, so the resume continues bit for bit (`--no-deterministic`: the faster ones)."""

from __future__ import annotations

import argparse
import time

import torch

from .. import _native
from ..core import recipes
from . import launch
from .demo import train_demo
from ..plan.hardware import probe
from ..ops import (
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)


def _device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"python -m deepwell: --device {name}, but torch sees no CUDA device")
    return torch.device(name)


def _median_ms(fn, device: torch.device, runs: int = 5) -> float:
    """Median wall time of `runs` calls after one warm-up, synchronised (one sample is noise)."""
    fn()
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[runs // 2]


def _device_line(device: torch.device) -> str:
    if device.type == "cpu":
        return "no CUDA device: running the CPU reference kernels"
    p = torch.cuda.get_device_properties(device)
    return f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs): running the CUDA kernels (NVRTC-compiled on first use)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _formats():
    """(name, round trip x -> dequantized float32) for each format the library offers."""
    f32 = torch.float32
    return [
        ("mxfp8 e4m3 rceil", lambda x: mxfp8_dequantize(*mxfp8_quantize(x), out_dtype=f32)),
        ("mxfp8 e4m3 floor", lambda x: mxfp8_dequantize(*mxfp8_quantize(x, scale_mode="floor"), out_dtype=f32)),
        ("mxfp8 e5m2 rceil", lambda x: mxfp8_dequantize(*mxfp8_quantize(x, elem="e5m2"), out_dtype=f32)),
        ("nvfp4 1x16", lambda x: nvfp4_dequantize(*nvfp4_quantize(x), out_dtype=f32)),
        ("nvfp4 16x16", lambda x: nvfp4_dequantize(*nvfp4_quantize(x, block_2d=True), out_dtype=f32)),
        ("fp8_block 1x128", lambda x: fp8_block_dequantize(*fp8_block_quantize(x), out_dtype=f32)),
        (
            "fp8_block 128x128",
            lambda x: fp8_block_dequantize(*fp8_block_quantize(x, 128, 128), 128, 128, out_dtype=f32),
        ),
    ]


def _tensors(device: torch.device, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.nn.Linear(4096, 4096, bias=False).weight.detach()
    # Activations of trained LLMs are heavy-tailed with a few outlier channels; a Student-t sample
    # with three outlier columns stands in for one here.
    act = torch.distributions.StudentT(4.0).sample((2048, 4096))
    act[:, torch.randint(0, 4096, (3,), generator=g)] *= 40.0
    return [("linear weight 4096x4096", weight.bfloat16().to(device)), ("activation 2048x4096", act.bfloat16().to(device))]


def quantization_report(device: torch.device) -> None:
    for fmt, round_trip in _formats():  # warm-up: the first CUDA call of each kernel compiles it
        round_trip(torch.ones(256, 256, device=device))
    for name, x in _tensors(device):
        ref = x.double()
        print(f"\n{name} ({x.dtype}): error of dequantize(quantize(x)) vs x")
        if name.startswith("activation"):
            print("  (Student-t samples with 3 outlier columns scaled 40x: max |err| comes from the outliers)")
        print(f"  {'format':<20}{'rel. RMSE':>11}{'SQNR dB':>9}{'max |err|':>11}{'zeros %':>9}{'ms':>8}")
        for fmt, round_trip in _formats():
            ms = _median_ms(lambda: round_trip(x), device)
            y = round_trip(x).double()
            err = y - ref
            rel = (err.norm() / ref.norm()).item()
            sqnr = 10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum()).item()
            zeros = 100.0 * ((y == 0) & (ref != 0)).double().mean().item()
            print(f"  {fmt:<20}{rel:>11.3e}{sqnr:>9.2f}{err.abs().max().item():>11.3e}{zeros:>9.3f}{ms:>8.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m deepwell",
        description="What deepwell finds on this machine, the quantization error of every format on real "
        "tensors, and a training run on real text (the Python standard library's sources) through the deepwell "
        "torch.compile backend: plan, progress, train and held-out loss, a checkpoint it resumes from, an export "
        "round trip and a per-recipe parity table.",
    )
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda or cuda:N")
    # The recipe table's names, checked here: an unknown one would otherwise fail after the corpus
    # is read and the model built, with a traceback.
    choices = ("auto", *recipes.names())
    p.add_argument(
        "--precision",
        default=None,
        choices=choices,
        metavar="{" + ",".join(choices) + "}",
        help="the training run's precision (default: auto on a GPU, mxfp8 emulated on the CPU)",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default 120 on the CPU, 400 on a GPU; 20 with --quick)")
    p.add_argument(
        "--parity-steps", type=int, default=None,
        help="steps per recipe of the parity run (default 40 on the CPU, 150 on a GPU; 10 with --quick; 0 skips it)",
    )
    p.add_argument(
        "--tensor-parallel", type=int, default=None,
        help="tensor-parallel degree under torchrun (default: the planner's choice; the rest of the processes "
        "are data-parallel ranks)",
    )
    p.add_argument(
        "--fp8-all-gather", action="store_true",
        help="under torchrun, FSDP2 gathers the fp8_block weights as FP8 codes and tile scales instead of their "
        "high-precision values (about half the bytes of bf16, the same training bits; autoplan's fp8_all_gather)",
    )
    p.add_argument(
        "--sequence-parallel", action="store_true",
        help="with a tensor degree above 1, also split the residual stream and norms along the sequence, with a "
        "vocabulary-parallel embedding and LM head (autoplan's sequence_parallel)",
    )
    p.add_argument("--noise-seeds", type=int, default=3,
                   help="seeds the parity run's bf16 baseline trains at, whose spread marks the recipes' gaps within noise (default 3; 1: none)")
    p.add_argument("--out", default="deepwell_run",
                   help="directory for the logs, plots, checkpoints and export: each run writes a new OUT/run-N inside it, "
                   "leaving earlier runs as they are (default: deepwell_run/ in the working directory)")
    p.add_argument("--quick", action="store_true", help="skip the quantization report; 20 training steps, 10 per parity run")
    # On by default: the job's resume check is only a check when both runs' bits are reproducible.
    p.add_argument(
        "--deterministic", action=argparse.BooleanOptionalAction, default=True,
        help="deterministic kernels, seeded everything (deepwell.Trainer's deterministic): the run resumed from its "
        "middle checkpoint continues bit for bit, on a GPU too (default); --no-deterministic: the faster kernels, "
        "whose last bits vary from run to run (on a GPU: atomic adds in the embedding's gradient, timed kernel choices)",
    )
    args = p.parse_args(argv)
    gpu = args.device != "cpu" and (args.device.startswith("cuda") or torch.cuda.is_available())
    if args.steps is None:
        args.steps = 20 if args.quick else (400 if gpu else 120)
    if args.parity_steps is None:
        args.parity_steps = 10 if args.quick else (150 if gpu else 40)
    if args.steps < 2:
        p.error(f"--steps must be at least 2 (the run checkpoints half-way and resumes), got {args.steps}")
    if args.noise_seeds < 1:
        p.error(f"--noise-seeds must be 1 or more, got {args.noise_seeds}")
    if args.parity_steps < 0:
        p.error(f"--parity-steps must be 0 or more, got {args.parity_steps}")
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        p.error(f"--tensor-parallel must be 1 or more, got {args.tensor_parallel}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    torch.manual_seed(0)
    with launch.processes(_device(args.device)) as device:
        print(f"deepwell {_native.version()}  library: {_native.library_path()}")
        print(f"device: {_device_line(device)}"
              + (f"  ({launch.world()} processes under torchrun)" if launch.world() > 1 else ""))
        print(probe())
        if not args.quick:
            quantization_report(device)
        train_demo(device, steps=args.steps, precision=args.precision, out=args.out, parity_steps=args.parity_steps,
                   tensor_parallel=args.tensor_parallel, fp8_all_gather=args.fp8_all_gather,
                   sequence_parallel=args.sequence_parallel, noise_seeds=args.noise_seeds,
                   deterministic=args.deterministic)
        print(f"main job: {time.perf_counter() - start:.0f} s")
