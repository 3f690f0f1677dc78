"""Float64 model of the linear layers' recipes (rust/ops/src/gemm/quantize.rs; the table in
torch_ops/deepwell/ops/linear.py), built on the reference quantizers of this package.

Every pass is `A @ B.T` over the shared last dim K, with each operand quantized along K as the
recipe prescribes, then dequantized exactly and multiplied in float64:

| pass | A | B |
|---|---|---|
| fprop | x (M, in) | W (out, in) |
| dgrad | dy (M, out), gradient | W.T (in, out), weight |
| wgrad | dy.T (out, M), gradient | x.T (in, M), activation |

NVFP4: weights in 16x16 blocks, gradients with stochastic rounding (seed for dgrad, seed + 1 for
wgrad), the Hadamard transform on both wgrad operands. A wgrad whose token count M is not a multiple
of the recipe's block runs unquantized on bf16-rounded operands (deepwell_core::policy::gemm_backend,
rule 1).
"""

from __future__ import annotations

import numpy as np
import torch

from . import numerics as ref
from . import nvfp4 as nv

BLOCK_K = {"mxfp8": 32, "nvfp4": 16, "fp8_block": 128}


def bf16_values(t: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (RNE), as float64."""
    return torch.from_numpy(np.ascontiguousarray(t, np.float32)).to(torch.bfloat16).double().numpy()


def operand(t: np.ndarray, recipe: str, role: str, seed: int | None = None, hadamard: bool = False) -> np.ndarray:
    """t (rows, K) float32 -> the float64 values the GEMM multiplies, quantized along K."""
    t = np.ascontiguousarray(t, np.float32)
    if recipe == "bf16":
        return bf16_values(t)
    if recipe == "mxfp8":
        data, scale = ref.mxfp8_quantize(t, -1)
        return ref.mxfp8_dequantize(data, scale, -1).astype(np.float64)
    if recipe == "fp8_block":
        block = (128, 128) if role == "weight" else (1, 128)
        data, scale = ref.fp8_block_quantize(t, *block)
        return ref.fp8_block_dequantize(data, scale, *block).astype(np.float64)
    if recipe == "fp8_tensor":
        elem = "e5m2" if role == "gradient" else "e4m3"
        data, scale_inv = ref.fp8_tensor_quantize(t, elem)
        return ref.fp8_tensor_dequantize(data, scale_inv, elem).astype(np.float64)
    if recipe == "nvfp4":
        sr = seed if role == "gradient" else None
        data, scale, s_dec = nv.nvfp4_quantize(t, block_2d=role == "weight", stochastic_seed=sr, hadamard=hadamard)
        q = nv.nvfp4_unpack(data).astype(np.int64)
        rows, k = q.shape
        vals = ref.decode_e2m1(q).reshape(rows, k // 16, 16).astype(np.float64)
        sb = ref.decode_e4m3(scale).astype(np.float64)[..., None]
        return (vals * sb * np.float64(s_dec)).reshape(rows, k)
    raise ValueError(recipe)


def forward(x2: np.ndarray, w: np.ndarray, b: np.ndarray | None, recipe: str) -> np.ndarray:
    """y (M, out) of x2 (M, in), W (out, in), b (out,) or None."""
    y = operand(x2, recipe, "activation") @ operand(w, recipe, "weight").T
    return y if b is None else y + b.astype(np.float64)


def backward(dy2: np.ndarray, x2: np.ndarray, w: np.ndarray, recipe: str, seed: int = 0):
    """(dx (M, in), dW (out, in))."""
    dx = operand(dy2, recipe, "gradient", seed) @ operand(np.ascontiguousarray(w.T), recipe, "weight").T
    m = dy2.shape[0]
    block = BLOCK_K.get(recipe)
    if block is not None and m % block != 0:
        a, b = bf16_values(dy2.T), bf16_values(x2.T)
    else:
        h = recipe == "nvfp4"
        a = operand(np.ascontiguousarray(dy2.T), recipe, "gradient", seed + 1, hadamard=h)
        b = operand(np.ascontiguousarray(x2.T), recipe, "activation", hadamard=h)
    return dx, a @ b.T
