"""How the `deepwell` backend compiles a model: `CompileOptions`, validated once where the user
writes them, with every default in this one place. `deepwell.optimize`, `deepwell.compile` and the
backend itself (`torch.compile(model, backend="deepwell", options=...)`, a `CompileOptions` or a
dict of its fields) all take it; the `Engine` keeps the one it was compiled with, and dryrun reads
the same object, so the estimate and the compiled graph cannot disagree on what a site saves.

    >>> opts = deepwell.CompileOptions(precision="fp8_block", recompute_codes=True)
    >>> compiled = torch.compile(model, backend="deepwell", options=opts)

Each site's strategy (`Codes`: does its input reach the backward as x, as saved FP8 codes, or as
codes the backward makes again) follows from the site's recipe and tokens and these options by one
rule, `CompileOptions.codes_for`; the backend writes it into the plan (`Site.codes`) before
rewriting, and the FX rewrite and dryrun only read it.

`fallback` also decides the run-time guardrails of the compiled quantized sites (compiler/guard.py):
"safe", the default, watches every quantized site every `guardrails.interval` calls and runs a site
whose input or output goes non-finite in bf16 from then on, which is what the precision policy
promises (docs/DESIGN.md "Precision policy"); "none" compiles with no guard at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from ..core.policy import PrecisionPolicy
from ..core.recipes import Recipe, arch_name, names as recipe_names, precision_name
from ..nn.guardrails import GuardrailConfig
from .sites import Codes, Plan, Site


#: `CompileOptions.attention`'s values.
ATTENTION = ("bf16", "fp8")


class Fallback(str, Enum):
    """What happens to a GEMM site that cannot run its planned recipe: one a fixed plan does not
    name (found when compiling), or a quantized one whose guardrail sees a non-finite input or
    output, or an amax of NaN or Inf (found while training: the run-time guard of
    compiler/guard.py, every `CompileOptions.guardrails.interval` calls, without a host sync).

    | fallback | a site the fixed plan lacks | a site whose guardrail trips |
    |---|---|---|
    | "safe" (default) | runs bf16 | runs bf16 from then on, with a warning and its record |
    | "error" | compiling raises | the call reading its statistics raises RuntimeError |
    | "none" | compiling raises | nothing is watched: no statistics, no cost |
    """

    #: the site runs bf16 (the model's own GEMM); a tripped guardrail falls back to bf16, as the
    #: policy promises (docs/DESIGN.md "Precision policy").
    SAFE = "safe"
    #: compiling the graph raises; a tripped guardrail raises.
    ERROR = "error"
    #: compiling the graph raises; no run-time guardrail (the sites run as planned, whatever their values).
    NONE = "none"


@dataclass(frozen=True)
class CompileOptions:
    """Every option of the `deepwell` backend (docs/OPS.md "The torch.compile backend"; what the
    strategy options do: docs/DESIGN.md "The backend's graph passes")."""

    #: the recipe of every site the policy does not keep in bf16: "auto" (the device's fastest native
    #: recipe), "mxfp8", "nvfp4", "fp8_block", "fp8_tensor" or "bf16".
    precision: str = "auto"
    #: a full policy (overrides, first/last rule, min_features); its precision wins over `precision`.
    policy: PrecisionPolicy | None = None
    #: a fixed plan (`deepwell.autoplan`): sites are looked up by name instead of planned.
    plan: Plan | None = None
    #: what a site that cannot run its recipe does: one a fixed plan lacks, or one whose run-time
    #: guardrail trips (`Fallback`: "safe" bf16, "error" raise, "none" no guardrail).
    fallback: Fallback = Fallback.SAFE
    #: the run-time guardrails' statistics interval, when `fallback` is not "none": a graph's
    #: quantized sites are observed every `interval` calls of it (default 16; a dict of the fields
    #: is taken too). An observed call costs one reduction of each quantized site's input and
    #: output; the calls between cost nothing measurable. Its `saturation_threshold` is
    #: deepwell.Linear's: the backend's recipes derive each scale from the current amax, so no
    #: compiled site clips (compiler/guard.py).
    guardrails: GuardrailConfig = dataclasses.field(default_factory=GuardrailConfig)
    #: plan for this arch ("sm_90", "sm_100", "cpu") instead of the weights' device's.
    arch: str | None = None
    #: print each graph's plan (also DEEPWELL_PRINT_PLAN=1).
    verbose: bool = False
    #: replay each compiled graph as a CUDA graph (Inductor's CUDA graph trees: what
    #: `mode="reduce-overhead"` gives torch.compile, which takes a mode or options, not both).
    cudagraphs: bool = False
    #: fp8_block sites quantize each input once, both copies, for all the sites reading it, and save
    #: its column copy for their backwards (`fp8_block_linear` given both copies); False: `scaled_linear`
    #: per site, x recomputed in the backward. Measured faster with the copies, in one process and
    #: under FSDP2 alike (docs/BASELINES.md).
    fp8_block_codes: bool = True
    #: the code-saving sites keep quantizing x once for all its readers, but the forward writes
    #: only the row copy and the backward makes the column copy from x (`fp8_*_linear` given the row copy):
    #: torchao's memory for a second pass over x (docs/BASELINES.md "deepwell on the H200").
    recompute_codes: bool = False
    #: `w_down(silu(w_gate(x)) * w_up(x))` with its three sites fp8_block on x's codes runs as one
    #: `fp8_block_swiglu_mlp` (compiler/fuse_mlp.py). Off: measured no faster than the three sites.
    fused_mlp: bool = False
    #: compiled graphs call the `deepwell_graph` twins of the ops, without the Python autograd layer
    #: (compiler/graph_ops.py).
    graph_ops: bool = True
    #: what the graph's `F.scaled_dot_product_attention` calls run: "bf16" (torch's own SDPA, exact),
    #: or "fp8", asked for by the user only: each call without attn_mask or dropout (and with Tq == Tk
    #: when causal) runs `deepwell.fp8_attention`, FlashAttention-3's FP8 forward numerics EMULATED
    #: (quantize, dequantize, fp32 attention: slower than SDPA) with a bf16 backward
    #: (docs/NUMERICS.md "FP8 attention").
    attention: str = "bf16"

    def __post_init__(self):
        def fail(name, expected, got):
            raise ValueError(f"deepwell.CompileOptions: '{name}' must be {expected}, got {got!r}")

        object.__setattr__(self, "precision", precision_name(self.precision))  # a deepwell.Precision member
        if not isinstance(self.precision, str) or self.precision not in ("auto", *recipe_names()):
            fail("precision", f"one of {', '.join(('auto', *recipe_names()))}", self.precision)
        if self.policy is not None and not isinstance(self.policy, PrecisionPolicy):
            fail("policy", "a deepwell.PrecisionPolicy or None", self.policy)
        if self.plan is not None and not isinstance(self.plan, Plan):
            fail("plan", "a deepwell.Plan (from deepwell.autoplan) or None", self.plan)
        try:
            object.__setattr__(self, "fallback", Fallback(self.fallback))
        except ValueError:
            fail("fallback", "'safe', 'error' or 'none'", self.fallback)
        if isinstance(self.guardrails, Mapping):
            known = {f.name for f in dataclasses.fields(GuardrailConfig)}
            if set(self.guardrails) - known:
                fail("guardrails", f"a deepwell.GuardrailConfig (or a dict of {', '.join(sorted(known))})", self.guardrails)
            object.__setattr__(self, "guardrails", GuardrailConfig(**self.guardrails))
        if not isinstance(self.guardrails, GuardrailConfig):
            fail("guardrails", "a deepwell.GuardrailConfig (or a dict of its fields)", self.guardrails)
        if self.arch is not None and not isinstance(self.arch, str):
            fail("arch", "an arch name such as 'sm_90' or None", self.arch)
        object.__setattr__(self, "arch", arch_name(self.arch))  # "blackwell-sm100" -> "sm_100"
        if self.attention not in ATTENTION:
            fail("attention", " or ".join(repr(a) for a in ATTENTION), self.attention)
        for f in ("verbose", "cudagraphs", "fp8_block_codes", "recompute_codes", "fused_mlp", "graph_ops"):
            if not isinstance(getattr(self, f), bool):
                fail(f, "a bool", getattr(self, f))

    @classmethod
    def of(cls, options: CompileOptions | Mapping | None) -> CompileOptions:
        """The options as given to the backend: a CompileOptions, a dict of its fields (None values
        keep the default), or None (every default)."""
        if isinstance(options, CompileOptions):
            return options
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise TypeError(f"deepwell backend: options must be a deepwell.CompileOptions or a dict, got {type(options)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"deepwell backend: unknown options {sorted(unknown)} ({', '.join(sorted(known))})")
        return cls(**{k: v for k, v in options.items() if v is not None})

    def replace(self, **changes) -> CompileOptions:
        """A copy with `changes` (None values keep this object's)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def precision_policy(self) -> PrecisionPolicy:
        """The policy the planner applies: `policy`, else the defaults with `precision`."""
        return self.policy if self.policy is not None else PrecisionPolicy(precision=self.precision)

    def codes_for(self, recipe: str | Recipe, tokens: int) -> Codes:
        """How a site of `recipe` with `tokens` rows per call gets x into its backward:
        fp8_tensor sites always run on x's codes (`fp8_tensor_linear` given them); fp8_block ones
        with `fp8_block_codes` when the tokens fill whole 1x128 blocks of the column copy (blocks run
        along the tokens); either way the codes are saved, or with `recompute_codes` remade in the
        backward. Every other recipe: `scaled_linear`, which keeps x."""
        family = Recipe.parse(str(recipe)).name
        on_codes = family == "fp8_tensor" or (
            family == "fp8_block" and self.fp8_block_codes and tokens > 0 and tokens % 128 == 0
        )
        if not on_codes:
            return Codes.X
        return Codes.RECOMPUTED if self.recompute_codes else Codes.SAVED

    def mark_fused(self, sites: list[Site]) -> None:
        """Writes each site's `fused_mlp`: with `fused_mlp`, the SwiGLU MLPs (`Site.swiglu`) whose three
        sites are all here, of one fp8_block recipe, and save x's codes (`Codes.SAVED`: the fused op
        saves its codes, so never with `recompute_codes`) run as one `fp8_block_swiglu_mlp`."""
        by_name = {s.name: s for s in sites}
        for s in sites:
            group = [by_name.get(name) for name in s.swiglu or ()]
            s.fused_mlp = (
                self.fused_mlp and bool(group) and all(m is not None and m.codes is Codes.SAVED for m in group)
                and len({m.recipe for m in group}) == 1 and Recipe.parse(s.recipe).name == "fp8_block"
            )

    def write_strategies(self, sites: list[Site]) -> None:
        """Each site's strategy under these options, as the backend writes it into its graph's plan:
        how x reaches the backward (`codes_for`) and whether it runs fused (`mark_fused`)."""
        for s in sites:
            s.codes = self.codes_for(s.recipe, s.tokens)
        self.mark_fused(sites)
