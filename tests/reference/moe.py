"""Float64 model of a Mixture-of-Experts layer (docs/DESIGN.md "MoE", which cites each router's
source), written independently of rust/core/src/moe: routing with numpy sorts (ties by
(score descending, expert index ascending)), then the SwiGLU experts token by token group in torch
float64 (so the tests take its autograd as the reference gradient).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _order(values: np.ndarray) -> np.ndarray:
    """Indices by value descending, then index ascending (-inf last; no NaN in these tests)."""
    return np.lexsort((np.arange(len(values)), -values))


def scores(logits: np.ndarray, score_func: str) -> np.ndarray:
    l = np.asarray(logits, dtype=np.float64)
    if score_func == "softmax":
        e = np.exp(l - l.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    return 1.0 / (1.0 + np.exp(-l))


def route(logits, bias=None, top_k=2, score_func="softmax", n_group=0, topk_group=0, capacity_factor=None):
    """(experts (T, K), dropped (T, K), counts (E,), lb_counts (E,)) as int64/bool numpy arrays."""
    s = scores(logits, score_func)
    t, e = s.shape
    choice = s + (0.0 if bias is None else np.asarray(bias, dtype=np.float64))
    experts = np.zeros((t, top_k), dtype=np.int64)
    lb = np.zeros(e, dtype=np.int64)
    for i in range(t):
        c = choice[i].copy()
        if n_group:
            size = e // n_group
            group_score = np.array([np.sort(c[g * size:(g + 1) * size])[-2:].sum() for g in range(n_group)])
            keep = set(_order(group_score)[:topk_group].tolist())
            for g in range(n_group):
                if g not in keep:
                    c[g * size:(g + 1) * size] = -np.inf
        experts[i] = _order(c)[:top_k]
        lb[_order(s[i])[:top_k]] += 1
    dropped = np.zeros((t, top_k), dtype=bool)
    counts = np.zeros(e, dtype=np.int64)
    cap = None if not capacity_factor else math.ceil(t * top_k / e * capacity_factor)
    for slot, x in enumerate(experts.reshape(-1)):
        if cap is not None and counts[x] >= cap:
            dropped.reshape(-1)[slot] = True
        else:
            counts[x] += 1
    return experts, dropped, counts, lb


def moe_forward(x, gate_w, gate_up, down, *, top_k, score_func="softmax", renormalize=True, route_scale=1.0,
                n_group=0, topk_group=0, capacity_factor=None, expert_bias=None, shared=None, shared_gate=None):
    """y (T, D) for x (T, D) in float64 (torch, differentiable); `shared` = (gate_proj, up_proj,
    down_proj) weights of the shared SwiGLU, `shared_gate` its (1, D) sigmoid gate. Also returns the
    routing (experts, dropped)."""
    logits = x @ gate_w.T
    bias = None if expert_bias is None else expert_bias.double().numpy()
    experts, dropped, _, _ = route(logits.detach().numpy(), bias, top_k, score_func, n_group, topk_group, capacity_factor)
    s = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    idx = torch.from_numpy(experts)
    w = s.gather(1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = (w * route_scale).masked_fill(torch.from_numpy(dropped), 0.0)
    y = torch.zeros_like(x)
    f = down.shape[2]
    for e in range(gate_up.shape[0]):
        tok, slot = np.nonzero((experts == e) & ~dropped)
        if len(tok) == 0:
            continue
        tok_t = torch.from_numpy(tok)
        h = x[tok_t] @ gate_up[e].T
        a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
        y = y.index_add(0, tok_t, w[tok_t, torch.from_numpy(slot)].unsqueeze(-1) * (a @ down[e].T))
    if shared is not None:
        g, u, d = shared
        sh = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
        if shared_gate is not None:
            sh = torch.sigmoid(x @ shared_gate.T) * sh
        y = y + sh
    return y, experts, dropped


def switch_aux_loss(logits, score_func, top_k) -> float:
    """E · Σ_e f_e · P_e, f from a plain top-K of the scores, P the mean scores normalised over E."""
    s = scores(logits, score_func)
    p = s / s.sum(-1, keepdims=True)
    t, e = s.shape
    f = np.zeros(e)
    for i in range(t):
        f[_order(s[i])[:top_k]] += 1
    return float(e * (f / (t * top_k) * p.mean(0)).sum())


def z_loss(logits) -> float:
    l = np.asarray(logits, dtype=np.float64)
    m = l.max(-1)
    lse = m + np.log(np.exp(l - m[:, None]).sum(-1))
    return float((lse**2).mean())
