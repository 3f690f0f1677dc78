"""What deepwell does to a whole model's MoE blocks: swap Hugging Face MoE blocks for
`DeepwellMoE` (`swap_hf_moe`), shard their experts over a process group (`expert_parallel`, the
per-block exchange in moe_ep.py), reduce the gradients of an expert-parallel model
(`reduce_gradients`), and present its experts' optimizer state whole (`optimizer_state_dict`,
`load_optimizer_state_dict`; the block's own state dict: moe_ep_state.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import moe_ep_state
from .moe import DeepwellMoE
from .moe_ep import WHO
from .moe_ep_state import EXPERT_WEIGHTS, as_shard, local_slice, whole_shape
from .moe_hf import SUPPORTED


def swap_hf_moe(model: nn.Module, recipe: str = "auto", policy=None, **kw) -> int:
    """Replaces every supported Hugging Face MoE block inside `model` by an equivalent DeepwellMoE
    (in place, weights copied); returns how many were swapped. `recipe="auto"` lets the Rust planner
    pick the experts' recipe under `policy` (deepwell.PrecisionPolicy; its globs see the block's
    qualified name + ".experts.gate_up_proj" / ".experts.down_proj")."""
    swapped = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__ in SUPPORTED:
                qualified = f"{name}.{child_name}" if name else child_name
                moe = DeepwellMoE.from_hf(child, recipe=recipe, policy=policy, name=qualified, **kw)
                setattr(module, child_name, moe.train(child.training))
                swapped += 1
    return swapped


def expert_parallel(model: nn.Module, group=None) -> int:
    """Shards the routed experts of every DeepwellMoE in `model` over `group` (default: the world):
    rank r keeps experts [r·E/world, (r+1)·E/world). Every rank must hold the same model (same
    initial weights) when this runs. Returns the number of blocks sharded."""
    if not dist.is_initialized():
        raise RuntimeError(f"{WHO}: torch.distributed is not initialized (call init_process_group first)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    blocks = [m for m in model.modules() if isinstance(m, DeepwellMoE)]
    for m in blocks:
        if m.ep_size > 1:
            raise ValueError(f"{WHO}: {m.name} is already expert-parallel")
        if m.num_experts % world != 0:
            raise ValueError(
                f"{WHO}: num_experts must be a multiple of the group's {world} processes, "
                f"got {m.num_experts} in {m.name}"
            )
        local = m.num_experts // world
        keep = slice(rank * local, (rank + 1) * local)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(m.experts, name)
            setattr(m.experts, name, nn.Parameter(full.detach()[keep].clone(), requires_grad=full.requires_grad))
        m.ep_group, m.ep_size = group, world
        # On the block, not a closure over it: the hooks read the module they are called with, so
        # a deepcopy of the model (which copies the hook dicts) stays right.
        m.register_state_dict_post_hook(moe_ep_state.experts_as_dtensors)
        m.register_load_state_dict_pre_hook(moe_ep_state.local_experts_of)
    return len(blocks)


def reduce_gradients(model: nn.Module, group=None) -> None:
    """After the backward of an expert-parallel model whose processes each took the mean loss of
    their own tokens: makes every gradient that of the mean over all processes' tokens. Replicated
    parameters are averaged over `group` (an all-reduce each); each rank's local experts already
    hold the sum over the processes' losses (the reverse all-to-all brought them every rank's
    tokens), so they are divided by the group's size."""
    world = dist.get_world_size(group)
    local = {id(p) for m in model.modules() if isinstance(m, DeepwellMoE) and m.ep_size > 1
             for p in (m.experts.gate_up_proj, m.experts.down_proj)}
    for p in model.parameters():
        if id(p) in local:
            if p.grad is not None:
                p.grad.div_(world)
        elif p.requires_grad:
            # Every rank joins every all-reduce (a rank without a gradient sends zeros), so the
            # ranks never wait on different collectives.
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=group)
            grad.div_(world)
            if p.grad is None and bool(grad.any()):
                p.grad = grad


# ---------------------------------------------------------------------------------------------
# The optimizer's state dict


def _local_experts(model):
    """(parameter FQN, block, weight name) of every expert-parallel block's local experts."""
    for path, m in model.named_modules():
        if isinstance(m, DeepwellMoE) and m.ep_size > 1:
            for name in EXPERT_WEIGHTS:
                yield f"{path}.experts.{name}" if path else f"experts.{name}", m, name


def optimizer_state_dict(model, optimizer) -> dict:
    """`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer)` (state
    keyed by parameter name), with every per-element state of the local experts (AdamW's
    `exp_avg`, `exp_avg_sq`: tensors of the parameter's shape) as Shard(0) DTensors of the whole
    shape, so that `dcp.save` writes every rank's. Scalar states (`step`) are the same on every
    rank and stay plain. A model without expert-parallel blocks gets torch's answer unchanged."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer)
    for fqn, block, name in _local_experts(model):
        if fqn not in sd["state"]:
            continue
        shape = getattr(block.experts, name).shape
        # A new dict: torch hands out the optimizer's own per-parameter state dicts.
        sd["state"][fqn] = {k: as_shard(block, v) if torch.is_tensor(v) and v.shape == shape else v
                            for k, v in sd["state"][fqn].items()}
    return sd


def load_optimizer_state_dict(model, optimizer, state_dict: dict) -> None:
    """Loads `state_dict` (as `optimizer_state_dict` gives it, after `dcp.load`; or an unsharded
    run's, with whole experts) into `optimizer`: the local experts' states become this rank's
    slices (`state_dict` then holds those), then torch's `set_optimizer_state_dict`."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for fqn, block, name in _local_experts(model):
        if fqn not in state_dict["state"]:
            continue
        whole = whole_shape(block, name)
        state_dict["state"][fqn] = {
            k: local_slice(block, f"{fqn} state {k!r}", v, whole, "deepwell.load_expert_optimizer_state_dict")
            if torch.is_tensor(v) and v.dim() > 0 else v
            for k, v in state_dict["state"][fqn].items()
        }
    set_optimizer_state_dict(model, optimizer, state_dict)


# ---------------------------------------------------------------------------------------------
# Hugging Face conversion
