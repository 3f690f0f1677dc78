"""A small LLaMA-style decoder (the main job's demo, the compile-backend tests, the train-step
benchmark): RMSNorm, rotary attention through SDPA, SwiGLU MLP, tied or untied LM head. Names follow Meta's reference
code (tok_embeddings, layers.N.attention.wq/wk/wv/wo, layers.N.feed_forward.w1/w2/w3, norm, output)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary(x, cos, sin):
    """Rotates pairs (x[..., :d/2], x[..., d/2:]) by the position's angles."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # -1, not d: under tensor parallelism (distributed/tensor_parallel.py) this rank holds heads / tensor
        # of the heads, and wo (row-parallel) takes their d / tensor features.
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int, max_seq: int = 4096, tied: bool = False):
        super().__init__()
        #: The constructor's arguments: what deepwell.export records to rebuild the model on load.
        self.config = {"vocab": vocab, "dim": dim, "layers": layers, "heads": heads, "hidden": hidden, "max_seq": max_seq, "tied": tied}
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight
        half = dim // heads // 2
        freqs = 1.0 / (10000.0 ** (torch.arange(half).float() / half))
        angles = torch.outer(torch.arange(max_seq).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tok_embeddings(tokens)
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))
