"""Pre-quantized weights for inference: a planned site's weight quantized once, exactly as the
recipe's forward quantizes it (rust/ops/src/gemm/quantize.rs), and `QuantizedLinear`, which runs the
recipe's forward from those stored codes.

| recipe | stored weight (what fprop computes from W) | activation at run time |
|---|---|---|
| mxfp8 | E4M3 codes, E8M0 scale per 1x32 along in_features (rceil) | same, per 1x32 |
| fp8_block | E4M3 codes, pow2 fp32 scale per 128x128 tile | per 1x128 |
| nvfp4 | packed E2M1 codes, E4M3 scale per 16x16 tile, fp32 per-tensor S_dec | per 1x16, its own S_dec |

The forward is the emulated fprop of deepwell.scaled_linear, step for step: both operands
dequantized exactly (fp32 on the CPU, bf16 on CUDA; NVFP4 without its per-tensor scales), one GEMM,
then `y * (S_dec_x * S_dec_w) + bias` in fp32 and one rounding to x's dtype (rust/ops/src/gemm/run.rs
and epilogue.rs). On the CPU the trained layer's forward runs this very arithmetic on bit-identical
operands, so the outputs are bit-identical. Why the weight's codes are stored instead of its
dequantized values: re-quantizing dequantize(quantize(W)) gives back the same values for the
power-of-two scales of mxfp8 and fp8_block, but not for NVFP4, whose per-tensor and E4M3 block
scales are recomputed from the already-rounded values.
"""

from __future__ import annotations

import torch

ops = torch.ops.deepwell

QUANTIZED = ("mxfp8", "fp8_block", "nvfp4")


def quantize_weight(weight: torch.Tensor, recipe: str) -> dict[str, torch.Tensor]:
    """The weight's fprop operand in `recipe`: {"data", "scale"} (+ "global_scale" for nvfp4)."""
    w = weight.detach().contiguous()
    if recipe == "mxfp8":
        data, scale = ops.mxfp8_quantize(w, -1, "rceil", "e4m3")
        return {"data": data, "scale": scale}
    if recipe == "fp8_block":
        data, scale = ops.fp8_block_quantize(w, 128, 128, True)
        return {"data": data, "scale": scale}
    if recipe == "nvfp4":
        data, scale, global_scale = ops.nvfp4_quantize(w, None, True, False, 0, False)
        return {"data": data, "scale": scale, "global_scale": global_scale}
    raise ValueError(f"quantize_weight: recipe must be one of {QUANTIZED}, got {recipe!r}")


def _dense_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _values(recipe: str, data, scale, global_scale, block: tuple[int, int], dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exactly dequantized values, and NVFP4's per-tensor decode scale kept for after the GEMM."""
    if recipe == "mxfp8":
        return ops.mxfp8_dequantize(data, scale, -1, dtype), None
    if recipe == "fp8_block":
        return ops.fp8_block_dequantize(data, scale, block[0], block[1], dtype), None
    return ops.nvfp4_dequantize(data, scale, torch.ones_like(global_scale), dtype), global_scale


def _activation(x2: torch.Tensor, recipe: str):
    dtype = _dense_dtype(x2.device)
    if recipe == "mxfp8":
        return _values(recipe, *ops.mxfp8_quantize(x2, -1, "rceil", "e4m3"), None, (1, 32), dtype)
    if recipe == "fp8_block":
        return _values(recipe, *ops.fp8_block_quantize(x2, 1, 128, True), None, (1, 128), dtype)
    return _values(recipe, *ops.nvfp4_quantize(x2, None, False, False, 0, False), (1, 16), dtype)


class QuantizedLinear(torch.nn.Module):
    """`y = x W^T + b` from a stored quantized W (inference only: no gradients flow to W)."""

    def __init__(self, recipe: str, in_features: int, out_features: int, weight: dict[str, torch.Tensor], bias: torch.Tensor | None = None):
        super().__init__()
        if recipe not in QUANTIZED:
            raise ValueError(f"QuantizedLinear: recipe must be one of {QUANTIZED}, got {recipe!r}")
        self.recipe, self.in_features, self.out_features = recipe, in_features, out_features
        self.register_buffer("weight_data", weight["data"])
        self.register_buffer("weight_scale", weight["scale"])
        self.register_buffer("weight_global_scale", weight.get("global_scale"))
        self.register_buffer("bias", bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise RuntimeError(f"QuantizedLinear: x has {x.shape[-1]} features (shape {tuple(x.shape)}), expected {self.in_features}")
        x2 = x.detach().contiguous().reshape(-1, self.in_features)
        xa, gx = _activation(x2, self.recipe)
        block = (128, 128) if self.recipe == "fp8_block" else (1, 0)
        wv, gw = _values(self.recipe, self.weight_data, self.weight_scale, self.weight_global_scale, block, xa.dtype)
        if xa.device.type != "cpu" and gx is None and x.dtype == torch.bfloat16:
            y = torch.nn.functional.linear(xa, wv, None if self.bias is None else self.bias.bfloat16())
        else:
            # fp32 out as rust/ops/src/gemm/run.rs: plain mm on the CPU's fp32 values, aten::mm.dtype
            # (bf16 in, fp32 out) on CUDA.
            y = torch.mm(xa, wv.t()) if xa.device.type == "cpu" else torch.ops.aten.mm.dtype(xa, wv.t(), torch.float32)
            if gx is not None:
                y = y * (gx * gw)
            if self.bias is not None:
                y = y + self.bias.float()
            y = y.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)
