"""The MoE layer's two weight-gradient GEMMs at Mixtral's shapes (E8, 2048 tokens per expert:
dW13 (28672 x 4096) = d(gate_up)^T x, dW2 (4096 x 14336) = dy^T h) through deepwell's FP8 K-grouped
wgrad in each tile shape, beside bf16 `torch._grouped_mm`, in one process; then, with `--ncu`, the
256-row kernel alone twice for Nsight Compute:

    python benchmarks/profile_wgrad.py [--tokens 16384,32768] [--tiles auto,256,128,2x128]
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis -k regex:fp8_block_gemm -c 2 python benchmarks/profile_wgrad.py --ncu
"""

from __future__ import annotations

import argparse

import torch

from deepwell import _native  # (importing deepwell registers torch.ops.deepwell)

from _common import time_ms

ops = torch.ops.deepwell
BF16 = torch.bfloat16
EXPERTS = 8
GEMMS = ((28672, 4096, "dW13"), (4096, 14336, "dW2"))  # (rows, cols) of each expert's gradient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16384", help="comma-separated routed rows (all experts)")
    parser.add_argument("--ncu", action="store_true", help="the 256-row kernel alone, twice per GEMM")
    parser.add_argument("--tiles", default="auto,256,128,2x128",
                        help="comma-separated tile shapes forced on the kernel (auto: Rust's choice)")
    args = parser.parse_args()
    tiles = [None if t == "auto" else t for t in args.tiles.split(",")]
    for t in (int(v) for v in args.tokens.split(",")):
        offs = torch.tensor([0] + [t // EXPERTS] * EXPERTS, device="cuda").cumsum(0).to(torch.int32)
        for n, k, name in GEMMS:
            dy = torch.randn(t, n, device="cuda", dtype=BF16)
            x = torch.randn(t, k, device="cuda", dtype=BF16)
            dt, dts = ops.fp8_block_quantize(dy.t().contiguous(), 1, 128)
            xt, xts = ops.fp8_block_quantize(x.t().contiguous(), 1, 128)
            flop = 2.0 * t * n * k
            row = []
            for tile in ["256"] if args.ncu else tiles:
                _native.call("fp8_gemm_tile", {"tile": tile})
                fn = lambda: ops.fp8_block_grouped_wgrad(dt, dts, xt, xts, offs, BF16)  # noqa: E731
                if args.ncu:
                    fn(), fn()
                    continue
                ms = time_ms(fn, iters=10)
                row.append(f"{tile or 'auto'} {ms:.3f} ms {flop / ms / 1e9:.0f}")
            _native.call("fp8_gemm_tile", {"tile": None})
            if not args.ncu:
                ms = time_ms(lambda: torch._grouped_mm(dy.t(), x, offs=offs[1:]), iters=10)
                row.append(f"bf16 {ms:.3f} ms {flop / ms / 1e9:.0f}")
                print(f"T{t} {name} {n}x{k} ({t // EXPERTS} tokens/expert), TFLOP/s: " + " | ".join(row), flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
