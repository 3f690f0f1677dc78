"""Shared helpers of the benchmark scripts: timing with CUDA events, the environment header, and
the JSON written to benchmarks/results/."""

from __future__ import annotations

import datetime
import json
import os
import platform

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def time_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of `fn()` measured with CUDA events, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def environment() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {
        "device": p.name,
        "sm": f"{p.major}.{p.minor}",
        "sms": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


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
