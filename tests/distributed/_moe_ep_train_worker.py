"""One process of tests/distributed/test_moe_ep.py's training test (gloo on the CPU): RANK of WORLD trains the
small MoE language model of tests/distributed/_moe_lm.py (eager, SGD) on its rows of the same global batches,
its experts split by deepwell.expert_parallel and its gradients made whole by
deepwell.reduce_gradients. Rank 0 writes the mean losses and, per
rank, its local experts' final weights' distance to the single-process run's (WORLD=1, the
reference, writes its full expert weights; DEEPWELL_TEST_REFERENCE names its JSON for the others).
DEEPWELL_TEST_RECIPE sets the experts' recipe (default bf16).

    python tests/distributed/_moe_ep_train_worker.py RANK WORLD STORE OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import deepwell
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _util
from _moe_lm import MoELM  # noqa: E402
from _util import finish_rank  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, DIM, EXPERTS, TOP_K, LAYERS = 3, 4, 32, 256, 128, 4, 2, 2
RECIPE = os.environ.get("DEEPWELL_TEST_RECIPE", "bf16")


def experts_of(model) -> list[torch.Tensor]:
    return [getattr(layer.moe.experts, n).detach() for layer in model.layers for n in ("gate_up_proj", "down_proj")]


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = MoELM(VOCAB, DIM, LAYERS, EXPERTS, TOP_K, aux_loss_coef=0.01, num_shared_experts=1, recipe=RECIPE)
    if world > 1:
        assert deepwell.expert_parallel(model) == LAYERS
    # Plain SGD: its step is linear in the gradient, so a wrongly scaled gradient shows in the
    # weights (Adam's normalisation would hide it).
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    initial = [w.clone() for w in experts_of(model)]
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses = []
    for step in range(STEPS):
        tokens, targets = data[step, rows, :-1], data[step, rows, 1:]
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        if world > 1:
            deepwell.reduce_gradients(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    result = {"losses": losses}
    if world == 1:
        result["experts"] = [w.tolist() for w in experts_of(model)]
        # How far training moved the experts: what a wrongly scaled gradient would get wrong.
        result["expert_update"] = min(((w - w0).norm() / w0.norm()).item() for w, w0 in zip(experts_of(model), initial))
    else:
        with open(os.environ["DEEPWELL_TEST_REFERENCE"]) as f:
            reference = [torch.tensor(w) for w in json.load(f)["experts"]]
        local = EXPERTS // world
        keep = slice(rank * local, (rank + 1) * local)
        err = max(((w - r[keep]).norm() / r[keep].norm()).item() for w, r in zip(experts_of(model), reference))
        every = [None] * world
        dist.all_gather_object(every, err)
        result["expert_weight_errors"] = every
    finish_rank(result, rank, world, out)


if __name__ == "__main__":
    main()
