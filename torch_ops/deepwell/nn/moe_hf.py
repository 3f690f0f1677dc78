"""Conversion between `deepwell.DeepwellMoE` and the MoE blocks of Hugging Face transformers 5:
MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock and DeepseekV3MoE (read in
transformers 5.23's modeling files, `transformers.models.*.modeling_*`). Every one stores its
experts in the fused layout DeepwellMoE uses (`experts.gate_up_proj` (E, 2F, D), gate rows first;
`experts.down_proj` (E, D, F)), so conversion copies tensors and sets the router options:

| block | scores | selection | weights | shared experts |
|---|---|---|---|---|
| Mixtral | softmax(logits.float()), gate GEMM in the model dtype | top-k | renormalised | none |
| Qwen2-MoE | same | top-k | renormalised if `norm_topk_prob` | one, scaled by sigmoid(shared_expert_gate(x)) |
| Qwen3-MoE | same | top-k | renormalised if `norm_topk_prob` | none |
| DeepSeek-V3 | sigmoid, gate GEMM in fp32 | top-k of scores + e_score_correction_bias within the best topk_group of n_group groups (masked to -inf) | renormalised if `norm_topk_prob` (+1e-20), × routed_scaling_factor | ungated, F · n_shared_experts |

The converted block's gate is an instance of the HF router class too (a `Router` subclass made
per HF class, pickled by its HF class), so Hugging Face's `output_router_logits` hooks still record
its logits and the model's own aux loss keeps working. Swap before the model's first
`output_router_logits` call: HF installs its hooks once, then. For Qwen2/3-MoE the HF router's slot
holds probabilities, which HF's loss softmaxes again; the converted gate gives the logits.
Not carried over: Mixtral's `router_jitter_noise` (training-time input noise; a warning says so).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

SUPPORTED = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE")


def _check_silu(block) -> None:
    act = block.experts.act_fn
    if not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"deepwell.DeepwellMoE.from_hf: experts use {type(act).__name__}, only SiLU (SwiGLU) is supported")


def _copy_swiglu(dst, src) -> None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(dst, name).weight.data.copy_(getattr(src, name).weight.data)


_ROUTER_CLASSES: dict[type, type] = {}


def hf_compatible_router(hf_router_class: type, router: nn.Module) -> nn.Module:
    """`router` (a deepwell Router) re-classed as a subclass of both its class and `hf_router_class`:
    Router's init and forward, HF's isinstance (what transformers' output recorders check)."""
    router.__class__ = _router_class(type(router), hf_router_class)
    return router


def _router_class(router_class: type, hf_router_class: type) -> type:
    cls = _ROUTER_CLASSES.get(hf_router_class)
    if cls is None:
        # Pickled by its two bases (a made class has no importable name): torch.save(model) works.
        def reduce(self, protocol):
            return _unpickle_router, (router_class, hf_router_class, self.__dict__)

        body = {"__module__": __name__, "__reduce_ex__": reduce}
        cls = type(f"Deepwell{hf_router_class.__name__}", (router_class, hf_router_class), body)
        _ROUTER_CLASSES[hf_router_class] = cls
    return cls


def _unpickle_router(router_class: type, hf_router_class: type, state: dict) -> nn.Module:
    cls = _router_class(router_class, hf_router_class)
    router = cls.__new__(cls)
    router.__dict__.update(state)
    return router


def from_hf(cls, block: nn.Module, **kw):
    """`DeepwellMoE.from_hf`: options read from the block; `kw` overrides any (e.g. recipe)."""
    kind = type(block).__name__
    if kind not in SUPPORTED:
        raise TypeError(f"deepwell.DeepwellMoE.from_hf: {kind} is not one of {', '.join(SUPPORTED)}")
    _check_silu(block)
    gate, experts = block.gate, block.experts
    num_experts, dim, ffn_dim = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2], experts.down_proj.shape[2]
    ref = experts.gate_up_proj
    opts: dict = dict(top_k=gate.top_k, device=ref.device, dtype=ref.dtype)
    shared = None
    if kind == "MixtralSparseMoeBlock":
        opts.update(score_func="softmax", renormalize=True)
        if getattr(block, "jitter_noise", 0) > 0:
            warnings.warn("deepwell.DeepwellMoE.from_hf: router_jitter_noise is not carried over", stacklevel=3)
    elif kind in ("Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock"):
        opts.update(score_func="softmax", renormalize=bool(gate.norm_topk_prob))
        if kind == "Qwen2MoeSparseMoeBlock":
            shared = block.shared_expert
            opts.update(num_shared_experts=1, shared_ffn_dim=shared.down_proj.in_features, shared_expert_gate=True)
    else:  # DeepseekV3MoE
        grouped = gate.num_group > 1
        opts.update(
            score_func="sigmoid",
            renormalize=bool(gate.norm_topk_prob),
            route_scale=float(gate.routed_scaling_factor),
            n_group=gate.num_group if grouped else 0,
            topk_group=gate.topk_group if grouped else 0,
            expert_bias=True,
            router_dtype=torch.float32,
        )
        shared = block.shared_experts
        opts.update(num_shared_experts=1, shared_ffn_dim=shared.down_proj.in_features)
    opts.update(kw)
    moe = cls(dim, ffn_dim, num_experts, **opts)
    hf_compatible_router(type(gate), moe.gate)
    with torch.no_grad():
        moe.gate.weight.copy_(gate.weight)
        moe.experts.gate_up_proj.copy_(experts.gate_up_proj)
        moe.experts.down_proj.copy_(experts.down_proj)
        if kind == "DeepseekV3MoE":
            moe.expert_bias.copy_(gate.e_score_correction_bias.float())
        if shared is not None:
            _copy_swiglu(moe.shared_experts, shared)
        if kind == "Qwen2MoeSparseMoeBlock":
            moe.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    return moe


def _hf_class(config):
    t = config.model_type
    if t == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as C
    elif t == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as C
    elif t == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as C
    elif t == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as C
    else:
        raise TypeError(f"deepwell.DeepwellMoE.to_hf: model_type {t!r} is not mixtral, qwen2_moe, qwen3_moe or deepseek_v3")
    return C


def to_hf(moe, config) -> nn.Module:
    """`DeepwellMoE.to_hf`: the HF block of `config`'s model type holding these weights."""
    block = _hf_class(config)(config)
    ref = moe.experts.gate_up_proj
    block.to(device=ref.device, dtype=ref.dtype)
    if block.experts.gate_up_proj.shape != ref.shape or block.experts.down_proj.shape != moe.experts.down_proj.shape:
        raise ValueError(
            f"deepwell.DeepwellMoE.to_hf: config gives experts {tuple(block.experts.gate_up_proj.shape)}, "
            f"this module has {tuple(ref.shape)}"
        )
    with torch.no_grad():
        block.gate.weight.copy_(moe.gate.weight)
        block.experts.gate_up_proj.copy_(moe.experts.gate_up_proj)
        block.experts.down_proj.copy_(moe.experts.down_proj)
        if config.model_type == "deepseek_v3":
            block.gate.e_score_correction_bias = block.gate.e_score_correction_bias.float()
            block.gate.e_score_correction_bias.copy_(moe.expert_bias)
            _copy_swiglu(block.shared_experts, moe.shared_experts)
        if config.model_type == "qwen2_moe":
            _copy_swiglu(block.shared_expert, moe.shared_experts)
            block.shared_expert_gate.weight.copy_(moe.shared_expert_gate.weight)
    return block
