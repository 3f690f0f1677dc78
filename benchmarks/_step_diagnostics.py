"""What bench_parallel.py measures in a training step besides its time, each on this process's rank:
deepwell's host spans, the main thread's CPU time / context switches / page faults, the caching
allocator's costly calls, the host's and the GPU's pace per phase, a CPU-only profile of the host's
regions, the GPU's kernel time by kind, and a per-step timeline of the compute stream's idle gaps."""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch


def longest_spans(steps: int, top: int = 12) -> dict[str, dict[str, float]]:
    """deepwell's host-time spans over the timed steps (rust/ops/src/host_time.rs; read, then
    switched off): the `top` whose single longest call took longest, each with that call's ms, its
    ms and calls per step. A pause inside a deepwell op (a lock, a blocked launch) shows as a
    longest call far above the op's mean."""
    from deepwell import _native

    spans = _native.call("host_time")
    _native.call("host_time", {"enable": False})
    ranked = sorted(spans.items(), key=lambda kv: -kv[1][2])[:top]
    return {name: {"longest_ms": longest * 1e3, "ms_per_step": secs * 1e3 / steps, "calls_per_step": n / steps}
            for name, (secs, n, longest) in ranked}


USAGE_FIELDS = ("cpu_ms", "involuntary_switches", "voluntary_switches", "minor_faults", "major_faults")


def thread_usage() -> tuple[float, ...]:
    """The calling thread's CPU time (ms), context switches (involuntary: preempted; voluntary:
    blocked) and page faults so far (Linux getrusage(RUSAGE_THREAD)). A step's host pause with its
    CPU time is work; without, a wait (a lock, the GPU's queue) or the thread descheduled."""
    import resource

    u = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    return (time.thread_time() * 1e3, u.ru_nivcsw, u.ru_nvcsw, u.ru_minflt, u.ru_majflt)


def allocator_calls(device) -> dict[str, int]:
    """The caching allocator's counts of what costs the host or stalls the GPU: cudaMalloc and
    cudaFree calls (cudaFree synchronizes the device), retries after a failed allocation, and
    syncs of all streams."""
    stats = torch.cuda.memory_stats(device)
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    return {k: int(stats.get(k, 0)) for k in keys}


def phase_lag(forward, update, steps: int = 3) -> dict[str, dict[str, float]]:
    """Whether the host or the GPU sets the pace, phase by phase (forward, backward, optimizer),
    without a profiler: a CUDA event on the compute stream at the end of each phase's launch, timed
    on the GPU from an event recorded when the GPU was idle. Per phase, averaged over `steps`: "host"
    ms to launch it, "gpu" ms the compute stream took for it, and "lag" ms the GPU was behind the
    host when the host finished launching it. A lag near 0 means the GPU ran each command as soon
    as it arrived (the host set the pace); a lag that grows means the host ran ahead."""
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    h0 = time.perf_counter()
    marks = []

    def mark(name):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, event, time.perf_counter()))

    for _ in range(steps):
        loss = forward()
        mark("forward")
        loss.backward()
        mark("backward")
        update()
        mark("optimizer")
    torch.cuda.synchronize()
    out: dict[str, dict[str, float]] = {}
    prev_gpu, prev_host = 0.0, 0.0
    for name, event, h in marks:
        gpu, host = start.elapsed_time(event), (h - h0) * 1e3
        row = out.setdefault(name, {"host": 0.0, "gpu": 0.0, "lag": 0.0})
        row["host"] += (host - prev_host) / steps
        row["gpu"] += (gpu - prev_gpu) / steps
        row["lag"] += (gpu - host) / steps
        prev_gpu, prev_host = gpu, host
    return out


def host_regions(step, sync, steps: int = 3, top: int = 20) -> dict[str, float]:
    """Host ms per step in the regions torch labels, from a CPU-only profile (no CUDA activity
    tracing, which would slow the launches it measures; so this runs before `kernel_split`): every
    FSDP2 region ("FSDP::..."), every wait for the GPU ("...Synchronize"), and the `top` costliest
    others (the compiled graphs "CompiledFunction..." / "Torch-Compiled Region", the optimizer
    "Optimizer.step#...", each deepwell op). Regions nest, so the values do not add up to the step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync()
    # FSDP2 names its regions per unit ("FSDP::pre_forward (layers.0)"): summed over the units.
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        fsdp = e.key.lower().startswith("fsdp")
        key = e.key.split(" (")[0].split(" for ")[0] if fsdp else e.key
        totals[key] = totals.get(key, 0.0) + e.cpu_time_total / steps / 1e3
    keys = sorted(totals, key=lambda k: -totals[k])
    keep = [k for k in keys if k.lower().startswith("fsdp") or "Synchronize" in k]
    keep += [k for k in keys if k not in keep][:top]
    return {k: totals[k] for k in keep}


def kernel_split(step, sync, steps: int, trace: str | None = None) -> dict[str, float]:
    """Kernel ms per step on this rank's GPU by kind (bench_train_step's kinds plus NCCL's
    collectives), and "busy": the union of all kernel intervals, so step - busy is the time the GPU
    waited (on the host, or on a collective's peer). `trace`: also write the profile there (Chrome's
    trace format, gzipped when the name ends in .gz)."""
    from torch.profiler import ProfilerActivity, profile

    from bench_train_step import kind_of

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    if trace:
        prof.export_chrome_trace(trace)
    kinds: dict[str, float] = {}
    spans = []
    for e in prof.events():
        lo, hi = e.time_range.start, e.time_range.end
        if e.device_type.name != "CUDA" or hi <= lo:
            continue
        kind = "nccl" if "nccl" in e.name.lower() else kind_of(e.name)
        kinds[kind] = kinds.get(kind, 0.0) + (hi - lo) / steps / 1e3
        spans.append((lo, hi))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return {**kinds, "busy": busy / steps / 1e3}


def step_timeline(step, sync, steps: int) -> list[dict]:
    """Each of `steps` profiled steps on this rank's GPU (CUDA activity only), cut at a marker kernel
    launched on the compute stream before each step: its span, the compute stream's busy ms, its
    idle ms and its longest idle gaps, each with where in the step it began and the kernels on either
    side (the GPU waiting on the host's launches, or on a collective it was told to wait for), NCCL's
    kernel ms with the longest one (a collective's kernel runs until its peer joins, so a long one
    means the other rank was late), and the copy engines' ms (memcpy activity: the copy-engine
    collectives' pulls and pushes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda._sleep(1)  # the marker: aten's "spin_kernel", launched nowhere else
            step()
        torch.cuda._sleep(1)
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    marks = [e for e in kernels if "spin_kernel" in e["name"]]
    compute = marks[0]["args"]["stream"]
    out = []
    for lo, hi in zip(marks, marks[1:]):
        start, stop = lo["ts"] + lo["dur"], hi["ts"]
        inside = [e for e in kernels if lo["ts"] < e["ts"] < hi["ts"]]
        mine = [e for e in inside if e["args"]["stream"] == compute]
        nccl = [e for e in inside if "nccl" in e["name"].lower()]
        gaps, end, before = [], start, "step start"
        for e in mine:
            if e["ts"] > end:
                gaps.append((e["ts"] - end, end - start, before, e["name"][:50]))
            if e["ts"] + e["dur"] > end:
                end, before = e["ts"] + e["dur"], e["name"][:50]
        if stop > end:
            gaps.append((stop - end, end - start, before, "step end"))
        gaps.sort(reverse=True)
        longest = max(nccl, key=lambda e: e["dur"], default=None)
        out.append({
            "ms": (stop - start) / 1e3, "compute_busy_ms": sum(e["dur"] for e in mine) / 1e3,
            "idle_ms": sum(g[0] for g in gaps) / 1e3,
            "longest_gap_ms": gaps[0][0] / 1e3 if gaps else 0.0, "gap_before": gaps[0][3] if gaps else "",
            "gaps": [{"ms": g / 1e3, "at_ms": at / 1e3, "after": a, "before": b} for g, at, a, b in gaps[:4]],
            "nccl_ms": sum(e["dur"] for e in nccl) / 1e3,
            "longest_nccl_ms": longest["dur"] / 1e3 if longest else 0.0,
            "longest_nccl": longest["name"][:40] if longest else "",
            "copy_engine_ms": sum(e["dur"] for e in copies if start < e["ts"] < stop) / 1e3,
        })
    return out
