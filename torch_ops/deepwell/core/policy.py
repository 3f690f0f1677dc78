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

from dataclasses import InitVar, asdict, dataclass, field

from .. import _native
from .recipes import current_arch, precision_name, table as recipe_table

ROLES = ("embedding", "attention", "mlp", "experts", "router", "norm", "lm_head", "other")

#: The design documents' words for roles in `sensitive_layers`.
ROLE_ALIASES = {"final_linear": "lm_head", "logits": "lm_head", "embeddings": "embedding", "norms": "norm"}


@dataclass(frozen=True)
class MicroscalingConfig:
    """The design's microscaling settings. In deepwell each recipe fixes its scale block (the Rust
    recipe table: mxfp8 32 elements per E8M0 scale, nvfp4 16 per E4M3 scale, fp8_block 128), so
    `block_size` is checked against the policy's recipe, not chosen: `PrecisionPolicy` raises when
    they differ (with precision "auto" or "bf16", when no recipe has that block)."""

    block_size: int = 32

    def __post_init__(self):
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"deepwell.MicroscalingConfig: block_size must be a positive int, got {b!r}")

    def check(self, precision: str) -> None:
        blocks = {r["name"]: r["block_k"] for r in recipe_table().values() if r["low_precision"] and r["block_k"] and r["block_k"] > 1}
        if precision in blocks and blocks[precision] != self.block_size:
            raise ValueError(f"deepwell.PrecisionPolicy: microscaling block_size={self.block_size}, but {precision} scales "
                             f"blocks of {blocks[precision]} (the recipe fixes it: {blocks})")
        if precision not in blocks and self.block_size not in blocks.values():
            raise ValueError(f"deepwell.PrecisionPolicy: microscaling block_size={self.block_size} is no recipe's block ({blocks})")


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
    #: sites kept bf16 before any other rule: roles (ROLES, or ROLE_ALIASES' words such as
    #: "final_linear") or module-name globs. The design's spelling; `decide` hands them to Rust as
    #: name overrides ahead of `name_overrides`.
    sensitive_layers: list[str] = field(default_factory=list)
    #: checked against the recipe's block (MicroscalingConfig); changes nothing else.
    microscaling: MicroscalingConfig | None = None
    #: the design's name for `precision` (a recipe name or a `deepwell.Precision`).
    default_compute: InitVar[str | None] = None

    def __post_init__(self, default_compute=None):
        # Checked here, where the user wrote them (Rust rejects them too, at the first decision).
        def fail(arg, expected, got):
            raise ValueError(f"deepwell.PrecisionPolicy: '{arg}' must be {expected}, got {got!r}")

        self.precision = precision_name(self.precision)
        if default_compute is not None:
            default_compute = precision_name(default_compute)
            if self.precision not in ("auto", default_compute):
                fail("default_compute", f"left out or equal to precision={self.precision!r} (it is its alias)", default_compute)
            self.precision = default_compute
        if isinstance(self.sensitive_layers, (str, bytes)) or not all(isinstance(n, str) for n in self.sensitive_layers):
            fail("sensitive_layers", "a list of roles or module-name globs", self.sensitive_layers)
        self.sensitive_layers = list(self.sensitive_layers)
        if isinstance(self.microscaling, dict):  # a policy read back from JSON (asdict)
            self.microscaling = MicroscalingConfig(**self.microscaling)
        if self.microscaling is not None:
            if not isinstance(self.microscaling, MicroscalingConfig):
                fail("microscaling", "a deepwell.MicroscalingConfig or None", self.microscaling)
            self.microscaling.check(self.precision)

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
                "name_overrides": self._sensitive(layers) + [list(kv) for kv in self.name_overrides.items()],
                "type_overrides": [list(kv) for kv in self.type_overrides.items()],
            },
            "arch": arch or current_arch(),
            "layers": [{k: v for k, v in asdict(layer).items() if v is not None} for layer in layers],
        }
        answer = _native.call("policy_decide", request, "deepwell.PrecisionPolicy")
        return [LayerDecision(**d) for d in answer["decisions"]]

    def _sensitive(self, layers: list[LayerInfo]) -> list[list[str]]:
        """`sensitive_layers` as Rust name overrides to bf16: a role becomes the names of its sites."""
        roles = {ROLE_ALIASES.get(n, n) for n in self.sensitive_layers} & set(ROLES)
        globs = [n for n in self.sensitive_layers if ROLE_ALIASES.get(n, n) not in ROLES]
        return [[layer.name, "bf16"] for layer in layers if layer.role in roles] + [[g, "bf16"] for g in globs]
