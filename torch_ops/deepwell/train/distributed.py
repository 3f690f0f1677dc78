"""What the Trainer does differently when it runs in several processes (torchrun; the model
sharded by deepwell.compile's plan, distributed/shard.py): every rank takes its rows of each global batch,
losses and gradient norms are averaged over the ranks, and only rank 0 writes logs, plots and the
progress bar. Checkpoints are sharded by default (train/sharded.py: every rank writes its shards
through torch.distributed.checkpoint); with checkpoint_format="full" they hold the weights and
optimizer states gathered to rank 0 (the gather functions here, torch.distributed.checkpoint's
state-dict API with full_state_dict), written by rank 0 in the one-process format. Either way a run
saved by N processes resumes in M. With one process every function here is the plain path."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.units import world_size
from . import state
from .checkpoint_files import CheckpointError


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def is_main() -> bool:
    return rank() == 0


def shard_rows(batch, who: str = "deepwell.Trainer", tensor: int = 1):
    """This rank's contiguous share of a batch's rows (dim 0): data rank r of d takes rows
    [r * b / d, (r + 1) * b / d), so the data ranks together see exactly the global batch. With
    tensor parallelism of degree `tensor` the `tensor` adjacent ranks of a data rank (distributed/shard.py's
    mesh) take the same rows: they split the layers, not the batch."""
    world = world_size()
    if world == 1 or not isinstance(batch, torch.Tensor):
        return batch
    data = world // tensor
    rows = batch.shape[0]
    if rows % data:
        raise ValueError(f"{who}: a global batch of {rows} rows cannot be split evenly over {data} data ranks")
    n = rows // data
    r = rank() // tensor
    return batch[r * n : (r + 1) * n]


def clip_grad_norm(params: list, max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_`, which needs the gradients all plain tensors or all DTensors on
    one mesh (one process; FSDP2). Tensor parallelism mixes them: its split weights are DTensors
    on the tensor mesh (with FSDP2, on the 2-D mesh) next to whole weights that are plain tensors
    (with FSDP2, DTensors on the data mesh). Then: each group's norm, gathered, combined into the
    global norm, and every gradient scaled by one coefficient. FSDP2's gradients alone (sharded
    over one mesh) are clipped on their local shards (train/clip.py: torch's bits, without
    DTensor's dispatch)."""
    if world_size() == 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    from torch.distributed.tensor import DTensor

    from .clip import clip_shards_, sharded_over_one_mesh

    grads = [p.grad for p in params]
    if sharded_over_one_mesh(grads):
        return clip_shards_(grads, max_norm)
    groups: dict = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = []
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms]), 2.0)
    # The coefficient as clip_grads_with_norm_ computes it (in fp32), applied as a Python scalar: a
    # plain tensor would not mix with the DTensor gradients.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).item()
    if coef < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of a 0-d tensor over the ranks (each rank's share is the same size)."""
    if world_size() == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / world_size()


def fsdp_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) shards any of the model's modules: it gathers their weights
    into fresh memory for each forward and backward, and frees them after."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def replicated(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from one that may be a DTensor (clip_grad_norm_'s norm under FSDP2)."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _fqns(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The parameter names in the order of the optimizer's flattened param groups: the index a
    one-process optimizer state dict uses."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`state.model_tensors`; when sharded, the gathered weights on rank 0 (empty elsewhere; tied
    weights are stored twice)."""
    if world_size() == 1:
        return state.model_tensors(model)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model, options=_options(cpu_offload=True))), {}


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    if world_size() == 1:
        return state.load_model_tensors(model, tensors, aliases)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    full = {**tensors, **{alias: tensors[name] for alias, name in aliases.items()}}
    set_model_state_dict(model, full, options=_options())  # every rank reads the files, keeps its shard


def optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """`state.optimizer_state`; when sharded, the gathered states on rank 0, re-keyed from names
    to the one-process indices."""
    if world_size() == 1:
        return state.optimizer_state(opt)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, opt, options=_options(cpu_offload=True))
    if not sd:
        return {}, {}
    index = {name: i for i, name in enumerate(_fqns(model, opt))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
    return state.optimizer_state(opt, {"state": {index[n]: v for n, v in sd["state"].items()}, "param_groups": groups})


def load_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    if world_size() == 1:
        return state.load_optimizer_state(opt, tensors, meta)
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    sd = state.optimizer_state_dict(opt, tensors, meta)
    names = _fqns(model, opt)
    sd = {
        "state": {names[i]: v for i, v in sd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
    }
    set_optimizer_state_dict(model, opt, sd, options=_options())


def on_rank0(fn):
    """fn() run by rank 0 alone, its result broadcast to every rank (a JSON-sized object). A
    CheckpointError it raises is raised on every rank with rank 0's message, so no rank waits for
    the others in a collective they never reach. (Verifying a checkpoint: rank 0 hashes its files
    once, not every rank.)"""
    if world_size() == 1:
        return fn()
    box = [None, None]
    if is_main():
        try:
            box[0] = fn()
        except CheckpointError as e:
            box[1] = str(e)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise CheckpointError(box[1])
    return box[0]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()
