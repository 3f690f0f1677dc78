"""fp8_block's transposing quantizers (`fp8_block_quantize_rowcol`, `fp8_block_quantize_transposed`)
by kernel time, beside a device copy of the same input: what each pass costs against the copy
bandwidth it should reach (docs/DESIGN.md "deepwell's FP8 GEMM" operands; docs/BASELINES.md
"deepwell on the H200").

    python benchmarks/profile_rowcol.py [--calls 48]

Kernel time is torch.profiler's device duration of each kernel, median over `--calls` calls that
rotate over 8 inputs (so no input stays in L2 and host time does not count: the 8192 x 2048 pass
takes ~25 us on an H200, about what one op's launch costs the host). GB/s is the pass's least
traffic (x read once in bf16, both FP8 copies and their scales written once) over its time; the
copy reads and writes 2 bytes per element, the same 4 bytes per element.
"""

from __future__ import annotations

import argparse
import statistics

import deepwell  # noqa: F401  (registers torch.ops.deepwell)
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

ops = torch.ops.deepwell
ROWCOL_SHAPES = [(8192, 2048), (8192, 5632), (16384, 4096), (8192, 14336), (16384, 14336)]
WEIGHT_SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632), (14336, 4096)]


def kernel_us(calls: list, match: str, n: int) -> float:
    """Median device microseconds of the kernels whose name contains `match`, over n calls."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            calls[i % len(calls)]()
        torch.cuda.synchronize()
    # Device events only: the host's runtime calls (cudaMemcpyAsync for the copy) match by name too.
    times = [e.device_time for e in prof.events() if e.device_type == DeviceType.CUDA and match in e.name]
    if not times:
        raise RuntimeError(f"profile_rowcol: no kernel named like '{match}' ran")
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=48)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'pass':>8} {'shape':>12} {'us':>8} {'GB/s':>6} {'copy us':>8} {'copy GB/s':>9}")
    for m, k in ROWCOL_SHAPES:
        xs = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(8)]
        least = m * k * 4 + 2 * (m * k // 128) * 4
        us = kernel_us(
            [lambda x=x: ops.fp8_block_quantize_rowcol(x, True, True) for x in xs],
            "quantize_rowcol",
            args.calls,
        )
        copy = kernel_us([lambda x=x: x.clone() for x in xs], "Memcpy", args.calls)
        print(
            f"{'rowcol':>8} {f'{m}x{k}':>12} {us:8.1f} {least / us / 1e3:6.0f} {copy:8.1f} {m * k * 4 / copy / 1e3:9.0f}"
        )
    for n, k in WEIGHT_SHAPES:  # a weight's dgrad copy: x^T in 128x128 blocks (TILE_T)
        ws = [torch.randn(n, k, device="cuda", generator=gen).bfloat16() for _ in range(8)]
        us = kernel_us(
            [lambda w=w: ops.fp8_block_quantize_transposed(w, True) for w in ws],
            "quantize_transposed",
            args.calls,
        )
        print(f"{'tile_t':>8} {f'{n}x{k}':>12} {us:8.1f} {n * k * 3 / us / 1e3:6.0f}")


if __name__ == "__main__":
    main()
