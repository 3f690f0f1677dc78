"""Applies a plan's parallel degrees with PyTorch's own engines. Tensor parallelism first (degree
`tensor` > 1): Megatron's layout on the LLaMA blocks through DTensor's `parallelize_module`
(`tensor_parallel.py`; the deepwell ops run each rank's shard through their DTensor sharding rules,
ops/sharding.py). Then FSDP2's `fully_shard` over the data ranks on each unit (the embedding,
groups of `unit_blocks` blocks, the final norm with the LM head: parallel.py `fsdp_units`) and the root
(weights, gradients and AdamW states sharded; the deepwell ops see each unit's gathered weights, and
the weight cache keys them like any other tensor), each unit's forward prefetching the next
`forward_prefetch` units' weights, the collectives given `sm_carveout` SMs beside the GEMMs or,
with `collectives` "copy_engine", moved by the copy engines instead of NCCL's kernels
(copy_engine.py; rust/core/src/policy/parallel.rs says why for each). Both: a 2-D mesh ("data",
"tensor"), the tensor ranks of a data rank adjacent (rank = data_rank * tensor + tensor_rank), as
torchtitan lays them out so that the per-layer all-reduces stay within a node; `autoplan(..., sequence_parallel=True)` splits
the residual stream along the sequence too. With `autoplan(..., fp8_all_gather=True)` the plan's
fp8_block weights that split into whole 128x128 tiles are gathered as FP8 codes and tile scales
instead (fp8_all_gather.py; the others as before)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _native
from ..nn.moe import DeepwellMoE
from . import copy_engine, fp8_all_gather, tensor_parallel
from .units import plan_units, world_size


def shard(model: torch.nn.Module, parallelism: dict, sharding: dict, recipe_of: dict[str, str] | None = None) -> torch.nn.Module:
    """`model` sharded as planned (in place: its parameters become DTensors); unchanged for one
    process. `recipe_of` (site name -> recipe) is what the tensor-parallel shards are checked
    against: each must hold whole quantization blocks."""
    data, tensor = parallelism["data"], parallelism["tensor"]
    if data * tensor == 1:
        return model
    refuse_expert_parallel(model)
    sequence = bool(sharding.get("sequence_parallel"))
    if tensor > 1:
        # Before the world size: a layout that cannot be split is wrong on any number of processes.
        tensor_parallel.check(model, tensor, recipe_of or {}, sequence)
        if sequence:
            tensor_parallel.check_sequence_degrees(data, tensor)
    if world_size() != data * tensor:
        raise RuntimeError(
            f"deepwell.compile: the plan is for {data * tensor} processes (data {data} x tensor {tensor}) but "
            f"torch.distributed {'has ' + str(world_size()) if dist.is_initialized() else 'is not initialised'}; "
            "launch with torchrun --nproc-per-node N and call deepwell.autoplan in every process"
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    # Only FSDP's collectives overlap the GEMMs: tensor parallelism's all-reduces run between them.
    sms = leave_sms_to_collectives(device, sharding.get("sm_carveout", 0)) if data > 1 else 0
    # A mesh dimension only for a degree above 1 (a data-parallel run keeps its 1-D mesh).
    names = tuple(n for n, d in (("data", data), ("tensor", tensor)) if d > 1)
    mesh = init_device_mesh(device.type, tuple(d for d in (data, tensor) if d > 1), mesh_dim_names=names,
                            **nccl_ctas(device, sms))
    if tensor > 1:
        tensor_parallel.apply(model, mesh["tensor"], tensor, sequence)
    if data == 1:
        return model
    reshard = sharding["reshard_after_forward"]
    # Before fully_shard, which shards the FP8 path's parameters like any other (fp8_all_gather.py).
    fp8_all_gather.apply(model, sharding.get("fp8_gathered") or [], data)
    units = plan_units(model, sharding)
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh["data"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["data"], reshard_after_forward=reshard)
    if sharding.get("collectives") == "copy_engine" and device.type == "cuda":
        try:
            params = copy_engine.unit_params(model, units)
            gather, scatter = copy_engine.make_comms(mesh["data"].get_group(), params, device)
        except Exception as e:  # no symmetric memory between these ranks: say so, and how to opt out
            raise RuntimeError(
                "deepwell.compile: the plan moves FSDP's collectives on the copy engines, which need PyTorch's "
                f"symmetric memory between the data ranks, and setting it up failed ({type(e).__name__}: {e}); "
                "plan with NCCL instead: plan.sharding['collectives'] = 'process_group' and "
                "plan.sharding['sm_carveout'] = 8 before deepwell.compile"
            ) from e
        for module in [unit[0] for unit in units] + [model]:
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
    prefetch_forward([unit[0] for unit in units], sharding.get("forward_prefetch", 0))
    return model


def refuse_expert_parallel(model: torch.nn.Module) -> None:
    """FSDP2 would take an expert-parallel block's local experts (different on every rank) for
    shards of one tensor and gather them into a wrong whole: refused, until the plan composes the
    two (nn/moe_ep.py)."""
    for name, m in model.named_modules():
        if isinstance(m, DeepwellMoE) and m.ep_size > 1:
            raise ValueError(
                f"deepwell.compile: {name or m.name} is expert-parallel (deepwell.expert_parallel), which the "
                "plan's FSDP2 / tensor-parallel sharding does not compose with yet; train it with a loop of "
                "your own and deepwell.reduce_gradients, or plan the model before splitting its experts"
            )


def prefetch_forward(units: list[torch.nn.Module], depth: int) -> None:
    """Has each FSDP unit's forward (`units`: each unit's first module, in forward order) start the
    all-gathers of the next `depth` units. FSDP2 issues a unit's all-gather when the host reaches
    that unit's forward, so without this the gathers overlap compute only as far as the host runs
    ahead of the GPU; the backward prefetches one unit by itself."""
    if depth <= 0:
        return
    for i, unit in enumerate(units[:-1]):
        unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + depth])


def leave_sms_to_collectives(device: torch.device, planned: int) -> int:
    """Has torch's GEMMs and deepwell's persistent FP8 GEMMs target all but `planned` SMs (the
    plan's `sm_carveout`; the reason is `COMM_SMS` in rust/core/src/policy/parallel.rs), so that
    FSDP's all-gathers and reduce-scatters find SMs beside a persistent GEMM, and returns the SMs the
    collectives get: a carveout the user set (torch._C._set_sm_carveout_experimental) is kept, wins
    and is given to deepwell's GEMMs too; 0 off the GPU. Process-wide, as torch's setting is."""
    if device.type != "cuda":
        return 0
    own = torch._C._get_sm_carveout_experimental()
    sms = max(int(planned if own is None else own), 0)
    if own is None and sms > 0:
        torch._C._set_sm_carveout_experimental(sms)
    _native.call("sm_carveout", {"sms": sms}, "deepwell.compile")
    return sms


def nccl_ctas(device: torch.device, sms: int) -> dict:
    """init_device_mesh's arguments that run the data ranks' NCCL collectives on at most `sms` CTAs
    (NCCL's `max_ctas`), so they fit in the SMs the GEMMs leave them; none for no carveout."""
    if device.type != "cuda" or sms <= 0:
        return {}
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options.config.max_ctas = sms
    return {"backend_override": {"data": ("nccl", options)}}
