"""One MoE layer's forward + backward on N processes (torchrun + NCCL on GPUs, gloo with --quick on
the CPU), each with its own T tokens: every process holding all E experts (data parallel: no
communication inside the layer) against deepwell.expert_parallel (E / N experts each, tokens sent
to their experts' process and back by all-to-all). Per variant: ms per forward + backward (the
slowest rank's median), tokens/s over all ranks, the experts' weight memory per rank, and the peak
memory per rank (GPU). Both variants compute the same layer (tests/distributed/test_moe_ep.py).

Shapes (T tokens per rank, bf16 on GPUs): Mixtral E=8, D=4096, F=14336, top-2; fine-grained E=64,
D=2048, F=1408, top-8.

    python benchmarks/bench_moe_ep.py [--procs 2] [--tokens 8192] [--recipes bf16,fp8_block] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = [("mixtral", 8, 4096, 14336, 2), ("fine-e64", 64, 2048, 1408, 8)]
QUICK_SHAPES = [("quick", 4, 128, 128, 2)]


def _worker(args) -> None:
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.quick
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for shape in (QUICK_SHAPES if args.quick else SHAPES):
        for recipe in args.recipes.split(","):
            for variant in ("replicated", "expert_parallel"):
                rows.append(_measure(args, shape, recipe, variant, device, dtype, rank, world))
                if cuda:
                    torch.cuda.empty_cache()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _measure(args, shape, recipe: str, variant: str, device, dtype, rank: int, world: int) -> dict:
    """One layer variant's row (every rank calls it; the all-reduce makes the slowest rank's time
    everyone's)."""
    import torch.distributed as dist

    import deepwell

    name, experts, dim, ffn, top_k = shape
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    layer = deepwell.DeepwellMoE(dim, ffn, experts, top_k, recipe=recipe, device=device, dtype=dtype)
    with torch.no_grad():  # balanced-random routing, as bench_moe.py
        layer.gate.weight.normal_(0, dim ** -0.5)
    if variant == "expert_parallel":
        deepwell.expert_parallel(layer)
    g = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(args.tokens, dim, device=device, dtype=dtype, generator=g).requires_grad_()
    dy = torch.randn(args.tokens, dim, device=device, dtype=dtype, generator=g)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        layer(x).backward(dy)
    sync()
    times = []
    for _ in range(args.iters):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        layer(x).backward(dy)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)  # NCCL reduces device tensors
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return {"shape": name, "experts": experts, "dim": dim, "ffn": ffn, "top_k": top_k, "recipe": recipe,
            "variant": variant, "procs": world, "tokens_per_rank": args.tokens, "ms": ms.item(),
            "tokens_per_s": world * args.tokens / ms.item() * 1e3,
            "expert_weight_bytes_per_rank": sum(p.numel() * p.element_size() for p in layer.experts.parameters()),
            "peak_bytes_rank0": torch.cuda.max_memory_allocated(device) if cuda else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--recipes", default="bf16,fp8_block")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="a tiny layer on the CPU (gloo)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.tokens = min(args.tokens, 256)
    if args.worker:
        return _worker(args)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import environment, write_json

    env = environment("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.procs}",
               os.path.abspath(__file__), "--worker", "--out", out, "--tokens", str(args.tokens), "--recipes",
               args.recipes, "--warmup", str(args.warmup), "--iters", str(args.iters)] + ["--quick"] * args.quick
        environ = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                   "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
        if subprocess.run(cmd, env=environ).returncode != 0:
            raise RuntimeError("bench_moe_ep: a rank failed; its output is above")
        with open(out) as f:
            rows = json.load(f)
    print(f"# bench_moe_ep: {args.procs} processes, {args.tokens} tokens each; {env['device']}, torch {env['torch']}, "
          f"{env['date']}")
    print(f"{'shape':<10} {'recipe':<10} {'variant':<16} {'ms':>8} {'tokens/s':>11} {'expert GiB/rank':>16} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['shape']:<10} {r['recipe']:<10} {r['variant']:<16} {r['ms']:8.2f} {r['tokens_per_s']:11.0f} "
              f"{r['expert_weight_bytes_per_rank'] / 2**30:16.3f} {r['peak_bytes_rank0'] / 2**30:9.2f}")
    print("wrote", write_json("bench_moe_ep" + ("-quick" if args.quick else ""), env, rows))


if __name__ == "__main__":
    main()
