"""One process of tests/distributed/test_moe_ep.py (gloo on the CPU): RANK of WORLD runs a DeepwellMoE block
sharded by deepwell.expert_parallel on its rows of a global batch, and beside it the unsharded
block (the same initial weights) on the whole batch, the reference. Rank 0 writes to OUT, per case,
the largest relative errors of the outputs (each rank's rows), the input gradients, the routed
experts' weight gradients (each rank's slice) and the replicated parameters' gradients (summed
over the ranks), and how many rows each rank's experts computed.

DEEPWELL_TEST_RECIPE sets the experts' recipe (bf16 or fp8_block, emulated on the CPU).

    python tests/distributed/_moe_ep_worker.py RANK WORLD STORE OUT
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

import deepwell
from deepwell.nn import moe_ep
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _util
from _util import finish_rank  # noqa: E402

DIM, FFN, EXPERTS, TOP_K, BATCH, SEQ = 128, 128, 4, 2, 4, 48
RECIPE = os.environ.get("DEEPWELL_TEST_RECIPE", "bf16")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_case(bias: list[float] | None, rank: int, world: int) -> dict:
    """One forward + backward of both blocks; `bias`: the expert bias (selection only), to steer
    every token to some experts (and none to a rank)."""
    torch.manual_seed(0)
    full = deepwell.DeepwellMoE(DIM, FFN, EXPERTS, TOP_K, recipe=RECIPE, num_shared_experts=1,
                                expert_bias=bias is not None, aux_loss_coef=0.01)
    if bias is not None:
        full.expert_bias.copy_(torch.tensor(bias))
    block = copy.deepcopy(full)
    assert deepwell.expert_parallel(block) == 1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, generator=g)
    dy = torch.randn(BATCH, SEQ, DIM, generator=g)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)

    rows = []
    real = moe_ep.run_experts

    def counting(xp, offsets, expert_ffn, ep_size, group):
        def ffn(r, offs):
            rows.append(r.shape[0])
            return expert_ffn(r, offs)

        return real(xp, offsets, ffn, ep_size, group)

    moe_ep.run_experts = counting
    try:
        xe = x[mine].clone().requires_grad_()
        ye = block(xe)
        (ye * dy[mine]).sum().backward()
    finally:
        moe_ep.run_experts = real
    xf = x.clone().requires_grad_()
    yf = full(xf)
    (yf * dy).sum().backward()

    local = EXPERTS // world
    keep = slice(rank * local, (rank + 1) * local)
    expert_grads = [rel(getattr(block.experts, n).grad, getattr(full.experts, n).grad[keep])
                    for n in ("gate_up_proj", "down_proj")]
    replicated = dict(block.named_parameters())
    shared_errs = []
    for name, p in full.named_parameters():
        if name.startswith("experts."):
            continue
        grad = replicated[name].grad.clone()
        dist.all_reduce(grad)  # each rank's tokens' share: summed, the whole batch's
        shared_errs.append(rel(grad, p.grad))
    return {
        "y": rel(ye, yf[mine]),
        "x_grad": rel(xe.grad, xf.grad[mine]),
        "expert_grads": max(expert_grads),
        "replicated_grads": max(shared_errs),
        "rows": rows[0],
        "local_experts": block.experts.gate_up_proj.shape[0],
    }


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cases = {
        "spread": run_case(None, rank, world),
        # Every token to experts 0 and 1 (rank 0's): rank 1's experts compute no row.
        "one_rank": run_case([10.0, 10.0, -10.0, -10.0], rank, world),
    }
    every = [None] * world
    dist.all_gather_object(every, cases)
    finish_rank({"ranks": every}, rank, world, out)


if __name__ == "__main__":
    main()
