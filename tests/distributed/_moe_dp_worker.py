"""One process of tests/distributed/test_moe_parallel.py (gloo on the CPU): RANK of WORLD trains the small MoE
language model of tests/distributed/_moe_lm.py (its blocks with aux-loss-free balancing and the Switch aux
loss) through deepwell's step API (capture, autoplan, compile: FSDP2 over the data ranks) on its
rows of the same global batches, moving the expert biases after every optimizer step (each
block's `update_expert_bias()` on even steps, the Trainer's `update_expert_biases(model)` on odd
ones). Then a step the optimizer skipped (`update_expert_biases(model, skipped=...)`, the Trainer's
on-device skip) must leave the biases and each rank's own counts, so that the next update equals
one update of both steps' counts. It writes the ranks' mean losses, every rank's expert biases and
that check to OUT (rank 0). With
WORLD=1 it is the single-process reference. DEEPWELL_TEST_RECIPE sets the experts' recipe
(default fp8_block, emulated on the CPU).

    python tests/distributed/_moe_dp_worker.py RANK WORLD STORE OUT
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import deepwell
import deepwell.compiler.backend
from deepwell.nn.moe import update_expert_biases
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _util
from _moe_lm import MoELM  # noqa: E402
from _util import finish_rank  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, DIM, EXPERTS, TOP_K, LAYERS = 3, 4, 32, 256, 128, 4, 2, 2
RECIPE = os.environ.get("DEEPWELL_TEST_RECIPE", "fp8_block")
RATE = 0.01


def _skipped_update(model, rank: int) -> dict:
    moes = [layer.moe for layer in model.layers]
    start = [m.expert_bias.clone() for m in moes]
    first = torch.tensor([rank + 1.0, 0.0, 2.0, 3.0 * rank])  # this rank's counts of the skipped step
    second = torch.tensor([0.0, 4.0, 1.0, 1.0])
    for m in moes:
        m.tokens_per_expert.copy_(first)
    update_expert_biases(model, skipped=torch.tensor(True))
    kept = all(torch.equal(m.expert_bias, b) and torch.equal(m.tokens_per_expert, first) for m, b in zip(moes, start))
    for m in moes:
        m.tokens_per_expert.add_(second)
    update_expert_biases(model)
    after_skip = [m.expert_bias.clone() for m in moes]
    for m, b in zip(moes, start):  # the same from one update of both steps' counts
        m.expert_bias.copy_(b)
        m.tokens_per_expert.copy_(first + second)
    update_expert_biases(model)
    return {"kept": kept, "same": all(torch.equal(a, m.expert_bias) for a, m in zip(after_skip, moes)),
            "moved": not all(torch.equal(a, b) for a, b in zip(after_skip, start))}


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    deepwell.compiler.backend.ensure_registered()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = MoELM(VOCAB, DIM, LAYERS, EXPERTS, TOP_K, expert_bias=True, bias_update_rate=RATE,
                  aux_loss_coef=0.01, recipe=RECIPE)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    local = BATCH // world
    rows = slice(rank * local, (rank + 1) * local)
    ir = deepwell.capture(model, (data[0, rows, :-1],))
    plan = deepwell.autoplan(ir, policy=deepwell.PrecisionPolicy(precision=RECIPE, min_features=128,
                                                                 first_last_bf16=False))
    engine = deepwell.compile(ir, plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        tokens, targets = data[step, rows, :-1], data[step, rows, 1:]
        loss = torch.nn.functional.cross_entropy(engine(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 2 == 0:  # each block's own update (an all-reduce each) ...
            for layer in model.layers:
                layer.moe.update_expert_bias(rate=RATE)
        else:  # ... and the Trainer's, every block's counts in one all-reduce
            assert update_expert_biases(model) == LAYERS
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    skip = _skipped_update(model, rank)
    biases = torch.stack([layer.moe.expert_bias for layer in model.layers])
    every = [torch.zeros_like(biases) for _ in range(world)]
    if world > 1:
        dist.all_gather(every, biases)
    else:
        every = [biases]
    result = {
        "losses": losses,
        "biases": [b.tolist() for b in every],
        "parallelism": plan.parallelism,
        "sharded": type(model).__name__,
        "experts_sharded": type(model.layers[0].moe.experts.gate_up_proj).__name__,
        "skipped_update": skip,
    }
    finish_rank(result, rank, world, out)


if __name__ == "__main__":
    main()
