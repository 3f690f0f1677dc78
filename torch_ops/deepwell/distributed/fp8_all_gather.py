"""Which weights FSDP2 gathers as fp8_block codes (`deepwell.autoplan(..., fp8_all_gather=True)`,
recorded in `plan.sharding`: "fp8_all_gather" the option, "fp8_gathered" the weights, the reason
says why the others are not) and putting them on that path before `fully_shard` (`apply`, called
by shard.py). The mechanism: fp8_weights.py.

A weight takes the FP8 all-gather when gathering its codes is exact (docs/NUMERICS.md "FP8 block":
quantization is per 128x128 tile, so shards of whole tile rows quantize to the whole weight's
tiles) and its only reader can run from them:
- its site is planned fp8_block, and so is every site sharing its compiled block graph (FSDP2
  compiles one graph per block code, which runs the most precise of their recipes:
  compiler/backend.py `_shared_decision`);
- it is the `weight` of an nn.Linear (F.linear(x, W): the GEMM the backend rewrites into
  `scaled_linear`), used by no other module (tied weights are also read by their embedding);
- out_features is a multiple of 128 x the data ranks and in_features of 128 (each rank holds whole
  tile rows; FSDP2 shards dim 0 evenly);
- no tensor parallelism (its DTensor shards would need the codes gathered per tensor rank: not yet).
Every other weight stays on FSDP2's high-precision all-gather, as without the option.
"""

from __future__ import annotations

import torch

from .fp8_weights import TILE, Fp8BlockShard
from .units import blocks


def _graph_mates(name: str, block_names: list[str], recipe_of: dict[str, str]) -> list[str]:
    """The sites whose compiled graph may run `name`'s: under FSDP2 a block's graph names its sites
    relative to the block (`attention.wq`), and `_shared_decision` gives it the decision of every
    site ending in that name (`layers.0.attention.wq`, `layers.1.attention.wq`, ...)."""
    prefix = next((b for b in block_names if name.startswith(b + ".")), None)
    if prefix is None:
        return [name]
    rel = name[len(prefix) + 1 :]
    return [s for s in recipe_of if s == rel or s.endswith("." + rel)]


def choose(model: torch.nn.Module, recipe_of: dict[str, str], data: int, tensor: int) -> tuple[list[str], str]:
    """(the weights to gather as fp8_block codes, by parameter name; a sentence saying what was
    chosen and why the others were not) for `data` data ranks and `tensor` tensor ranks."""
    if data < 2:
        return [], "FP8 all-gather: nothing is gathered with one data rank"
    if tensor > 1:
        return [], "FP8 all-gather off: not with tensor parallelism yet (weights gathered in high precision)"
    ids = {id(b) for b in blocks(model)}
    block_names = [n for n, m in model.named_modules() if id(m) in ids]
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    modules = dict(model.named_modules())
    chosen, skipped = [], []
    for name, recipe in recipe_of.items():
        module = modules.get(name)
        if recipe != "fp8_block":
            why = f"recipe {recipe}"
        elif not isinstance(module, torch.nn.Linear):
            why = "not the weight of an nn.Linear"
        elif any(recipe_of[s] != "fp8_block" for s in _graph_mates(name, block_names, recipe_of)):
            why = "its block graph is shared with a site planned otherwise"
        elif counts[id(module.weight)] > 1:
            why = "the weight is shared (tied)"
        elif module.weight.shape[0] % (TILE * data) or module.weight.shape[1] % TILE:
            n, k = module.weight.shape
            why = f"{n}x{k} does not split into whole {TILE}-row tiles over {data} ranks"
        else:
            chosen.append(f"{name}.weight")
            continue
        skipped.append(f"{name} ({why})")
    reason = f"FP8 all-gather (fp8_block codes + tile scales) for {len(chosen)} weights"
    if skipped:
        more = f", ... ({len(skipped)} in all)" if len(skipped) > 3 else ""
        reason += f"; high-precision gather for {', '.join(skipped[:3])}{more}"
    return chosen, reason


def is_fp8_gathered(p: torch.Tensor) -> bool:
    """Whether FSDP2 gathers parameter `p` (after `apply` and `fully_shard`) as fp8_block codes."""
    return isinstance(getattr(p, "_local_tensor", p), Fp8BlockShard)


def gathered_bytes(params) -> int:
    """Bytes FSDP2 gathers for `params` at their global sizes: an FP8-gathered weight's E4M3 codes
    (a byte per element) and fp32 scales (one per 128x128 tile), every other parameter in its dtype."""
    total = 0
    for p in params:
        if is_fp8_gathered(p):
            n, k = p.shape
            total += n * k + 4 * (n // TILE) * (k // TILE)
        else:
            total += p.numel() * p.element_size()
    return total


def _plain_state(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook: the weight as a plain tensor (a DTensor of the plain shard under
    FSDP2), sharing its storage, so checkpoints hold ordinary tensors and loading into it loads
    into the parameter."""
    key = prefix + "weight"
    value = state_dict.get(key)
    local = getattr(value, "_local_tensor", value)
    if not isinstance(local, Fp8BlockShard):
        return
    if local is value:
        state_dict[key] = local._tensor
        return
    from torch.distributed.tensor import DTensor

    state_dict[key] = DTensor.from_local(
        local._tensor, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )


_plain_state._from_public_api = True  # register_state_dict_post_hook's in-place contract


def apply(model: torch.nn.Module, names: list[str], data: int) -> None:
    """Puts the named weights (`choose`'s) on the FP8 all-gather: each becomes a parameter whose
    tensor is an `Fp8BlockShard` of its values (FSDP2 then shards it as any other), and its module
    checkpoints it as a plain tensor. Before `fully_shard`."""
    for name in names:
        module_name, _, param = name.rpartition(".")
        module = model.get_submodule(module_name)
        w = getattr(module, param)
        n, k = w.shape
        if n % (TILE * data) or k % TILE:
            raise RuntimeError(
                f"deepwell.compile: {name} ({n}x{k}) is planned for the FP8 all-gather but does not split into "
                f"whole {TILE}-row tiles over {data} data ranks; make the plan for this world size"
            )
        setattr(module, param, torch.nn.Parameter(Fp8BlockShard(w.detach()), requires_grad=w.requires_grad))
        module.register_state_dict_post_hook(_plain_state)
