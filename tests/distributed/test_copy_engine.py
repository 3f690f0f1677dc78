"""FSDP2's collectives on the copy engines (torch_ops/deepwell/distributed/copy_engine.py).

On the CPU, threads stand in for the ranks (a shared dict for the symmetric staging buffers, a
threading.Barrier for the signal pads), which checks the protocol itself: which bytes go to which
peer's slot, the sum in rank order, AVG, the buffers' growth, the size checks. With 2 GPUs, the real
collectives against NCCL's bit for bit, and a training run whose losses equal the NCCL run's."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.distributed as dist

from _util import spawn
from deepwell.distributed import copy_engine


class ThreadPeers:
    """copy_engine.Peers for rank `rank` of `world` threads: staging buffers in `shared`."""

    def __init__(self, rank: int, world: int, shared: dict, barrier: threading.Barrier):
        self.rank, self.world, self.shared, self._barrier = rank, world, shared, barrier
        self.grown, self.capacity = 0, None  # capacity: bytes past which staging() returns None

    def staging(self, nbytes):
        if self.rank not in self.shared or self.shared[self.rank].numel() < nbytes:
            if self.capacity is not None and nbytes > self.capacity:
                return None
            self.shared[self.rank] = torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # poisoned
            self.grown += 1
        return self.shared[self.rank]

    def remote(self, peer, nbytes, offset=0):
        return self.shared[peer][offset:offset + nbytes]

    def barrier(self):
        self._barrier.wait(timeout=30)

    def run_on_own_stream(self):
        return contextlib.nullcontext()


def run_ranks(world: int, body) -> list:
    """body(peers) on `world` threads at once; their results in rank order (a thread's exception
    re-raised)."""
    shared, barrier = {}, threading.Barrier(world)
    peers = [ThreadPeers(r, world, shared, barrier) for r in range(world)]
    results, errors = [None] * world, []

    def run(r):
        try:
            results[r] = body(peers[r])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def data(rank: int, n: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 7 * rank + n)
    return (torch.randn(n, generator=g) * 5).to(dtype)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_all_gather_puts_every_rank_shard_at_its_place(world, dtype):
    sizes = [5, 1000, 3]  # the second grows the staging buffers, the third reuses them

    def body(peers):
        outs = []
        for n in sizes:
            output = torch.full((world * n,), 77, dtype=torch.uint8).view(dtype) if dtype == torch.uint8 else \
                torch.full((world * n,), float("nan"), dtype=dtype)
            shard = output[peers.rank * n:(peers.rank + 1) * n]
            shard.copy_(data(peers.rank, n, torch.float32).to(dtype))
            copy_engine.all_gather(peers, output, shard)
            outs.append(output.clone())
        return outs, peers.grown

    results = run_ranks(world, body)
    for i, n in enumerate(sizes):
        expected = torch.cat([data(r, n, torch.float32).to(dtype) for r in range(world)])
        for r, (outs, _) in enumerate(results):
            assert torch.equal(outs[i], expected), (n, r)
    assert all(grown == 2 for _, grown in results)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("average", [False, True])
def test_reduce_scatter_sums_each_rank_chunk_over_the_ranks(world, average):
    n = 513

    def body(peers):
        chunks = data(peers.rank, world * n)
        output = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        copy_engine.reduce_scatter(peers, output, chunks, average)
        second = torch.full((n,), float("nan"), dtype=torch.bfloat16)  # again, on the same buffers
        copy_engine.reduce_scatter(peers, second, chunks * 2, average)
        return output, second

    results = run_ranks(world, body)
    for r, (output, second) in enumerate(results):
        terms = torch.stack([data(q, world * n).reshape(world, n)[r] for q in range(world)])
        if world == 2:  # one rounding of a + b, as NCCL's ring: exact, not within a tolerance
            expected = terms[0] + terms[1]
        else:
            expected = terms.sum(0)
        if average:
            expected = expected / world
        assert torch.equal(output, expected), r
        assert torch.equal(second, expected * 2), r
    if world == 2:  # the sum is the same on both ranks' chunks whichever rank adds
        a, b = data(0, 2 * n).reshape(2, n), data(1, 2 * n).reshape(2, n)
        assert torch.equal(results[0][0], (a[0] + b[0]) / (2 if average else 1))


def test_sizes_that_do_not_match_raise_naming_the_collective():
    def gather(peers):
        copy_engine.all_gather(peers, torch.zeros(10), torch.zeros(4))

    with pytest.raises(RuntimeError, match="copy-engine all-gather: output must hold 2 shards of 16 bytes, got 40"):
        run_ranks(2, gather)

    def scatter(peers):
        copy_engine.reduce_scatter(peers, torch.zeros(4), torch.zeros(9), True)

    with pytest.raises(RuntimeError, match="copy-engine reduce-scatter: input must be 2 chunks"):
        run_ranks(2, scatter)


@pytest.mark.parametrize("world", [2, 4])
def test_staging_bytes_predicts_the_buffers_the_collectives_ask_for(world):
    """dryrun's `staging_bytes` (what make_comms allocates) against the sizes all_gather and
    reduce_scatter request for a unit of `shard` elements per rank (its gradients: `world` chunks
    of as many)."""
    shard = 300_001
    asked = {}

    class Recording(ThreadPeers):
        def staging(self, nbytes):
            asked[(self.rank, len(asked) % 2)] = nbytes
            return super().staging(nbytes)

    def body(peers):
        peers.__class__ = Recording
        output = torch.zeros(world * shard, dtype=torch.bfloat16)
        copy_engine.all_gather(peers, output, output[peers.rank * shard:(peers.rank + 1) * shard])
        copy_engine.reduce_scatter(peers, torch.zeros(shard, dtype=torch.bfloat16), output, False)

    run_ranks(world, body)
    gather, scatter = 2 * shard, 2 * shard * (world - 1)
    assert sorted(set(asked.values())) == sorted({gather, scatter})
    unit = [torch.empty(world * shard, dtype=torch.bfloat16, device="meta")]  # a shard of `shard` per rank
    predicted = copy_engine.staging_bytes([unit], world)
    assert predicted == copy_engine.rounded(gather) + copy_engine.rounded(scatter)


def test_a_collective_larger_than_the_staging_is_left_to_the_process_group():
    """all_gather / reduce_scatter return False, touching nothing, when the staging buffer (sized
    for the largest unit when the plan is applied) cannot hold it: the comm then calls NCCL."""
    def body(peers):
        peers.capacity = 64
        output = torch.full((2 * 100,), float("nan"))
        done = copy_engine.all_gather(peers, output, output[:100])
        out = torch.full((100,), float("nan"))
        done_rs = copy_engine.reduce_scatter(peers, out, torch.ones(200), False)
        return done, done_rs, bool(output.isnan().all()), bool(out.isnan().all())

    assert run_ranks(2, body) == [(False, False, True, True)] * 2


def test_unit_bytes_count_fsdp_padded_shards():
    """FSDP2 pads dim 0 to a multiple of the ranks: a (5, 3) bf16 weight's shard is 3 rows on 2
    ranks (18 bytes), a 0-d or 1-d fp32 parameter its rows' share."""
    params = [torch.zeros(5, 3, dtype=torch.bfloat16), torch.zeros(7), torch.zeros(())]
    assert copy_engine.unit_bytes(params, 2) == 18 + 16 + 4
    assert copy_engine.unit_bytes(params, 4) == 12 + 8 + 4


def test_only_sum_and_average_run_on_the_copy_engines():
    assert copy_engine.reduce_is_average(dist.ReduceOp.SUM) is False
    assert copy_engine.reduce_is_average(dist.ReduceOp.AVG) is True
    assert copy_engine.reduce_is_average(dist.ReduceOp.MAX) is None
    if hasattr(dist, "_make_nccl_premul_sum"):
        assert copy_engine.reduce_is_average(dist._make_nccl_premul_sum(0.5)) is None


def two_gpus(test):
    """A GPU test (the `gpu` marker) that needs 2 GPUs of one node."""
    return pytest.mark.gpu(pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")(test))


@pytest.mark.distributed
@two_gpus
def test_copy_engine_collectives_equal_nccl_bit_for_bit(tmp_path):
    verdicts = spawn(tmp_path, "distributed/_copy_engine_worker.py", 2, "collectives", DEEPWELL_TEST_CASE="collectives")["verdicts"]
    assert verdicts and all(verdicts.values()), verdicts


@pytest.mark.distributed
@two_gpus
def test_fsdp_training_on_copy_engines_gives_nccl_losses(tmp_path):
    runs = {c: spawn(tmp_path, "distributed/_copy_engine_worker.py", 2, c, DEEPWELL_TEST_CASE="train", DEEPWELL_TEST_COLLECTIVES=c)
            for c in ("copy_engine", "process_group")}
    assert runs["copy_engine"]["collectives"] == "copy_engine"
    assert runs["copy_engine"]["losses"] == runs["process_group"]["losses"], runs
