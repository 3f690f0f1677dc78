"""Quantizer bandwidth on the GPU: deepwell's kernels vs a device copy of the same bytes (the
roofline) and vs the same maths compiled by torch.compile (stock PyTorch), in one process.

Bytes moved per kernel = bytes read + bytes written (input bf16, fp8 data, scales). GB/s = bytes /
median time; "% copy" compares with a device-to-device copy's GB/s measured here.

    python benchmarks/bench_quantize.py [--quick]
"""

from __future__ import annotations

import argparse

import torch

import deepwell  # noqa: F401
from _common import environment, header, time_ms, write_json

ops = torch.ops.deepwell
SHAPES = [(16384, 4096), (16384, 14336), (32768, 4096), (4096, 14336)]


# ----------------------------------------------------------------------------- stock PyTorch
def _e8m0_rceil(amax: torch.Tensor) -> torch.Tensor:
    bits = (amax * (1.0 / 448.0)).view(torch.int32)
    exp, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    e = torch.where(exp == 0, (mant > 0x400000).int(), exp + (mant != 0).int())
    return e.clamp(max=254)


def torch_mx_rows(x: torch.Tensor):
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    e = _e8m0_rceil(xb.abs().amax(-1))
    inv = ((254 - e).clamp(min=1) << 23).view(torch.float32)  # 2^(127-e), normal range
    q = (xb * inv[..., None]).to(torch.float8_e4m3fn)
    return q.view(m, k), e.to(torch.uint8)


def torch_mx_cols(x: torch.Tensor):
    return torch_mx_rows(x.t())  # transposed copy, quantized along the old rows


def torch_mx_rowcol(x: torch.Tensor):
    return (*torch_mx_rows(x), *torch_mx_cols(x))


def torch_fp8_block_rows(x: torch.Tensor):
    m, k = x.shape
    xb = x.float().view(m, k // 128, 128)
    amax = xb.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)  # round down to a power of two
    return (xb * scale).to(torch.float8_e4m3fn).view(m, k), (1.0 / scale).squeeze(-1)


def torch_fp8_block_rowcol(x: torch.Tensor):
    return (*torch_fp8_block_rows(x), *torch_fp8_block_rows(x.t()))


def torch_fp8_tensor(x: torch.Tensor, dtype=torch.float8_e4m3fn):
    """fp8_tensor in torch ops (what torchao's tensorwise cast compiles to): amax, pow2 scale, cast."""
    amax = x.abs().amax().float()
    scale = torch.where(amax > 0, torch.finfo(dtype).max / amax, torch.ones_like(amax))
    scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return (x.float() * scale).to(dtype), 1.0 / scale


def torch_fp8_tensor_rowcol(x: torch.Tensor):
    q, s = torch_fp8_tensor(x, torch.float8_e5m2)
    return q, q.t().contiguous(), s


# ----------------------------------------------------------------------------- cases
def cases(m: int, k: int):
    """(name, deepwell fn, torch fn or None, bytes moved) for x (m, k) bf16."""
    n = m * k
    mx1 = 2 * n + n + n // 32  # read bf16, write fp8 + e8m0 scales
    fb1 = 2 * n + n + 4 * (n // 128)  # fp32 scales
    nv1 = 2 * n + n // 2 + n // 16  # packed fp4 + e4m3 scales (the amax pass reads x once more)
    return [
        ("mxfp8 rows", lambda x: ops.mxfp8_quantize(x, -1), torch_mx_rows, mx1),
        ("mxfp8 cols (dim 0)", lambda x: ops.mxfp8_quantize(x, 0), torch_mx_cols, mx1),
        ("mxfp8 rowcol", lambda x: ops.mxfp8_quantize_rowcol(x), torch_mx_rowcol, mx1 + n + n // 32),
        ("mxfp8 rowcol, col^T", lambda x: ops.mxfp8_quantize_rowcol(x, "rceil", "e4m3", True), torch_mx_rowcol, mx1 + n + n // 32),
        ("fp8_block 1x128", lambda x: ops.fp8_block_quantize(x, 1, 128), torch_fp8_block_rows, fb1),
        ("fp8_block 128x128", lambda x: ops.fp8_block_quantize(x, 128, 128), None, 2 * n + n + 4 * (n // 16384)),
        ("fp8_block rowcol^T", lambda x: ops.fp8_block_quantize_rowcol(x), torch_fp8_block_rowcol, fb1 + n + 4 * (n // 128)),
        ("fp8_block 128x128 of x^T", lambda x: ops.fp8_block_quantize_transposed(x), None, 2 * n + n + 4 * (n // 16384)),
        # x as 4 experts' stacked weights (E, N, K): the MoE grouped GEMMs' operands (no reuse scope).
        ("fp8_block expert W (fprop)", lambda x: ops.fp8_block_expert_weight(x.view(4, -1, x.shape[-1]), "fprop"), None,
         2 * n + n + 4 * (n // 16384)),
        ("fp8_block expert W^T (dgrad)", lambda x: ops.fp8_block_expert_weight(x.view(4, -1, x.shape[-1]), "dgrad"), None,
         2 * n + n + 4 * (n // 16384)),
        # The MXFP8 experts' operands: the codes, their scales, then the scales read and written tiled.
        ("mxfp8 expert W (fprop)", lambda x: ops.mxfp8_expert_weight(x.view(4, -1, x.shape[-1]), "fprop"), None,
         mx1 + 2 * (n // 32)),
        ("mxfp8 expert W^T (dgrad)", lambda x: ops.mxfp8_expert_weight(x.view(4, -1, x.shape[-1]), "dgrad"), None,
         mx1 + 2 * (n // 32)),
        # fp8_tensor reads x twice (amax, then the cast).
        ("fp8_tensor (+amax pass)", lambda x: ops.fp8_tensor_quantize(x), torch_fp8_tensor, 2 * n + 2 * n + n),
        ("fp8_tensor rowcol e5m2", lambda x: ops.fp8_tensor_quantize_rowcol(x, "e5m2"), torch_fp8_tensor_rowcol, 4 * n + 2 * n),
        ("nvfp4 1x16 (given amax)", lambda x: ops.nvfp4_quantize(x, AMAX), None, nv1),
        ("nvfp4 1x16 (+amax pass)", lambda x: ops.nvfp4_quantize(x), None, nv1 + 2 * n),
        ("mxfp8 dequantize", lambda x: ops.mxfp8_dequantize(*MX[0]), None, n + n // 32 + 2 * n),
        ("nvfp4 dequantize", lambda x: ops.nvfp4_dequantize(*MX[1]), None, n // 2 + n // 16 + 2 * n),
        ("fp8_block dequantize", lambda x: ops.fp8_block_dequantize(*MX[2]), None, n + 4 * (n // 128) + 2 * n),
        ("fp8_tensor dequantize", lambda x: ops.fp8_tensor_dequantize(*MX[4]), None, n + 2 * n),
        ("swizzle_scales (mx scales)", lambda x: ops.swizzle_scales(MX[0][1]), None, 2 * (n // 32)),
        ("unswizzle_scales", lambda x: ops.unswizzle_scales(MX[3], m, k // 32), None, 2 * (n // 32)),
    ]


AMAX = None
MX: list = []  # per shape: quantized inputs of the dequantize and layout rows


def main() -> None:
    global AMAX
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="first shape only")
    args = parser.parse_args()
    env = environment()
    header("deepwell quantizers vs copy roofline and torch.compile (bf16 input)", env)
    AMAX = torch.tensor([8.0], device="cuda")
    rows = []
    for m, k in SHAPES[:1] if args.quick else SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        copy_ms = time_ms(lambda: dst.copy_(x))
        copy_gbs = 2 * x.numel() * 2 / copy_ms / 1e6
        print(f"\n{m}x{k}: device copy {copy_gbs:7.0f} GB/s (roofline)")
        print(f"  {'kernel':<26}{'ms':>8}{'GB/s':>8}{'% copy':>8}  {'torch.compile GB/s':>19}{'speedup':>9}")
        mx = ops.mxfp8_quantize(x)
        MX[:] = [mx, ops.nvfp4_quantize(x), ops.fp8_block_quantize(x), ops.swizzle_scales(mx[1]), ops.fp8_tensor_quantize(x)]
        for name, fn, ref, nbytes in cases(m, k):
            ms = time_ms(lambda: fn(x))
            gbs = nbytes / ms / 1e6
            ref_gbs = None
            if ref is not None:
                compiled = torch.compile(ref)
                ref_gbs = nbytes / time_ms(lambda: compiled(x)) / 1e6
            ratio = f"{gbs / ref_gbs:8.2f}x" if ref_gbs else f"{'':>9}"
            ref_s = f"{ref_gbs:19.0f}" if ref_gbs else f"{'—':>19}"
            print(f"  {name:<26}{ms:8.3f}{gbs:8.0f}{100 * gbs / copy_gbs:7.1f}%  {ref_s}{ratio}")
            rows.append(
                {"shape": [m, k], "kernel": name, "ms": ms, "bytes": nbytes, "gbs": gbs, "copy_gbs": copy_gbs,
                 "pct_copy": 100 * gbs / copy_gbs, "torch_compile_gbs": ref_gbs}
            )
        del x, dst
        torch.cuda.empty_cache()
    print("\nwrote", write_json("bench_quantize", env, rows))


if __name__ == "__main__":
    main()
