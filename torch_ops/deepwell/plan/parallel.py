"""Which parallel degrees a job runs with: the Rust planner's decision (`parallel_plan`,
rust/core/src/policy/parallel.rs) from the job's processes, its devices (`probe()`) and the model's
sizes measured here (parameters, AdamW states, saved activations of one rank's micro-batch, the
largest block FSDP gathers at a time). Applying the decision: `shard.py`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _native
from .hardware import Hardware
from .memory import saved_activation_bytes


def world_size() -> int:
    """The job's processes: torch.distributed's world when initialised, else 1."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The sharding units: the children of the model's ModuleLists (its transformer blocks), in order."""
    return [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]


def unit_blocks_of(sharding: dict) -> list[int] | int:
    """A plan's FSDP block units for `fsdp_units`: the planner's `unit_blocks`, or a block per unit
    where it planned none (no data parallelism)."""
    return sharding.get("unit_blocks") or 1


def plan_units(model: torch.nn.Module, sharding: dict) -> list[list[torch.nn.Module]]:
    """The FSDP units a plan's `sharding` gives `model` (`fsdp_units` with its `unit_blocks` and
    `ends_join_blocks`; plans made before the latter existed keep the ends in units of their own)."""
    return fsdp_units(model, unit_blocks_of(sharding), bool(sharding.get("ends_join_blocks")))


def fsdp_units(model: torch.nn.Module, unit_blocks: list[int] | int = 1,
               ends_join_blocks: bool = False) -> list[list[torch.nn.Module]]:
    """FSDP's units in forward order: the modules registered before the blocks (the embedding), the
    blocks in consecutive groups of `unit_blocks` blocks (the plan's counts, which must cover the
    blocks; an int: groups of that many), and those registered after them (the final norm and the
    LM head). Whatever a unit does not hold (the root's own parameters, and both ends when they share
    a parameter: tied embeddings) stays with the root's unit. Before and after are read off
    registration order along the path from the root to the blocks' ModuleList, which is forward order
    in the LLaMA layouts (deepwell.models, Hugging Face's `model.embed_tokens ... model.norm, lm_head`).
    Out of the root's unit, the LM head's gather overlaps the blocks' forward and its gradients'
    reduction their backward, where the root's would wait for the whole step. `ends_join_blocks`:
    the modules before the blocks share the first group's unit and those after the last group's
    (the plan's choice, rust/core/src/policy/parallel.rs: every unit costs host time each step)."""
    every = blocks(model)
    if isinstance(unit_blocks, int):
        per_unit = max(unit_blocks, 1)
        unit_blocks = [per_unit] * (len(every) // per_unit) + [len(every) % per_unit] * bool(len(every) % per_unit)
    if sum(unit_blocks) != len(every) or min(unit_blocks, default=1) < 1:
        raise RuntimeError(f"deepwell.compile: the plan's FSDP units of {list(unit_blocks)} blocks do not cover "
                           f"this model's {len(every)} blocks; plan again for this model (deepwell.autoplan)")
    starts = [sum(unit_blocks[:i]) for i in range(len(unit_blocks))]
    groups = [every[a:a + n] for a, n in zip(starts, unit_blocks)]
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]  # blocks' first
    if not lists:
        return groups
    ids = {id(b) for b in every}
    path = _path_to(model, lists[0])
    before, after = [], []  # after: per level, the innermost level's modules run first
    for parent, child in zip(path, path[1:]):
        seen, level = False, []
        for sibling in parent.children():
            if sibling is child:
                seen = True
            elif any(True for _ in sibling.parameters()) and not any(id(m) in ids for m in sibling.modules()):
                (level if seen else before).append(sibling)
        after[:0] = level
    params = [{id(p) for m in end for p in m.parameters()} for end in (before, after)]
    if params[0] & params[1]:
        return groups
    if ends_join_blocks and groups:
        if len(groups) == 1:
            return [before + groups[0] + after]
        return [before + groups[0], *groups[1:-1], groups[-1] + after]
    return ([before] if before else []) + groups + ([after] if after else [])


def _path_to(root: torch.nn.Module, target: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules from `root` down to `target` (both included)."""
    for child in root.children():
        if child is target:
            return [root, child]
        path = _path_to(child, target)
        if path:
            return [root, *path]
    return []


def nbytes(params) -> int:
    """Bytes of `params` at their global sizes (a DTensor counts whole)."""
    return sum(p.numel() * p.element_size() for p in params)


def plan_parallelism(
    model: torch.nn.Module, example_inputs: tuple, hw: Hardware | None, world: int, quantized: bool | None = None,
    codes: dict[str, str] | None = None, tensor: int | None = None
) -> dict:
    """{data, tensor, fsdp, reshard_after_forward, sm_carveout, unit_blocks, ends_join_blocks,
    forward_prefetch, per_rank_bytes, reason, saved} for `world`
    processes; `saved`: `memory.saved_activation_bytes`'s (total, largest, output bytes, output elements), measured before
    sharding (dryrun reuses it: a sharded model's forward cannot run on fake tensors). `example_inputs`
    is one rank's micro-batch; `hw` the node's devices (None: unknown memory); `quantized`: whether
    the plan has deepwell GEMMs (plan/memory.py; None: eager autograd's saved tensors); `codes`: its
    fp8_tensor sites (name -> recipe), which save x's codes; `tensor`: a tensor degree the caller
    fixed (`check_tensor_degree`), for which Rust plans the rest."""
    weights = nbytes(model.parameters())
    units = blocks(model)
    largest = max((nbytes(b.parameters()) for b in units), default=weights)
    saved = saved_activation_bytes(model, example_inputs, quantized, codes=codes) if world > 1 else (0, 0, 0, 0)
    devices = hw.devices if hw is not None else []
    cluster = {
        "world_size": world,
        "devices_per_node": max(len(devices), 1),
        "memory_bytes": min((d.memory_bytes for d in devices), default=0),
        "peer_access": bool(hw and hw.links) and all(link["p2p"] for link in hw.links),
    }
    sizes = {
        "weight_bytes": weights,
        "gradient_bytes": weights,
        "optimizer_bytes": 2 * weights,  # AdamW's two states, in the parameter dtype
        "activation_bytes": saved[0],
        "largest_unit_bytes": largest,
        "blocks": len(units),
    }
    request = {"cluster": cluster, "model": sizes, **({"tensor": tensor} if tensor is not None else {})}
    return {**_native.call("parallel_plan", request, "deepwell.autoplan"), "saved": saved}


def with_tensor_share(model: torch.nn.Module, example_inputs: tuple, par: dict, quantized: bool | None,
                      sequence: bool = False) -> dict:
    """`par` with `saved` measured for one rank of its tensor degree (memory.py traces the split
    layers at their local shapes, and with `sequence` the split residual stream) when that degree is
    above 1; the whole model's count (an upper bound) stays where the model cannot be split (compile
    then raises the reason)."""
    from . import tensor_parallel

    tensor = par["tensor"]
    if tensor == 1 or par["saved"] == (0, 0, 0, 0):
        return par
    try:
        tensor_parallel.check(model, tensor, {}, sequence)
    except RuntimeError:
        return par
    return {**par, "saved": saved_activation_bytes(model, example_inputs, quantized, tensor, sequence)}


def check_tensor_degree(world: int, tensor) -> None:
    """autoplan's `tensor_parallel=`: a positive integer dividing the world size, or RuntimeError."""
    if not isinstance(tensor, int) or isinstance(tensor, bool) or tensor < 1 or world % tensor:
        raise RuntimeError(
            f"deepwell.autoplan: tensor_parallel must be a positive integer dividing the world size {world}, "
            f"got {tensor!r}"
        )
