"""The precision policy: which recipe each GEMM site runs, and why. The decisions are made in Rust
(rust/core/src/policy, through the `policy_decide` entry of rust/ops/src/capi.rs); this module is
its typed front.

Defaults (docs/DESIGN.md "Precision policy"): embeddings, norms, router gates and the LM head stay bf16;
so do the first and last GEMM sites, shapes whose in/out features the recipe's block does not
divide, and GEMMs with fewer than `min_features` in or out features. Everything else runs the
policy's precision ("auto" = the fastest native recipe of the device: fp8_block on Hopper, mxfp8 on
Blackwell, bf16 elsewhere). Overrides by module-name glob or module type come first. A recipe with
no native GEMM on the device is marked emulated (exact numerics, dequantize + high-precision GEMM).

    >>> policy = deepwell.PrecisionPolicy(precision="mxfp8", name_overrides={"*.attn.*": "bf16"})
    >>> policy.decide([deepwell.LayerInfo("layers.0.mlp.up", "Linear", "mlp", 1, 4, 4096, 14336)], "sm_90")
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .. import _native
from .recipes import current_arch

ROLES = ("embedding", "attention", "mlp", "experts", "router", "norm", "lm_head", "other")


@dataclass
class LayerInfo:
    """One GEMM site: qualified module name, module type, role, position among the model's GEMM
    sites (index of count), the weight's features, and (optional) the tokens per call, which lets the
    planner name each pass's GEMM kernel. `experts`: the site is one projection of that many stacked
    expert weights (DeepwellMoE), `tokens` then its grouped GEMMs' rows (tokens x top-k), which the
    planner's `auto` weighs against the cost of quantizing (Rust's rule 9)."""

    name: str
    module_type: str
    role: str
    index: int
    count: int
    in_features: int
    out_features: int
    tokens: int | None = None
    experts: int | None = None


@dataclass
class LayerDecision:
    recipe: str
    emulated: bool
    reason: str
    rule: str
    #: pass ("fprop", "dgrad", "wgrad") -> {"backend", "emulated", "reason"}, when tokens were given.
    gemms: dict = field(default_factory=dict)


@dataclass
class PrecisionPolicy:
    precision: str = "auto"
    first_last_bf16: bool = True
    min_features: int = 512
    #: glob -> recipe, first match wins (`*` matches across dots, `?` one character).
    name_overrides: dict[str, str] = field(default_factory=dict)
    #: module type name -> recipe.
    type_overrides: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        # Checked here, where the user wrote them (Rust rejects them too, at the first decision).
        def fail(arg, expected, got):
            raise ValueError(f"deepwell.PrecisionPolicy: '{arg}' must be {expected}, got {got!r}")

        if not isinstance(self.precision, str):
            fail("precision", "a recipe name", self.precision)
        if not isinstance(self.first_last_bf16, bool):
            fail("first_last_bf16", "a bool", self.first_last_bf16)
        if isinstance(self.min_features, bool) or not isinstance(self.min_features, int) or self.min_features < 0:
            fail("min_features", "a non-negative int", self.min_features)
        for arg in ("name_overrides", "type_overrides"):
            table = getattr(self, arg)
            if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
                fail(arg, "a dict of str -> recipe name", table)

    def decide(self, layers: list[LayerInfo], arch: str | None = None) -> list[LayerDecision]:
        """The decision for each site on `arch` ("sm_90", "sm_100", "cpu"; default: this machine)."""
        request = {
            "policy": {
                "precision": self.precision,
                "first_last_bf16": self.first_last_bf16,
                "min_features": self.min_features,
                "name_overrides": [list(kv) for kv in self.name_overrides.items()],
                "type_overrides": [list(kv) for kv in self.type_overrides.items()],
            },
            "arch": arch or current_arch(),
            "layers": [{k: v for k, v in asdict(layer).items() if v is not None} for layer in layers],
        }
        answer = _native.call("policy_decide", request, "deepwell.PrecisionPolicy")
        return [LayerDecision(**d) for d in answer["decisions"]]

