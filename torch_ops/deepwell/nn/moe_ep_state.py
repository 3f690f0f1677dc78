"""The state of expert-parallel blocks (nn/moe_ep.py) in checkpoints and conversions.

Every rank's local experts have the same parameter name and shape (E / world, ...) but different
contents, so plain state dicts would look replicated to torch.distributed.checkpoint (DCP), which
would keep one rank's copy and lose the other experts without a word. So:

- **The model's state dict** (hooks that `deepwell.expert_parallel` registers on each block)
  presents `experts.gate_up_proj` and `experts.down_proj` as DTensors of the whole (E, ...) shape,
  Shard(0) over a 1-D DeviceMesh of the group. The parameters themselves stay plain tensors: the
  forward and the optimizer see no change. `dcp.save(model.state_dict(), checkpoint_id=d)` writes
  whole experts and `dcp.load` reshards them: into expert-parallel processes, or one unsharded
  process (`dcp.load(sd, checkpoint_id=d, no_dist=True)`); then `model.load_state_dict(sd)`.
  `load_state_dict` also takes the whole (E, ...) tensors of an unsharded model and keeps this
  rank's slice.
- **The optimizer's state** has the same problem (AdamW's moments of the local experts):
  `optimizer_state_dict(model, optimizer)` is torch's `get_optimizer_state_dict` with those
  moments as the same Shard(0) DTensors, and `load_optimizer_state_dict` takes them (or whole
  tensors) back to this rank's slices before torch's `set_optimizer_state_dict`. An unsharded
  process reads the checkpoint with torch's own two functions.
- **Hugging Face conversion**: `unsharded(block)` all-gathers the experts for `DeepwellMoE.to_hf`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

_WHO = "deepwell.expert_parallel"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _mesh(block, device: torch.device):
    """The block's group as a 1-D DeviceMesh (no collective: it wraps the existing group)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(block.ep_group or dist.group.WORLD, "cuda" if device.type == "cuda" else "cpu")


def whole_shape(block, name: str) -> tuple[int, ...]:
    return (block.num_experts, *getattr(block.experts, name).shape[1:])


def as_shard(block, local: torch.Tensor):
    """`local` (this rank's E / world experts' rows of something) as its Shard(0) of a DTensor of
    the whole shape. Every rank holds the same number of experts, so from_local infers the global
    shape without a collective, and the DTensor wraps `local` without a copy: `dcp.load` into it
    fills `local`."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, _mesh(block, local.device), [Shard(0)], run_check=False)


def local_slice(block, key: str, value, whole: tuple[int, ...], who: str) -> torch.Tensor:
    """This rank's experts of `value`: a DTensor as `as_shard` makes them (after `dcp.load`), or a
    whole (E, ...) tensor of an unsharded model. Anything else is refused, in particular a plain
    (E / world, ...) tensor, whose rank is unknown."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = block.ep_size, dist.get_rank(block.ep_group)
    local = block.num_experts // world
    if tuple(value.shape) == whole:
        if not isinstance(value, DTensor):
            return value[rank * local:(rank + 1) * local]
        # This rank's shard is its experts only if the mesh orders the ranks as the group does.
        if tuple(value.placements) == (Shard(0),) and tuple(value.device_mesh.get_coordinate() or ()) == (rank,):
            return value.to_local()
    got = (f"a DTensor {tuple(value.shape)} placed {tuple(value.placements)} on mesh {value.device_mesh}"
           if isinstance(value, DTensor) else f"a plain tensor {tuple(value.shape)}")
    raise RuntimeError(
        f"{who} ({_WHO} over {world} processes): {key} must be a DTensor of shape {whole} sharded on dim 0 "
        f"over the group, as state_dict() gives, or the whole {whole} tensor; got {got}. Load a "
        "checkpoint of another layout through torch.distributed.checkpoint (dcp.load reshards)"
    )


# ---------------------------------------------------------------------------------------------
# The model's state dict: hooks on each expert-parallel block


def experts_as_dtensors(block, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook of an expert-parallel block: its local experts as `as_shard`s."""
    for name in EXPERT_WEIGHTS:
        key = f"{prefix}experts.{name}"
        state_dict[key] = as_shard(block, state_dict[key])


def local_experts_of(block, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:
    """Load-state-dict pre-hook of an expert-parallel block: the incoming experts become this
    rank's slice (`local_slice`) before the parameters copy them."""
    for name in EXPERT_WEIGHTS:
        key = f"{prefix}experts.{name}"
        if key in state_dict:  # else load_state_dict reports it as missing
            state_dict[key] = local_slice(block, key, state_dict[key], whole_shape(block, name),
                                           "load_state_dict of an expert-parallel block")


def unsharded(block):
    """A stand-in for an expert-parallel block holding its whole (E, ...) experts (detached),
    all-gathered over its group: a collective, every rank must call it. What the Hugging Face
    conversion (nn/moe_hf.py `to_hf`) reads; every other attribute is the block's own (router,
    expert bias, shared experts)."""
    experts = {}
    for name in EXPERT_WEIGHTS:
        local = getattr(block.experts, name).detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(block.ep_size)]
        dist.all_gather(parts, local, group=block.ep_group)
        experts[name] = torch.cat(parts)
    return _Unsharded(block, SimpleNamespace(**experts))


class _Unsharded:
    def __init__(self, block, experts):
        self._block, self.experts = block, experts

    def __getattr__(self, name):  # only names not set in __init__
        return getattr(self.__dict__["_block"], name)
