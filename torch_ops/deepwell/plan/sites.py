"""The plan: one decision per GEMM site of a captured graph (recipe, each pass's GEMM kernel, and
why), made by the Rust planner (rust/core/src/policy, through the `policy_decide` entry of
rust/ops/src/capi.rs) from the sites, the device and the user's policy, and the graph's attention
sites with the kernel torch runs each with (plan/attention.py; listed, rewritten only under
attention="fp8"). Printable as a table (`verbose=True` or DEEPWELL_PRINT_PLAN=1)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from ..core.policy import LayerDecision, LayerInfo, PrecisionPolicy
from ..core.recipes import current_arch, device_arch, role_of  # noqa: F401  (role_of: the planner's roles)
from .attention import AttentionSite


class Codes(str, Enum):
    """How a site's input x reaches its backward, which decides the op it runs as (the backend
    writes it from `CompileOptions.codes_for`; the FX rewrite and dryrun read it)."""

    #: x itself is kept: `scaled_linear` quantizes it again in the backward (bf16 sites: the model's GEMM).
    X = "x"
    #: x quantized once for all the sites reading it, its column copy saved for their backwards
    #: (`fp8_*_linear` given both copies).
    SAVED = "saved"
    #: x quantized once, row copy only; the backward makes the column copy from x
    #: (`fp8_*_linear` given the row copy alone).
    RECOMPUTED = "recomputed"


@dataclass
class Site:
    """One GEMM site of a graph and its decision."""

    name: str
    module_type: str
    role: str
    in_features: int
    out_features: int
    tokens: int
    decision: LayerDecision | None = None
    #: Where the weight lives ("cpu", "cuda:0"): the plan is made for that device's arch.
    device: str = "cpu"
    #: The activation's dtype ("torch.float32", ...): what an unquantized site really computes in.
    dtype: str = ""
    #: How x reaches the backward (the backend's strategy for the site, from its options).
    codes: Codes = Codes.X
    #: (gate, up, down) site names when the site is one of a SwiGLU MLP's three projections that
    #: `fp8_block_swiglu_mlp` could compute (the graph's structure, found when captured).
    swiglu: tuple[str, str, str] | None = None
    #: The site runs inside its MLP's `fp8_block_swiglu_mlp` (the backend's strategy, from its options).
    fused_mlp: bool = False

    @property
    def recipe(self) -> str:
        return self.decision.recipe if self.decision else "bf16"

    @property
    def runs_in(self) -> str:
        """The recipe as it runs: a "bf16" site is the model's own GEMM, so an fp32 model computes it
        in fp32 (and says so)."""
        short = {"torch.float32": "fp32", "torch.float16": "fp16"}
        if self.recipe == "bf16" and self.dtype in short:
            return f"{short[self.dtype]} (unquantized)"
        return self.recipe


@dataclass
class Plan:
    """Every site's decision, in graph order, for one device."""

    arch: str
    policy: PrecisionPolicy
    sites: list[Site] = field(default_factory=list)
    #: The graphs' attention, in graph order: what torch runs each with (not rewritten).
    attention: list[AttentionSite] = field(default_factory=list)
    #: Parallel degrees (single GPU: all 1) and the training shape the plan was made for.
    parallelism: dict = field(default_factory=lambda: {"data": 1, "tensor": 1, "pipeline": 1, "expert": 1})
    #: How the degrees are applied: {fsdp, reshard_after_forward, sm_carveout, unit_blocks,
    #: ends_join_blocks, forward_prefetch, per_rank_bytes, reason, ...} (autoplan).
    sharding: dict | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    moe: dict | None = None

    def fused_mlps(self) -> set[tuple[str, str, str]]:
        """(gate, up, down) names of the SwiGLU MLPs that run as one `fp8_block_swiglu_mlp`."""
        return {s.swiglu for s in self.sites if s.fused_mlp and s.swiglu}

    def table(self) -> str:
        """One row per site. A reason that several sites share is printed once, under the table, and
        its rows name it by a key ([a], [b], ...): a 29-site model repeats one long reason otherwise."""
        rows = [f"deepwell plan for {self.arch} (precision={self.policy.precision}): {len(self.sites)} GEMM sites"
                + (f", {len(self.attention)} attention sites" if self.attention else "")]
        if self.sharding:
            rows.append(f"parallel: data {self.parallelism['data']} x tensor {self.parallelism['tensor']}: {self.sharding['reason']}")
        reasons = [_shown_reason(s) for s in self.sites]
        whys = [a.why for a in self.attention]
        counts = Counter(reasons + whys)
        keys = {}
        for r in reasons + whys:
            if counts[r] > 1 and r not in keys:
                keys[r] = f"[{_key(len(keys))}]"
        rows.append(f"{'site':<36} {'role':<9} {'in x out':>13} {'recipe':<17} {'fprop kernel':<48} reason")
        for s, reason in zip(self.sites, reasons):
            d = s.decision
            fprop = d.gemms.get("fprop", {}).get("backend", "") if d else ""
            if s.fused_mlp:
                fprop = "fp8_block_swiglu_mlp (fused MLP)"
            emu = " (emulated)" if d and d.emulated else ""
            shape = f"{s.in_features}x{s.out_features}"
            rows.append(f"{s.name:<36} {s.role:<9} {shape:>13} {s.runs_in + emu:<17} {fprop[:48]:<48} {keys.get(reason, reason)}")
        if self.attention:
            rows.append(f"{'attention site':<36} {'causal':<6} {'B x H x Tq x Tk x D':>22} {'dtype':<9} {'kernel':<36} why")
        for a in self.attention:
            dtype = a.dtype.replace("torch.", "")
            rows.append(f"{a.name or '<model>':<36} {'yes' if a.causal else 'no':<6} {a.shape:>22} {dtype:<9} {a.kernel[:36]:<36} {keys.get(a.why, a.why)}")
        for reason, key in keys.items():
            rows.append(f"{key} ({counts[reason]} sites): {reason}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {
            "arch": self.arch,
            "precision": self.policy.precision,
            "parallelism": self.parallelism,
            "sharding": self.sharding,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "sites": [
                {
                    "name": s.name,
                    "module_type": s.module_type,
                    "role": s.role,
                    "in_features": s.in_features,
                    "out_features": s.out_features,
                    "tokens": s.tokens,
                    "recipe": s.recipe,
                    "runs_in": s.runs_in,
                    "emulated": bool(s.decision and s.decision.emulated),
                    "reason": s.decision.reason if s.decision else "",
                    "rule": s.decision.rule if s.decision else "",
                    "gemms": s.decision.gemms if s.decision else {},
                    "codes": s.codes.value,
                    "swiglu": list(s.swiglu) if s.swiglu else None,
                    "fused_mlp": s.fused_mlp,
                }
                for s in self.sites
            ],
            "attention": [a.to_dict() for a in self.attention],
        }


def _key(i: int) -> str:
    """a, b, ..., z, aa, ab, ...: the keys of the shared reasons in a plan's table."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[i] if i < len(letters) else _key(i // len(letters) - 1) + letters[i % len(letters)]


def _shown_reason(site: Site) -> str:
    """The planner's reason as the table shows it. The planner calls an unquantized site "bf16" (the
    recipe's name); in an fp32 or fp16 model that site computes in the model's dtype, which the
    recipe column says ("fp32 (unquantized)"), so the reason says "unquantized" too."""
    reason = site.decision.reason if site.decision else ""
    if site.recipe == "bf16" and site.runs_in != "bf16":
        reason = reason.replace("bf16 by policy", "unquantized by policy")
    return reason


def plan_sites(sites: list[Site], policy: PrecisionPolicy, arch: str | None = None) -> Plan:
    """Asks the Rust planner for every site's decision; sites are numbered in order (the policy's
    first/last rule). The arch defaults to that of the device the weights live on."""
    arch = arch or (device_arch(sites[0].device) if sites else current_arch())
    infos = [
        LayerInfo(s.name, s.module_type, s.role, i, len(sites), s.in_features, s.out_features, s.tokens)
        for i, s in enumerate(sites)
    ]
    for site, decision in zip(sites, policy.decide(infos, arch) if infos else []):
        site.decision = decision
    return Plan(arch, policy, sites)
