"""The fused SwiGLU quantizers beside the plain rowcol pass, for Nsight Compute: what bounds them
(DRAM, issue slots, occupancy, stalls). Each kernel runs `--calls` times on one shape; run under

    ncu --clock-control none --kernel-name regex:rowcol --launch-count 6 --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        python benchmarks/profile_swiglu.py --ncu [--rows 8192 --f 5632]

Without ncu it prints each kernel's time and GB/s of its least traffic (CUDA events).
"""

from __future__ import annotations

import argparse

import torch

import deepwell  # noqa: F401  (registers torch.ops.deepwell)
from _common import time_ms

ops = torch.ops.deepwell


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--f", type=int, default=5632, help="SwiGLU's width (the 0.95B LLaMA's MLP: 5632)")
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--ncu", action="store_true", help="each kernel twice, nothing timed (for ncu --launch-count 6)")
    args = p.parse_args()
    m, f = args.rows, args.f
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(m, 2 * f, device="cuda", generator=gen).bfloat16()
    dh = torch.randn(m, f, device="cuda", generator=gen).bfloat16()
    h = torch.randn(m, f, device="cuda", generator=gen).bfloat16()
    # name -> (call, least bytes: inputs read once, both FP8 copies and their scales written once)
    kernels = {
        "rowcol of h (m, f)": (lambda: ops.fp8_block_quantize_rowcol(h, True, True), m * f * 2 + 2 * m * f),
        "swiglu forward + rowcol": (lambda: ops.fp8_block_swiglu_quantize_rowcol(gate_up, True), m * 2 * f * 2 + 2 * m * f),
        "swiglu backward + rowcol": (lambda: ops.fp8_block_swiglu_backward_quantize_rowcol(gate_up, dh, True),
                                     m * 2 * f * 2 + m * f * 2 + 2 * m * 2 * f),
    }
    for name, (call, nbytes) in kernels.items():
        for _ in range(2 if args.ncu else args.calls):
            call()
        torch.cuda.synchronize()
        if args.ncu:
            continue
        ms = time_ms(call, warmup=1, iters=5, reps=3)
        print(f"{name:>28}: {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s of least traffic")


if __name__ == "__main__":
    main()
