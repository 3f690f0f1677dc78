"""One process of tests/distributed/test_copy_engine.py's 2-GPU runs (NCCL, one GPU per process).

DEEPWELL_TEST_CASE=collectives: the copy-engine all-gather and reduce-scatter (distributed/copy_engine.py)
against NCCL's on the same random data, bit for bit: several sizes, bf16 and uint8, SUM and AVG,
PREMUL_SUM and one all-gather larger than the staging buffer (both handed to NCCL), and a run of
all-gathers and reduce-scatters issued alternately on two streams, as FSDP2 overlaps them. Writes
each case's verdict to OUT.

DEEPWELL_TEST_CASE=train: a small LLaMA through deepwell.compile with FSDP2 over the 2 GPUs, the
plan's collectives set to DEEPWELL_TEST_COLLECTIVES; writes the losses of 4 steps to OUT.

    python tests/distributed/_copy_engine_worker.py RANK WORLD STORE OUT
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _util
from _util import finish_rank  # noqa: E402

CASE = os.environ.get("DEEPWELL_TEST_CASE", "collectives")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def collectives(rank: int, world: int, device: torch.device) -> dict:
    from deepwell.distributed import copy_engine

    group = dist.group.WORLD
    # Staging sized as for one FSDP unit of world x 5 Mi bf16 elements: the 6 Mi all-gather below
    # goes to NCCL instead (the comm's fallback), the rest to the copy engines.
    unit = [torch.empty(world * (5 << 20), dtype=torch.bfloat16, device="meta")]
    gather, scatter = copy_engine.make_comms(group, [unit], device)
    gen = torch.Generator(device=device).manual_seed(100 + rank)  # every rank its own data
    verdicts = {}

    def shard_data(n, dtype):
        if dtype == torch.uint8:
            return torch.randint(0, 256, (n,), generator=gen, device=device, dtype=torch.uint8)
        return (torch.randn(n, generator=gen, device=device) * 3).to(dtype)

    def gathered(n, dtype):
        size = world * n * torch.empty((), dtype=dtype).element_size()
        output = torch.full((size,), 255, dtype=torch.uint8, device=device).view(dtype)  # poisoned
        shard = output[rank * n:(rank + 1) * n]
        shard.copy_(shard_data(n, dtype))
        ref = torch.empty_like(output)
        dist.all_gather_into_tensor(ref, shard.clone(), group=group)
        return output, shard, ref

    for n, dtype in [(1000, torch.bfloat16), (3 << 20, torch.bfloat16), (777, torch.uint8), (5 << 20, torch.bfloat16),
                     (6 << 20, torch.bfloat16)]:
        output, shard, ref = gathered(n, dtype)
        gather(output, shard, group)
        torch.cuda.synchronize()
        verdicts[f"all_gather {n} {dtype}"] = same_bits(output, ref)

    def scattered(n, op):
        chunks = shard_data(world * n, torch.bfloat16)
        ref = torch.empty(n, dtype=torch.bfloat16, device=device)
        dist.reduce_scatter_tensor(ref, chunks.clone(), op=op, group=group)
        output = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=device)
        return chunks, output, ref

    premul = dist._make_nccl_premul_sum(0.25)
    for n, op, name in [(4096, dist.ReduceOp.SUM, "SUM"), ((3 << 20) + 5, dist.ReduceOp.AVG, "AVG"),
                        (1001, dist.ReduceOp.AVG, "AVG"), (2048, premul, "PREMUL_SUM")]:
        chunks, output, ref = scattered(n, op)
        scatter(output, chunks, group, op)
        torch.cuda.synchronize()
        verdicts[f"reduce_scatter {n} {name}"] = same_bits(output, ref)

    # FSDP2 overlaps a unit's all-gather with another's reduce-scatter on two streams.
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    sizes = torch.randint(1, 1 << 20, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    pending = []
    for i, n in enumerate(sizes):
        output, shard, ref = gathered(n, torch.bfloat16)
        chunks, out_rs, ref_rs = scattered(n, dist.ReduceOp.AVG)
        torch.cuda.synchronize()
        with torch.cuda.stream(streams[0]):
            gather(output, shard, group)
        with torch.cuda.stream(streams[1]):
            scatter(out_rs, chunks, group, dist.ReduceOp.AVG)
        pending.append((output, ref, out_rs, ref_rs))
    torch.cuda.synchronize()
    verdicts["overlapped on two streams"] = all(same_bits(o, r) and same_bits(o2, r2) for o, r, o2, r2 in pending)
    return {"verdicts": verdicts}


def train(rank: int, world: int, device: torch.device) -> dict:
    import deepwell
    import deepwell.compiler.backend
    from deepwell.models import Llama
    from deepwell.train.distributed import shard_rows

    deepwell.compiler.backend.ensure_registered()
    torch.manual_seed(0)
    model = Llama(512, 256, 4, 4, 768, max_seq=128).to(device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (4, 128), generator=g)
    targets = torch.randint(0, 512, (4, 128), generator=g)
    mine, my_targets = shard_rows(tokens.to(device)), shard_rows(targets.to(device))
    ir = deepwell.capture(model, (mine,))
    plan = deepwell.autoplan(ir, hw=deepwell.probe(), precision="fp8_block")
    plan.sharding["collectives"] = os.environ["DEEPWELL_TEST_COLLECTIVES"]
    plan.sharding["sm_carveout"] = 0
    engine = deepwell.compile(ir, plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for _ in range(4):
        logits = engine(mine)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), my_targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {"losses": losses, "collectives": plan.sharding["collectives"]}


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.FileStore(store, world), rank=rank, world_size=world, device_id=device)
    result = collectives(rank, world, device) if CASE == "collectives" else train(rank, world, device)
    finish_rank(result, rank, world, out)


if __name__ == "__main__":
    main()
