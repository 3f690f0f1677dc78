"""Applies a plan's parallel degrees with PyTorch's own engine: FSDP2's `fully_shard` on every
block and then the root (weights, gradients and AdamW states sharded over the data ranks; the
deepwell ops see each block's gathered, ordinary tensors during its forward and backward, and the
weight cache keys them like any other tensor). Tensor parallelism is planned but not applied yet."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .parallel import blocks, world_size


def shard(model: torch.nn.Module, parallelism: dict, sharding: dict) -> torch.nn.Module:
    """`model` sharded as planned (in place, FSDP2 turns its parameters into DTensors); unchanged for
    one process."""
    data, tensor = parallelism["data"], parallelism["tensor"]
    if data * tensor == 1:
        return model
    if world_size() != data * tensor:
        raise RuntimeError(
            f"deepwell.compile: the plan is for {data * tensor} processes (data {data} x tensor {tensor}) but "
            f"torch.distributed {'has ' + str(world_size()) if dist.is_initialized() else 'is not initialised'}; "
            "launch with torchrun --nproc-per-node N and call deepwell.autoplan in every process"
        )
    if tensor > 1:
        raise NotImplementedError(
            f"deepwell.compile: the plan asks for tensor parallelism of degree {tensor} ({sharding['reason']}); "
            "deepwell does not apply tensor parallelism yet: use more data ranks or a smaller micro-batch"
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (data,))
    reshard = sharding["reshard_after_forward"]
    for block in blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model
