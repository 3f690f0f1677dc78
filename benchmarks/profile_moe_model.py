"""The d=1024 Mixtral-style model step of bench_moe.py (4 layers, 8 experts, top-2, 8x2048 tokens,
AdamW fused) under deepwell.optimize: precision auto, bf16, auto again, each timed over 10 steps;
for auto also with deepwell's direct cuBLASLt path switched off (through aten::_scaled_mm_v2), then
its kernels by total CUDA time over 2 profiled steps, and the dense plan. Needs transformers.

    python benchmarks/profile_moe_model.py
"""

import time

import torch
import transformers

import deepwell
import deepwell.compiler.backend
from deepwell import _native

CONFIG = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
              max_position_embeddings=4096)


def ms_per_step(step, steps: int = 10) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def run(precision: str, tokens: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG)).to("cuda", torch.bfloat16).train()
    compiled = deepwell.optimize(model, precision=precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        compiled(tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    print(f"{precision}: {ms_per_step(step):.1f} ms/step", flush=True)
    if precision != "auto":
        return
    _native.call("direct_cublaslt", {"enable": False})
    print(f"  auto, direct cuBLASLt off: {ms_per_step(step):.1f} ms/step", flush=True)
    _native.call("direct_cublaslt", {"enable": True})
    activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    print(deepwell.last_plan())


def main() -> None:
    deepwell.compiler.backend.ensure_registered()
    tokens = torch.randint(0, 32000, (8, 2048), device="cuda")
    for precision in ("auto", "bf16", "auto"):
        run(precision, tokens)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
