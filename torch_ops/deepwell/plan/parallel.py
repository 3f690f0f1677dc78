"""Which parallel degrees a job runs with: the Rust planner's decision (`parallel_plan`,
rust/core/src/policy/parallel.rs) from the job's processes, its devices (`probe()`) and the model's
sizes measured here (parameters, AdamW states, saved activations of one rank's micro-batch, the
largest block FSDP gathers at a time). Applying the decision: `shard.py`."""

from __future__ import annotations

import torch

from .. import _native
from ..distributed import tensor_parallel
from ..distributed.units import blocks, nbytes
from .hardware import Hardware
from .memory import saved_activation_bytes


def plan_parallelism(
    model: torch.nn.Module, example_inputs: tuple, hw: Hardware | None, world: int, quantized: bool | None = None,
    codes: dict[str, str] | None = None, tensor: int | None = None
) -> dict:
    """{data, tensor, fsdp, reshard_after_forward, sm_carveout, unit_blocks, ends_join_blocks,
    forward_prefetch, per_rank_bytes, reason, saved} for `world`
    processes; `saved`: `memory.saved_activation_bytes`'s (total, largest, output bytes, output elements), measured before
    sharding (dryrun reuses it: a sharded model's forward cannot run on fake tensors). `example_inputs`
    is one rank's micro-batch; `hw` the node's devices (None: unknown memory); `quantized`: whether
    the plan has deepwell GEMMs (plan/memory.py; None: eager autograd's saved tensors); `codes`: its
    fp8_tensor sites (name -> recipe), which save x's codes; `tensor`: a tensor degree the caller
    fixed (`check_tensor_degree`), for which Rust plans the rest."""
    weights = nbytes(model.parameters())
    units = blocks(model)
    largest = max((nbytes(b.parameters()) for b in units), default=weights)
    saved = saved_activation_bytes(model, example_inputs, quantized, codes=codes) if world > 1 else (0, 0, 0, 0)
    devices = hw.devices if hw is not None else []
    cluster = {
        "world_size": world,
        "devices_per_node": max(len(devices), 1),
        "memory_bytes": min((d.memory_bytes for d in devices), default=0),
        "peer_access": bool(hw and hw.links) and all(link["p2p"] for link in hw.links),
    }
    sizes = {
        "weight_bytes": weights,
        "gradient_bytes": weights,
        "optimizer_bytes": 2 * weights,  # AdamW's two states, in the parameter dtype
        "activation_bytes": saved[0],
        "largest_unit_bytes": largest,
        "blocks": len(units),
    }
    request = {"cluster": cluster, "model": sizes, **({"tensor": tensor} if tensor is not None else {})}
    return {**_native.call("parallel_plan", request, "deepwell.autoplan"), "saved": saved}


def with_tensor_share(model: torch.nn.Module, example_inputs: tuple, par: dict, quantized: bool | None,
                      sequence: bool = False) -> dict:
    """`par` with `saved` measured for one rank of its tensor degree (memory.py traces the split
    layers at their local shapes, and with `sequence` the split residual stream) when that degree is
    above 1; the whole model's count (an upper bound) stays where the model cannot be split (compile
    then raises the reason)."""
    tensor = par["tensor"]
    if tensor == 1 or par["saved"] == (0, 0, 0, 0):
        return par
    try:
        tensor_parallel.check(model, tensor, {}, sequence)
    except RuntimeError:
        return par
    return {**par, "saved": saved_activation_bytes(model, example_inputs, quantized, tensor, sequence)}


def check_tensor_degree(world: int, tensor) -> None:
    """autoplan's `tensor_parallel=`: a positive integer dividing the world size, or RuntimeError."""
    if not isinstance(tensor, int) or isinstance(tensor, bool) or tensor < 1 or world % tensor:
        raise RuntimeError(
            f"deepwell.autoplan: tensor_parallel must be a positive integer dividing the world size {world}, "
            f"got {tensor!r}"
        )
