"""`deepwell.DeepwellMoE`: a drop-in Mixture-of-Experts block (docs/DESIGN.md "MoE").

    moe = deepwell.DeepwellMoE(dim=4096, ffn_dim=14336, num_experts=8, top_k=2)   # Mixtral
    y = moe(x)                                   # x (..., dim) -> y (..., dim)

One forward: the router gate (`Router`, kept in the model's precision: router gates stay bf16 by
policy) gives logits; `deepwell.moe_route` (Rust) picks each token's experts; torch computes the
routing weights from those indices (differentiable); `moe_permute_index` (Rust) lays the kept
assignments out expert by expert; `moe_dispatch` gathers the tokens; the SwiGLU experts run as two
grouped GEMMs (`swiglu_experts`: `grouped_linear` in `recipe`, deepwell's `swiglu` between them,
fused into the FP8 quantizers where both GEMMs are deepwell's FP8 grouped ones); `moe_combine`
weights and sums them back per token in a fixed order. Shared experts (Qwen2-MoE's gated one, DeepSeek-V3's ungated ones) are added.

Router options (docs/DESIGN.md "MoE" names the system each one comes from):
- `score_func`: "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3); selection on scores + the
  expert bias (aux-loss-free balancing, arXiv:2408.15664: the bias never changes the weights);
- `n_group` / `topk_group`: group-limited routing (DeepSeek-V3; groups masked to -inf);
- `renormalize` (w / (Σw + 1e-20)) then `route_scale` (DeepSeek-V3's routed_scaling_factor);
- `capacity_factor`: None is dropless; else each expert keeps ceil(T·K/E · cf) assignments, the
  earliest ones ("position" dropping), and a dropped assignment's weight is 0 (not renormalised);
- `aux_loss`: "switch" (E · Σ_e f_e · P_e over the batch, Megatron's `aux_loss`), "seq" (the same per
  sequence, averaged: DeepSeek-V3's sequence-wise loss) or None; `z_loss_coef` > 0 adds the router
  z-loss mean_t logsumexp(l_t)² (ST-MoE). With a coefficient > 0 the loss joins the gradient by
  itself, as Megatron's MoEAuxLossAutoScaler does (nothing to add to the training loss); the
  unweighted values of the last forward are in `moe.losses` (eager mode) for logging.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental import symbolic_shapes

from .. import _env
from ..core import recipes
from ..core.policy import LayerInfo, PrecisionPolicy
from ..ops.grouped_linear import block_of
from ..ops.moe import moe_combine, moe_dispatch, moe_permute_index, moe_route
from ..ops.swiglu_experts import swiglu_experts
from . import moe_args, moe_ep, moe_ep_state, moe_hf

AUX_LOSSES = ("switch", "seq", None)


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP, `down(silu(gate(x)) * up(x))` (the shared experts; Hugging Face names)."""

    def __init__(self, dim: int, ffn_dim: int, **factory):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False, **factory)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False, **factory)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False, **factory)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """The router gate: logits = x · weightᵀ (weight (E, D), no bias), computed in `router_dtype`
    (None: the input's). Hugging Face conversions use a subclass that is also an instance of the HF
    router class, so HF's `output_router_logits` hooks still find it (nn/moe_hf.py)."""

    def __init__(self, dim: int, num_experts: int, router_dtype: torch.dtype | None = None, device=None, dtype=None):
        nn.Module.__init__(self)  # not super(): HF-compatible subclasses put the HF class after this one
        self.router_dtype = router_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, dim, device=device, dtype=dtype))
        bound = 1.0 / math.sqrt(dim)  # nn.Linear's default init
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_dtype is None:
            return F.linear(x, self.weight)
        return F.linear(x.to(self.router_dtype), self.weight.to(self.router_dtype))

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[1]}, num_experts={self.weight.shape[0]}, router_dtype={self.router_dtype}"


class Experts(nn.Module):
    """The routed experts' weights in Hugging Face transformers 5's fused layout: `gate_up_proj`
    (E, 2F, D) with the gate rows first, `down_proj` (E, D, F)."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, **factory):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, dim, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, ffn_dim, **factory))
        # nn.Linear's default init, per expert.
        for w in (self.gate_up_proj, self.down_proj):
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)


class _AddLossToGrad(torch.autograd.Function):
    """Returns y unchanged; its backward also sends d(loss)/d(loss) = 1 to `loss` (which carries its
    coefficient), so the loss trains the router without the user adding it (Megatron-Core's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, y, loss):
        ctx.loss_meta = (loss.dtype, loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.loss_meta
        return grad, torch.ones((), dtype=dtype, device=device)


def _static_int(n) -> int | None:
    """`n` where it is a plain int, None where it is a symbolic size of torch.compile's dynamic shapes.
    Not `isinstance(n, int)`: while Dynamo traces, a SymInt passes that test (its Python type is
    int), and the planner call below, whose arguments must be constants, then fails (seen on the
    H100 with torch 2.11 when a second model's batch size made Dynamo recompile with dynamic shapes).
    `has_static_value` is what Dynamo evaluates at trace time."""
    return n if symbolic_shapes.has_static_value(n) else None


@torch._dynamo.assume_constant_result
def _plan_experts(
    policy_json: str, device: str, name: str, kind: str, dim: int, ffn_dim: int, experts: int,
    assignments: int | None, verbose: bool
) -> tuple[str, ...]:
    """The Rust planner's recipes for the two expert projections (role "experts") on `device`, and
    its reasons: (gate_up recipe, down recipe, gate_up reason, down reason). Printed when `verbose`
    or DEEPWELL_PRINT_PLAN=1 (this runs eagerly, also while torch.compile traces)."""
    arch = recipes.device_arch(device)
    reasons = tuple(plan_experts(PrecisionPolicy(**json.loads(policy_json)), arch, name, kind, dim, ffn_dim, experts,
                                 assignments))
    if verbose or _env.print_plan():
        for r in reasons[2:]:
            print(f"deepwell MoE plan ({device}): {r}")
    return reasons


def plan_experts(policy: PrecisionPolicy, arch: str, name: str, kind: str, dim: int, ffn_dim: int, experts: int,
                 assignments: int | None) -> list[str]:
    """[gate_up recipe, down recipe, gate_up reason, down reason] on `arch`, from the Rust planner:
    under precision "auto" it keeps a projection bf16 where its cost model predicts FP8 no faster at
    `assignments` rows (tokens x top-k; None: unknown), as the dense policy keeps layers too small
    to gain (deepwell_core `decide_experts`)."""
    infos = [
        LayerInfo(f"{name}.experts.gate_up_proj", kind, "experts", 1, 3, dim, 2 * ffn_dim, assignments, experts),
        LayerInfo(f"{name}.experts.down_proj", kind, "experts", 1, 3, ffn_dim, dim, assignments, experts),
    ]
    # Sites 1 of 3: the policy's first/last rule is about the model's ends, not this block's.
    decisions = policy.decide(infos, arch)
    return [d.recipe for d in decisions] + [f"{i.name}: {d.recipe} ({d.reason})" for i, d in zip(infos, decisions)]


class DeepwellMoE(nn.Module):
    """A Mixture-of-Experts block: router, SwiGLU experts as grouped GEMMs in `recipe`, shared experts.

    Args:
        dim, ffn_dim, num_experts, top_k: D, F (each routed expert's hidden size), E, K.
        score_func, renormalize, route_scale, n_group, topk_group, capacity_factor: the router (see
            the module docs). Defaults are Mixtral's.
        expert_bias: keep an aux-loss-free balancing bias (`expert_bias`, fp32, selection only),
            updated by `update_expert_bias()` from the token counts of the training forwards
            (deepwell.Trainer calls it after every optimizer step, through `update_expert_biases`);
            `bias_update_rate`: its step (torchtitan's `load_balance_coeff`, 1e-3 by default).
        num_shared_experts, shared_ffn_dim: shared SwiGLU experts of hidden size
            `shared_ffn_dim` (default F · num_shared_experts, DeepSeek-V3's), added to every token;
            `shared_expert_gate`: scale them by sigmoid(x · w_g) (Qwen2-MoE).
        aux_loss, aux_loss_coef, z_loss_coef: the balancing losses (see the module docs).
        router_dtype: the dtype of the router GEMM (None: the input's, as Mixtral and Qwen run it;
            torch.float32 as DeepSeek-V3 does). Scores and weights are always computed in fp32.
        recipe: the experts' GEMMs: "bf16", "fp8_block", "mxfp8", "nvfp4" or "auto" (the Rust planner
            decides per projection on the device of the first forward, role "experts", under
            `policy`: default `PrecisionPolicy()`, whose precision "auto" is the device's fastest
            native recipe, kept bf16 for a projection where Rust's cost model predicts it slower
            than bf16 at the forward's tokens per expert (fine-grained experts on Hopper; planned
            once per token count);
            `name` is the module's qualified name the policy's globs see; `verbose` prints the
            decisions, as DEEPWELL_PRINT_PLAN=1 does).
    """

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        renormalize: bool = True,
        route_scale: float = 1.0,
        n_group: int = 0,
        topk_group: int = 0,
        capacity_factor: float | None = None,
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        num_shared_experts: int = 0,
        shared_ffn_dim: int | None = None,
        shared_expert_gate: bool = False,
        aux_loss: str | None = "switch",
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        router_dtype: torch.dtype | None = None,
        recipe: str = "bf16",
        policy=None,
        name: str = "moe",
        verbose: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if aux_loss not in AUX_LOSSES:
            raise ValueError(f"deepwell.DeepwellMoE: aux_loss must be 'switch', 'seq' or None, got {aux_loss!r}")
        if recipe not in (*recipes.names(), "auto"):
            choices = ", ".join(repr(r) for r in (*recipes.names(), "auto"))
            raise ValueError(f"deepwell.DeepwellMoE: recipe must be one of {choices}, got {recipe!r}")
        moe_args.check_config(
            dim=dim, ffn_dim=ffn_dim, num_experts=num_experts, top_k=top_k, route_scale=route_scale,
            n_group=n_group, topk_group=topk_group, capacity_factor=capacity_factor,
            bias_update_rate=bias_update_rate, num_shared_experts=num_shared_experts,
            shared_ffn_dim=shared_ffn_dim, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef,
        )
        factory = {"device": device, "dtype": dtype}
        self.dim, self.ffn_dim, self.num_experts, self.top_k = dim, ffn_dim, num_experts, top_k
        self.score_func, self.renormalize, self.route_scale = score_func, renormalize, float(route_scale)
        self.n_group, self.topk_group, self.capacity_factor = n_group, topk_group, capacity_factor
        self.aux_loss, self.aux_loss_coef, self.z_loss_coef = aux_loss, aux_loss_coef, z_loss_coef
        self.bias_update_rate = float(bias_update_rate)
        self.router_dtype, self.recipe = router_dtype, recipe
        self.policy, self.name, self.verbose = policy, name, verbose
        # Read once, here: a plain string is a constant to torch.compile.
        self._policy_json = json.dumps(asdict(policy or PrecisionPolicy(precision="auto")))
        self.gate = Router(dim, num_experts, router_dtype, **factory)
        self.experts = Experts(num_experts, dim, ffn_dim, **factory)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device))
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts, device=device))
        else:
            self.expert_bias = self.tokens_per_expert = None
        self.shared_experts = None
        self.shared_expert_gate = None
        if num_shared_experts > 0:
            self.shared_experts = SwiGLU(dim, shared_ffn_dim or ffn_dim * num_shared_experts, **factory)
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(dim, 1, bias=False, **factory)
        self.losses: dict[str, torch.Tensor] = {}
        # Expert parallelism (deepwell.expert_parallel, nn/moe_ep.py): this process holds
        # num_experts / ep_size of the routed experts; tokens reach them by all-to-all over ep_group.
        self.ep_group, self.ep_size = None, 1
        # The recipes of the last forward (fixed, or "auto"'s plan) and their reasons; "auto" plans
        # once per token count (the cost model's choice depends on it): a first call on a few
        # tokens does not decide for the training batches.
        self._planned: tuple[str, str] | None = None if recipe == "auto" else (recipe, recipe)
        self.plan_reasons: list[str] = []
        self._plans: dict[int | None, tuple[tuple[str, str], list[str]]] = {}
        # The router's string option (score_func) now, with the op's message (its numbers passed
        # check_config above): a bad config fails at construction.
        moe_route(torch.zeros(1, num_experts), None, top_k, score_func, n_group, topk_group, capacity_factor or 0.0)

    # ---------------------------------------------------------------------------------------------
    # Routing

    def route(self, x2: torch.Tensor):
        """(logits, experts, dropped, counts, lb_counts, weights) for tokens x2 (T, D)."""
        logits = self.gate(x2)
        bias = self.expert_bias
        experts, dropped, counts, lb_counts = moe_route(
            logits.detach(), bias, self.top_k, self.score_func, self.n_group, self.topk_group,
            self.capacity_factor or 0.0,
        )
        scores = self._scores(logits)
        weights = scores.gather(1, experts.long())
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = (weights * self.route_scale).masked_fill(dropped, 0.0)
        return logits, experts, dropped, counts, lb_counts, weights

    def _scores(self, logits):
        return logits.float().softmax(-1) if self.score_func == "softmax" else logits.float().sigmoid()

    def _losses(self, logits, lb_counts, batch: int) -> dict[str, torch.Tensor]:
        """The unweighted aux and z losses (module docs)."""
        out = {}
        t, e, k = logits.shape[0], self.num_experts, self.top_k
        if self.aux_loss is not None:
            s = self._scores(logits)
            p = s / s.sum(-1, keepdim=True)  # scores normalised over E (sigmoid: Megatron's)
            if self.aux_loss == "switch":
                f = lb_counts.float() / (t * k)
                out["aux"] = e * (f * p.mean(0)).sum()
            else:
                idx = p.detach().topk(k, dim=-1).indices.reshape(batch, -1)
                f = torch.zeros(batch, e, device=p.device).scatter_add_(1, idx, torch.ones(idx.shape, device=p.device))
                f = f / (t // batch * k)
                out["aux"] = e * (f * p.reshape(batch, -1, e).mean(1)).sum(-1).mean()
        if self.z_loss_coef > 0:
            out["z"] = torch.logsumexp(logits.float(), -1).square().mean()
        return out

    # ---------------------------------------------------------------------------------------------
    # Experts

    def _recipes(self, x2) -> tuple[str, str]:
        """(gate_up, down) recipes: fixed, or planned by Rust for the input's device and token count
        (a constant to torch.compile, which cannot trace the planner's JSON call), once per count."""
        if self.recipe != "auto":
            return self._planned
        # The row count is unknown (a SymInt) while torch.compile traces dynamic shapes (a recompile
        # after the batch size changed, or dynamic=True): then the policy alone decides.
        rows = _static_int(x2.shape[0])
        assignments = rows * self.top_k if rows is not None else None
        plan = self._plans.get(assignments)
        if plan is None:
            up, down, *reasons = _plan_experts(
                self._policy_json, str(x2.device), self.name, type(self).__name__, self.dim, self.ffn_dim,
                self.num_experts, assignments, self.verbose
            )
            plan = ((up, down), list(reasons))
            if not torch.compiler.is_compiling():
                self._plans[assignments] = plan
        if not torch.compiler.is_compiling():
            self._planned, self.plan_reasons = plan
        return plan[0]

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() may move the experts to another device: plan "auto" again there.
        if self.recipe == "auto":
            self._planned, self.plan_reasons, self._plans = None, [], {}
        return super()._apply(fn, recurse)

    def _align(self, recipe_pair) -> int:
        """Rows per group: the recipes' block, so wgrad's K (an expert's rows) is whole blocks."""
        return max(block_of(r) for r in recipe_pair)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe_args.check_input(x, self.dim)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        logits, experts, dropped, counts, lb_counts, weights = self.route(x2)
        r_up, r_down = self._recipes(x2)
        row_of_slot, slot_of_row, offsets = moe_permute_index(experts, dropped, self.num_experts, self._align((r_up, r_down)))
        xp = moe_dispatch(x2, slot_of_row, row_of_slot)

        def expert_ffn(rows, offs):
            if rows.shape[0] == 0:
                # An expert-parallel rank no token was routed to this time. The (0, D) output stays
                # a function of the rows and weights, so this rank's backward runs the same
                # all-to-alls as the others' (a rank that skipped one would hang them).
                return rows + 0 * (self.experts.gate_up_proj.sum() + self.experts.down_proj.sum())
            w = self.experts
            return swiglu_experts(rows, w.gate_up_proj, w.down_proj, offs, (r_up, r_down), groups_aligned=True)

        if self.ep_size == 1:
            yp = expert_ffn(xp, offsets)
        else:
            yp = moe_ep.run_experts(xp, offsets, expert_ffn, self.ep_size, self.ep_group)
        y = moe_combine(yp, weights, row_of_slot, slot_of_row)
        if self.shared_experts is not None:
            s = self.shared_experts(x2)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x2)) * s
            y = y + s
        if self.tokens_per_expert is not None and self.training and torch.is_grad_enabled():
            self.tokens_per_expert.add_(counts.float())
        batch = shape[0] if len(shape) == 3 else 1
        losses = self._losses(logits, lb_counts, batch)
        if not torch.compiler.is_compiling():
            self.losses = {k: v.detach() for k, v in losses.items()}
        total = None
        if "aux" in losses and self.aux_loss_coef > 0:
            total = self.aux_loss_coef * losses["aux"]
        if "z" in losses:
            total = self.z_loss_coef * losses["z"] if total is None else total + self.z_loss_coef * losses["z"]
        if total is not None and torch.is_grad_enabled():
            y = _AddLossToGrad.apply(y, total)
        return y.reshape(shape)

    # ---------------------------------------------------------------------------------------------
    # Aux-loss-free balancing

    @torch.no_grad()
    def update_expert_bias(self, rate: float | None = None, group=None) -> None:
        """b += rate · sign(mean(c) − c), centred (torchtitan's update: Δ −= mean(Δ)), then the
        counts c of the training forwards since the last update restart at 0 (arXiv:2408.15664).
        `rate` defaults to the module's `bias_update_rate`.

        Under torch.distributed the counts are first summed over `group` (default: every process),
        so every data rank moves its bias alike from all ranks' tokens, as torchtitan does: from its
        own counts alone each rank's bias, and with it its routing, would drift apart. Tensor ranks
        route the same tokens; counting them t times scales every count alike, which the sign
        ignores. Every process of `group` must call it (a collective)."""
        if self.expert_bias is None:
            raise RuntimeError("deepwell.DeepwellMoE.update_expert_bias: built without expert_bias=True")
        _sum_over_processes(self.tokens_per_expert, group)
        self._move_bias(rate)

    def _move_bias(self, rate: float | None, skipped: torch.Tensor | None = None, own: torch.Tensor | None = None) -> None:
        """The update from counts already summed over the processes. `skipped` (a bool tensor on
        the device) and `own` (this process's counts before the sum): where skipped, the bias stays
        and the counts go back to `own`, as if this update had not been called (the next one sums
        them again), without the host reading `skipped`."""
        rate = self.bias_update_rate if rate is None else rate
        c = self.tokens_per_expert
        delta = rate * torch.sign(c.mean() - c)
        if skipped is None:
            self.expert_bias.add_(delta - delta.mean())
            c.zero_()
        else:
            self.expert_bias.add_(torch.where(skipped, 0.0, delta - delta.mean()))
            c.copy_(torch.where(skipped, own, 0.0))

    def extra_repr(self) -> str:
        shared = f", shared_experts={self.shared_experts.down_proj.in_features}" if self.shared_experts else ""
        return (
            f"dim={self.dim}, ffn_dim={self.ffn_dim}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_func={self.score_func!r}, recipe={self.recipe!r}{shared}"
            + (f", expert_parallel={self.ep_size}" if self.ep_size > 1 else "")
        )

    # Hugging Face conversion (nn/moe_hf.py).
    @classmethod
    def from_hf(cls, block: nn.Module, **kw) -> "DeepwellMoE":
        """A DeepwellMoE computing what `block` computes (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3
        MoE blocks of transformers 5), sharing nothing: the weights are copied."""
        return moe_hf.from_hf(cls, block, **kw)

    def to_hf(self, config) -> nn.Module:
        """The Hugging Face block for `config` (its model type picks the class) with these weights.
        On an expert-parallel block (deepwell.expert_parallel) it is a collective: the experts are
        all-gathered over `ep_group`, so every rank of the group must call it, and each gets the
        whole block."""
        if self.ep_size > 1:
            return moe_hf.to_hf(moe_ep_state.unsharded(self), config)
        return moe_hf.to_hf(self, config)


def _sum_over_processes(t: torch.Tensor, group=None) -> None:
    """`t` summed in place over the processes of `group` when torch.distributed runs several."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)


@torch.no_grad()
def update_expert_biases(model: nn.Module, group=None, skipped: torch.Tensor | None = None) -> int:
    """`update_expert_bias()` of every DeepwellMoE in `model` that keeps an expert bias, each at its
    own `bias_update_rate`, with all their counts summed over the processes in one all-reduce (a
    collective: every process calls it at the same step). deepwell.Trainer calls it after each
    optimizer step, as torchtitan's optimizer hook does. `skipped`: a bool tensor on the device,
    true when the optimizer skipped this step; then nothing moves and each process keeps its own
    counts for the next update, as when this is not called, but the host need not read it.
    Returns how many modules it updated."""
    moes = [m for m in model.modules() if isinstance(m, DeepwellMoE) and m.expert_bias is not None]
    if not moes:
        return 0
    counts = torch.cat([m.tokens_per_expert for m in moes])
    sizes = [m.num_experts for m in moes]
    own = counts.clone().split(sizes) if skipped is not None else [None] * len(moes)
    _sum_over_processes(counts, group)
    for m, c, mine in zip(moes, counts.split(sizes), own):
        m.tokens_per_expert.copy_(c)
        m._move_bias(None, skipped, mine)
    return len(moes)
