"""FSDP2's all-gather and reduce-scatter moved by the GPUs' copy engines instead of NCCL's kernels,
for data ranks that reach each other's memory directly (one node, NVLink): the plan's
`collectives = "copy_engine"` (rust/core/src/policy/parallel.rs says when and why).

Why: NCCL runs each collective as a kernel that needs SMs, while cuBLASLt's and deepwell's FP8
GEMMs are persistent kernels holding every SM. The plan used to leave 8 SMs to NCCL (the GEMMs then
run ~13% slower: their tiles no longer fill whole waves). A copy engine moves bytes over NVLink
without any SM, so the GEMMs keep them all. Measured on 2 H100s (benchmarks/probe_copy_engine.py,
results/probe_copy_engine-*, two runs): 40 FP8 GEMMs of 8192^3 take 30.5-31.4 ms alone, 33.4-33.7 ms
beside six 256 MB copy-engine pulls, 37.0-37.7 ms beside six NCCL all-gathers of the same bytes,
34.6-35.1 ms with 8 SMs left and 36.6-37.2 ms with the all-gathers on them. The training step:
docs/DESIGN.md "Scale-out" (its bullet "Collectives on the copy engines").

How, with PyTorch's own symmetric memory (torch.distributed._symmetric_memory, CUDA backend: each
rank's staging buffer mapped into every rank's address space, a barrier through its signal pads):
- all-gather (FSDP2's in-place form: this rank's shard is already at its place in the output):
  copy the shard into this rank's staging buffer, barrier, copy every peer's staging buffer into
  its place in the output (over NVLink), barrier (so no rank refills its staging buffer while a
  peer still reads it).
- reduce-scatter (SUM or AVG): barrier (every peer has consumed what was pushed to it last time),
  copy each chunk destined for peer p into p's staging buffer at this rank's slot (`slot`: one per
  other rank), barrier, then sum the ranks' chunks in rank order (one elementwise kernel) into the
  output.
  With 2 ranks the result is the single rounding of a + b that NCCL's ring gives, bit for bit.
- Each kind runs on a stream of its own, whatever stream FSDP2 calls it on (it waits for that
  stream, which then waits for it), so consecutive collectives reuse the staging buffer in order.
  Every rank issues them in the same order (FSDP2's program order), so the barriers pair up.
- The staging buffers are allocated when the plan is applied, sized for the largest unit; nothing
  in a collective blocks the host (`Peers` says why). A collective larger than its staging buffer
  goes to the process group (NCCL) instead, on every rank alike.
- Copies between tensors of one device are `cudaMemcpyAsync` device-to-device in torch, which the
  copy engines carry out; the barriers and the reduction's sum are small kernels.

Costs: one staging buffer per kind, outside PyTorch's caching allocator (so not in
`torch.cuda.max_memory_allocated`; `live_staging_bytes` reports them, dryrun predicts them with
`staging_bytes`): the largest unit's shard for the all-gather, as many bytes from each other rank
for the reduce-scatter. Then the all-gather's local copy into staging, and 4-5
launches per collective where NCCL takes one. Other reduce ops (PREMUL_SUM for a custom gradient
divide factor) go to NCCL unchanged.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

#: Staging buffers are whole multiples of this many bytes.
GRANULE = 2 << 20

#: Every Peers of this process, for `live_staging_bytes`.
_ALL_PEERS: weakref.WeakSet = weakref.WeakSet()


def rounded(nbytes: int) -> int:
    return -(-nbytes // GRANULE) * GRANULE


def unit_bytes(params, world: int) -> int:
    """Bytes of one rank's shard of an FSDP unit's `params` on `world` ranks, which is both what its
    all-gather sends and each chunk of its reduce-scatter: FSDP2 pads each parameter's dim 0 to a
    multiple of `world`, and gathers and reduces in the parameter's dtype here (an FP8-gathered
    weight moves fewer bytes: an upper bound)."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        total += -(-rows // world) * (p.numel() // max(rows, 1)) * p.element_size()
    return total


def unit_params(model: torch.nn.Module, units: list) -> list:
    """Each FSDP unit's parameters (`units`: parallel.py `fsdp_units`), then the root's own (those
    in no unit)."""
    params = [[p for m in unit for p in m.parameters()] for unit in units]
    in_units = {id(p) for unit in params for p in unit}
    return params + [[p for p in model.parameters() if id(p) not in in_units]]


def staging_sizes(units: list, world: int) -> tuple[int, int]:
    """(all-gather, reduce-scatter) staging bytes one rank allocates for FSDP units whose
    parameters are `units`, on `world` ranks: the largest shard, and that many bytes from each
    other rank."""
    shard = max((unit_bytes(params, world) for params in units), default=0)
    return rounded(max(shard, 1)), rounded(max(shard * (world - 1), 1))


def staging_bytes(units: list, world: int) -> int:
    """dryrun's prediction of `live_staging_bytes` (`staging_sizes` together)."""
    return sum(staging_sizes(units, world))


def live_staging_bytes() -> int:
    """Bytes of this process's staging buffers (symmetric memory PyTorch's allocator does not count)."""
    return sum(p.buffer.numel() for p in list(_ALL_PEERS) if p.buffer is not None)


def slot(sender: int, receiver: int) -> int:
    """Where `sender`'s chunk lands in `receiver`'s reduce-scatter staging: one slot per other rank."""
    return sender - (sender > receiver)


class Peers:
    """One rank's staging buffer of `nbytes`, symmetric across a process group, and the stream its
    collectives run on; `channel` keeps the all-gather's and the reduce-scatter's barriers apart.

    Made once, by every rank at the same point (rendezvous is a collective of the hosts), before
    training: nothing inside a collective may block the host. A host waiting on its GPU while that
    GPU waits for a peer's collective the peer's host has not issued yet (it may be behind, its GPU
    stream waiting on this rank's next collective) never returns; a first version that grew its
    buffers on demand (a stream sync and a rendezvous inside the call) hung the 0.95B step that way."""

    def __init__(self, group: dist.ProcessGroup, channel: int, nbytes: int, device: torch.device):
        """`nbytes`: the buffer's size (`staging_sizes`)."""
        from torch.distributed import _symmetric_memory as symm_mem

        self.group, self.channel = group, channel
        self.rank, self.world = group.rank(), group.size()
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.stream = torch.cuda.Stream(device)
        _ALL_PEERS.add(self)

    def staging(self, nbytes: int):
        """This rank's staging buffer (uint8) when it holds `nbytes`, else None (the caller falls
        back to the process group's collective, on every rank alike: the sizes are the same)."""
        return self.buffer if nbytes <= self.buffer.numel() else None

    def remote(self, peer: int, nbytes: int, offset: int = 0) -> torch.Tensor:
        """`nbytes` of `peer`'s staging buffer from `offset`, as a tensor of this device."""
        return self.handle.get_buffer(peer, (nbytes,), torch.uint8, offset)

    def barrier(self) -> None:
        self.handle.barrier(channel=self.channel)

    @contextlib.contextmanager
    def run_on_own_stream(self):
        """Context: this kind's stream, after the caller's; the caller's stream waits for it on exit."""
        caller = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            caller.wait_stream(self.stream)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _fsdp_api():
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def make_comms(group: dist.ProcessGroup, units: list, device: torch.device):
    """(all-gather, reduce-scatter) comm objects for `FSDPModule.set_custom_all_gather` /
    `set_custom_reduce_scatter`, shared by every FSDP unit (`units`: each unit's parameters, the
    root's own among them): one staging buffer per kind, sized for the largest unit and allocated
    now, on every rank at once."""
    AllGather, ReduceScatter = _fsdp_api()
    gather_bytes, scatter_bytes = staging_sizes(units, group.size())
    gather_peers = Peers(group, 0, gather_bytes, device)
    scatter_peers = Peers(group, 1, scatter_bytes, device)

    class CopyEngineAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if not all_gather(gather_peers, output_tensor, input_tensor):
                return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            return None

    class CopyEngineReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            average = reduce_is_average(op)
            if average is None or not reduce_scatter(scatter_peers, output_tensor, input_tensor, average):
                # A reduction the copy engines do not do, or more bytes than the staging holds: NCCL's.
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            return None

    return CopyEngineAllGather(), CopyEngineReduceScatter()


def reduce_is_average(op) -> bool | None:
    """False for SUM, True for AVG, None for any other reduction (PREMUL_SUM, MAX, ...)."""
    for kind, average in ((dist.ReduceOp.SUM, False), (dist.ReduceOp.AVG, True)):
        try:
            if op == kind:
                return average
        except (TypeError, RuntimeError):  # a ReduceOp holding a premul factor compares to nothing
            return None
    return None


def all_gather(peers: Peers, output: torch.Tensor, shard: torch.Tensor) -> bool:
    """In-place all-gather: `shard` is `output`'s chunk for this rank; every other chunk is filled
    with the peer's shard. False (nothing done) when the staging buffer is too small."""
    nbytes = shard.numel() * shard.element_size()
    if output.numel() * output.element_size() != nbytes * peers.world:
        raise RuntimeError(
            f"deepwell copy-engine all-gather: output must hold {peers.world} shards of {nbytes} bytes, "
            f"got {output.numel() * output.element_size()} bytes"
        )
    staging = peers.staging(nbytes)
    if staging is None:
        return False
    out = as_bytes(output)
    with peers.run_on_own_stream():
        staging[:nbytes].copy_(as_bytes(shard))
        peers.barrier()
        for step in range(1, peers.world):
            peer = (peers.rank + step) % peers.world
            out[peer * nbytes:(peer + 1) * nbytes].copy_(peers.remote(peer, nbytes))
        peers.barrier()
    return True


def reduce_scatter(peers: Peers, output: torch.Tensor, chunks: torch.Tensor, average: bool) -> bool:
    """`output` = the sum (or mean) over ranks of chunk `rank` of every rank's `chunks`. False
    (nothing done) when the staging buffer is too small."""
    world, rank = peers.world, peers.rank
    n = output.numel()
    if chunks.numel() != n * world or chunks.dtype != output.dtype:
        raise RuntimeError(
            f"deepwell copy-engine reduce-scatter: input must be {world} chunks of the output's {n} "
            f"{output.dtype} elements, got {chunks.numel()} {chunks.dtype} elements"
        )
    per = n * output.element_size()
    staging = peers.staging(per * (world - 1))
    if staging is None:
        return False
    parts = chunks.reshape(world, n)
    with peers.run_on_own_stream():
        peers.barrier()
        for step in range(1, world):
            peer = (rank + step) % world
            peers.remote(peer, per, slot(rank, peer) * per).copy_(as_bytes(parts[peer]))
        peers.barrier()
        received = staging[:per * (world - 1)].view(output.dtype).reshape(world - 1, n)
        terms = [parts[r] if r == rank else received[slot(r, rank)] for r in range(world)]
        out = output.view(-1)
        if world == 2:
            torch.add(terms[0], terms[1], out=out)
        else:
            torch.sum(torch.stack(terms), 0, out=out)
        if average:
            out.div_(world)
    return True
