"""Where one MoE layer's forward + backward spends its GPU time, stage by stage: the Hugging Face
`torch._grouped_mm` reference (bench_moe.hf_grouped_mm) against deepwell.DeepwellMoE bf16, with
torch.profiler, next to a bytes/FLOPs prediction. Prints per stage the kernel time, kernel launches,
host syncs and device-to-host copies, then the top kernels of each side by side; writes JSON to
benchmarks/results/.

    python benchmarks/profile_moe.py [--shape fine-e64|fine-e128|mixtral] [--tokens 8192] [--steps 1] [--recipe fp8_block]
    python benchmarks/profile_moe.py --quick --device cpu    # tiny shape: checks the script runs

Prediction (count first, predict, then measure). Default shape E=64, D=2048, F=1408, K=8, T=8192,
bf16 (b = 2 bytes); A = T·K = 65536 assignments, R = A buffer rows (bf16 groups need no padding).
Tensors: x, y (T, D) = 33.6 MB; the expert buffers xp, yp (A, D) = 268.4 MB; gate_up out (A, 2F) =
369.1 MB; SwiGLU out (A, F) = 184.5 MB; weights W1 (E, 2F, D) = 738.2 MB, W2 (E, D, F) = 369.1 MB.
The least each stage must move, forward + backward (a gathered row is read from L2 after its first
read: x fits the H100's 50 MB L2), and its FLOPs:

| stage        | must move, forward + backward                                   |   MB |  GFLOP |    ms |
|--------------|-----------------------------------------------------------------|------|--------|-------|
| router       | gate GEMM (x in), dgrad (x out), wgrad (x in); (T, E) softmax/top-k | 108 |   6.4 | 0.036 |
| permutation  | 3 int32 indices of A; x -> xp gather (x + xp); backward xp-grad + x-grad | 605 | 0 | 0.202 |
| expert GEMMs | each GEMM's operands + output once, x3 (fwd, dgrad, wgrad)      | 6593 | 3401.6 | 5.233 |
| activation   | fwd (A, 2F) in, (A, F) out; bwd (A, F) + (A, 2F) in, (A, 2F) out | 1476 |     0 | 0.492 |
| combine      | fwd yp + weights in, y out; bwd dy + yp in, d-yp + d-weights out |  873 |     0 | 0.291 |
| aux losses   | none in bench_moe's config (aux_loss=None)                      |    0 |      0 |     0 |
| total        |                                                                 | 9656 | 3408.0 | 6.254 |

Expert GEMMs: 18·A·D·F FLOPs (2·A·D·2F + 2·A·F·D per pass, three passes); per pass 1375.7 MB (gate_up)
+ 822.1 MB (down); compute-bound at 5.2 ms, so the layer's floor is ~6.3 ms against 11.8 (HF) and
15.6 (deepwell) measured.

Both implementations share the expert GEMMs (torch._grouped_mm bf16, same groups) and the eager
SwiGLU (silu + mul, and SplitBackward's cat: ~3.3 GB as written, 1.1 ms, in both). Where they differ,
as written (hand count from ops/moe.py and bench_moe.py; X = 33.6 MB a (T, D) bf16 tensor, X32 =
67.1 MB in fp32; P = 268.4 MB an (A, D) bf16 buffer, P32 = 536.9 MB in fp32):
- deepwell permutation ~4.2 GB (1.4 ms): dispatch = index_select + a torch.where copy of the whole
  buffer (~0.84 GB); its backward sums K gathers in fp32, per k: index_select, where, .to(fp32),
  add (~3.4 GB). HF: one index (0.3 GB) + index_put accumulate backward (~0.4 GB) = ~0.7 GB.
- deepwell combine ~12.2 GB (4.1 ms): forward per k: index_select, where, .to(fp32), x weight, add
  (~4.5 GB); backward d_rows materialises (A, D) in fp32 three times (gather, where, x w) then casts
  (~3.7 GB), d_weights re-gathers per k (~4.1 GB). HF ~6.8 GB (2.3 ms): h · w promotes (A, D) to
  fp32 (bf16 x fp32 router weights), .to(bf16), index_add_ (~2.0 GB); backward index_select, the
  fp32 cast back, both products in fp32 and the sum over D (~4.9 GB).
Predicted gap from these two stages: ~16.5 GB - ~7.5 GB = ~9 GB, ~3.0 ms at 3 TB/s, of the 3.8 ms
measured (15.6 vs 11.8 ms); the rest would be deepwell's extra small kernels (router: moe_route plus
torch's softmax/gather/renormalise/masked_fill and their backward; the per-k loops of dispatch
and combine launch over a hundred more kernels than HF's). The printed table tests that prediction.

Stages are assigned by where each kernel was launched, not only its name:
- forward: the top-level ops of the layer's forward, in order — router until the permutation starts
  (aten::sort / deepwell::moe_permute_index), permutation until the first grouped GEMM, activation
  between the two grouped GEMMs, combine after the second; DeepwellMoE's `_losses` runs inside a
  record_function range set here (on the instance: nn/moe.py is not changed) and is "aux losses";
- backward: each autograd node carries its forward op's sequence number, so its kernels join the
  stage of the forward op that made it (the accumulation of x's two gradients, router and
  permutation, lands in whichever node finishes second);
- a kernel with no such context (none expected) falls back to KERNEL_PATTERNS by name, else "other".
Each stage's row therefore holds its forward and backward kernels (e.g. combine = HF's h·w +
index_add_ + their backward; deepwell's moe_combine + _CombineBackward).
On the CPU there are no kernels: each aten op's self CPU time stands for one, so the run checks the
script, not the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from collections import Counter, defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import deepwell
import deepwell.compiler.backend
from _common import environment, header, time_ms, write_json
from bench_moe import SHAPES, hf_grouped_mm, step

HBM_BPS, BF16_FLOPS = 3.0e12, 650e12  # H100 SXM: HBM3 bandwidth, dense bf16 (the anchors' peak)
STAGES = ("router", "permutation", "expert GEMMs", "activation", "combine", "aux losses", "other")

# Kernel name -> stage, first match wins (case-insensitive); only for kernels launched outside any
# forward op or autograd node of the layer. Grouped GEMMs are CUTLASS GemmUniversal<GroupProblemShape>
# (torch._grouped_mm on sm_90) and its prepare_grouped_gemm_data; the only dense GEMM is the gate.
KERNEL_PATTERNS = [
    ("expert GEMMs", r"group|ptrarray"),
    ("router", r"gemm|nvjet|xmma|cublas|cutlass|matmul|softmax|topk|radixselect|moe_route"),
    ("activation", r"silu|swiglu"),
    ("permutation", r"sort|radix|index|gather|scatter|histc|histogram|cumsum|scan|moe_permute"),
]
PERMUTE_ANCHORS = ("aten::sort", "aten::argsort", "deepwell::moe_permute_index")
GEMM_ANCHORS = ("aten::_grouped_mm", "deepwell_moe::grouped_scaled_linear", "_GroupedEmulated", "_GroupedFp8Block")
# record_function ranges set here (profile_step, build); kineto may also list them as GPU events.
OWN_RANGES = "profile_moe::"
AUX_RANGE, STEP_RANGE, FORWARD_RANGE = (OWN_RANGES + n for n in ("aux_losses", "step", "forward"))
# Host-blocking runtime and driver calls (Rust ops launch through the driver API); CUPTI may append
# an API version (_v3020). cudaMemcpyAsync alone does not block: .item() pairs it with a sync.
SYNC_CALL = re.compile(r"cu(da)?(Stream|Device|Ctx|Event)Synchronize(_v\d+)?|cu(da)?Memcpy(DtoH)?(_v\d+)?")
EVALUATE = "autograd::engine::evaluate_function: "


def predict(e: int, d: int, f: int, k: int, t: int, b: int = 2) -> dict[str, tuple[float, float, float]]:
    """stage -> (bytes, FLOPs, ms): the least traffic of the module docstring's table, any shape."""
    a = t * k
    x, p = t * d * b, a * d * b
    gemm1 = (a * d + e * 2 * f * d + a * 2 * f) * b  # xp, W1 in; (A, 2F) out
    gemm2 = (a * f + e * d * f + a * d) * b  # SwiGLU out, W2 in; yp out
    router = (x + e * d * b + t * e * b + t * e * (b + 4) + t * k * 8) + 2 * (x + t * e * b + e * d * b)
    parts = {
        "router": [(router, 3 * 2 * t * d * e)],
        "permutation": [(3 * a * 4 + 2 * (x + p), 0)],
        "expert GEMMs": [(gemm1, 2 * a * d * 2 * f)] * 3 + [(gemm2, 2 * a * f * d)] * 3,
        "activation": [(8 * a * f * b, 0)],
        "combine": [((p + a * 4 + x) + (x + 2 * p + a * 4), 0)],
    }
    return {s: (sum(by for by, _ in v), sum(fl for _, fl in v),
                sum(max(by / HBM_BPS, fl / BF16_FLOPS) for by, fl in v) * 1e3) for s, v in parts.items()}


def name_stage(name: str) -> str:
    for stage, pattern in KERNEL_PATTERNS:
        if re.search(pattern, name, re.IGNORECASE):
            return stage
    return "other"


def forward_stages(forward_range) -> dict[int, str]:
    """Top-level forward op id -> stage, by the anchors in program order (module docstring)."""
    stages, phase, gemms = {}, "router", 0
    for ev in sorted(forward_range.cpu_children, key=lambda e: e.time_range.start):
        if ev.name == AUX_RANGE or ev.name == "_AddLossToGrad":
            stage = "aux losses"
        elif ev.name in GEMM_ANCHORS:
            stage, gemms = "expert GEMMs", gemms + 1
        else:
            if gemms == 0 and ev.name in PERMUTE_ANCHORS:
                phase = "permutation"
            stage = phase if gemms == 0 else ("activation" if gemms == 1 else "combine")
        stages[ev.id] = stage
    return stages


class Context:
    """The stage of any CPU event: its forward top-level op's, or its autograd node's forward op's.
    Sequence numbers grow over the whole run, so one map serves all profiled steps."""

    def __init__(self, events, forwards):
        self.forwards = {f.id for f in forwards}
        self.top: dict[int, str] = {}
        for f in forwards:
            self.top.update(forward_stages(f))
        self.seq: dict[int, str] = {}
        # Overwritten in time order: ops that make no node report the next op's number, so the
        # last op holding a number is the one whose node got it.
        for ev in sorted(events, key=lambda e: e.time_range.start):
            top = self._top(ev)
            if top is not None and ev.sequence_nr >= 0:
                self.seq[ev.sequence_nr] = self.top[top.id]

    def _top(self, ev):
        while ev is not None and (ev.cpu_parent is None or ev.cpu_parent.id not in self.forwards):
            ev = ev.cpu_parent
        return ev

    def stage(self, ev) -> str | None:
        node = ev
        while node is not None:
            if node.name.startswith(EVALUATE):
                return self.seq.get(node.sequence_nr)
            if node.cpu_parent is not None and node.cpu_parent.id in self.forwards:
                return self.top.get(node.id)
            node = node.cpu_parent
        return None


def kernel_records(events, ctx: Context, on_cpu: bool) -> list[dict]:
    """One record per kernel (GPU) or per aten op's self time (CPU): name, us, stage, how. A device
    event that the profiler linked to no op (seen in no op's `kernels`) is kept, classified by name."""
    out, linked = [], Counter()
    for ev in events:
        if ev.device_type != DeviceType.CPU or ev.is_async:
            continue
        items = [(k.name, k.duration) for k in ev.kernels]
        if on_cpu and "::" in ev.name and not ev.name.startswith(("autograd::", OWN_RANGES)):
            items = [(ev.name, ev.self_cpu_time_total)]
        for name, us in items:
            linked[name, us] += 1
            if name.startswith(OWN_RANGES):  # the GPU-side copy of a range, not a kernel
                continue
            stage = ctx.stage(ev)
            how = "context" if stage else "name"
            out.append({"name": name, "us": us, "stage": stage or name_stage(name), "how": how})
    for ev in events:
        if ev.device_type == DeviceType.CUDA and not ev.name.startswith(OWN_RANGES):
            key = (ev.name, ev.time_range.end - ev.time_range.start)
            if linked[key] > 0:
                linked[key] -= 1
            else:
                out.append({"name": ev.name, "us": key[1], "stage": name_stage(ev.name), "how": "name"})
    return out


def sync_records(events, ctx: Context) -> list[str]:
    """Stages of the host-blocking runtime calls inside a profiled step. A runtime event with no
    parent (its thread not matched to an op's) takes the innermost op whose time range holds it."""
    steps = [e.time_range for e in events if e.name == STEP_RANGE]
    ops = [e for e in events if e.device_type == DeviceType.CPU and "::" in e.name and e.name != STEP_RANGE]
    out = []
    for ev in events:
        if not SYNC_CALL.fullmatch(ev.name) or not any(r.start <= ev.time_range.start <= r.end for r in steps):
            continue
        owner = ev.cpu_parent
        if owner is None:
            t = ev.time_range
            holding = [o for o in ops if o.time_range.start <= t.start and t.end <= o.time_range.end]
            owner = min(holding, key=lambda o: o.time_range.elapsed_us(), default=None)
        out.append((owner is not None and ctx.stage(owner)) or "other")
    return out


def summarize(records, syncs, steps: int) -> dict[str, dict]:
    rows = {s: {"ms": 0.0, "launches": 0, "syncs": 0, "dtoh": 0} for s in STAGES}
    for r in records:
        row = rows[r["stage"]]
        row["ms"] += r["us"] / 1e3 / steps
        if r["name"].startswith(("Memcpy", "Memset")):
            row["dtoh"] += ("DtoH" in r["name"]) / steps
        else:
            row["launches"] += 1 / steps
    for s in syncs:
        rows[s]["syncs"] += 1 / steps
    return rows


def top_kernels(records, steps: int, n: int = 15) -> list[dict]:
    """The n kernels (name and stage: one name can serve several stages) with the most time."""
    agg = defaultdict(lambda: [0.0, 0])
    for r in records:
        a = agg[r["name"], r["stage"]]
        a[0] += r["us"] / steps
        a[1] += 1 / steps
    top = sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": nm, "stage": st, "ms": us / 1e3, "calls": calls} for (nm, st), (us, calls) in top]


def short(name: str, width: int) -> str:
    """A kernel name without the namespaces and `void ` that hide what it does."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "cutlass::", "at::cuda::", "std::"):
        name = name.replace(noise, "")
    return name if len(name) <= width else name[: width - 1] + "~"


def profile_step(fn, x, params, dy, steps: int, device: str):
    """torch.profiler over `steps` forward + backward calls, after warm-up."""
    for _ in range(3):
        step(fn, x, params, dy)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                with record_function(FORWARD_RANGE):
                    y = fn(x)
                torch.autograd.grad(y, (x, *params), dy)
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    ctx = Context(events, [e for e in events if e.name == FORWARD_RANGE])
    return kernel_records(events, ctx, device == "cpu"), sync_records(events, ctx)


def wall_ms(fn, x, params, dy, device: str) -> float:
    if device == "cuda":
        return time_ms(lambda: step(fn, x, params, dy), warmup=2, iters=5, reps=3)
    t0 = time.perf_counter()
    for _ in range(3):
        step(fn, x, params, dy)
    return (time.perf_counter() - t0) / 3 * 1e3


def build(e, d, f, k, tokens, device, aux_loss):
    """bench_moe.layer_rows' layer and inputs (same init), on `device`."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d, device=device, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(tokens, d, device=device, generator=g).bfloat16()
    moe = deepwell.DeepwellMoE(d, f, e, k, aux_loss=aux_loss, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        moe.gate.weight.normal_(0, d**-0.5)
    losses = moe._losses  # a range around the aux losses, on this instance only (nn/moe.py unchanged)

    def ranged_losses(*a):
        with record_function(AUX_RANGE):
            return losses(*a)

    moe._losses = ranged_losses
    params = (moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj)
    return x, dy, moe, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="fine-e64", choices=[s[0] for s in SHAPES])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=1, help="profiled forward + backward calls (averaged)")
    p.add_argument("--quick", action="store_true", help="D and F / 8, 512 tokens (a CPU check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--recipe", default=None, choices=["fp8_block", "mxfp8", "nvfp4"],
                   help="also profile DeepwellMoE with its experts in this recipe (same weights)")
    p.add_argument("--aux-loss", default=None, choices=["switch", "seq"],
                   help="DeepwellMoE's aux loss (bench_moe: none; HF has none)")
    args = p.parse_args()
    deepwell.compiler.backend.ensure_registered()
    name, e, d, f, k = next(s for s in SHAPES if s[0] == args.shape)
    tokens = args.tokens
    if args.quick:
        d, f, tokens = d // 8, f // 8, 512
    env = environment(args.device)
    header(f"profile_moe: one MoE layer forward + backward by stage, {name} E{e} D{d} F{f} top-{k}, "
           f"{tokens} tokens, bf16", env)
    x, dy, moe, params = build(e, d, f, k, tokens, args.device, args.aux_loss)
    impls = {"hf grouped_mm": (lambda x: hf_grouped_mm(x, *params, k), params), "deepwell bf16": (moe, params)}
    if args.recipe:  # the same layer with its experts in `recipe` (the stages' prediction stays bf16's)
        other = deepwell.DeepwellMoE(d, f, e, k, aux_loss=args.aux_loss, recipe=args.recipe, device=args.device,
                                     dtype=torch.bfloat16)
        other.load_state_dict(moe.state_dict())
        impls[f"deepwell {args.recipe}"] = (other, (other.gate.weight, other.experts.gate_up_proj, other.experts.down_proj))
    pred = predict(e, d, f, k, tokens)
    results = {}
    with cpu_histc(args.device):
        for label, (fn, params) in impls.items():
            records, syncs = profile_step(fn, x, params, dy, args.steps, args.device)
            results[label] = {"stages": summarize(records, syncs, args.steps),
                              "top": top_kernels(records, args.steps),
                              "wall_ms": wall_ms(fn, x, params, dy, args.device),
                              "by_name": sum(r["how"] == "name" for r in records)}
    print_tables(results, pred, args.device)
    shape = {"shape": name, "experts": e, "dim": d, "ffn": f, "top_k": k, "tokens": tokens}
    rows = []
    for label, r in results.items():
        for s, v in r["stages"].items():
            by, fl, ms = pred.get(s, (0, 0, 0))
            pred_row = {"pred_ms": ms, "pred_bytes": by, "pred_flops": fl}
            rows.append({"impl": label, "stage": s, **v, **pred_row, **shape})
    extra = {"top_kernels": {label: r["top"] for label, r in results.items()},
             "wall_ms": {label: r["wall_ms"] for label, r in results.items()}}
    # One file per shape: the device_run step profiles several the same day.
    tag = (f"-{args.recipe}" if args.recipe else "") + ("-quick" if args.quick else "")
    print("wrote", write_json(f"profile_moe-{name}{tag}", env, rows, extra))


def print_tables(results, pred, device: str) -> None:
    unit = "kernel" if device == "cuda" else "aten-op self CPU"
    labels = list(results)
    print(f"# {unit} time per stage (forward + backward), launches, host syncs, DtoH copies; "
          f"predicted = least traffic at {HBM_BPS / 1e12:.1f} TB/s and {BF16_FLOPS / 1e12:.0f} TFLOP/s")
    head = f"{'stage':<13} {'pred ms':>8} {'pred MB':>8} {'GFLOP':>7}"
    for label in labels:
        head += f" | {label[:14]:>14} ms {'n':>5} {'sync':>4} {'DtoH':>4}"
    print(head)
    totals = {label: [0.0, 0, 0, 0] for label in labels}
    for s in STAGES:
        by, fl, ms = pred.get(s, (0, 0, 0))
        line = f"{s:<13} {ms:8.3f} {by / 1e6:8.0f} {fl / 1e9:7.1f}"
        for label in labels:
            v = results[label]["stages"][s]
            line += f" | {v['ms']:17.3f} {v['launches']:5.0f} {v['syncs']:4.0f} {v['dtoh']:4.0f}"
            for i, key in enumerate(("ms", "launches", "syncs", "dtoh")):
                totals[label][i] += v[key]
        print(line)
    by, fl, ms = (sum(v[i] for v in pred.values()) for i in range(3))
    line = f"{'total':<13} {ms:8.3f} {by / 1e6:8.0f} {fl / 1e9:7.1f}"
    for label in labels:
        t = totals[label]
        line += f" | {t[0]:17.3f} {t[1]:5.0f} {t[2]:4.0f} {t[3]:4.0f}"
    print(line)
    line = f"{'step wall':<13} {'':>8} {'':>8} {'':>7}"
    for label in labels:
        line += f" | {results[label]['wall_ms']:17.3f} {'':>5} {'':>4} {'':>4}"
    print(line + ("   (CUDA events; wall - kernels = GPU idle)" if device == "cuda" else "   (perf_counter)"))
    for label in labels:
        if results[label]["by_name"]:
            n = results[label]["by_name"]
            print(f"# {label}: {n} kernels had no op context and were classified by name")
    print(f"# top {len(results[labels[0]]['top'])} {unit}s per step")
    w = 46
    print("   ".join(f"{'ms':>7} {'calls':>5} {'stage':<12} {label:<{w}}" for label in labels))
    for i in range(max(len(r["top"]) for r in results.values())):
        cells = []
        for label in labels:
            top = results[label]["top"]
            if i >= len(top):
                cells.append(" " * (27 + w))
                continue
            c = top[i]
            cells.append(f"{c['ms']:7.3f} {c['calls']:5.0f} {c['stage'][:12]:<12} {short(c['name'], w):<{w}}")
        print("   ".join(cells))


@contextlib.contextmanager
def cpu_histc(device: str):
    """torch.histc has no int kernel on the CPU (bench_moe's HF reference counts int32 ids): cast
    there, for the CPU check only; CUDA runs the reference untouched."""
    orig = torch.histc
    if device == "cpu":
        torch.histc = lambda t, *a, **kw: orig(t if t.is_floating_point() else t.float(), *a, **kw)
    try:
        yield
    finally:
        torch.histc = orig


if __name__ == "__main__":
    main()
