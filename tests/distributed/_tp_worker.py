"""One process of tests/distributed/test_tensor_parallel.py's sharding-rule check (gloo on the CPU): deepwell's
linear ops on DTensors (the rules of deepwell/ops/sharding.py) against the same ops on the whole
tensors, for each recipe in DEEPWELL_TEST_RECIPES; rank 0 writes the largest differences, whether
they are within their bounds, and the placements DTensor chose to OUT. (The LLaMA runs with tensor
parallelism use tests/distributed/_fsdp_worker.py.)

    python tests/distributed/_tp_worker.py RANK WORLD STORE OUT
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import deepwell  # noqa: F401  (the ops and their sharding rules)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _util
from _util import finish_rank  # noqa: E402

U = 2.0**-24  # fp32's unit roundoff
LAYOUTS = ("colwise", "rowwise", "replicated")


def _bound(a: torch.Tensor, b: torch.Tensor, length: int) -> torch.Tensor:
    """Per element, how far a sum of `length` products split over the ranks may be from one GEMM's
    sum: both are within gamma_length * (|a| @ |b|) of the exact sum (Higham, Accuracy and Stability,
    eq. 3.5: gamma_n = n*u / (1 - n*u) ~ n*u in fp32), so they are within twice that of each other;
    the +1 is the all-reduce's addition, the 1/8 margin covers |a|, |b| being the operands before
    quantization (E4M3's relative step is 2^-3 at most)."""
    return (a.abs() @ b.abs()) * (2 * (length + 1) * U * 1.125)


def _compare(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor | None) -> dict:
    diff = (got - ref).abs()
    return {"max_diff": diff.max().item(), "within_bound": None if bound is None else bool((diff <= bound).all())}


def _ops(world: int) -> dict:
    """For each recipe and layout: y, dx, dW of scaled_linear on DTensors vs on the whole tensors
    (every rank holds the same whole tensors, so the reference is local)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    k, n = 512, 256  # per rank: k 256, n 128, whole fp8_block blocks
    x = torch.randn(2, 64, k, generator=g)  # a leading batch dim: the rules' Shard(-1) is dim 2
    w = torch.randn(n, k, generator=g) / k**0.5
    dy = torch.randn(2, 64, n, generator=g)
    bounds = {"y": _bound(x, w.T, k), "dx": _bound(dy, w, n)}  # dW's sum (over tokens) is never split
    placements = {  # x, W, dy
        "colwise": ([Replicate()], [Shard(0)], [Shard(2)]),
        "rowwise": ([Shard(2)], [Shard(1)], [Replicate()]),
        "replicated": ([Replicate()], [Replicate()], [Replicate()]),
    }
    results = {}
    for recipe in os.environ.get("DEEPWELL_TEST_RECIPES", "bf16,fp8_block").split(","):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y_ref = torch.ops.deepwell.scaled_linear(xr, wr, None, recipe, 0)
        y_ref.backward(dy)
        ref = {"y": y_ref.detach(), "dx": xr.grad, "dw": wr.grad}
        for layout in LAYOUTS:
            xp, wp, dyp = placements[layout]
            xd = distribute_tensor(x, mesh, xp).requires_grad_()
            wd = distribute_tensor(w, mesh, wp).requires_grad_()
            y = torch.ops.deepwell.scaled_linear(xd, wd, None, recipe, 0)
            y.backward(distribute_tensor(dy, mesh, dyp))
            got = {"y": y.detach().full_tensor(), "dx": xd.grad.full_tensor(), "dw": wd.grad.full_tensor()}
            row = {name: _compare(got[name], ref[name], bounds.get(name)) for name in got}
            # The placements DTensor chose: the rules' own (no redistribution behind them).
            row["placements"] = [repr(t.placements[0]) for t in (y, xd.grad, wd.grad)]
            # The backward op alone with only dW asked for: dx comes back empty.
            gx, gw = torch.ops.deepwell.scaled_linear_backward(
                distribute_tensor(dy, mesh, dyp), xd.detach(), wd.detach(), recipe, 0, False, True
            )
            row["weight_only"] = bool(gx.to_local().numel() == 0 and torch.equal(gw.full_tensor(), wr.grad))
            results[f"{recipe}/{layout}"] = row
    # A bias: column-parallel splits it with W's rows; row-parallel declares it Partial, so DTensor
    # adds it once to the sum (its Replicate -> Partial step divides it by the ranks: not bitwise).
    b = torch.randn(n, generator=g)
    y_ref = torch.ops.deepwell.scaled_linear(x, w, b, "fp8_block", 0)
    for layout in LAYOUTS:
        xp, wp, _ = placements[layout]
        bp = [Shard(0)] if layout == "colwise" else [Replicate()]
        y = torch.ops.deepwell.scaled_linear(
            distribute_tensor(x, mesh, xp), distribute_tensor(w, mesh, wp), distribute_tensor(b, mesh, bp), "fp8_block", 0
        )
        results[f"bias/{layout}"] = {"y": _compare(y.full_tensor(), y_ref, bounds["y"] + b.abs() * 4 * U)}
    # mxfp8_linear takes the same rules without a recipe argument.
    y_ref = torch.ops.deepwell.mxfp8_linear(x, w)
    for layout in LAYOUTS:
        xp, wp, _ = placements[layout]
        y = torch.ops.deepwell.mxfp8_linear(distribute_tensor(x, mesh, xp), distribute_tensor(w, mesh, wp))
        results[f"mxfp8_linear/{layout}"] = {"y": _compare(y.full_tensor(), y_ref, bounds["y"])}
    return results


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = _ops(world)
    finish_rank(result, rank, world, out)


if __name__ == "__main__":
    main()
