"""`deepwell.Linear`: a drop-in `torch.nn.Linear` whose three GEMMs run in a low-precision recipe
(torch.ops.deepwell.scaled_linear), with run-time guardrails that fall back to bf16 and say why."""

from __future__ import annotations

import torch

from ..core import recipes
from ..core.recipes import current_arch
from .guardrails import Guardrail, GuardrailConfig

ops = torch.ops.deepwell

def auto_recipe(arch: str | None = None) -> str:
    """`recipe="auto"`: the fastest native recipe of the device (deepwell_core `auto_recipe`)."""
    return recipes.auto(arch)


class Linear(torch.nn.Linear):
    """`y = x W^T + b` in `recipe` ("mxfp8", "nvfp4", "fp8_block", "bf16" or "auto").

    Args:
        recipe: the quantization recipe; "auto" picks the device's fastest native one.
        name: the layer's name in `deepwell.policy_report()` (default: its id).
        guardrails: collect statistics and fall back to bf16 on non-finite values or saturation
            (deepwell.nn.guardrails); `guardrail_config` sets the threshold and interval.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        recipe: str = "auto",
        name: str | None = None,
        guardrails: bool = True,
        guardrail_config: GuardrailConfig | None = None,
    ):
        if recipe not in (*recipes.names(), "auto"):
            # Here rather than at the first forward, where the op would name scaled_linear.
            choices = ", ".join(repr(r) for r in (*recipes.names(), "auto"))
            raise ValueError(f"deepwell.Linear: argument 'recipe' must be one of {choices}, got {recipe!r}")
        planned = auto_recipe() if recipe == "auto" else recipe
        reason = f"recipe={recipe!r}" + (f" -> {planned} on {current_arch()}" if recipe == "auto" else "")
        block = recipes.block_k(planned)
        if block and (in_features % block or out_features % block):
            # Both dims are some pass's K. An explicit recipe that cannot take the shape is an error
            # now (not at the first forward); "auto" plans bf16 and says why, as the backend does.
            why = f"{planned} needs in_features and out_features divisible by {block}"
            if recipe != "auto":
                raise ValueError(f"deepwell.Linear: {why}, got ({in_features}, {out_features})")
            planned, reason = "bf16", f"{reason}; {why}, got ({in_features}, {out_features}): bf16"
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        label = name or f"Linear@{id(self):x}"
        self.guardrail = Guardrail(label, planned, reason, guardrail_config) if guardrails else None
        self.recipe = planned

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: str = "auto", **kw) -> "Linear":
        """A deepwell.Linear sharing `linear`'s parameters."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta", recipe=recipe, **kw)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self.recipe if self.guardrail is None else self.guardrail.recipe
        if recipe == "fp8_tensor":  # saves x's FP8 codes for the backward instead of x
            y = ops.fp8_tensor_linear(x, self.weight, self.bias, recipe)[0]
        else:
            y = ops.scaled_linear(x, self.weight, self.bias, recipe, None)
        if self.guardrail is not None:
            self.guardrail.observe(x, y)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"
