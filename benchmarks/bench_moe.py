"""One MoE layer's forward + backward, side by side, on the GPU: the Hugging Face eager expert loop,
Hugging Face's `torch._grouped_mm` path, and deepwell.DeepwellMoE in bf16 and fp8_block (and the
emulated recipes with --all-recipes), and fp8_block once more with the experts' FP8 weights from the
weight cache (`deepwell.microbatches()`: what micro-batches after the first of a gradient-accumulation
step pay; timed alone, after the others); then the grouped GEMMs alone in TFLOP/s, the router ops, and
(with transformers installed) Mixtral-style models' training steps vs torch.compile bf16.

Shapes (tokens T = 8192 by default, bf16):
- Mixtral: E=8, D=4096, F=14336, top-2;
- fine-grained: E=64, D=2048, F=1408, top-8 and E=128, D=2048, F=768, top-8.

Every layer variant computes the same thing (softmax router, renormalised top-k, SwiGLU experts);
the routing is balanced-random (router weights N(0, 1/D)). Targets: deepwell bf16 >= 3x
the HF loop at fine-grained shapes; fp8_block >= 1.3x deepwell bf16 at Mixtral shapes; an fp8
grouped GEMM at E64/K2048/N1408 >= 900 TFLOP/s; the model's train step >= 1.3x torch.compile bf16.
Anchors (the team's H100 measurements of others' kernels): torch bf16 grouped 541-704 TFLOP/s, fp8 rowwise grouped 307 at E64.

    python benchmarks/bench_moe.py [--quick] [--tokens 8192] [--all-recipes] [--no-model] [--sections layer,gemm,router,model]
"""

from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F

import deepwell
import deepwell.compiler.backend
from _common import environment, first_call_s, header, time_ms, write_json

ops = torch.ops.deepwell
SHAPES = [("mixtral", 8, 4096, 14336, 2), ("fine-e64", 64, 2048, 1408, 8), ("fine-e128", 128, 2048, 768, 8)]


def router(x, gate_w, top_k):
    logits = F.linear(x, gate_w)
    p = logits.float().softmax(-1)
    w, idx = p.topk(top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)), idx


def hf_eager_loop(x, gate_w, gate_up, down, top_k):
    """transformers 5's MixtralExperts eager forward (modeling_mixtral.py), verbatim in substance."""
    w, idx = router(x, gate_w, top_k)
    e = gate_up.shape[0]
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(idx, num_classes=e + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for ex in hit:
        ex = ex[0]
        if ex == e:
            continue
        pos, tok = torch.where(mask[ex])
        g, u = F.linear(x[tok], gate_up[ex]).chunk(2, dim=-1)
        h = F.linear(F.silu(g) * u, down[ex]) * w[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


def hf_grouped_mm(x, gate_w, gate_up, down, top_k):
    """transformers 5's `grouped_mm` experts implementation (`transformers.integrations.moe`), without EP."""
    w, idx = router(x, gate_w, top_k)
    e = gate_up.shape[0]
    ids = idx.reshape(-1)
    ids_g, perm = torch.sort(ids)
    xg = x[perm // top_k]
    counts = torch.histc(ids_g.int(), bins=e, min=0, max=e - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    g, u = torch._grouped_mm(xg, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    h = torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs)
    h = h * w.reshape(-1)[perm, None]
    out = torch.zeros_like(x)
    out.index_add_(0, perm // top_k, h.to(out.dtype))
    return out


def step(fn, x, params, dy):
    y = fn(x)
    return torch.autograd.grad(y, (x, *params), dy)


ROUNDS = 5  # timing rounds per layer shape (layer_rows)


def layer_rows(name, e, d, f, k, tokens, recipes_) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, d, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(tokens, d, device="cuda", generator=g).bfloat16()
    moe = deepwell.DeepwellMoE(d, f, e, k, aux_loss=None, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe.gate.weight.normal_(0, d**-0.5)
    params = (moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj)
    flops = 3 * 2 * tokens * k * (d * 2 * f + f * d)  # fwd + dgrad + wgrad of both expert GEMMs
    variants = [
        ("hf eager loop", lambda x: hf_eager_loop(x, *params, k)),
        ("hf grouped_mm", lambda x: hf_grouped_mm(x, *params, k)),
    ]
    for r in recipes_:
        m = deepwell.DeepwellMoE(d, f, e, k, aux_loss=None, recipe=r, device="cuda", dtype=torch.bfloat16)
        m.load_state_dict(moe.state_dict())
        variants.append((f"deepwell {r}", m))
    def params_of(fn):
        if isinstance(fn, torch.nn.Module):
            return fn.gate.weight, fn.experts.gate_up_proj, fn.experts.down_proj
        return params

    # Round-robin timing: each round times every variant once, the median of the rounds is kept. Timed
    # one after the other instead, a variant's place in the order moved it by up to 8% (the same
    # fp8_block plan measured 27.3 and 25.1 ms in one run). Each round starts one variant
    # later, so each variant takes every place once (5 rounds of the 5 default variants): in a fixed
    # order, auto (the fp8_block plan at Mixtral, always timed right after fp8_block) read 0.6-1.3 ms
    # slower than fp8_block in four runs on two GPU kinds.
    runs = {}
    for label, fn in variants:
        try:
            time_ms(lambda: step(fn, x, params_of(fn), dy), warmup=2, iters=1, reps=1)
            runs[label] = []
        except torch.OutOfMemoryError as err:
            print(f"{name:>10} {label:>18} out of memory ({str(err)[:60]})")
        torch.cuda.empty_cache()
    timed = [(label, fn) for label, fn in variants if label in runs]
    for turn in range(ROUNDS):
        first = turn % len(timed)
        for label, fn in timed[first:] + timed[:first]:
            runs[label].append(time_ms(lambda: step(fn, x, params_of(fn), dy), warmup=1, iters=5, reps=1))
    # fp8_block with the experts' FP8 weights from the weight cache (`deepwell.microbatches()`): what
    # micro-batches 2..n of a gradient-accumulation step pay. The scope is process-wide (it would cache
    # the other variants' weights too), so this variant is timed after the round-robin, alone.
    cached = dict(variants).get("deepwell fp8_block")
    if cached is not None and "deepwell fp8_block" in runs:
        label = "fp8_block cached W"
        stats = lambda: deepwell._native.call("weight_cache_stats")  # noqa: E731
        with deepwell.microbatches():
            time_ms(lambda: step(cached, x, params_of(cached), dy), warmup=2, iters=1, reps=1)
            before = stats()
            runs[label] = [time_ms(lambda: step(cached, x, params_of(cached), dy), warmup=1, iters=5, reps=1)
                           for _ in range(ROUNDS)]
            after = stats()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        print(f"{name:>10} {label:>18} weight cache while timed: {hits} hits, {misses} misses")
        variants.append((label, cached))
    rows, base = [], {}
    for label, fn in variants:
        if label not in runs:
            continue
        ms = sorted(runs[label])[len(runs[label]) // 2]
        base[label] = ms
        vs_loop = base["hf eager loop"] / ms if "hf eager loop" in base else float("nan")
        vs_dw = base["deepwell bf16"] / ms if "deepwell bf16" in base else float("nan")
        print(f"{name:>10} {label:>18} {ms:9.3f} {tokens / ms / 1e3:10.1f} {flops / ms / 1e9:8.0f} {vs_loop:8.2f} {vs_dw:9.2f}")
        rows.append({"shape": name, "experts": e, "dim": d, "ffn": f, "top_k": k, "tokens": tokens, "variant": label,
                     "step_ms": ms, "mtok_s": tokens / ms / 1e3, "tflops": flops / ms / 1e9, "vs_hf_loop": vs_loop,
                     "vs_deepwell_bf16": vs_dw, "planned": getattr(fn, "_planned", None)})
        if label == "deepwell auto":
            print(f"{'':>10} {'':>18} (auto planned gate_up {fn._planned[0]}, down {fn._planned[1]})")
    return rows


def gemm_rows(e, k_dim, n, rows_per_expert) -> list[dict]:
    """The grouped GEMM alone (fprop shape: (E·m) x K times E x (N, K)) in every implementation at hand."""
    m = rows_per_expert * e
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, k_dim, device="cuda", generator=g).bfloat16()
    w = (torch.randn(e, n, k_dim, device="cuda", generator=g) / k_dim**0.5).bfloat16()
    off = torch.arange(0, m + 1, rows_per_expert, device="cuda", dtype=torch.int32)
    flops = 2 * m * n * k_dim
    out = []

    def row(label, fn, note=""):
        try:
            ms = time_ms(fn)
        except (RuntimeError, NotImplementedError) as err:
            print(f"{'':>4} E{e} K{k_dim} N{n} m{rows_per_expert} {label:>28}   unavailable: {str(err).splitlines()[0][:80]}")
            return
        print(f"{'':>4} E{e} K{k_dim} N{n} m{rows_per_expert} {label:>28} {ms:8.3f} ms {flops / ms / 1e9:7.0f} TFLOP/s {note}")
        out.append({"experts": e, "k": k_dim, "n": n, "rows_per_expert": rows_per_expert, "gemm": label,
                    "ms": ms, "tflops": flops / ms / 1e9})

    row("torch._grouped_mm bf16", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=off[1:]))
    row("deepwell grouped_linear bf16", lambda: deepwell.grouped_linear(x, w, off, "bf16"))
    backend = importlib.import_module("deepwell.ops.grouped_linear").backend_on("fp8_block", "cuda", True)
    row("deepwell grouped_linear fp8_block", lambda: deepwell.grouped_linear(x, w, off, "fp8_block", groups_aligned=True),
        f"({backend}, quantization included)")
    if hasattr(torch, "_scaled_grouped_mm"):
        xq = x.to(torch.float8_e4m3fn)
        wq = w.to(torch.float8_e4m3fn)
        sx = torch.ones(m, device="cuda")
        sw = torch.ones(e, n, device="cuda")
        row("torch._scaled_grouped_mm fp8 rowwise",
            lambda: torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), sx, sw, offs=off[1:], out_dtype=torch.bfloat16),
            "(pre-quantized)")
    return out


def router_rows(tokens, e, d, k) -> list[dict]:
    """The router's and the permutation's own ops: route, permutation index, and the value moves of
    dispatch (gather) and combine (weighted sum over k; its backward's per-slot dots)."""
    logits = torch.randn(tokens, e, device="cuda")
    r = ops.moe_route(logits, None, k, "softmax", 0, 0, 0.0)
    route_ms = time_ms(lambda: ops.moe_route(logits, None, k, "softmax", 0, 0, 0.0))
    perm_ms = time_ms(lambda: ops.moe_permute_index(r[0], r[1], e, 1))
    topk_ms = time_ms(lambda: logits.softmax(-1).topk(k, dim=-1))
    row_of_slot, slot_of_row, _ = ops.moe_permute_index(r[0], r[1], e, 1)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(tokens, k, device="cuda")
    rows = ops.moe_gather_rows(x, slot_of_row, None, k)
    gather_ms = time_ms(lambda: ops.moe_gather_rows(x, slot_of_row, None, k))
    sum_ms = time_ms(lambda: ops.moe_sum_slots(rows, row_of_slot, weights))
    dots_ms = time_ms(lambda: ops.moe_slot_dots(rows, row_of_slot, x))
    moved = tokens * k * d * 2 + tokens * d * 2  # K rows of D bf16 read or written, one (T, D) the other way
    print(f"    router T={tokens} E={e} K={k}: moe_route {route_ms:.3f} ms, moe_permute_index {perm_ms:.3f} ms "
          f"(torch softmax+topk {topk_ms:.3f} ms); D={d}: moe_gather_rows {gather_ms:.3f} ms, moe_sum_slots "
          f"{sum_ms:.3f} ms, moe_slot_dots {dots_ms:.3f} ms (each moves >= {moved / 1e6:.0f} MB: "
          f"{moved / sum_ms / 1e9:.2f} TB/s for the sum)")
    return [{"tokens": tokens, "experts": e, "dim": d, "top_k": k, "moe_route_ms": route_ms, "moe_permute_index_ms": perm_ms,
             "torch_softmax_topk_ms": topk_ms, "moe_gather_rows_ms": gather_ms, "moe_sum_slots_ms": sum_ms,
             "moe_slot_dots_ms": dots_ms}]


# Mixtral-style models for the training step (transformers' MixtralConfig fields): a small one, and
# Mixtral 8x7B's own layer (d=4096, F=14336, 32 heads, 8 KV heads) with 2 layers, the size where the
# layer rows above measure fp8_block's gain.
MODELS = {
    "mixtral-4L-8E-d1024": (dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=16,
                                 num_key_value_heads=8), 8),
    "mixtral-2L-8E-d4096": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                 num_attention_heads=32, num_key_value_heads=8), 4),
}


def model_rows(steps: int, models: list[str]) -> list[dict]:
    """Each Mixtral-style model (8 experts, top-2, `batch` x 2048 tokens, AdamW fused): torch.compile of
    the HF model in bf16 against deepwell.optimize (MoE blocks swapped; precision auto, and bf16 to
    show what the swap alone gives), all in one process."""
    try:
        import transformers
    except ImportError:
        print("    (transformers not installed: model step skipped)")
        return []
    out = []
    for name in models:
        shape, batch = MODELS[name]
        cfg = dict(shape, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096)
        seq = 2048
        tokens = torch.randint(0, 32000, (batch, seq), device="cuda")
        rows = []
        for label in ("torch.compile bf16 (HF)", "deepwell.optimize bf16", "deepwell.optimize auto"):
            torch.manual_seed(0)
            model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg)).to("cuda", torch.bfloat16).train()
            impl = getattr(model.config, "_experts_implementation", None)
            if label.startswith("torch"):
                compiled = torch.compile(model)
            else:
                compiled = deepwell.optimize(model, precision=label.rsplit(" ", 1)[1])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def train_step(compiled=compiled, opt=opt):
                loss = compiled(tokens, labels=tokens).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            first = first_call_s(train_step)
            ms = time_ms(train_step, warmup=2, iters=steps, reps=1)
            peak = torch.cuda.max_memory_allocated() / 2**30
            vs = rows[0]["step_ms"] / ms if rows else 1.0
            print(f"    {name} {label:>26}: {ms:8.1f} ms/step, {batch * seq / ms:8.1f} ktok/s, {vs:.2f}x, "
                  f"peak {peak:.2f} GiB, first call {first:.1f} s (HF experts_implementation={impl})")
            rows.append({"model": name, "variant": label, "step_ms": ms, "first_s": first, "peak_gib": peak,
                         "vs_torch_compile_bf16": vs, "tokens_per_step": batch * seq,
                         "experts_implementation": str(impl)})
            del model, compiled, opt
            torch.cuda.empty_cache()
        out += rows
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fine-grained E64 shape only, no model step")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--all-recipes", action="store_true", help="also mxfp8 and nvfp4 (emulated on sm_90)")
    p.add_argument("--no-model", action="store_true")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--sections", default="layer,gemm,router,model",
                   help="comma-separated subset of layer,gemm,router,model (to split a run under a time limit)")
    args = p.parse_args()
    deepwell.compiler.backend.ensure_registered()  # (an installed deepwell registers it by entry point)
    sections = set(args.sections.split(","))
    env = environment()
    header(f"bench_moe: one MoE layer forward + backward, {args.tokens} tokens, bf16", env)
    # "auto": the Rust planner's per-projection choice (policy rule 9), measured beside the fixed recipes.
    recipes_ = ["bf16", "fp8_block", "auto"] + (["mxfp8", "nvfp4"] if args.all_recipes else [])
    rows = {"layer": [], "gemm": [], "router": [], "model": []}
    if "layer" in sections:
        print(f"{'shape':>10} {'variant':>18} {'step ms':>9} {'Mtok/s':>10} {'TFLOP/s':>8} {'vs loop':>8} {'vs dw bf16':>9}")
        for name, e, d, f, k in SHAPES[1:2] if args.quick else SHAPES:
            rows["layer"] += layer_rows(name, e, d, f, k, args.tokens, recipes_)
    if "gemm" in sections:
        print("# grouped GEMMs alone (forward shape)")
        rows["gemm"] += gemm_rows(64, 2048, 1408, 1024)
        if not args.quick:
            rows["gemm"] += gemm_rows(8, 4096, 28672, 2048)
            rows["gemm"] += gemm_rows(128, 2048, 1536, 512)
    if "router" in sections:
        print("# router ops")
        for _, e, d, _, k in SHAPES:
            rows["router"] += router_rows(args.tokens, e, d, k)
    if "model" in sections and not (args.quick or args.no_model):
        print("# Mixtral-style models, training step")
        rows["model"] += model_rows(steps=5, models=args.models.split(","))
    print("wrote", write_json("bench_moe", env, [r for v in rows.values() for r in v], {"sections": list(rows)}))


if __name__ == "__main__":
    main()
