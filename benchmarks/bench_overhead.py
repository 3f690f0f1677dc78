"""Per-call host overhead of deepwell ops on tiny inputs (where the kernels take no time), next to
torch's own ops of the same size in the same process: what a call costs in the dispatcher, the
argument checks, the Rust glue and the launch. On the GPU the time is wall-clock per call over
back-to-back calls with one synchronize at the end; on the CPU the same, so both devices work.

    python benchmarks/bench_overhead.py [--device cpu|cuda] [--calls N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

import deepwell

ops = torch.ops.deepwell
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def us_per_call(fn, device: str, calls: int, reps: int = 7) -> float:
    """Median over `reps` of the wall time of `calls` back-to-back calls, per call, in us."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(max(calls // 10, 10)):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(samples)[reps // 2]


def cases(device: str) -> list[tuple[str, object]]:
    g = torch.Generator(device=device).manual_seed(0)
    x32 = torch.randn(32, 32, device=device, generator=g).bfloat16()
    x128 = torch.randn(128, 128, device=device, generator=g).bfloat16()
    w128 = torch.randn(128, 128, device=device, generator=g).bfloat16()
    xg = x128.clone().requires_grad_()
    recipe = "fp8_block" if device == "cuda" else "bf16"
    return [
        ("torch.mul 32x32 (baseline)", lambda: torch.mul(x32, x32)),
        ("F.linear 128^3 (baseline)", lambda: F.linear(x128, w128)),
        ("mxfp8_quantize 32x32", lambda: ops.mxfp8_quantize(x32)),
        ("fp8_block_quantize 128x128", lambda: ops.fp8_block_quantize(x128)),
        (f"scaled_linear {recipe} 128^3 forward", lambda: ops.scaled_linear(x128, w128, None, recipe, None)),
        (
            f"scaled_linear {recipe} 128^3 forward+backward",
            lambda: ops.scaled_linear(xg, w128, None, recipe, None).sum().backward(),
        ),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--tag", default="", help="suffix of the JSON name (e.g. before/after)")
    args = p.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    env = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepwell": deepwell.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(f"# bench_overhead on {args.device} ({name}), torch {env['torch']}, {env['date']}")
    print(f"{'call':<48} {'us/call':>9}")
    rows = []
    for label, fn in cases(args.device):
        us = us_per_call(fn, args.device, args.calls)
        rows.append({"call": label, "us_per_call": us})
        print(f"{label:<48} {us:9.1f}")
    os.makedirs(RESULTS, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path = os.path.join(RESULTS, f"bench_overhead{tag}-{name.replace(' ', '_')}-{env['date'][:10]}.json")
    with open(path, "w") as f:
        json.dump({"env": env, "device": args.device, "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
