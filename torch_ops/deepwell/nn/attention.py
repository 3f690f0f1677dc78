"""Attention modules that miss PyTorch's fast path, given it: `DeepwellMultiheadAttention`, a drop-in
for `torch.nn.MultiheadAttention` that computes with `F.scaled_dot_product_attention` unless a call
asks for the attention weights, and `swap_attention`, which puts it in place of every
`nn.MultiheadAttention` of a model and switches Hugging Face models configured with eager attention
to their SDPA implementation.

Why `nn.MultiheadAttention` is slow in training: `torch.nn.MultiheadAttention.forward` has two fast
paths. The inference one (`torch._native_multi_head_attention`) needs eval mode and no
autograd, so training never takes it (its docstring lists the conditions). The other is in
`torch.nn.functional.multi_head_attention_forward`: only under `need_weights=False` does it call
`scaled_dot_product_attention` (FlashAttention, arXiv:2205.14135, or the memory-efficient kernel,
arXiv:2112.05682); with `need_weights=True` (the default) it must return the softmax
probabilities, so it builds them explicitly: `baddbmm(mask, q·d^-1/2, kᵀ)`, `softmax`, `bmm` with v,
materialising (batch·heads, L, S) scores in the forward and again in the backward, and ignoring the
`is_causal` hint. Most callers never read the weights they are handed (`out, _ = attn(x, x, x)`),
and nothing can tell whether a caller will.

The one behavioural difference of the drop-in, therefore: a call that does not pass
`need_weights` gets `(output, None)`, as if it had passed `need_weights=False`; a call that passes
`need_weights=True` explicitly gets the exact weights through torch's explicit path, and
`deepwell.optimize(..., keep_attention_weights=True)` swaps nothing. The computation is torch's own
`need_weights=False` branch (the drop-in calls `nn.MultiheadAttention.forward` with it), so every
option of the module behaves as torch defines it there: batch_first either way, unbatched input,
key_padding_mask and attn_mask (bool: True = masked out, or float: added; torch turns both into
SDPA's additive float mask), is_causal (with no key_padding_mask torch hands SDPA `is_causal=True`
and drops the mask, as its docs warn: the hint must be true), dropout (SDPA's, in train mode only;
the same distribution as the explicit path's dropout of the weights, other random draws),
add_bias_kv, add_zero_attn, kdim/vdim. With a key_padding_mask, torch merges the masks into one float
mask of (batch·heads, 1 or L, S) and SDPA takes its memory-efficient kernel (FlashAttention reads
no mask)."""

from __future__ import annotations

import dataclasses

from torch import nn

#: What the reports call the one behavioural difference.
NEED_WEIGHTS_NOTE = ("returns (output, None) unless a call passes need_weights=True; "
                     "deepwell.optimize(keep_attention_weights=True) keeps the weights everywhere")


class DeepwellMultiheadAttention(nn.MultiheadAttention):
    """`torch.nn.MultiheadAttention` (same constructor, parameters and state_dict keys: either
    module's weights load into the other unchanged) whose attention runs in
    `F.scaled_dot_product_attention` unless a call explicitly passes `need_weights=True`.

    The behavioural difference: `need_weights` defaults to None here, meaning False: such a call
    returns `(output, None)` where `nn.MultiheadAttention` would return the attention weights
    too. `need_weights=True` passed explicitly takes torch's explicit path and returns them (averaged
    over heads unless `average_attn_weights=False`), exactly as `nn.MultiheadAttention` does."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=None, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        # torch's own need_weights=False branch (F.multi_head_attention_forward): the masks, the
        # causal hint, dropout and the rare options (bias_kv, zero_attn, kdim/vdim) as torch
        # defines them, with scaled_dot_product_attention in place of the explicit softmax.
        return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                               need_weights=bool(need_weights), attn_mask=attn_mask,
                               average_attn_weights=average_attn_weights, is_causal=is_causal)

    @classmethod
    def from_module(cls, mha: nn.MultiheadAttention) -> DeepwellMultiheadAttention:
        """The drop-in for `mha`, sharing its parameters (the same `Parameter` objects, so an
        optimizer built before the swap still updates them, and `mha`'s state_dict is this one's)
        and its `out_proj` submodule; training mode copied. Hooks registered on `mha` itself are
        not carried over."""
        new = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
                  add_bias_kv=mha.bias_k is not None, add_zero_attn=mha.add_zero_attn, kdim=mha.kdim,
                  vdim=mha.vdim, batch_first=mha.batch_first, device="meta")
        for name, p in mha.named_parameters(recurse=False):
            setattr(new, name, p)
        new.out_proj = mha.out_proj
        return new.train(mha.training)


def unswappable(module: nn.Module) -> str | None:
    """Why `module` (an `nn.MultiheadAttention`) is not replaced, or None when it is."""
    if isinstance(module, DeepwellMultiheadAttention):
        return "already a DeepwellMultiheadAttention"
    if type(module).forward is not nn.MultiheadAttention.forward:
        # A subclass with its own forward may read the weights or change the maths: its
        # semantics are its author's, not nn.MultiheadAttention's.
        return f"{type(module).__name__} overrides nn.MultiheadAttention.forward"
    return None


def _hf_attention(module: nn.Module) -> str | None:
    """The attention implementation a Hugging Face `PreTrainedModel` is configured with, or None for
    any other module (duck-typed: deepwell does not import transformers)."""
    config = getattr(module, "config", None)
    if not callable(getattr(module, "set_attn_implementation", None)) or config is None:
        return None
    return getattr(config, "_attn_implementation", None)


def _hf_unswitchable(model: nn.Module) -> str | None:
    """Why an eager Hugging Face model is not switched to SDPA, or None when it can be."""
    if not getattr(model, "_supports_sdpa", False):
        return f"{type(model).__name__} has no SDPA attention in transformers (_supports_sdpa is False)"
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        return f"{type(model).__name__} cannot change its attention implementation after construction"
    return None


@dataclasses.dataclass
class AttentionReport:
    """What `swap_attention` did to a model, read back from the model (`attention_report`)."""

    swapped: list[str]          # nn.MultiheadAttention replaced by DeepwellMultiheadAttention
    switched: list[str]         # Hugging Face models switched from eager attention to "sdpa"
    kept: dict[str, str]        # name -> why it still computes attention explicitly

    def lines(self) -> list[str]:
        out = []
        if self.swapped:
            out.append(f"{len(self.swapped)} nn.MultiheadAttention -> deepwell.nn.DeepwellMultiheadAttention "
                       f"(SDPA; {NEED_WEIGHTS_NOTE})")
        if self.switched:
            names = ", ".join(n or "<model>" for n in self.switched)
            out.append(f"{len(self.switched)} Hugging Face model(s) switched from eager attention to sdpa "
                       f"({names}; output_attentions=True then returns no weights)")
        for name, why in self.kept.items():
            out.append(f"kept {name or '<model>'}: {why}")
        return out


def swap_attention(model: nn.Module, keep_attention_weights: bool = False) -> int:
    """Replaces, in place, every `nn.MultiheadAttention` inside `model` (and `model` itself is left
    alone: replace a bare module with `DeepwellMultiheadAttention.from_module`) by its
    `DeepwellMultiheadAttention` (parameters shared), and switches every Hugging Face model in it
    configured with eager attention to "sdpa" (`set_attn_implementation`, where transformers
    supports SDPA for it). Returns how many modules were changed; `attention_report` says which, and
    why the others were kept. With `keep_attention_weights`, changes nothing."""
    if keep_attention_weights:
        return 0
    changed = 0
    for name, module in list(model.named_modules()):
        if _hf_attention(module) == "eager" and _hf_unswitchable(module) is None:
            module.set_attn_implementation("sdpa")
            if _hf_attention(module) == "sdpa":
                module._deepwell_attention_was = "eager"  # for attention_report; not in the state_dict
                changed += 1
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.MultiheadAttention) and unswappable(child) is None:
                setattr(module, child_name, DeepwellMultiheadAttention.from_module(child))
                changed += 1
    return changed


def attention_report(model: nn.Module, keep_attention_weights: bool = False) -> AttentionReport:
    """The attention modules of `model` after `swap_attention(model, keep_attention_weights)`."""
    report = AttentionReport([], [], {})
    hf_inner = set()  # a PreTrainedModel inside another one (LlamaModel in LlamaForCausalLM) shares its verdict
    for name, module in model.named_modules():
        if isinstance(module, DeepwellMultiheadAttention):
            report.swapped.append(name)
        elif isinstance(module, nn.MultiheadAttention):
            report.kept[name] = ("keep_attention_weights=True" if keep_attention_weights
                                 else unswappable(module) or "not swapped")
        impl = _hf_attention(module)
        if impl is None or any(name.startswith(outer + ".") or outer == "" for outer in hf_inner):
            continue
        hf_inner.add(name)
        if getattr(module, "_deepwell_attention_was", None) == "eager":
            report.switched.append(name)
        elif impl == "eager":
            report.kept[name] = ("Hugging Face eager attention, keep_attention_weights=True" if keep_attention_weights
                                 else f"Hugging Face eager attention: {_hf_unswitchable(module) or 'not switched'}")
    return report
