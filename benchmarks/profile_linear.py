"""Where one linear layer's forward + backward spends its time: host (CPU) time per call against
the device's kernel time, with torch.profiler, for deepwell's fp8_block and F.linear bf16 at one
LLaMA-sized shape. A call whose host time exceeds its kernel time makes a training step host-bound:
the GPU waits for launches. Prints the profiler's tables (host time per aten op, kernel time per
kernel) and writes the per-call figures to benchmarks/results/.

    python benchmarks/profile_linear.py [--m 8192 --k 2048 --n 2048] [--calls 50] [--compiled]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import deepwell  # noqa: F401  (registers torch.ops.deepwell)
from _common import environment, header, write_json

ops = torch.ops.deepwell


def host_us(fn, calls: int) -> float:
    """Host wall time per call with the launch queue never drained (no synchronize inside)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def device_us(fn, calls: int) -> float:
    """Kernel time per call, summed over the profiler's device events."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--compiled", action="store_true", help="also fp8_block under torch.compile, and its kernel table")
    args = p.parse_args()
    env = environment()
    header(f"profile_linear: host vs device time of one layer's forward + backward, {args.m}x{args.k}x{args.n}", env)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.m, args.k, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(args.n, args.k, device="cuda", generator=g) / args.k**0.5).bfloat16().requires_grad_()
    dy = torch.randn(args.m, args.n, device="cuda", generator=g).bfloat16()
    cases = {
        "F.linear bf16": lambda: torch.autograd.grad(F.linear(x, w), (x, w), dy),
        "scaled_linear fp8_block": lambda: torch.autograd.grad(ops.scaled_linear(x, w, None, "fp8_block", None), (x, w), dy),
        "scaled_linear fp8_block forward": lambda: ops.scaled_linear(x, w, None, "fp8_block", None),
        "scaled_linear_backward fp8_block": lambda: ops.scaled_linear_backward(dy, x, w, "fp8_block", None, True, True),
    }
    if args.compiled:
        # bench_linear found the compiled layer slower than eager at 8192x2048x5632: its kernel
        # table (below) says whether the difference is on the device or the host.
        compiled = torch.compile(lambda x, w: ops.scaled_linear(x, w, None, "fp8_block", None), dynamic=False)
        cases["scaled_linear fp8_block compiled"] = lambda: torch.autograd.grad(compiled(x, w), (x, w), dy)
        # torch.compile's own runtime cost per forward + backward, on a layer without deepwell.
        compiled_bf16 = torch.compile(lambda x, w: F.linear(x, w), dynamic=False)
        cases["F.linear bf16 compiled"] = lambda: torch.autograd.grad(compiled_bf16(x, w), (x, w), dy)
    rows = []
    print(f"{'call':<36} {'host us':>9} {'kernels us':>11}  bound")
    for name, fn in cases.items():
        h, d = host_us(fn, args.calls), device_us(fn, args.calls)
        rows.append({"call": name, "host_us": h, "device_us": d, "m": args.m, "k": args.k, "n": args.n})
        print(f"{name:<36} {h:9.1f} {d:11.1f}  {'host' if h > d else 'device'}")
    # Host time per aten op inside deepwell's backward (the Rust glue calls aten through the dispatcher).
    fn = cases["scaled_linear fp8_block"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    if args.compiled:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                cases["scaled_linear fp8_block compiled"]()
            torch.cuda.synchronize()
        print("compiled:")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
    print("wrote", write_json("profile_linear", env, rows))


if __name__ == "__main__":
    main()
