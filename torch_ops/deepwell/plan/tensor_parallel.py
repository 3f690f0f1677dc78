"""Tensor parallelism with PyTorch's own DTensor engine: Megatron's layout on LLaMA-style blocks
through `torch.distributed.tensor.parallel.parallelize_module` (as torchtitan applies it), the
deepwell ops running each rank's shard through their sharding rules (ops/sharding.py).

Per block: attention.wq/wk/wv and feed_forward.w1/w3 column-parallel (weight rows split, the input
replicated, each rank's output a slice of the features: its own heads, its own hidden units),
attention.wo and feed_forward.w2 row-parallel (weight columns split, the partial outputs summed by
an all-reduce). Two all-reduces per block forward and two in the backward. The attention module
then computes `heads / tensor` local heads (its `heads` attribute is set as torchtitan sets
`n_heads`). Everything outside the blocks (embeddings, final norm, LM head) and the blocks' norms
stay whole on every rank: they see the same replicated activations, so their gradients agree.

Not done: sequence parallelism (the norms' activations are replicated, not split over the
sequence), a vocabulary-parallel embedding / LM head, loss parallelism, FP8 all-gathers, and any
block layout other than LLaMA's names (MoE blocks included): those raise `RuntimeError`.
"""

from __future__ import annotations

import contextlib

import torch

from . import recipes

#: Megatron's layout on a LLaMA block (names of deepwell.models.llama, Meta's reference code).
LAYOUT = {
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}

_WHAT = "LLaMA-style blocks (attention.wq/wk/wv/wo and feed_forward.w1/w2/w3 as nn.Linear, attention.heads)"


def named_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, block) of every child of the model's ModuleLists, as plan/parallel.py's
    `blocks` finds them."""
    return [
        (f"{name}.{i}".lstrip("."), b)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList)
        for i, b in enumerate(m)
    ]


def _fail(msg: str):
    raise RuntimeError(f"deepwell.compile: tensor parallelism {msg}")


def check(model: torch.nn.Module, tensor: int, recipe_of: dict[str, str]) -> None:
    """Raises unless every block can be split `tensor` ways exactly: LLaMA-shaped, heads and
    features divisible by `tensor`, and each shard boundary on a block of its site's recipe
    (`recipe_of`: site name -> recipe; a site not there runs bf16). Why the blocks: a shard holding
    whole quantization blocks quantizes them exactly as one process does (ops/sharding.py)."""
    found = named_blocks(model)
    if not found:
        _fail(f"of degree {tensor} applies to {_WHAT}; {type(model).__name__} has no nn.ModuleList of blocks")
    for name, block in found:
        where = f"block {name!r} ({type(block).__name__})"
        for rel, style in LAYOUT.items():
            try:
                layer = block.get_submodule(rel)
            except AttributeError:
                _fail(f"of degree {tensor} applies to {_WHAT}; {where} has no {rel!r}: this model is not supported")
            if type(layer) is not torch.nn.Linear:  # (ColwiseParallel / RowwiseParallel split nn.Linear only)
                kind = f"{type(layer).__module__}.{type(layer).__qualname__}"
                _fail(f"of degree {tensor} applies to {_WHAT}; {where}'s {rel!r} is a {kind}, not an nn.Linear: "
                      "this model is not supported")
            if hasattr(layer.weight, "placements"):  # a DTensor: split before, its heads already divided
                _fail(f"of degree {tensor}: {name}.{rel} is already split (deepwell.compile ran on this model "
                      "before); capture and compile a fresh model")
            dim_name, dim = ("out_features", layer.out_features) if style == "colwise" else ("in_features", layer.in_features)
            if dim % tensor:
                _fail(f"of degree {tensor} cannot split {name}.{rel}'s {dim_name} {dim} evenly")
            site = f"{name}.{rel}"
            recipe = recipe_of.get(site, "bf16")
            block_k = recipes.block_k(recipe)
            if block_k and (dim // tensor) % block_k:
                _fail(
                    f"of degree {tensor} splits {site} ({style}) along {dim_name} {dim} into {dim // tensor} per rank, "
                    f"not a multiple of {recipe}'s quantization block of {block_k}: the shards would not quantize "
                    f"as the whole layer does; use a tensor degree whose shards hold whole blocks, or plan this "
                    f"layer bf16"
                )
        heads = getattr(block.attention, "heads", None)
        if not isinstance(heads, int):
            _fail(f"of degree {tensor} applies to {_WHAT}; {where}'s attention has no integer 'heads' attribute")
        if heads % tensor:
            _fail(f"of degree {tensor} cannot split {name}.attention's {heads} heads evenly")


def local_shapes(model: torch.nn.Module, tensor: int) -> dict[str, tuple[int, ...]]:
    """Parameter name -> the shape one rank holds after `apply(model, mesh, tensor)` (LAYOUT's
    weights only; `check` first): what plan/memory.py traces to measure one rank's activations."""
    shapes = {}
    for name, block in named_blocks(model):
        for rel, style in LAYOUT.items():
            n, k = block.get_submodule(rel).weight.shape
            shapes[f"{name}.{rel}.weight"] = (n // tensor, k) if style == "colwise" else (n, k // tensor)
    return shapes


@contextlib.contextmanager
def local_heads(model: torch.nn.Module, tensor: int):
    """The blocks' attention computes `heads / tensor` heads inside the block, as after `apply`."""
    attentions = [block.attention for _, block in named_blocks(model)]
    for a in attentions:
        a.heads //= tensor
    try:
        yield
    finally:
        for a in attentions:
            a.heads *= tensor


def apply(model: torch.nn.Module, mesh, tensor: int) -> None:
    """Splits every block over the 1-D "tensor" `mesh` (in place; `check` first)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for _, block in named_blocks(model):
        styles = {rel: ColwiseParallel() if s == "colwise" else RowwiseParallel() for rel, s in LAYOUT.items()}
        parallelize_module(block, mesh, styles)
        # wq/wk/wv now give this rank's slice of the features: its heads / tensor heads, whole.
        block.attention.heads //= tensor
