"""SwiGLU between the MoE experts' two grouped GEMMs, on the GPU, in one process: deepwell's kernels
against what runs without them.

- bf16 activation: torch eager (`F.silu(g) * u`, five passes), the same formula compiled by Inductor
  (one kernel each way), deepwell's `swiglu` /
  `swiglu_backward` (cuda/swiglu.cuh).
- fp8_block operands of the next GEMMs: `swiglu` then `fp8_block_quantize_rowcol` (two passes, h or
  d_gate_up written and read back) against the fused `fp8_block_swiglu_quantize_rowcol` /
  `fp8_block_swiglu_backward_quantize_rowcol` (one pass; the same bits, tests/ops/test_swiglu.py).

Bytes = the least traffic of each row (inputs read once, outputs written once); GB/s = bytes / median
time; "% copy" against a device-to-device copy measured here (the roofline).

    python benchmarks/bench_swiglu.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import deepwell  # noqa: F401  (registers torch.ops.deepwell)
from _common import environment, header, time_ms, write_json

ops = torch.ops.deepwell
# (name, rows, f): the experts' rows at Mixtral's layer (8192 tokens, top-2) and at E64 (8192
# tokens, top-8, F 1408), and one LLaMA-3-8B MLP of 8192 tokens.
SHAPES = [("mixtral", 16384, 14336), ("e64", 65536, 1408), ("llama8b", 8192, 14336)]


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def _backward_of(fn):
    """fn's backward alone: d gate_up for a fixed dh, the forward recomputed outside the timing."""

    def run(gate_up, dh):
        x = gate_up.detach().requires_grad_()
        y = fn(x)
        return lambda: torch.autograd.grad(y, x, dh, retain_graph=True)[0]

    return run


def shape_rows(name: str, rows: int, f: int, copy_gbs: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(rows, 2 * f, device="cuda", generator=gen).bfloat16()
    dh = torch.randn(rows, f, device="cuda", generator=gen).bfloat16()
    n = rows * f  # elements of h
    compiled = torch.compile(_silu_mul, dynamic=False, fullgraph=True)
    out = []

    def row(what: str, nbytes: int, fn):
        ms = time_ms(fn, iters=10)
        gbs = nbytes / ms / 1e6
        pct = 100 * gbs / copy_gbs
        out.append({"shape": name, "rows": rows, "f": f, "what": what, "ms": ms, "gb": nbytes / 1e9, "gbs": gbs,
                    "pct_copy": pct})
        print(f"{name:>8} {what:<52} {ms:8.3f} ms {nbytes / 1e9:6.2f} GB {gbs:7.0f} GB/s {pct:5.1f}%", flush=True)

    fwd, bwd = 6 * n, 10 * n  # bf16: read 2n write n; read 3n write 2n (2 bytes each)
    row("forward  torch eager", fwd, lambda: _silu_mul(gate_up))
    row("forward  Inductor", fwd, lambda: compiled(gate_up))
    row("forward  deepwell swiglu", fwd, lambda: ops.swiglu(gate_up))
    row("backward torch eager", bwd, _backward_of(_silu_mul)(gate_up, dh))
    row("backward Inductor", bwd, _backward_of(compiled)(gate_up, dh))
    row("backward deepwell swiglu_backward", bwd, lambda: ops.swiglu_backward(gate_up, dh))
    # fp8_block operands: codes n bytes per copy, two copies, + scales (4 bytes per 128 elements each).
    q = 2 * n + 2 * 4 * n // 128
    row("fp8 fwd  swiglu + rowcol", fwd + 2 * n + q, lambda: ops.fp8_block_quantize_rowcol(ops.swiglu(gate_up)))
    row("fp8 fwd  fused fp8_block_swiglu_quantize_rowcol", 4 * n + q,
        lambda: ops.fp8_block_swiglu_quantize_rowcol(gate_up))
    row("fp8 bwd  swiglu_backward + rowcol", bwd + 4 * n + 2 * q,
        lambda: ops.fp8_block_quantize_rowcol(ops.swiglu_backward(gate_up, dh)))
    row("fp8 bwd  fused fp8_block_swiglu_backward_quantize_rowcol", 6 * n + 2 * q,
        lambda: ops.fp8_block_swiglu_backward_quantize_rowcol(gate_up, dh))
    return out


def _copy_gbs() -> float:
    """GB/s (read + write) of a 1 GiB device-to-device copy: the roofline."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src), iters=10) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    args = parser.parse_args()
    env = environment()
    header("SwiGLU and its fused FP8-block quantizers: deepwell vs torch eager and Inductor", env)
    copy_gbs = _copy_gbs()
    print(f"# device copy: {copy_gbs:.0f} GB/s (read + write)")
    rows = []
    for name, r, f in SHAPES[:1] if args.quick else SHAPES:
        rows += shape_rows(name, r, f, copy_gbs)
        torch.cuda.empty_cache()
    print("wrote", write_json("bench_swiglu", env, rows, {"copy_gbs": copy_gbs}))


if __name__ == "__main__":
    main()
