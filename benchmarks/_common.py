"""Shared helpers of the benchmark scripts: timing with CUDA events, the environment header, and
the JSON written to benchmarks/results/."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def first_call_s(fn) -> float:
    """Seconds of `fn()`'s first call, compilation included, with the peak-memory counter reset
    first (so the peak read after the timed calls covers the whole run)."""
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_ms(fn, warmup: int = 5, iters: int = 20, reps: int = 7) -> float:
    """Milliseconds per call of `fn()`: `iters` back-to-back calls between two CUDA events (the
    launch queue stays full, so host overhead per call overlaps the previous kernel, as in a
    training step), median over `reps` repetitions, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    samples.sort()
    return samples[len(samples) // 2]


def step_times_ms(fn, warmup: int = 3, steps: int = 10) -> list[float]:
    """Milliseconds of each of `steps` back-to-back calls of `fn()` after `warmup`: a CUDA event
    after each call, none of them waited on until the last (the launch queue stays full, as in
    training). Their mean is what `time_ms(fn, warmup, steps, reps=1)` reads; each one on its own
    shows a single slow call (a recompile, a host pause) that a mean over one window hides."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for event in events[1:]:
        fn()
        event.record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def environment(device: str = "cuda") -> dict:
    """Where the run happened: the GPU (name, SM version and count) or, for a `device="cpu"` run,
    "cpu" with its threads as `sms`; torch, CUDA and Python versions; the UTC date."""
    common = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device == "cpu":
        return {"device": "cpu", "sm": "0.0", "sms": torch.get_num_threads(), **common, "cuda": None}
    p = torch.cuda.get_device_properties(0)
    return {"device": p.name, "sm": f"{p.major}.{p.minor}", "sms": p.multi_processor_count, **common}


def header(title: str, env: dict) -> None:
    print(f"# {title}")
    print(f"# {env['device']} (sm_{env['sm'].replace('.', '')}, {env['sms']} SMs), torch {env['torch']}, CUDA {env['cuda']}, {env['date']}")


def write_json(name: str, env: dict, rows: list[dict], extra: dict | None = None) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    device = env["device"].replace(" ", "_")
    path = os.path.join(RESULTS, f"{name}-{device}-{env['date'][:10]}.json")
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows, **(extra or {})}, f, indent=1)
    return path


def torchao_float8(model: torch.nn.Module, recipe: str = "tensorwise"):
    """`model` with torchao's float8 training linears (the peer a Hopper user would otherwise pick),
    the LM head (`output`) kept in bf16 as deepwell's policy does; None when torchao is absent."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "output")


def torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__
