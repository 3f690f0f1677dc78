"""One linear layer's forward + backward (quantization included) per recipe vs bf16
`torch.nn.functional.linear` (cuBLAS), in one process, on the GPU.

For each (M, K, N): bf16 inputs x (M, K), W (N, K), dy (M, N); times of
- `step`: forward + backward (dx and dW), the weight quantized by the forward and again by the
  backward (the default: nothing is reused across calls);
- `step_cached`: a later micro-batch inside `deepwell.microbatches()`, the weight's operands reused;
- `fwd`: the forward alone (the weight quantized in it);
and TFLOP/s = 3 * 2MNK / step (2MNK for fwd), the speedup over bf16, and the forward output's
relative error (Frobenius) vs float64 maths on the same inputs. For fp8_block and fp8_tensor,
`gemms` is the three cuBLASLt GEMMs alone on pre-quantized operands (blockwise; per-tensor, E5M2
gradients): step - gemms is what quantization and glue cost (the gap to explain; docs/BASELINES.md
has the measured split). Also, in the same process: fp8_block's and fp8_tensor's forward + backward
under torch.compile (they must not be slower than eager), the
inference forward from stored weight codes (`quantized_linear`) and the backward from them
(`quantized_linear_backward`, what FSDP2's FP8 all-gather runs), and
torchao's float8 training linear (tensorwise and rowwise recipes, eager and compiled) when torchao
is installed. The last shape, 8192 x 2048 x 5632, is small enough that per-call host time matters.

    python benchmarks/bench_linear.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import deepwell
from deepwell.ops.fp8_tensor import amax_of
from _common import environment, header, time_ms, torchao_version, write_json

ops = torch.ops.deepwell
SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (8192, 2048, 5632)]
RECIPES = ["fp8_block", "fp8_tensor", "mxfp8", "nvfp4", "bf16"]
NATIVE_ON_SM90 = {"fp8_block", "fp8_tensor", "bf16"}


def bf16_step(x, w, dy):
    y = F.linear(x, w)
    return torch.autograd.grad(y, (x, w), dy)


def deepwell_fwd(x, w, recipe):
    if recipe == "mxfp8":
        return ops.mxfp8_linear(x, w, None)
    return ops.scaled_linear(x, w, None, recipe, None)


def deepwell_step(x, w, dy, recipe):
    y = deepwell_fwd(x, w, recipe)
    return torch.autograd.grad(y, (x, w), dy)


def microbatch_ms(x, w, dy, recipe) -> float:
    """A later micro-batch of gradient accumulation: the weight's operands reused
    (`deepwell.microbatches()`; the first call of the scope quantizes them)."""
    with deepwell.microbatches():
        return time_ms(lambda: deepwell_step(x, w, dy, recipe))


def blockwise_gemms(x, w, dy):
    """The three fp8_block GEMMs alone (sm_90 layouts, docs/BASELINES.md), operands quantized beforehand."""
    ST = F.ScalingType
    mm = F.scaled_mm

    def m_major(s):
        return s.t().contiguous().t()

    xr, xs, xc, xcs = ops.fp8_block_quantize_rowcol(x)
    dr, ds, dc, dcs = ops.fp8_block_quantize_rowcol(dy)
    wq, ws = ops.fp8_block_quantize(w, 128, 128)
    wt, wts = wq.t().contiguous(), ws.t().contiguous()
    xs, xcs, ds, dcs = map(m_major, (xs, xcs, ds, dcs))

    def run():
        mm(xr, wq.t(), xs, ST.BlockWise1x128, ws.t(), ST.BlockWise128x128, output_dtype=torch.bfloat16)
        mm(dr, wt.t(), ds, ST.BlockWise1x128, wts.t(), ST.BlockWise128x128, output_dtype=torch.bfloat16)
        mm(dc, xc.t(), dcs, ST.BlockWise1x128, xcs, ST.BlockWise1x128, output_dtype=torch.bfloat16)

    return run


def tensorwise_gemms(x, w, dy):
    """fp8_tensor's three GEMMs alone: per-tensor scales, E4M3 x and W, E5M2 dy (TN operands)."""
    xr, xc, xs = ops.fp8_tensor_quantize_rowcol(x, "e4m3")
    wr, wc, ws = ops.fp8_tensor_quantize_rowcol(w, "e4m3")
    dr, dc, ds = ops.fp8_tensor_quantize_rowcol(dy, "e5m2")
    mm = torch._scaled_mm

    def run():
        mm(xr, wr.t(), xs, ws, out_dtype=torch.bfloat16)
        mm(dr, wc.t(), ds, ws, out_dtype=torch.bfloat16)
        mm(dc, xc.t(), ds, xs, out_dtype=torch.bfloat16)

    return run


def torchao_steps(x, w, dy) -> dict:
    """torchao's Float8Linear (eager and compiled) forward + backward per recipe, on a copy of w."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    out = {}
    for recipe in ("tensorwise", "rowwise"):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        lin.weight.data.copy_(w.detach())
        lin = convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name(recipe))
        for mode, fn in (("eager", lin), ("compiled", torch.compile(lin, dynamic=False))):
            out[f"torchao {recipe} {mode}"] = time_ms(lambda: torch.autograd.grad(fn(x), (x, lin.weight), dy))
    return out


def rel_err(y, y64) -> float:
    return ((y.double() - y64).norm() / y64.norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="first shape only")
    p.add_argument("--shape", type=int, default=None, help="only SHAPES[i]")
    args = p.parse_args()
    env = environment()
    header("bench_linear: forward + backward of one linear layer, bf16 inputs", env)
    rows = []
    print(f"{'M x K x N':>20} {'recipe':>10} {'step ms':>8} {'micro':>8} {'fwd ms':>7} {'TFLOP/s':>8} "
          f"{'vs bf16':>8} {'fwd vs bf16':>11} {'rel err':>9}  note")
    shapes = SHAPES[:1] if args.quick else SHAPES if args.shape is None else [SHAPES[args.shape]]
    for m, k, n in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16().requires_grad_()
        dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        y64 = x.detach().double() @ w.detach().double().t()
        flops = 2 * m * n * k
        base_step = time_ms(lambda: bf16_step(x, w, dy))
        base_fwd = time_ms(lambda: F.linear(x, w))
        base_err = rel_err(F.linear(x, w), y64)
        shape = f"{m} x {k} x {n}"
        print(f"{shape:>20} {'torch bf16':>10} {base_step:8.3f} {'':>8} {base_fwd:7.3f} {3 * flops / base_step / 1e9:8.0f} "
              f"{1.0:8.2f} {1.0:11.2f} {base_err:9.2e}  F.linear (cuBLAS)")
        rows.append({"m": m, "k": k, "n": n, "recipe": "torch_bf16", "step_ms": base_step, "fwd_ms": base_fwd,
                     "tflops": 3 * flops / base_step / 1e9, "rel_err": base_err})
        for recipe in RECIPES:
            step = time_ms(lambda: deepwell_step(x, w, dy, recipe))
            cached = microbatch_ms(x, w, dy, recipe)
            fwd = time_ms(lambda: deepwell_fwd(x, w, recipe))
            with torch.no_grad():
                err = rel_err(deepwell_fwd(x, w, recipe), y64)
            native = env["sm"] != "9.0" or recipe in NATIVE_ON_SM90
            note = "native" if native else "emulated (exact quantization, bf16 GEMM)"
            row = {"m": m, "k": k, "n": n, "recipe": recipe, "step_ms": step, "step_cached_ms": cached, "fwd_ms": fwd,
                   "tflops": 3 * flops / step / 1e9, "speedup": base_step / step, "speedup_cached": base_step / cached,
                   "fwd_speedup": base_fwd / fwd, "rel_err": err, "rel_err_minus_bf16": err - base_err,
                   "emulated": not native}
            gemm_runs = {"fp8_block": blockwise_gemms, "fp8_tensor": tensorwise_gemms}
            if recipe in gemm_runs and env["sm"] == "9.0":
                gemms = time_ms(gemm_runs[recipe](x.detach(), w.detach(), dy))
                row["gemms_only_ms"] = gemms
                note += f"; 3 GEMMs alone {gemms:.3f} ms ({base_step / gemms:.2f}x bf16)"
            print(f"{shape:>20} {recipe:>10} {step:8.3f} {cached:8.3f} {fwd:7.3f} {row['tflops']:8.0f} "
                  f"{row['speedup']:8.2f} {row['fwd_speedup']:11.2f} {err:9.2e}  {note}")
            rows.append(row)
        # Static shapes, compiled afresh per shape (as a model's graph is): a second shape would
        # otherwise recompile the same code as a dynamic-shape graph, with its extra host work.
        torch._dynamo.reset()
        peers = {}
        for recipe in ("fp8_block", "fp8_tensor"):
            compiled = torch.compile(lambda x, w, r=recipe: ops.scaled_linear(x, w, None, r, None), dynamic=False)
            peers[f"deepwell {recipe} compiled"] = time_ms(lambda: torch.autograd.grad(compiled(x, w), (x, w), dy))
        if torchao_version():
            peers.update(torchao_steps(x, w, dy))
        for what, ms in peers.items():
            print(f"{shape:>20} {what:>36}: {ms:.3f} ms ({base_step / ms:.2f}x bf16)")
            rows.append({"m": m, "k": k, "n": n, "recipe": what, "step_ms": ms, "speedup": base_step / ms,
                         "torchao": torchao_version() if "torchao" in what else None})
        # fp8_tensor with x's codes saved by the forward (what the backend and deepwell.Linear run).
        def saved_step():
            y = ops.fp8_tensor_linear(x, w, None, "fp8_tensor")[0]
            return torch.autograd.grad(y, (x, w), dy)

        ms = time_ms(saved_step)
        print(f"{shape:>20} {'fp8_tensor_linear (x codes saved)':>36}: {ms:.3f} ms ({base_step / ms:.2f}x bf16)")
        rows.append({"m": m, "k": k, "n": n, "recipe": "fp8_tensor_linear", "step_ms": ms, "speedup": base_step / ms})
        # Its forward from codes made beforehand (the backend's layers sharing one input's quantization).
        xr, xc, xs = ops.fp8_tensor_quantize_rowcol(x.detach(), "e4m3")
        with torch.no_grad():
            fwd = time_ms(lambda: ops.fp8_tensor_linear(x, w, None, "fp8_tensor", xr, xs, xc))
        print(f"{shape:>20} {'fp8_tensor':>10} forward from shared codes: {fwd:.3f} ms")
        rows.append({"m": m, "k": k, "n": n, "recipe": "fp8_tensor", "fwd_from_codes_ms": fwd})
        _, codes, scale = ops.fp8_tensor_linear(x.detach(), w.detach(), None, "fp8_tensor")
        bwd = time_ms(lambda: ops.fp8_tensor_linear_backward(dy, codes, scale, w, "fp8_tensor", True, True))
        print(f"{shape:>20} {'fp8_tensor':>10} backward from the saved codes alone: {bwd:.3f} ms")
        rows.append({"m": m, "k": k, "n": n, "recipe": "fp8_tensor", "backward_saved_ms": bwd})
        # fp8_block the same way: one rowcol pass over x for both copies, the column copy saved.
        def block_saved_step():
            return torch.autograd.grad(deepwell.fp8_block_linear(x, w, None), (x, w), dy)

        ms = time_ms(block_saved_step)
        print(f"{shape:>20} {'fp8_block_linear (x codes saved)':>36}: {ms:.3f} ms ({base_step / ms:.2f}x bf16)")
        rows.append({"m": m, "k": k, "n": n, "recipe": "fp8_block_linear", "step_ms": ms, "speedup": base_step / ms})
        codes = ops.fp8_block_quantize_rowcol(x.detach(), True, True)
        with torch.no_grad():
            fwd = time_ms(lambda: ops.fp8_block_linear(x, w, None, "fp8_block", *codes))
        bwd = time_ms(lambda: ops.fp8_block_linear_backward(dy, codes[2], codes[3], w, "fp8_block", True, True))
        print(f"{shape:>20} {'fp8_block':>10} forward from shared codes: {fwd:.3f} ms, "
              f"backward from the saved codes alone: {bwd:.3f} ms")
        rows.append({"m": m, "k": k, "n": n, "recipe": "fp8_block", "fwd_from_codes_ms": fwd, "backward_saved_ms": bwd})
        del codes

        # Each recipe on x's row copy alone, the backward making the column copy from x (the
        # backend's recompute_codes): x saved instead of its codes, each pass writing one copy.
        def rows_step(recipe):
            if recipe == "fp8_block":
                codes, scales = ops.fp8_block_quantize_rowcol(x.detach(), True, True, "rows")[:2]
                y = ops.fp8_block_linear(x, w, None, recipe, codes, scales)[0]
            else:
                amax = amax_of(x.detach())
                codes, _, scale = ops.fp8_tensor_quantize_rowcol(x.detach(), "e4m3", amax, "rows")
                y = ops.fp8_tensor_linear(x, w, None, recipe, codes, scale, x_amax=amax)[0]
            return torch.autograd.grad(y, (x, w), dy)

        for recipe in ("fp8_block", "fp8_tensor"):
            ms = time_ms(lambda: rows_step(recipe))
            print(f"{shape:>20} {recipe + '_linear (row copy)':>36}: {ms:.3f} ms ({base_step / ms:.2f}x bf16)")
            rows.append({"m": m, "k": k, "n": n, "recipe": f"{recipe}_linear (row copy)", "step_ms": ms,
                         "speedup": base_step / ms})
        # The backward op alone (dgrad + wgrad, the weight quantized in it), for the breakdown.
        bwd = time_ms(lambda: ops.scaled_linear_backward(dy, x, w, "fp8_block", None, True, True))
        print(f"{shape:>20} {'fp8_block':>10} backward op alone: {bwd:.3f} ms")
        rows.append({"m": m, "k": k, "n": n, "recipe": "fp8_block", "backward_op_ms": bwd})
        # Inference from an exported model's stored codes (the weight quantized once, beforehand).
        wq, ws = ops.fp8_block_quantize(w.detach(), 128, 128)
        with torch.no_grad():
            inf = time_ms(lambda: ops.quantized_linear(x.detach(), wq, ws, None, None, "fp8_block"))
        print(f"{shape:>20} {'fp8_block':>10} quantized_linear (stored weight codes) forward: {inf:.3f} ms")
        rows.append({"m": m, "k": k, "n": n, "recipe": "fp8_block", "quantized_linear_fwd_ms": inf})
        # The backward from the same codes (FSDP2's FP8 all-gather: distributed/fp8_weights.py): vs the
        # backward op above, W^T's operand is the codes transposed instead of W quantized again.
        bwd_codes = time_ms(lambda: ops.quantized_linear_backward(dy, x, wq, ws, "fp8_block", w.dtype, True, True))
        print(f"{shape:>20} {'fp8_block':>10} quantized_linear_backward (from the codes): {bwd_codes:.3f} ms")
        rows.append({"m": m, "k": k, "n": n, "recipe": "fp8_block", "quantized_linear_backward_ms": bwd_codes})
        del x, w, dy, y64
        torch.cuda.empty_cache()
    if not torchao_version():
        print("torchao is not installed: its rows are skipped (pip install torchao)")
    print("wrote", write_json("bench_linear" + ("-quick" if args.quick else ""), env, rows))


if __name__ == "__main__":
    main()
