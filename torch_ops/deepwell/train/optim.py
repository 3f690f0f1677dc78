"""AdamW for FSDP2-sharded models: torch.optim.AdamW, with its update run on each DTensor's local shard.

Why. Under FSDP2 every parameter, gradient and AdamW state is a DTensor. torch.optim.AdamW then
launches its fused (or foreach) update through DTensor's dispatcher, which works out a sharding for
every one of the hundreds of tensors in each call, every step. For the 0.95B LLaMA (146
parameters) that host work is most of the optimizer phase:
- On 2 H100s the optimizer phase took ~5.5 ms of host time against ~1.7 ms on one GPU.
- In profiled steps the GPU waited for it: the longest idle gaps fell between fused AdamW launches.
- On the CPU (2 gloo processes, the same 146 parameters at tiny sizes), one fused step took
  10.3 ms on the DTensors against 2.0 ms for the same call on their local shards.
With this class (2 H100s, docs/DESIGN.md "Scale-out"): 2.2-3.0 ms of host time against
5.2-7.4. The pipelined benchmark's step did not change (its GPU trails the host by more than
that); what gains is a step whose host is on the critical path, as the Trainer's on 2 GPUs.

What. A shard's update needs only that shard: AdamW is elementwise, and FSDP2 gives a parameter's
gradient and states the parameter's own placement. DTensor's dispatcher, for such lists, runs the
same op on the local tensors. This class hands torch's own update (torch.optim.adam.adam: fused,
foreach or per tensor, as the group asks) the local tensors directly, so the bits are the same and
the dispatch is skipped.

What stays torch's. Everything but which tensors reach the update:
- the step (hooked: deepwell's weight cache sees it, nn/weight_cache.py);
- the lazily made states, created as DTensors as torch makes them;
- param_groups, LR schedulers, state_dict and distributed-checkpoint state dicts (the states stay
  DTensors).

When it falls back. A group keeps torch's DTensor path, unchanged, when any DTensor in it:
- has a gradient or a state on another mesh or placement than its parameter (a Partial gradient,
  say: the update would then need a collective, which DTensor's path runs);
- has a local tensor that is itself a subclass (FP8 all-gather's shards);
- or when the group is `differentiable`.
Plain tensors in a group pass through as they are. So one optimizer can also hold the plain
parameters that tensor parallelism leaves next to its DTensors, which a fused torch.optim.AdamW
refuses (one kind of tensor per call).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["AdamW", "fusable", "shard_local"]


def shard_local(params: list[torch.Tensor], *per_param: list[torch.Tensor]) -> bool:
    """Whether the update of `params` may run on local shards: every DTensor parameter's tensors in
    `per_param` (gradients, states: lists in the order of `params`) are DTensors laid out as the
    parameter (same mesh, same placements: their local tensors hold the elements of the
    parameter's), and every local tensor is a plain tensor."""
    for i, p in enumerate(params):
        if not isinstance(p, DTensor):
            continue
        spec = p._spec  # DTensor's own fields: its properties cost more than the comparison, per tensor, per step
        for t in (p, *(ts[i] for ts in per_param)):
            if not isinstance(t, DTensor) or type(t._local_tensor) is not torch.Tensor:
                return False
            if t is p:
                continue
            if t._spec.placements != spec.placements or not (t._spec.mesh is spec.mesh or t._spec.mesh == spec.mesh):
                return False
    return True


def fusable(params) -> bool:
    """Whether torch's fused AdamW takes these parameters: floating point, on the CPU or a CUDA GPU."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def _local(tensors: list[torch.Tensor]) -> None:
    tensors[:] = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, same results bit for bit) whose update runs on the local
    shards of DTensor parameters; see the module's docstring for why and when it falls back."""

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        # torch.optim.Adam.step calls this to list the group's tensors (and make missing states),
        # then passes the lists to its update: the one place to swap in the local tensors.
        has_complex = super()._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        if group["differentiable"] or not any(isinstance(p, DTensor) for p in params_with_grad):
            return has_complex  # nothing to swap: torch's path as it is
        states = [exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if group["amsgrad"] else [])
        if not shard_local(params_with_grad, grads, *states):
            return has_complex
        for tensors in (params_with_grad, grads, *states):
            _local(tensors)
        return has_complex
