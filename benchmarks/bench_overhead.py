"""Per-call host overhead of deepwell ops on tiny inputs (where the kernels take no time), next to
torch's own ops of the same size in the same process: what a call costs in the dispatcher, the
argument checks, the Rust glue and the launch. On the GPU the time is wall-clock per call over
back-to-back calls with one synchronize at the end; on the CPU the same, so both devices work.

`--spans` also times, for training-sized layers (8192 tokens, 2048 x 2048), where each deepwell op's
host time goes inside Rust (rust/ops/src/host_time.rs spans: argument decoding, validation, the
policy's GEMM choice, allocations, aten calls, kernel launches; inclusive, so they nest), in us per
op call. The kernels run too, so every call's GPU work is real; the host time is what it costs to
issue them.

    python benchmarks/bench_overhead.py [--device cpu|cuda] [--calls N] [--spans]
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


def layer_cases(device: str) -> list[tuple[str, object]]:
    """One training-sized layer's deepwell ops (8192 x 2048 x 2048), each as the backend calls it."""
    g = torch.Generator(device=device).manual_seed(0)
    m, k, n = (8192, 2048, 2048) if device == "cuda" else (256, 256, 256)
    x = torch.randn(m, k, device=device, generator=g).bfloat16()
    w = (torch.randn(n, k, device=device, generator=g) / k**0.5).bfloat16()
    dy = torch.randn(m, n, device=device, generator=g).bfloat16()
    amax_of = deepwell.ops.fp8_tensor.amax_of
    x_amax, dy_amax = amax_of(x), amax_of(dy)
    codes = ops.fp8_tensor_quantize_rowcol(x, "e4m3", x_amax)
    codes_t = codes[1].view(torch.uint8)
    block = "fp8_block" if device == "cuda" else "fp8_block@sm_90"
    tensor = "fp8_tensor" if device == "cuda" else "fp8_tensor@sm_90"
    return [
        ("fp8_tensor_quantize_rowcol", lambda: ops.fp8_tensor_quantize_rowcol(x, "e4m3", x_amax)),
        ("fp8_tensor_linear (codes given)",
         lambda: ops.fp8_tensor_linear(x, w, None, tensor, codes[0], codes[2], codes[1])),
        ("fp8_tensor_linear_backward", lambda: ops.fp8_tensor_linear_backward(
            dy, codes_t, codes[2], w, tensor, True, True, dy_amax)),
        ("scaled_linear fp8_block", lambda: ops.scaled_linear(x, w, None, block, None)),
        ("scaled_linear_backward fp8_block",
         lambda: ops.scaled_linear_backward(dy, x, w, block, None, True, True)),
    ]


def span_rows(device: str, calls: int) -> list[dict]:
    """Per op: wall us per call (back-to-back, kernels included) and each host-time span's us per
    call; on the GPU each op twice: FP8 GEMMs on cuBLASLt called directly (the default,
    rust/ops/src/gemm/cublaslt.rs), then through `aten::_scaled_mm_v2` (what they replace)."""
    from deepwell import _native

    rows = []
    direct = [True, False] if device == "cuda" else [True]
    for label, fn, on in ((f"{label}{'' if on else ' (aten::_scaled_mm_v2)'}", fn, on)
                          for label, fn in layer_cases(device) for on in direct):
        _native.call("direct_cublaslt", {"enable": on})
        for _ in range(10):
            fn()
        _native.call("host_time", {"enable": True})
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls * 1e6  # before the sync: what issuing costs
        if device == "cuda":
            torch.cuda.synchronize()
        spans = _native.call("host_time")
        _native.call("host_time", {"enable": False})
        per_call = {name: secs / calls * 1e6 for name, (secs, *_) in spans.items()}
        counts = {name: n / calls for name, (_, n, *_) in spans.items()}
        print(f"{label}: {host:.0f} us of host time per call")
        for name, us in sorted(per_call.items(), key=lambda kv: -kv[1]):
            print(f"    {us:8.1f} us {counts[name]:5.1f}x  {name}")
        rows.append({"call": label, "host_us_per_call": host, "spans_us_per_call": per_call,
                     "spans_per_call": counts, "direct_cublaslt": on})
    _native.call("direct_cublaslt", {"enable": True})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--tag", default="", help="suffix of the JSON name (e.g. before/after)")
    p.add_argument("--spans", action="store_true", help="also where training-sized layers' host time goes")
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
    spans = span_rows(args.device, max(args.calls // 20, 20)) if args.spans else []
    os.makedirs(RESULTS, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path = os.path.join(RESULTS, f"bench_overhead{tag}-{name.replace(' ', '_')}-{env['date'][:10]}.json")
    with open(path, "w") as f:
        json.dump({"env": env, "device": args.device, "rows": rows, "spans": spans}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
