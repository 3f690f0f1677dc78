"""Tensor parallelism with PyTorch's own DTensor engine: Megatron's layout on LLaMA-style blocks
through `torch.distributed.tensor.parallel.parallelize_module` (as torchtitan applies it), the
deepwell ops running each rank's shard through their sharding rules (ops/sharding.py).

Per block: attention.wq/wk/wv and feed_forward.w1/w3 column-parallel (weight rows split, the input
replicated, each rank's output a slice of the features: its own heads, its own hidden units),
attention.wo and feed_forward.w2 row-parallel (weight columns split, the partial outputs summed by
an all-reduce). Two all-reduces per block forward and two in the backward. The attention module
then computes `heads / tensor` local heads (its `heads` attribute is set as torchtitan sets
`n_heads`). Without sequence parallelism everything outside the blocks (embeddings, final norm,
LM head) and the blocks' norms stay whole on every rank: they see the same replicated
activations, so their gradients agree.

Sequence parallelism (`sequence=True`: autoplan's `sequence_parallel=True`, Megatron's
`--sequence-parallel`, torchtitan's layout): the residual stream, the norms and their
activations are split along the sequence (dim 1) over the tensor ranks, so each rank keeps
1/tensor of them. The embedding is vocabulary-parallel (its rows split, each rank's partial
embedding reduce-scattered along the sequence), each block's attention and feed-forward inputs
are all-gathered along the sequence before their column-parallel layers, the row-parallel
outputs reduce-scattered back (the all-reduce split in its two halves), and the LM head is
column-parallel over the vocabulary (its logits gathered whole: no loss parallelism). The model's
top level must have LLaMA's names too (`TOP`); tied embeddings are refused.

Not done: loss parallelism, FP8 all-gathers under tensor parallelism, and any block layout other
than LLaMA's names (MoE blocks included): those raise `RuntimeError`.
"""

from __future__ import annotations

import contextlib

import torch

from ..core import recipes

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

#: Sequence parallelism's top-level modules (deepwell.models.llama, Meta's names) and the blocks' norms.
TOP = {"tok_embeddings": torch.nn.Embedding, "norm": torch.nn.Module, "output": torch.nn.Linear}
NORMS = ("attention_norm", "ffn_norm")

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


def check(model: torch.nn.Module, tensor: int, recipe_of: dict[str, str], sequence: bool = False) -> None:
    """Raises unless every block can be split `tensor` ways exactly: LLaMA-shaped, heads and
    features divisible by `tensor`, and each shard boundary on a block of its site's recipe
    (`recipe_of`: site name -> recipe; a site not there runs bf16). Why the blocks: a shard holding
    whole quantization blocks quantizes them exactly as one process does (ops/sharding.py). With
    `sequence`, also the top level (`TOP`, untied, vocabulary divisible by `tensor`) and the
    blocks' norms (`NORMS`); the sequence length is checked per call (`check_sequence`)."""
    if sequence:
        _check_top(model, tensor)
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
        for norm in NORMS if sequence else ():
            if not isinstance(getattr(block, norm, None), torch.nn.Module):
                _fail(f"with sequence parallelism applies to {_WHAT} with norms {NORMS}; {where} has no {norm!r}")
        heads = getattr(block.attention, "heads", None)
        if not isinstance(heads, int):
            _fail(f"of degree {tensor} applies to {_WHAT}; {where}'s attention has no integer 'heads' attribute")
        if heads % tensor:
            _fail(f"of degree {tensor} cannot split {name}.attention's {heads} heads evenly")


def _check_top(model: torch.nn.Module, tensor: int) -> None:
    for name, kind in TOP.items():
        if not isinstance(getattr(model, name, None), kind):
            _fail(f"with sequence parallelism needs the model's {name!r} ({kind.__name__}, LLaMA's names: "
                  f"{', '.join(TOP)}); {type(model).__name__} has none: use sequence_parallel=False")
    if model.output.weight is model.tok_embeddings.weight:
        _fail("with sequence parallelism does not split tied embeddings (the vocabulary-parallel embedding and "
              "LM head would split one weight two ways): untie them or use sequence_parallel=False")
    vocab = model.tok_embeddings.num_embeddings
    if vocab % tensor:
        _fail(f"with sequence parallelism of degree {tensor} cannot split the vocabulary of {vocab} evenly")


def check_sequence_degrees(data: int, tensor: int) -> None:
    """Sequence parallelism runs with a data degree of 1 only: with FSDP2 over a 2-D mesh the
    compiled 4-process gloo run of tests/distributed/_fsdp_worker.py failed (DTensor's vocabulary-parallel
    embedding: "Mixing fake modes NYI" in its mask buffer under torch.compile, torch 2.15) or, with
    the embedding kept whole, did not finish in 10 minutes: not understood, so refused."""
    if data > 1:
        _fail(f"with sequence parallelism runs without data parallelism for now (the plan has data {data} x "
              f"tensor {tensor}): use sequence_parallel=False, or as many processes as the tensor degree")


def check_sequence(length: int, tensor: int) -> None:
    """Raises unless a sequence of `length` splits evenly over `tensor` ranks (each must hold the
    same share: the reduce-scatters' chunks)."""
    if length % tensor:
        _fail(f"with sequence parallelism of degree {tensor} cannot split a sequence of {length} tokens evenly")


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


@contextlib.contextmanager
def local_sequence(model: torch.nn.Module, tensor: int):
    """One rank's activations under sequence parallelism, on plain tensors (what plan/memory.py
    traces): the embedding's output cut to 1/tensor of the sequence (the reduce-scatter), the
    attention's, the feed-forward's and the LM head's inputs repeated `tensor` times along it (the
    all-gathers: their memory, not their values), the row-parallel outputs cut again."""
    def cut(module, args, out):
        return out.narrow(1, 0, out.shape[1] // tensor).clone()

    def gather(module, args):
        return (torch.cat([args[0]] * tensor, dim=1), *args[1:])

    handles = [model.tok_embeddings.register_forward_hook(cut), model.output.register_forward_pre_hook(gather)]
    for _, block in named_blocks(model):
        handles += [block.attention.register_forward_pre_hook(gather), block.feed_forward.register_forward_pre_hook(gather)]
        handles += [block.get_submodule(rel).register_forward_hook(cut) for rel, s in LAYOUT.items() if s == "rowwise"]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def apply(model: torch.nn.Module, mesh, tensor: int, sequence: bool = False) -> None:
    """Splits every block over the 1-D "tensor" `mesh` (in place; `check` first); with `sequence`,
    the residual stream along the sequence too (the module docs)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if sequence:
        parallelize_module(model, mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
        model.register_forward_pre_hook(_check_sequence_of(tensor))
    for _, block in named_blocks(model):
        styles = {rel: ColwiseParallel() if s == "colwise" else RowwiseParallel() for rel, s in LAYOUT.items()}
        if sequence:
            # Row-parallel outputs reduce-scattered along the sequence; the norms' inputs and outputs
            # stay split; attention (x, cos, sin) and the feed-forward gather x whole first.
            styles.update({rel: RowwiseParallel(output_layouts=Shard(1)) for rel, s in LAYOUT.items() if s == "rowwise"})
            styles.update({norm: SequenceParallel() for norm in NORMS})
            styles["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                     desired_input_layouts=(Replicate(), None, None))
            styles["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, mesh, styles)
        # wq/wk/wv now give this rank's slice of the features: its heads / tensor heads, whole.
        block.attention.heads //= tensor


def _check_sequence_of(tensor: int):
    def hook(module, args):
        tokens = args[0] if args else None
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2:
            check_sequence(tokens.shape[1], tensor)

    return hook
