"""A job's world, a model's blocks and its FSDP units: what planning, sharding and checkpoints all
read (`plan/parallel.py` decides the degrees, `shard.py` applies them)."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
