"""A training step (forward, backward, AdamW) of a small transformer built on `torch.nn.MultiheadAttention`,
called the common way (`out, _ = attn(h, h, h, attn_mask=causal, is_causal=True)`: need_weights left at its
default, True), side by side in one process: eager PyTorch, `torch.compile` (Inductor, bf16), and
`deepwell.optimize`, which swaps every nn.MultiheadAttention for deepwell.nn.DeepwellMultiheadAttention
(scaled_dot_product_attention instead of the explicit (B·H, T, T) softmax that need_weights=True
forces; docs/OPS.md "Attention"). `deepwell.optimize(precision="bf16")` shows the attention swap's
gain alone (every GEMM in bf16, as the baseline's); `deepwell.optimize` (precision auto: FP8 GEMMs on
sm_90) adds the GEMMs' gain; `torch.compile + swap_attention` is the swap under plain Inductor.

Every variant starts from the same weights (seed 0) and first trains `--parity-steps` steps on the same
batches (arithmetic token sequences a + b·t mod V, learnable through attention), printing the loss after
them (parity: within bf16 rounding of torch.compile's); then the steps are timed in `--rounds` rounds,
each round timing every variant once, starting one variant later (clocks drift over a run), each time
the median of `--reps` windows of `--steps` back-to-back steps between CUDA events after warm-up.
Target: deepwell.optimize(precision="bf16") >= 1.5x torch.compile bf16 at T=2048.

Model (defaults): 4 pre-norm layers, d=1024, 16 heads, GELU MLP 4d, vocab 8192, batch 4 x T=2048, bf16
parameters, AdamW (fused on CUDA). `--quick`: fewer steps and rounds. On a machine without CUDA (a smoke
test) it runs a tiny model (2 layers, d=64, 4 heads, T=128, batch 2) with wall-clock timing.

    python benchmarks/bench_attention.py [--quick] [--seq 2048] [--batch 4] [--layers 4] [--dim 1024] [--heads 16]
        [--vocab 8192] [--variants eager,compile,compile+swap,deepwell-bf16,deepwell] [--no-causal-hint]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import deepwell
import deepwell.compiler.backend
from _common import environment, header, time_ms, write_json

VARIANTS = {
    "eager": "eager bf16 (nn.MHA)",
    "compile": "torch.compile bf16 (nn.MHA)",
    "compile+swap": "torch.compile + swap_attention",
    "deepwell-bf16": "deepwell.optimize bf16",
    "deepwell": "deepwell.optimize auto",
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int, causal_hint: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.causal_hint = causal_hint

    def forward(self, x):
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        # need_weights left at its default (True), the weights ignored: the usual call.
        out, _ = self.attn(h, h, h, attn_mask=causal, is_causal=self.causal_hint)
        x = x + out
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, causal_hint: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, causal_hint) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def batches(n: int, batch: int, seq: int, vocab: int, device: str) -> list[torch.Tensor]:
    """Arithmetic sequences a + b·t (mod vocab), a and b random per row: the next token follows from
    the previous two, so the loss falls as attention learns b."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        a = torch.randint(0, vocab, (batch, 1), generator=g)
        b = torch.randint(1, 17, (batch, 1), generator=g)
        out.append(((a + b * torch.arange(seq + 1)) % vocab).to(device))
    return out


def cpu_time_ms(fn, warmup: int, iters: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return sorted(samples)[len(samples) // 2]


def build(variant: str, args, device: str):
    torch.manual_seed(0)
    model = LM(args.vocab, args.dim, args.heads, args.layers, not args.no_causal_hint).to(device, torch.bfloat16).train()
    if variant == "eager":
        run = model
    elif variant == "compile":
        run = torch.compile(model)
    elif variant == "compile+swap":
        deepwell.swap_attention(model)
        run = torch.compile(model)
    else:
        run = deepwell.optimize(model, precision="bf16" if variant == "deepwell-bf16" else None)
    swapped = sum(isinstance(m, deepwell.DeepwellMultiheadAttention) for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device == "cuda")
    return model, run, opt, swapped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    p.add_argument("--seq", type=int, default=None, help="T (default 2048; 128 on CPU)")
    p.add_argument("--batch", type=int, default=None, help="default 4; 2 on CPU")
    p.add_argument("--layers", type=int, default=None, help="default 4; 2 on CPU")
    p.add_argument("--dim", type=int, default=None, help="default 1024; 64 on CPU")
    p.add_argument("--heads", type=int, default=None, help="default 16; 4 on CPU")
    p.add_argument("--vocab", type=int, default=None, help="default 8192; 256 on CPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--no-causal-hint", action="store_true",
                   help="call the attention with the causal attn_mask alone (SDPA then reads the mask)")
    p.add_argument("--parity-steps", type=int, default=None, help="training steps before the loss is compared (default 20)")
    p.add_argument("--steps", type=int, default=None, help="steps per timing window (default 10)")
    p.add_argument("--reps", type=int, default=None, help="timing windows per round (default 3)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 3)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    for name, big, small in (("seq", 2048, 128), ("batch", 4, 2), ("layers", 4, 2), ("dim", 1024, 64), ("heads", 16, 4),
                             ("vocab", 8192, 256)):
        if getattr(args, name) is None:
            setattr(args, name, big if gpu else small)
    defaults = dict(parity_steps=(5, 20), steps=(3, 10), reps=(1, 3), rounds=(1, 3))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    deepwell.compiler.backend.ensure_registered()  # (an installed deepwell registers it by entry point)
    env = environment(device)
    header(f"bench_attention: {args.layers}-layer nn.MultiheadAttention transformer, d={args.dim}, {args.heads} heads, "
           f"batch {args.batch} x T={args.seq}, vocab {args.vocab}, bf16, train step (fwd+bwd+AdamW)", env)

    data = batches(args.parity_steps, args.batch, args.seq, args.vocab, device)
    variants = [v for v in args.variants.split(",") if v]
    runs, rows = {}, []
    for v in variants:
        torch._dynamo.reset()  # each compiled variant compiles its own graphs, none reused
        if gpu:
            torch.cuda.synchronize()
            base_alloc = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        model, run, opt, swapped = build(v, args, device)

        def train_step(batch, run=run, opt=opt):
            loss = run(batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        t0 = time.perf_counter()
        losses = [train_step(b).item() for b in data]
        first = time.perf_counter() - t0  # the parity steps, compilation included
        peak = (torch.cuda.max_memory_allocated() - base_alloc) / 2**30 if gpu else float("nan")
        runs[v] = dict(step=lambda step=train_step, b=data[-1]: step(b), times=[], losses=losses, swapped=swapped,
                       first_s=first, peak_gib=peak)
        print(f"  {VARIANTS[v]:>32}: loss {losses[0]:.4f} -> {losses[-1]:.4f} after {len(losses)} steps, "
              f"{swapped} attention modules swapped, parity steps {first:.1f} s (compile included)"
              + (f", peak {peak:.2f} GiB" if gpu else ""))

    for turn in range(args.rounds):
        order = variants[turn % len(variants):] + variants[:turn % len(variants)]
        for v in order:
            if gpu:
                ms = time_ms(runs[v]["step"], warmup=2, iters=args.steps, reps=args.reps)
            else:
                ms = cpu_time_ms(runs[v]["step"], warmup=1, iters=args.steps, reps=args.reps)
            runs[v]["times"].append(ms)

    ref = "compile" if "compile" in runs else variants[0]
    tokens = args.batch * args.seq
    med = {v: sorted(r["times"])[len(r["times"]) // 2] for v, r in runs.items()}
    print(f"{'variant':>32} {'step ms':>9} {'ktok/s':>9} {'vs ' + ref:>12} {'vs eager':>9} {'final loss':>11} {'Δloss vs ' + ref:>16}")
    for v, r in runs.items():
        vs_ref = med[ref] / med[v]
        vs_eager = med["eager"] / med[v] if "eager" in med else float("nan")
        dloss = r["losses"][-1] - runs[ref]["losses"][-1]
        print(f"{VARIANTS[v]:>32} {med[v]:9.2f} {tokens / med[v]:9.1f} {vs_ref:11.2f}x {vs_eager:8.2f}x "
              f"{r['losses'][-1]:11.4f} {dloss:+16.4f}")
        rows.append({"variant": VARIANTS[v], "key": v, "step_ms": med[v], "round_ms": r["times"], "ktok_s": tokens / med[v],
                     "vs_" + ref: vs_ref, "vs_eager": vs_eager, "losses": r["losses"], "final_loss": r["losses"][-1],
                     "attention_swapped": r["swapped"], "first_s": r["first_s"], "peak_gib": r["peak_gib"]})
    config = {k: getattr(args, k) for k in ("seq", "batch", "layers", "dim", "heads", "vocab", "lr", "parity_steps",
                                            "steps", "reps", "rounds", "no_causal_hint")}
    print("wrote", write_json("bench_attention" + ("-quick" if args.quick else ""), env, rows, {"config": config}))


if __name__ == "__main__":
    main()
