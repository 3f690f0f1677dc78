"""deepwell.fp8_attention (EMULATED: quantize, dequantize, fp32 attention; docs/NUMERICS.md "FP8
attention") against torch's SDPA, side by side in one process: forward, and forward + backward
(fp8_attention_backward is SDPA's own vjp). The emulation is a numerics contract, not a fast path:
this measures what it costs (a fast FP8 Hopper kernel would replace it), and prints each shape's
relative error to float64 exact attention.

    python benchmarks/bench_fp8_attention.py [--device cuda] [--shapes 4x16x2048x128,1x16x8192x128]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import deepwell  # noqa: F401  (registers the ops)
from _common import environment, header, time_ms, write_json

ops = torch.ops.deepwell


def _wall_ms(fn, iters: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default=None, help="BxHxTxD,... (default: 4x16x2048x128,1x16x8192x128 on a GPU, 1x4x512x64 on the CPU)")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    shapes = args.shapes or ("4x16x2048x128,1x16x8192x128" if cuda else "1x4x512x64")
    env = environment("cuda" if cuda else "cpu")
    header("fp8_attention (EMULATED) vs torch SDPA, bf16, causal", env)
    timer = time_ms if cuda else _wall_ms
    rows = []
    print(f"{'shape':<20} {'sdpa fwd ms':>12} {'fp8 fwd ms':>12} {'sdpa f+b ms':>12} {'fp8 f+b ms':>12} {'fp8 bwd ms':>11} {'rel err':>9}")
    for shape in shapes.split(","):
        b, h, t, d = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(b, h, t, d, device=args.device, dtype=torch.bfloat16) for _ in range(3))
        grad = torch.randn_like(q)
        sdpa = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        fp8 = timer(lambda: ops.fp8_attention(q, k, v, True))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        sdpa_fb = timer(lambda: torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves, grad))
        fp8_fb = timer(lambda: torch.autograd.grad(ops.fp8_attention(*leaves, True), leaves, grad))
        # The backward alone: SDPA's forward again and its vjp (what a training step's backward runs).
        bwd = timer(lambda: ops.fp8_attention_backward(grad, q, k, v, True))
        out = ops.fp8_attention(q, k, v, True).float()
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        err = ((out - ref).norm() / ref.norm()).item()
        rows.append({"shape": shape, "sdpa_fwd_ms": sdpa, "fp8_emulated_fwd_ms": fp8, "sdpa_fwd_bwd_ms": sdpa_fb,
                     "fp8_emulated_fwd_bwd_ms": fp8_fb, "fp8_backward_ms": bwd, "rel_err_vs_fp32": err})
        print(f"{shape:<20} {sdpa:>12.2f} {fp8:>12.2f} {sdpa_fb:>12.2f} {fp8_fb:>12.2f} {bwd:>11.2f} {err:>9.4f}")
    print(f"wrote {write_json('bench_fp8_attention', env, rows)}")
    return rows


if __name__ == "__main__":
    main()
