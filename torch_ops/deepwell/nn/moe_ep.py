"""Expert parallelism for deepwell.DeepwellMoE: each process of a group holds E / world of the routed
experts, and the tokens travel to their experts' process and back by all-to-all (GShard's and
torchtitan's scheme; docs/DESIGN.md "MoE").

    deepwell.expert_parallel(model, group)   # after building the model, before the optimizer

One block's forward on a rank, with El = E / world experts per rank:
1. Route all of its own tokens over all E experts (the router is replicated) and group the
   assignments by expert into the padded buffer (`moe_permute_index` / `moe_dispatch`): rank r's
   experts [r·El, (r+1)·El) are one contiguous run of groups, so the buffer splits by destination
   rank as it is.
2. Exchange the group sizes (rows per destination rank and local expert), then the rows
   (`all_to_all_single_autograd`: its backward is the reverse exchange). Each rank receives, from every source, its experts'
   groups in expert order; a gather puts them expert-major (each local expert's rows from all
   sources together), keeping each group's padding, so every group stays a multiple of the block.
3. The experts' grouped GEMMs run on the local groups, the inverse gather and the reverse
   all-to-all bring the rows home, and `moe_combine` weighs them into token order as before.

Every rank must call each block's forward the same number of times (the all-to-alls are
collectives). The gradients of a rank's experts come from every rank's tokens through the reverse
exchange, so they are complete: expert weights need no gradient all-reduce, while the replicated
parameters (router gate, shared experts, norms, the rest of the model) do. `reduce_gradients`
does both after the backward, for a training loop without a data-parallel wrapper.
The rows per source and destination cross to the host (`.tolist()`: one sync per block and pass,
for the all-to-all's split sizes), as in torchtitan; the gather index is built on the device.

Checkpoints and Hugging Face conversion (nn/moe_ep_state.py): the block's state dict presents the
local experts as Shard(0) DTensors of the whole (E, ...) shape, so torch.distributed.checkpoint
writes every rank's and reshards on load; `deepwell.expert_optimizer_state_dict` and
`deepwell.load_expert_optimizer_state_dict` do the same for the optimizer's state;
`DeepwellMoE.to_hf` all-gathers the experts. deepwell.Trainer refuses an expert-parallel model
(train/trainer.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch import nn

from . import moe_ep_state

WHO = "deepwell.expert_parallel"


def run_experts(xp: torch.Tensor, offsets: torch.Tensor, expert_ffn, ep_size: int, group) -> torch.Tensor:
    """`expert_ffn(rows, local_offsets)` (this rank's experts' grouped GEMMs) applied to the buffer
    `xp` (rows grouped by all E experts, `offsets` (E + 1,)), each group computed on its expert's
    rank; returns the rows in `xp`'s order."""
    num_experts = offsets.numel() - 1
    local = num_experts // ep_size
    sizes = (offsets[1:] - offsets[:-1]).to(torch.int64).reshape(ep_size, local)  # [dest rank, expert]
    got = torch.empty_like(sizes)
    dist.all_to_all_single(got, sizes, group=group)  # [source rank, my expert]
    send_rows, recv_rows = sizes.sum(1).tolist(), got.sum(1).tolist()  # the host's one sync
    group = group or dist.group.WORLD
    xr = exchange(xp, recv_rows, send_rows, group)
    index, local_offsets = expert_major(got, sum(recv_rows))
    xg = xr.index_select(0, index)
    yg = expert_ffn(xg, local_offsets)
    back = torch.empty_like(index)
    back[index] = torch.arange(index.numel(), device=index.device)  # the inverse permutation
    yr = yg.index_select(0, back)  # source-major again
    return exchange(yr, send_rows, recv_rows, group)


def exchange(rows: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """`rows` split by `send` to the ranks in order, the ranks' `recv` rows back: torch's
    differentiable all-to-all (its backward is the reverse exchange), waited for here."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), recv, send, group))


def expert_major(recv: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows come source-major: from each source (the rows of `recv` (world, El), rows per
    source and local expert) its groups in expert order. Returns the gather index that puts them
    expert-major (each expert's rows from every source, sources in rank order) and the local
    groups' int32 offsets (El + 1,), on `recv`'s device, without a host sync (`total` rows)."""
    flat = recv.reshape(-1)
    source_major_start = (flat.cumsum(0) - flat).reshape(recv.shape)  # where each segment arrived
    lens = recv.t().reshape(-1)  # the segments in expert-major order
    start = source_major_start.t().reshape(-1)
    lands = lens.cumsum(0) - lens  # where each segment goes
    shift = torch.repeat_interleave(start - lands, lens, output_size=total)
    index = torch.arange(total, device=recv.device) + shift
    offsets = torch.cat([recv.new_zeros(1), recv.sum(0).cumsum(0)]).to(torch.int32)
    return index, offsets
