"""The fp8_block GEMMs alone, on pre-quantized operands: deepwell's sm_90a kernel
(`fp8_block_gemm`, `fp8_block_grouped_gemm`, `fp8_block_grouped_wgrad`; cuda/fp8_gemm.cuh) against
what a user would otherwise call, in one process:

- dense (M, K, N): bf16 `F.linear` (cuBLAS); cuBLASLt's blockwise FP8 through `F.scaled_mm`
  (1x128 x 128x128, the fprop / dgrad mode; 1x128 x 1x128, the wgrad mode); cuBLASLt tensor-wise
  FP8 (`torch._scaled_mm`, one scale per operand: the speed class of torchao's float8);
- grouped (MoE experts: E, tokens T, K, N): `torch._grouped_mm` bf16; torch's rowwise FP8
  `torch._scaled_grouped_mm` where it exists; and the wgrad `dW_e = dy_e^T x_e` per expert.

Each row: milliseconds (median, CUDA events), TFLOP/s, and the output's error against the float64
product of the same dequantized operands (relative Frobenius). Ceilings on the H100 (ANCHORS):
~700 TFLOP/s bf16, ~1250 FP8.

`--carveouts 0,4,8` times the dense GEMMs of one block of the 0.95B LLaMA training step (8192
tokens: fprop, dgrad and wgrad of q/k/v/o, w1/w3 and w2 in the modes the fp8_block recipe runs them)
under each of torch's SM carveouts (cuBLASLt's SM count target, what FSDP's plan sets so that NCCL
finds free SMs), and sums them per block: a carveout that leaves a tile count just short of a whole
wave costs a whole extra wave.

`--tiles 256,2x128` times each deepwell row once per tile shape forced on the kernel (128 rows,
256 rows, or 256 rows over a 2-CTA cluster sharing B; `auto` is Rust's own choice), in one process.

    python benchmarks/bench_gemm.py [--quick] [--carveouts 0,4,8] [--tiles auto,256,2x128]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from deepwell import _native  # (importing deepwell registers torch.ops.deepwell)

from _common import environment, header, time_ms, write_json

ops = torch.ops.deepwell
DENSE = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (8192, 2048, 5632)]
# The other fprop / dgrad shapes of the training steps: (M, K, N) of the 8B-shaped MLP
# at 8192 tokens and its dgrad, the 0.95B model's dgrad of w1/w3 and its attention projections, and
# a DeepSeek-style 4096 x 7168 x 2048 with its dgrad.
DENSE_MORE = [(8192, 4096, 14336), (8192, 14336, 4096), (8192, 5632, 2048), (8192, 2048, 2048),
              (4096, 7168, 2048), (4096, 2048, 7168)]
# (experts, tokens routed, K, N): Mixtral, and two fine-grained MoE shapes (E64, E128).
GROUPED = [(8, 32768, 4096, 14336), (64, 65536, 2048, 1408), (128, 65536, 7168, 2048)]
BF16 = torch.bfloat16
# The tile shapes each deepwell row is timed under (`--tiles`); None: Rust's choice.
TILES: list[str | None] = [None]
# Whether the wgrad rows are timed (`--fprop-only` drops them), and how many times each shape's rows
# are timed in turn (`--rounds`: the summary takes each row's median over the rounds, so a slow
# spell of the card does not land on one row alone).
WGRAD = [True]
ROUNDS = [1]


def tiled(row, what, fn, ref=None):
    """`row` once per shape of TILES, forced on deepwell's FP8 GEMM around its timing."""
    for tile in TILES:
        _native.call("fp8_gemm_tile", {"tile": tile})
        try:
            row(what + (f" [{tile}]" if tile else ""), fn, ref)
        finally:
            _native.call("fp8_gemm_tile", {"tile": None})


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def deq(codes, scale, block):
    return ops.fp8_block_dequantize(codes, scale, *block, torch.float32).double()


def m_major(s):
    return s.t().contiguous().t()


def dense_rows(m: int, k: int, n: int, check: bool) -> list[dict]:
    x, w = torch.randn(m, k, device="cuda", dtype=BF16), torch.randn(n, k, device="cuda", dtype=BF16)
    dy = torch.randn(m, n, device="cuda", dtype=BF16)
    a, sa = ops.fp8_block_quantize(x, 1, 128)
    b, sb = ops.fp8_block_quantize(w, 128, 128)
    # wgrad operands: dy^T (n, m) and x^T (k, m), both in 1x128 blocks along the tokens m.
    dt, dts = ops.fp8_block_quantize(dy.t().contiguous(), 1, 128)
    xt, xts = ops.fp8_block_quantize(x.t().contiguous(), 1, 128)
    sa_mm, dts_mm, xts_mm = m_major(sa), m_major(dts), m_major(xts)
    flops = 2.0 * m * n * k
    rows = []

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config = _native.call("fp8_gemm_config", {"rows": m, "cols": n, "k": k, "sms": sms})["heuristic"]

    def row(what, fn, ref=None):
        ms = time_ms(fn)
        if what == "fprop deepwell fp8_block_gemm":
            what += f" [auto: {config}]"
        r = {"shape": f"{m}x{k}x{n}", "what": what, "ms": ms, "tflops": tflops(flops, ms), "round": round_[0]}
        if check and ref is not None and round_[0] == 0:
            r["err"] = rel_err(fn(), ref())
        rows.append(r)
        err = f"  err {r['err']:.2e}" if "err" in r else ""
        print(f"{r['shape']:>18} {what:<50} {ms:8.3f} ms {r['tflops']:7.0f} TFLOP/s{err}", flush=True)

    fprop_ref = lambda: deq(a, sa, (1, 128)) @ deq(b, sb, (128, 128)).T  # noqa: E731
    wgrad_ref = lambda: deq(dt, dts, (1, 128)) @ deq(xt, xts, (1, 128)).T  # noqa: E731
    round_ = [0]
    for round_[0] in range(ROUNDS[0]):
        one_round(row, x, w, a, sa, b, sb, sa_mm, dt, dts, xt, xts, dts_mm, xts_mm, fprop_ref, wgrad_ref)
    return rows


def one_round(row, x, w, a, sa, b, sb, sa_mm, dt, dts, xt, xts, dts_mm, xts_mm, fprop_ref, wgrad_ref):
    ST = F.ScalingType
    row("bf16 F.linear (cuBLAS)", lambda: F.linear(x, w))
    row("fprop cuBLASLt blockwise 1x128 x 128x128", lambda: F.scaled_mm(
        a, b.t(), sa_mm, ST.BlockWise1x128, sb.t(), ST.BlockWise128x128, output_dtype=BF16), fprop_ref)
    tiled(row, "fprop deepwell fp8_block_gemm", lambda: ops.fp8_block_gemm(a, sa, b, sb, None, BF16), fprop_ref)
    if WGRAD[0]:
        row("wgrad cuBLASLt blockwise 1x128 x 1x128", lambda: F.scaled_mm(
            dt, xt.t(), dts_mm, ST.BlockWise1x128, xts_mm, ST.BlockWise1x128, output_dtype=BF16), wgrad_ref)
        tiled(row, "wgrad deepwell fp8_block_gemm (1x128 B)",
              lambda: ops.fp8_block_gemm(dt, dts, xt, xts, None, BF16), wgrad_ref)
    one = torch.ones((), device="cuda")
    row("fprop cuBLASLt tensor-wise (torch._scaled_mm)",
        lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=BF16))


# One block of the 0.95B LLaMA at 8192 tokens: (M, K, N) of each projection's forward and how many
# such projections a block has (q, k, v, o; w1, w3; w2).
STEP_BLOCK = [((8192, 2048, 2048), 4), ((8192, 2048, 5632), 2), ((8192, 5632, 2048), 1)]


def carveout_rows(carveouts: list[int]) -> list[dict]:
    """The block's GEMMs as the fp8_block recipe runs them through cuBLASLt (fprop and dgrad 1x128 x
    128x128, wgrad 1x128 x 1x128), timed under each SM carveout; one row per (carveout, GEMM) and a
    per-block total. Operands are codes of random data (the speed does not depend on the values)."""
    ST = F.ScalingType
    gemms = []  # (name, count, flops, fn)
    for (m, k, n), count in STEP_BLOCK:
        for what, (rows_, inner, cols) in (("fprop", (m, k, n)), ("dgrad", (m, n, k)), ("wgrad", (n, m, k))):
            a = torch.randn(rows_, inner, device="cuda", dtype=BF16).to(torch.float8_e4m3fn)
            b = torch.randn(cols, inner, device="cuda", dtype=BF16).to(torch.float8_e4m3fn)
            # The layouts deepwell hands cuBLASLt: 1x128 scales M-major, 128x128 tile scales (cols/128,
            # K/128) row-major seen transposed.
            sa = m_major(torch.rand(rows_, inner // 128, device="cuda") + 0.5)
            if what == "wgrad":
                sb, mode_b = m_major(torch.rand(cols, inner // 128, device="cuda") + 0.5), ST.BlockWise1x128
            else:
                sb, mode_b = (torch.rand(cols // 128, inner // 128, device="cuda") + 0.5).t(), ST.BlockWise128x128
            fn = (lambda a=a, b=b, sa=sa, sb=sb, mode_b=mode_b: F.scaled_mm(
                a, b.t(), sa, ST.BlockWise1x128, sb, mode_b, output_dtype=BF16))
            gemms.append((f"{what} {rows_}x{inner}x{cols}", count, 2.0 * rows_ * inner * cols, fn))
    own = torch._C._get_sm_carveout_experimental()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    try:
        for c in carveouts:
            torch._C._set_sm_carveout_experimental(c)
            total = 0.0
            for name, count, flops, fn in gemms:
                ms = time_ms(fn)
                total += count * ms
                rows.append({"carveout": c, "gemm": name, "count": count, "ms": ms, "tflops": tflops(flops, ms)})
            rows.append({"carveout": c, "gemm": "block total", "ms": total})
    finally:
        torch._C._set_sm_carveout_experimental(own)
    names = [g[0] for g in gemms]
    print(f"\n# one 0.95B block's GEMMs (8192 tokens) under an SM carveout, ms (TFLOP/s); {sms} SMs")
    print(f"{'GEMM':<24} x " + "".join(f"{f'{sms - c} SMs':>18}" for c in carveouts))
    for name in names + ["block total"]:
        cells = []
        for c in carveouts:
            r = next(r for r in rows if r["carveout"] == c and r["gemm"] == name)
            cells.append(f"{r['ms']:8.3f}" + (f" ({r['tflops']:5.0f})" if "tflops" in r else " " * 8))
        count = next((g[1] for g in gemms if g[0] == name), "")
        print(f"{name:<24} {count!s:>1} " + "".join(f"{c:>18}" for c in cells))
    return rows


def group_sizes(experts: int, tokens: int, align: int, gen) -> list[int]:
    """Uneven expert loads (a softmax router's spread), each padded to `align`, summing near `tokens`."""
    weights = torch.rand(experts, generator=gen) + 0.5
    sizes = (weights / weights.sum() * tokens).long()
    return [int((s + align - 1) // align * align) for s in sizes]


def grouped_rows(experts: int, tokens: int, k: int, n: int, check: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    sizes = group_sizes(experts, tokens, 128, gen)
    t = sum(sizes)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), ends])
    x = torch.randn(t, k, device="cuda", dtype=BF16)
    w = torch.randn(experts, n, k, device="cuda", dtype=BF16)
    dy = torch.randn(t, n, device="cuda", dtype=BF16)
    a, sa = ops.fp8_block_quantize(x, 1, 128)
    b, sb = ops.fp8_block_quantize(w, 128, 128)
    dt, dts = ops.fp8_block_quantize(dy.t().contiguous(), 1, 128)
    xt, xts = ops.fp8_block_quantize(x.t().contiguous(), 1, 128)
    flops = 2.0 * t * n * k
    shape = f"E{experts} T{t} K{k} N{n}"
    rows = []

    def row(what, fn, ref=None):
        ms = time_ms(fn, iters=10)
        r = {"shape": shape, "what": what, "ms": ms, "tflops": tflops(flops, ms)}
        if check and ref is not None:
            r["err"] = ref(fn())
        rows.append(r)
        err = f"  err {r['err']:.2e}" if "err" in r else ""
        print(f"{shape:>26} {what:<40} {ms:8.3f} ms {r['tflops']:7.0f} TFLOP/s{err}", flush=True)

    def fprop_err(y):  # a few experts against float64 (the whole product is large)
        da = deq(a, sa, (1, 128))
        errs = []
        for e in (0, experts // 2, experts - 1):
            lo, hi = offsets[e].item(), offsets[e + 1].item()
            db = deq(b[e], sb[e], (128, 128))
            errs.append(rel_err(y[lo:hi], da[lo:hi] @ db.T))
        return max(errs)

    def wgrad_err(y):
        da, dx = deq(dt, dts, (1, 128)), deq(xt, xts, (1, 128))
        errs = []
        for e in (0, experts - 1):
            lo, hi = offsets[e].item(), offsets[e + 1].item()
            errs.append(rel_err(y[e], da[:, lo:hi] @ dx[:, lo:hi].T))
        return max(errs)

    wt = w.transpose(-2, -1)
    row("bf16 torch._grouped_mm", lambda: torch._grouped_mm(x, wt, offs=ends))
    if hasattr(torch, "_scaled_grouped_mm"):
        # Rowwise scales of ones: the kernel's speed does not depend on their values.
        x8 = x.to(torch.float8_e4m3fn)
        w8 = w.to(torch.float8_e4m3fn).transpose(-2, -1)
        ones_a = torch.ones(t, device="cuda")
        ones_b = torch.ones(experts, n, device="cuda")
        try:
            torch._scaled_grouped_mm(x8, w8, ones_a, ones_b, offs=ends, out_dtype=BF16)
            row("fp8 rowwise torch._scaled_grouped_mm",
                lambda: torch._scaled_grouped_mm(x8, w8, ones_a, ones_b, offs=ends, out_dtype=BF16))
        except RuntimeError as e:
            print(f"{shape:>26} torch._scaled_grouped_mm unavailable: {str(e).splitlines()[0]}")
    tiled(row, "fprop deepwell fp8_block_grouped_gemm",
          lambda: ops.fp8_block_grouped_gemm(a, sa, b, sb, offsets, BF16), fprop_err)
    # wgrad: dW_e = dy_e^T x_e, the same FLOPs.
    row("wgrad bf16 torch._grouped_mm", lambda: torch._grouped_mm(dy.t(), x, offs=ends))
    tiled(row, "wgrad deepwell fp8_block_grouped_wgrad",
          lambda: ops.fp8_block_grouped_wgrad(dt, dts, xt, xts, offsets, BF16), wgrad_err)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="first dense and first grouped shape only")
    parser.add_argument("--no-check", action="store_true", help="skip the float64 error column")
    parser.add_argument("--only", choices=("dense", "grouped"), help="one family of shapes")
    parser.add_argument("--carveouts", default=None,
                        help="comma-separated SM carveouts: time one 0.95B block's step GEMMs under each instead")
    parser.add_argument("--tag", default="", help="suffix of the JSON name")
    parser.add_argument("--tiles", default="auto",
                        help="comma-separated tile shapes of deepwell's kernel to time: auto (Rust's choice), 128, 256, "
                             "2x128, 128x192, 128x192h, 192")
    parser.add_argument("--fprop-only", action="store_true",
                        help="dense: the fprop / dgrad mode only (1x128 x 128x128), no wgrad rows")
    parser.add_argument("--more", action="store_true", help="also the other fprop / dgrad shapes of the steps")
    parser.add_argument("--rounds", type=int, default=1, help="dense: time each shape's rows this many times in turn")
    args = parser.parse_args()
    TILES[:] = [None if t == "auto" else t for t in args.tiles.split(",")]
    WGRAD[0] = not args.fprop_only
    ROUNDS[0] = max(1, args.rounds)
    env = environment()
    header("fp8_block GEMMs alone: deepwell's kernel vs cuBLAS / cuBLASLt / torch grouped", env)
    if args.carveouts is not None:
        rows = carveout_rows([int(c) for c in args.carveouts.split(",")])
        path = write_json("bench_gemm-carveout" + (f"-{args.tag}" if args.tag else ""), env, rows)
        print(f"# wrote {path}")
        return
    dense = [] if args.only == "grouped" else (DENSE[:1] if args.quick else DENSE + (DENSE_MORE if args.more else []))
    grouped = [] if args.only == "dense" else (GROUPED[:2] if args.quick else GROUPED)
    rows = []
    for m, k, n in dense:
        rows += dense_rows(m, k, n, not args.no_check)
        torch.cuda.empty_cache()
    for e, t, k, n in grouped:
        rows += grouped_rows(e, t, k, n, not args.no_check)
        torch.cuda.empty_cache()
    summary(rows)
    path = write_json("bench_gemm" + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else ""), env, rows)
    print(f"# wrote {path}")


def summary(rows: list[dict]) -> None:
    """One line per dense shape: TFLOP/s of cuBLASLt's block mode, torch._scaled_mm per-tensor and
    each deepwell fprop row, and deepwell's best over each."""
    shapes = dict.fromkeys(r["shape"] for r in rows if "x" in r["shape"] and not r["shape"].startswith("E"))
    print("\n# fprop / dgrad (1x128 x 128x128), TFLOP/s (median over the rounds); ratios: deepwell's auto and best "
          "rows over cuBLASLt block, best over per-tensor")
    for shape in shapes:
        samples: dict[str, list[float]] = {}
        for r in rows:
            if r["shape"] == shape:
                samples.setdefault(r["what"], []).append(r["tflops"])
        mine = {w: sorted(t)[len(t) // 2] for w, t in samples.items()}
        block = mine.get("fprop cuBLASLt blockwise 1x128 x 128x128", float("nan"))
        tensor = mine.get("fprop cuBLASLt tensor-wise (torch._scaled_mm)", float("nan"))
        ours = {w.replace("fprop deepwell fp8_block_gemm", "").strip(): t for w, t in mine.items()
                if w.startswith("fprop deepwell")}
        best = max(ours.values(), default=float("nan"))
        auto = next((t for w, t in ours.items() if w.startswith("[auto")), float("nan"))
        cells = "  ".join(f"{w or 'auto'} {t:5.0f}" for w, t in ours.items())
        print(f"{shape:>18}  block {block:5.0f}  tensor {tensor:5.0f}  | {cells} | auto/block {auto / block:4.2f}"
              f"  best/block {best / block:4.2f}  best/tensor {best / tensor:4.2f}", flush=True)


if __name__ == "__main__":
    main()
