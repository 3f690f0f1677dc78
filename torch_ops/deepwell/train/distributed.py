"""What the Trainer does differently when it runs in several processes (torchrun; the model
sharded by deepwell.compile's plan, plan/shard.py): every rank takes its rows of each global batch,
losses and gradient norms are averaged over the ranks, and only rank 0 writes logs, plots and the
progress bar. With one process every function here is the identity."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan.parallel import world_size


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def is_main() -> bool:
    return rank() == 0


def shard_rows(batch, who: str = "deepwell.Trainer"):
    """This rank's contiguous share of a batch's rows (dim 0): rank r of w takes rows
    [r * b / w, (r + 1) * b / w), so the ranks together see exactly the global batch."""
    world = world_size()
    if world == 1 or not isinstance(batch, torch.Tensor):
        return batch
    rows = batch.shape[0]
    if rows % world:
        raise ValueError(f"{who}: a global batch of {rows} rows cannot be split evenly over {world} processes")
    n = rows // world
    return batch[rank() * n : (rank() + 1) * n]


def mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of a 0-d tensor over the ranks (each rank's share is the same size)."""
    if world_size() == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / world_size()


def scalar(t: torch.Tensor) -> float:
    """A Python float from a tensor that may be a replicated DTensor (clip_grad_norm_ under FSDP2)."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).item()
