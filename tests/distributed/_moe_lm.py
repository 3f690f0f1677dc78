"""The small MoE language model the distributed MoE tests train (tests/distributed/_moe_dp_worker.py,
tests/distributed/_moe_ep_train_worker.py): embedding, blocks of RMSNorm + deepwell.DeepwellMoE (residual),
final norm, LM head, under LLaMA's top-level names (tok_embeddings, layers, norm, output), which
FSDP's units follow."""

from __future__ import annotations

from torch import nn

import deepwell
from deepwell.models.llama import RMSNorm


class Block(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, **moe):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.moe = deepwell.DeepwellMoE(dim, dim, experts, top_k=top_k, **moe)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class MoELM(nn.Module):
    """`layers` blocks of width `dim` over a `vocab`-token embedding; `moe`: DeepwellMoE options."""

    def __init__(self, vocab: int, dim: int, layers: int, experts: int, top_k: int, **moe):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, experts, top_k, **moe) for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))
