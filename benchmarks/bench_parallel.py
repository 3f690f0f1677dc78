"""Scale-out on one node: the same training step on 1 and 2 GPUs, with the parallel plan
deepwell.autoplan picks (FSDP2 over the data ranks; `--configs` adds tensor parallelism), through
torchrun. Per run: tokens/s, peak memory per rank against dryrun's per-rank prediction, and the loss
at every step, so 2 GPUs can be checked against 1 for the same global batch (loss parity) and for
the same per-GPU batch (weak scaling). On GPUs also the spread of step times (each step's GPU time
and, on every rank, the host's: a pause of one rank's host shows there, with what its main thread
did meanwhile: CPU time, context switches, page faults), the host's time to
launch a step and, per phase (forward, backward, optimizer), its host and GPU time and how far the
GPU trails the host (`phase_lag`: whether the host sets the pace; these probes live in _step_diagnostics.py); `--profile` adds a CPU-only
profile of FSDP2's regions on the host and the kernel time by kind. Python's garbage collection
runs as deepwell.Trainer runs it (`--gc-every`). `--collectives process_group|copy_engine` replaces
the plan's carrier of FSDP's collectives (NCCL beside 8 SMs, or the copy engines with none; the
measured peak counts the copy engines' staging buffers, which live outside torch's allocator).
`--sm-carveout N` replaces the plan's SMs for the collectives; `--backward-carveout N` gives the
backward's GEMMs another carveout than the forward's (the collectives keep the forward's CTA count). `--spans` times deepwell's own host spans over
the timed steps and prints the ops whose single longest call took longest (a pause inside an op).

A config is "<processes>x<global batch rows>[tp]": "1x4" one GPU with 4 rows of SEQ tokens, "2x8" two
processes with 4 rows each (FSDP2), "2x4tp" two processes splitting every layer (tensor parallel 2)
over the same 4 rows, "2x4sp" the same with sequence parallelism. Each config runs in its own `torchrun --standalone` (the launcher here), from
the same initial weights (seed 0) on the same batch every step.

- scaling = tokens/s of "2xB" / tokens/s of "1x(B/2)": each GPU keeps its batch (weak scaling, the
  >= 1.8x target); scaling_by_median the same from the median step times; "vs 1 GPU same batch" divides by "1xB" instead.
- parity = the largest |loss difference| over the steps between "2xB" and "1xB" (same global batch):
  FSDP2 reduces gradients in bf16 across ranks and the GEMMs see half the rows, so the last bits
  differ; it is printed next to the loss's own drop over the run, for scale.

    python benchmarks/bench_parallel.py [--model 1b|8b] [--configs 1x4,1x8,2x8] [--steps 12]
    python benchmarks/bench_parallel.py --quick --device cpu   # tiny model, gloo: checks the script

NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1): the lent
multi-GPU machines require it, and FSDP2 does not need it.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from _step_diagnostics import (USAGE_FIELDS, allocator_calls, host_regions, kernel_split, longest_spans, phase_lag,
                               step_timeline, thread_usage)

#: The lent multi-GPU machines' rule (the device tool's notes on its kinds): never use NVLink multicast.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SEQ, QUICK_SEQ = 2048, 128


def parse_config(text: str) -> tuple[int, int, int, bool]:
    """'2x8' -> (2 processes, 8 rows, tensor degree 1, no sequence parallelism); '2x4tp' -> (2, 4,
    2, False); '2x4sp' -> (2, 4, 2, True): tensor parallel with sequence parallelism."""
    split = text[-2:] in ("tp", "sp")
    procs, rows = (int(v) for v in (text[:-2] if split else text).split("x"))
    return procs, rows, procs if split else 1, text.endswith("sp")


# ------------------------------------------------------------------------------------------------
# Worker: one rank of one config (run by torchrun).


def _worker(args) -> None:
    import torch.distributed as dist

    import deepwell
    import deepwell.compiler.backend
    from deepwell.models import Llama
    from deepwell.train.distributed import shard_rows

    cpus = deepwell.pin_cores() if args.pin_cores else sorted(os.sched_getaffinity(0))  # before CUDA and NCCL

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_train_step import MODELS, VOCAB, host_ms

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank = dist.get_rank() if world > 1 else 0
    deepwell.compiler.backend.ensure_registered()
    if args.sm_carveout is not None:
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
    if args.aten_scaled_mm:  # the FP8 GEMMs through aten::_scaled_mm_v2, as before deepwell called cuBLASLt itself
        deepwell._native.call("direct_cublaslt", {"enable": False})

    procs, rows, tensor, sequence = parse_config(args.config)
    dim, heads, hidden, layers = MODELS[args.model]
    seq = SEQ
    if args.quick:
        dim, heads, hidden, layers, seq = 256, 4, 768, 2, QUICK_SEQ
    torch.manual_seed(0)
    model = Llama(VOCAB, dim, layers, heads, hidden, max_seq=seq).to(device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)  # on the CPU: every rank draws the same global batch
    tokens = torch.randint(0, VOCAB, (rows, seq), generator=g).to(device)
    targets = torch.randint(0, VOCAB, (rows, seq), generator=g).to(device)
    mine, my_targets = shard_rows(tokens, tensor=tensor), shard_rows(targets, tensor=tensor)

    ir = deepwell.capture(model, (mine,))
    plan = deepwell.autoplan(ir, hw=deepwell.probe(), precision=args.precision,
                             tensor_parallel=tensor if tensor > 1 else None, fp8_all_gather=args.fp8_all_gather,
                             sequence_parallel=sequence)
    if args.collectives is not None:  # the plan's, unless given (to measure the other)
        plan.sharding["collectives"] = args.collectives
        plan.sharding["sm_carveout"] = 8 if args.collectives == "process_group" else 0
    if args.forward_prefetch is not None:  # the plan's, unless given (to measure others)
        plan.sharding["forward_prefetch"] = args.forward_prefetch
    if args.unit_blocks is not None:
        plan.sharding["unit_blocks"] = [int(n) for n in args.unit_blocks.split(",")]
        if len(plan.sharding["unit_blocks"]) == 1:  # "2": units of 2 blocks
            plan.sharding["unit_blocks"] = plan.sharding["unit_blocks"][0]
    if args.ends_join_blocks is not None:
        plan.sharding["ends_join_blocks"] = args.ends_join_blocks == "on"
    codes = {None: None, "on": True, "off": False}[args.fp8_block_codes]
    engine = deepwell.compile(ir, plan=plan, fp8_block_codes=codes)
    estimate = deepwell.dryrun(engine)
    if args.optimizer == "deepwell":  # fused AdamW on the local shards (train/optim.py), the Trainer's default
        opts = [deepwell.train.AdamW(model.parameters(), lr=1e-4, fused=True)]
    else:
        # torch's fused AdamW takes one kind of tensor per call: tensor parallelism leaves the
        # embeddings, norms and LM head plain next to its DTensor shards, so each kind gets its own.
        from torch.distributed.tensor import DTensor

        kinds = [[p for p in model.parameters() if isinstance(p, DTensor) == d] for d in (True, False)]
        opts = [torch.optim.AdamW(params, lr=1e-4, fused=True) for params in kinds if params]
    losses = []

    forward_carveout = torch._C._get_sm_carveout_experimental() if cuda else None

    def forward():
        if args.backward_carveout is not None:
            torch._C._set_sm_carveout_experimental(forward_carveout)
        logits = engine(mine)
        if args.backward_carveout is not None and logits.requires_grad:
            # Fires when the backward reaches the model: its GEMMs launch under the other carveout.
            logits.register_hook(lambda g: torch._C._set_sm_carveout_experimental(args.backward_carveout))
        loss = F.cross_entropy(logits.view(-1, VOCAB).float(), my_targets.reshape(-1))
        losses.append(loss.detach())
        return loss

    def update():
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    steps_run = [0]

    trainer = None
    if args.trainer:  # deepwell.Trainer's own step: gradient clipping, the non-finite check, its reads
        trainer = deepwell.Trainer.from_engine(engine, optimizer=opts[0], max_steps=1 << 30, log_every=10, progress=False,
                                               plot=False, loss_fn=lambda eng, batch: forward(),
                                               wait_every_step=args.sync_every_step)
        feed = itertools.repeat(0)  # a stand-in batch: the loss function reads this rank's rows itself

    def step():
        if trainer is not None:
            # What Trainer.fit runs each step, without its progress bar, evaluations and checkpoints.
            trainer._read_steps(wait=trainer._train_step(feed))
        else:
            forward().backward()
            if args.sync_every_step:  # as deepwell.Trainer with wait_every_step, which reads the loss and norm first
                sync()
            update()
            if args.sync_every_step:
                sync()
        steps_run[0] += 1
        if args.gc_every and steps_run[0] % args.gc_every == 0:
            gc.collect(1)  # the young generations only, at the same step on every rank

    if args.gc_every is None:  # as deepwell.Trainer does (train/trainer.py GC_EVERY says why)
        from deepwell.train.trainer import GC_EVERY

        args.gc_every = GC_EVERY if world > 1 else 0
    if args.gc_every:
        gc.disable()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def settle():
        """Every rank idle and at the same point: a measurement that starts with a peer still busy
        counts its wait for that peer."""
        sync()
        if world > 1:
            dist.barrier()
        sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    sync()
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    settle()
    allocator = allocator_calls(device) if cuda else {}
    ends = []  # an event at each step's end: the spread of step times, without syncing between them
    host_ends = []  # and when each rank's host finished launching it: a host pause shows as a gap here
    usage = []  # and what the main thread did meanwhile (what a pause was: computing, descheduled, faulting)
    if args.spans:
        deepwell._native.call("host_time", {"enable": True})
    t0, t0_unix = time.perf_counter(), time.time()
    for _ in range(args.steps):
        step()
        host_ends.append(time.perf_counter())
        usage.append(thread_usage())
        if cuda:
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
    sync()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    spans = longest_spans(args.steps) if args.spans else {}
    if args.spans and world > 1:  # every rank's: a pause on one rank shows on the other as a wait
        by_rank = [None] * world
        dist.all_gather_object(by_rank, spans)
        spans = {f"rank {r} {name}": v for r, s in enumerate(by_rank) for name, v in s.items()}
    each = [a.elapsed_time(b) for a, b in zip(ends, ends[1:])]
    host_each = torch.tensor([(b - a) * 1e3 for a, b in zip(host_ends, host_ends[1:])], device=device)
    usage_each = torch.tensor([[y - x for x, y in zip(a, b)] for a, b in zip(usage, usage[1:])], device=device)
    allocator = {k: v - allocator[k] for k, v in allocator_calls(device).items()} if cuda else {}
    # The copy-engine collectives' staging buffers are symmetric memory outside torch's allocator.
    from deepwell.distributed.copy_engine import live_staging_bytes

    peak = torch.cuda.max_memory_allocated(device) + live_staging_bytes() if cuda else 0
    settle()
    host = host_ms(step)[0] if cuda else None  # before any profiler (host_ms says why)
    settle()
    phases = phase_lag(forward, update) if cuda and trainer is None else {}
    settle()
    regions = host_regions(step, sync) if args.profile and cuda else {}
    settle()
    kernels = kernel_split(step, sync, 3, args.trace if rank == 0 else None) if args.profile and cuda else {}
    timeline = []
    if args.timeline and cuda:
        settle()
        timeline = [step_timeline(step, sync, args.timeline)]
        if world > 1:
            timeline = [None] * world
            dist.all_gather_object(timeline, step_timeline(step, sync, args.timeline))

    # The global loss of each step: the ranks' means over equal row counts, averaged (tensor ranks
    # of one data rank hold the same rows, so their mean is that data rank's loss).
    curve = torch.stack(losses).float()
    peaks = torch.tensor([float(peak)], device=device)
    host_by_rank, usage_by_rank = [host_each], [usage_each]
    if world > 1:
        dist.all_reduce(curve)
        curve /= world
        host_by_rank = [torch.zeros_like(host_each) for _ in range(world)]
        dist.all_gather(host_by_rank, host_each)
        usage_by_rank = [torch.zeros_like(usage_each) for _ in range(world)]
        dist.all_gather(usage_by_rank, usage_each)
        gathered = [torch.zeros_like(peaks) for _ in range(world)]
        dist.all_gather(gathered, peaks)
        peaks = torch.cat(gathered)
    if rank == 0:
        out = {
            "config": args.config, "processes": procs, "global_rows": rows, "tensor": tensor, "seq": seq,
            "tokens_per_step": rows * seq, "step_ms": ms, "aten_scaled_mm": args.aten_scaled_mm,
            "cpus_rank0": len(cpus), "pinned": args.pin_cores, "step_ms_each": each,
            "host_ms_each": [h.tolist() for h in host_by_rank],
            # Rank 0's step ends on the wall clock: to line steps up with a GPU monitor's samples.
            "host_end_unix": [t0_unix + (h - t0) for h in host_ends],
            "thread_usage_each": {"fields": list(USAGE_FIELDS), "ranks": [u.tolist() for u in usage_by_rank]},
            "allocator_calls": allocator, "host_ms": host, "tokens_per_s": rows * seq / ms * 1e3,
            "first_call_s": first_s, "peak_bytes_per_rank": [int(p) for p in peaks.tolist()],
            "predicted_peak_bytes_per_rank": estimate.peak_bytes, "losses": curve.tolist(),
            "params": sum(p.numel() for p in model.parameters()) if world == 1 else None,
            "parallelism": plan.parallelism, "unit_blocks": plan.sharding.get("unit_blocks"),
            "ends_join_blocks": bool(plan.sharding.get("ends_join_blocks")), "optimizer": args.optimizer, "sync_every_step": args.sync_every_step, "trainer": args.trainer, "reason": plan.sharding["reason"],
            "sites": {r: sum(s.recipe == r for s in plan.sites) for r in sorted({s.recipe for s in plan.sites})},
            "estimate": str(estimate), "kernel_ms": kernels,
            "phases": phases, "host_regions_ms": regions, "spans": spans, "timeline": timeline, "fp8_gathered": len(plan.sharding.get("fp8_gathered", [])),
        }
        with open(args.out, "w") as f:
            json.dump(out, f)
    if world > 1:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Launcher: one torchrun per config, then the table.


def _launch(args, config: str, out: str) -> dict:
    procs = parse_config(config)[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
           os.path.abspath(__file__), "--worker", "--config", config, "--out", out, "--model", args.model,
           "--precision", args.precision, "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]
    cmd += ["--quick"] * args.quick + ["--profile"] * args.profile + ["--fp8-all-gather"] * args.fp8_all_gather
    cmd += ["--spans"] * args.spans + ["--timeline", str(args.timeline)] + ["--aten-scaled-mm"] * args.aten_scaled_mm
    cmd += ["--pin-cores"] * args.pin_cores
    cmd += [] if args.fp8_block_codes is None else ["--fp8-block-codes", args.fp8_block_codes]
    cmd += [] if args.sm_carveout is None else ["--sm-carveout", str(args.sm_carveout)]
    cmd += ["--sync-every-step"] * args.sync_every_step + ["--trainer"] * args.trainer
    for flag in ("forward_prefetch", "unit_blocks", "backward_carveout", "collectives", "ends_join_blocks", "optimizer"):
        cmd += [] if getattr(args, flag) is None else ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    cmd += ["--trace", args.trace] if args.trace else []
    cmd += [] if args.gc_every is None else ["--gc-every", str(args.gc_every)]
    env = {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"bench_parallel: config {config} failed (exit {done.returncode}); its output is above")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1b", choices=["1b", "8b"])
    p.add_argument("--configs", default="1x4,1x8,2x8")
    p.add_argument("--precision", default="auto")
    p.add_argument("--steps", type=int, default=12, help="timed steps (after the first call and the warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a 2-layer d=256 model, 128-token rows")
    p.add_argument("--sm-carveout", type=int, default=None,
                   help="SMs torch's GEMMs leave free for NCCL (default: the plan's sm_carveout; 0 for none)")
    p.add_argument("--backward-carveout", type=int, default=None,
                   help="SMs torch's GEMMs leave free in the backward (the forward keeps the plan's or --sm-carveout)")
    p.add_argument("--collectives", choices=["process_group", "copy_engine"], default=None,
                   help="FSDP2's collectives on NCCL (8 SMs left to it) or on the copy engines (no SMs); default: the plan's")
    p.add_argument("--fp8-all-gather", action="store_true", help="FSDP2 gathers fp8_block weights as FP8 codes")
    p.add_argument("--fp8-block-codes", choices=["on", "off"], default=None,
                   help="deepwell.compile's fp8_block_codes (default: the backend's, on)")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin each rank to its own physical cores (deepwell.pin_cores), before CUDA starts")
    p.add_argument("--aten-scaled-mm", action="store_true",
                   help="FP8 GEMMs through aten::_scaled_mm_v2 instead of cuBLASLt called directly (to compare)")
    p.add_argument("--spans", action="store_true",
                   help="time deepwell's host spans over the timed steps: each op's longest call (every rank)")
    p.add_argument("--timeline", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS more steps' kernels: per step and rank, the GPU's idle gaps and NCCL's waits")
    p.add_argument("--profile", action="store_true", help="also each run's kernel ms by kind (NCCL's included) on rank 0")
    p.add_argument("--trace", default=None, help="with --profile: rank 0's profiled steps as a Chrome trace to this file")
    p.add_argument("--forward-prefetch", type=int, default=None,
                   help="FSDP units whose all-gathers each unit's forward starts (default: the plan's forward_prefetch)")
    p.add_argument("--unit-blocks", default=None,
                   help="blocks per FSDP unit, '2' for all or '1,2,4,8,1' in forward order (default: the plan's unit_blocks)")
    p.add_argument("--ends-join-blocks", choices=["on", "off"], default=None,
                   help="the embedding in the first block unit, the final norm and LM head in the last (on), or "
                        "units of their own (off); default: the plan's ends_join_blocks")
    p.add_argument("--optimizer", choices=["deepwell", "torch"], default="deepwell",
                   help="fused AdamW: deepwell.train.AdamW, stepped on the local shards (default), or torch.optim.AdamW, "
                        "stepped through DTensor's dispatch")
    p.add_argument("--sync-every-step", action="store_true",
                   help="wait for the GPU before each optimizer step and at each step's end, as deepwell.Trainer does")
    p.add_argument("--trainer", action="store_true",
                   help="each step as deepwell.Trainer runs it (clipping, the non-finite check, the loss and norm copied to the "
                        "host without waiting, or read every step with --sync-every-step); needs --optimizer deepwell")
    p.add_argument("--gc-every", type=int, default=None,
                   help="Python's automatic garbage collection off, a young-generation collection every N steps "
                        "instead; 0: automatic (default: deepwell.Trainer's choice, every 50 steps under several processes)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer and args.optimizer != "deepwell":
        p.error("--trainer runs deepwell.Trainer with one optimizer: --optimizer deepwell")
    if args.worker:
        return _worker(args)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import environment, write_json

    env = {**environment(args.device), "gpus": torch.cuda.device_count() if args.device == "cuda" else 0}
    print(f"# bench_parallel: {args.model} LLaMA, precision={args.precision}, configs {args.configs}; "
          f"{env['device']} x {env['gpus']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs.split(","):
            r = runs[config] = _launch(args, config, os.path.join(tmp, f"{config}.json"))
            print(f"{config}: {r['tokens_per_s']:.0f} tokens/s, peak {max(r['peak_bytes_per_rank']) / 2**30:.2f} GiB/rank, "
                  f"losses {[round(v, 4) for v in r['losses']]}", flush=True)

    gib = 2**30
    print(f"\n{'config':<8} {'plan':<22} {'step ms':>8} {'tokens/s':>10} {'peak GiB/rank':>14} {'dryrun GiB':>10} "
          f"{'err':>6} {'first s':>8}  loss first -> last")
    for c, r in runs.items():
        par = r["parallelism"]
        plan = f"data {par['data']} x tensor {par['tensor']}"
        peak = max(r["peak_bytes_per_rank"])
        err = r["predicted_peak_bytes_per_rank"] / peak - 1 if peak else float("nan")
        print(f"{c:<8} {plan:<22} {r['step_ms']:8.1f} {r['tokens_per_s']:10.0f} {peak / gib:14.2f} "
              f"{r['predicted_peak_bytes_per_rank'] / gib:10.2f} {err * 100:+5.1f}% {r['first_call_s']:8.1f}  "
              f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
        r["dryrun_error"] = err
        if r.get("step_ms_each"):
            each = r["step_ms_each"]
            print(f"{'':<8} step ms min {min(each):.1f} median {statistics.median(each):.1f} max {max(each):.1f}; "
                  f"allocator calls while timed: {r['allocator_calls']}")
            print(f"{'':<8} GPU ms per step:  " + " ".join(f"{v:.0f}" for v in each))
            usage = r.get("thread_usage_each", {}).get("ranks", [])
            for rank, host in enumerate(r.get("host_ms_each", [])):
                print(f"{'':<8} rank {rank} host ms: " + " ".join(f"{v:.0f}" for v in host))
                # The steps whose host time stands 15 ms above the median: what the thread did.
                typical = statistics.median(host)
                for i, v in enumerate(host):
                    if v > typical + 15 and rank < len(usage):
                        cpu, invol, vol, minflt, majflt = usage[rank][i]
                        print(f"{'':<8}   step {i + 1}: host {v:.0f} ms, main thread CPU {cpu:.0f} ms, switches "
                              f"{invol:.0f} involuntary / {vol:.0f} voluntary, page faults {minflt:.0f} minor / {majflt:.0f} major")
        for name, v in r.get("spans", {}).items():
            print(f"{'':<8} span {name}: longest call {v['longest_ms']:.2f} ms; {v['ms_per_step']:.2f} ms "
                  f"in {v['calls_per_step']:.0f} calls a step")
        for rank, steps in enumerate(r.get("timeline") or []):
            # The first two profiled steps, then every step 10 ms above the median: where its time went.
            typical = statistics.median(t["ms"] for t in steps)
            for i, t in enumerate(steps):
                if i < 2 or t["ms"] > typical + 10:
                    print(f"{'':<8} rank {rank} profiled step {i + 1}: {t['ms']:.1f} ms (median {typical:.1f}); "
                          f"compute stream busy {t['compute_busy_ms']:.1f}, idle {t.get('idle_ms', 0.0):.1f}; "
                          f"NCCL {t['nccl_ms']:.1f}, longest {t['longest_nccl_ms']:.1f} ({t['longest_nccl']}); "
                          f"copy engines {t.get('copy_engine_ms', 0.0):.1f}")
                    for g in t.get("gaps", []):
                        print(f"{'':<10} idle {g['ms']:.2f} ms at {g['at_ms']:.1f} ms: after {g['after']}, before {g['before']}")
        if r.get("unit_blocks"):
            ends = "with the embedding and the LM head" if r.get("ends_join_blocks") else "besides the embedding's and the LM head's"
            print(f"{'':<8} FSDP units of {r['unit_blocks']} blocks, {ends}; {r.get('optimizer', 'torch')}'s fused AdamW"
                  + ("; deepwell.Trainer's step" if r.get("trainer") else "")
                  + ("; the GPU waited for every step" if r.get("sync_every_step") else ""))
        if r.get("host_ms"):
            print(f"{'':<8} host: {r['host_ms']:.1f} ms to launch a step")
        for phase, v in (r.get("phases") or {}).items():
            print(f"{'':<8} {phase:<9}: host {v['host']:6.1f} ms, GPU {v['gpu']:6.1f} ms, GPU behind the host by {v['lag']:6.1f} ms at its end")
        if r.get("host_regions_ms"):
            print(f"{'':<8} host ms per step by region on rank 0: "
                  + "  ".join(f"{k} {v:.1f}" for k, v in r["host_regions_ms"].items()))
        if r["kernel_ms"]:
            print(f"{'':<8} kernel ms per step on rank 0: " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(r["kernel_ms"].items())))
    summary = []
    for c, r in runs.items():
        procs, rows, tensor, _ = parse_config(c)
        if procs == 1:
            continue
        one_gpu_same_batch = runs.get(f"1x{rows}")
        one_gpu_same_per_gpu = runs.get(f"1x{rows // procs}") if tensor == 1 else one_gpu_same_batch
        line = {"config": c}
        if one_gpu_same_per_gpu:
            line["scaling"] = r["tokens_per_s"] / one_gpu_same_per_gpu["tokens_per_s"]
            if r.get("step_ms_each") and one_gpu_same_per_gpu.get("step_ms_each"):
                # The same from median steps: robust to the few steps a pause on one rank stretches.
                rate = [o["tokens_per_step"] / statistics.median(o["step_ms_each"]) for o in (r, one_gpu_same_per_gpu)]
                line["scaling_by_median"] = rate[0] / rate[1]
        if one_gpu_same_batch:
            line["vs_one_gpu_same_batch"] = r["tokens_per_s"] / one_gpu_same_batch["tokens_per_s"]
            diffs = [abs(a - b) for a, b in zip(r["losses"], one_gpu_same_batch["losses"])]
            line["parity_max_abs"] = max(diffs)
            line["loss_drop"] = one_gpu_same_batch["losses"][0] - one_gpu_same_batch["losses"][-1]
        summary.append(line)
        print(f"{c}: " + ", ".join(f"{k} {v:.4g}" for k, v in line.items() if k != "config"))
    name = f"bench_parallel-{args.model}" + ("-fp8ag" if args.fp8_all_gather else "") + ("-quick" if args.quick else "")
    print("wrote", write_json(name, env, list(runs.values()), {"summary": summary, "precision": args.precision}))


if __name__ == "__main__":
    main()
