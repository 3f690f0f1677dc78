"""Pre-quantized weights for inference: a planned site's weight quantized once, exactly as the
recipe's forward quantizes it (rust/ops/src/gemm/quantize.rs), and `QuantizedLinear`, which runs the
recipe's forward from those stored codes through `deepwell.quantized_linear`.

| recipe | stored weight (what fprop computes from W) | activation at run time |
|---|---|---|
| mxfp8 | E4M3 codes, E8M0 scale per 1x32 along in_features (rceil) | same, per 1x32 |
| fp8_block | E4M3 codes, pow2 fp32 scale per 128x128 tile | per 1x128 |
| nvfp4 | packed E2M1 codes, E4M3 scale per 16x16 tile, fp32 per-tensor S_dec | per 1x16, its own S_dec |

`quantized_linear` (rust/ops/src/ops/linear/quantized_linear.rs) rebuilds the fprop operand the
trained layer's forward built from W, quantizes x the same way and dispatches the GEMM through the
same table (the native block-scaled GEMM on a GPU that has it, exact emulation elsewhere), so the
output is bit-identical to the trained layer's forward on every device. Why the weight's codes are
stored instead of its dequantized values: re-quantizing dequantize(quantize(W)) gives back the same
values for the power-of-two scales of mxfp8 and fp8_block, but not for NVFP4, whose per-tensor and
E4M3 block scales are recomputed from the already-rounded values.
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
        return ops.quantized_linear(
            x, self.weight_data, self.weight_scale, self.weight_global_scale, self.bias, self.recipe
        )
