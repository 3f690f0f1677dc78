"""One benchmark script run under two trees, a "before" and an "after", interleaved in one GPU
session, and a table of its key rows under both with the ratio after / before.

The after tree is this checkout (its torch_ops/ and the library `DEEPWELL_LIBRARY` names, else
.device/libdeepwell.so); the before tree is a directory (default .device/before/) holding the other
commit's torch_ops/ and libdeepwell.so, and its benchmarks/ where the script's arguments or the op
names it calls differ between the two (without benchmarks/ there, this tree's script runs under both).
Each tree runs `--rounds` times (default 2), the order alternating per round (before, after; then
after, before; ...), so that the GPU's clock drift over the session falls on both alike. Each run
is a separate process with PYTHONPATH and DEEPWELL_LIBRARY switched; its rows are read from the
JSON the script writes (the "wrote PATH" line it prints).

Key rows: bench_linear.py, every row with a step time (ms, lower is better), by shape and recipe;
bench_train_step.py, every run's tokens/s (higher is better). The table gives each tree's mean over
its rounds, and after / before (for tokens/s above 1 is faster; for ms below 1 is faster).

    python benchmarks/before_after.py linear [--before .device/before] [--rounds 2] [-- ARGS...]
    python benchmarks/before_after.py train [-- ARGS...]

ARGS go to the script (defaults keep each run near a minute on an H200: linear `--shape 3`, the
8192 x 2048 x 5632 layer, where per-call host time matters; train `--quick --torchao ''
--precisions auto,fp8_tensor`).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"linear": "bench_linear.py", "train": "bench_train_step.py"}
DEFAULT_ARGS = {"linear": ["--shape", "3"], "train": ["--quick", "--torchao", "", "--precisions", "auto,fp8_tensor"]}


def _tree(root: str, library: str) -> dict:
    return {"torch_ops": os.path.join(root, "torch_ops"), "library": library, "benchmarks": os.path.join(root, "benchmarks")}


def key_rows(bench: str, rows: list[dict]) -> dict[str, tuple[float, str]]:
    """name -> (value, unit) of the rows the table compares."""
    out = {}
    for r in rows:
        if bench == "linear" and "step_ms" in r:
            out[f"{r['m']}x{r['k']}x{r['n']} {r['recipe']}"] = (r["step_ms"], "ms")
        elif bench == "train" and "tokens_per_s" in r:
            out[r["what"]] = (r["tokens_per_s"], "tok/s")
    return out


def run_once(bench: str, tree: dict, fallback: str, args: list[str], log) -> dict[str, tuple[float, str]]:
    """The script under `tree` (its own copy where it has one); its key rows."""
    script = os.path.join(tree["benchmarks"], SCRIPTS[bench])
    script = script if os.path.exists(script) else os.path.join(fallback, SCRIPTS[bench])
    env = dict(os.environ, PYTHONPATH=tree["torch_ops"], DEEPWELL_LIBRARY=tree["library"], PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    log.write(proc.stdout + proc.stderr)
    log.flush()
    if proc.returncode != 0:
        raise SystemExit(f"{script} under {tree['torch_ops']} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    wrote = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    if not wrote:
        raise SystemExit(f"{script} printed no 'wrote PATH' line")
    with open(os.path.join(ROOT, wrote[-1])) as f:
        rows = json.load(f)["rows"]
    print(f"  {os.path.relpath(script, ROOT)} under {os.path.relpath(tree['torch_ops'], ROOT)}: "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return key_rows(bench, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=sorted(SCRIPTS))
    p.add_argument("--before", default=os.path.join(ROOT, ".device", "before"),
                   help="the before tree: torch_ops/, libdeepwell.so, optionally benchmarks/")
    p.add_argument("--rounds", type=int, default=2)
    out = os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "deepwell-out")  # as device_run.sh's
    p.add_argument("--out", default=out, help="logs and JSON go here")
    argv = sys.argv[1:]
    ours, args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = p.parse_args(ours)  # after '--': the script's arguments
    args = args or DEFAULT_ARGS[a.bench]
    after_lib = os.environ.get("DEEPWELL_LIBRARY") or os.path.join(ROOT, ".device", "libdeepwell.so")
    trees = {"before": _tree(a.before, os.path.join(a.before, "libdeepwell.so")), "after": _tree(ROOT, after_lib)}
    for name, tree in trees.items():
        for path in (tree["torch_ops"], tree["library"]):
            if not os.path.exists(path):
                raise SystemExit(f"the {name} tree has no {path}")
    os.makedirs(a.out, exist_ok=True)
    results: dict[str, list[dict]] = {"before": [], "after": []}
    with open(os.path.join(a.out, f"before_after-{a.bench}.log"), "w") as log:
        for r in range(a.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            print(f"round {r + 1}: {' then '.join(order)}", flush=True)
            for name in order:
                log.write(f"\n=== round {r + 1}: {name}\n")
                results[name].append(run_once(a.bench, trees[name], os.path.join(ROOT, "benchmarks"), args, log))
    names = [k for k in results["after"][0] if all(k in res for res in results["before"] + results["after"])]
    missing = sorted(set().union(*results["before"], *results["after"]) - set(names))
    table = []
    print(f"\n{'row':<58} {'before (min-max)':>30} {'after (min-max)':>30} {'after/before':>12}")
    for k in names:
        unit = results["after"][0][k][1]
        before = [res[k][0] for res in results["before"]]
        after = [res[k][0] for res in results["after"]]
        ratio = statistics.mean(after) / statistics.mean(before)

        def cell(vs):
            return f"{statistics.mean(vs):.4g} {unit} ({min(vs):.4g}-{max(vs):.4g})"

        print(f"{k:<58} {cell(before):>30} {cell(after):>30} {ratio:12.3f}")
        table.append({"row": k, "unit": unit, "before": before, "after": after, "ratio": ratio})
    if missing:
        print("rows in one tree's runs only (not compared):", ", ".join(missing))
    path = os.path.join(a.out, f"before_after-{a.bench}.json")
    with open(path, "w") as f:
        json.dump({"bench": a.bench, "args": args, "rounds": a.rounds, "rows": table, "not_compared": missing}, f,
                  indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
