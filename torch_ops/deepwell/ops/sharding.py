"""DTensor sharding rules for the linear ops, so that PyTorch's own tensor parallelism
(`torch.distributed.tensor.parallel.parallelize_module` with ColwiseParallel / RowwiseParallel)
runs deepwell's GEMMs on each rank's shard. Registered with
`torch.distributed.tensor.experimental.register_sharding`; imported by `ops/__init__.py` only when
torch.distributed is built in.

One mesh dimension's rules (DTensor expands them over a 2-D mesh), with k = in_features and
n = out_features of `y = x @ W.T + b`:

| layout | x | W (n, k) | b | y |
|---|---|---|---|---|
| replicated | Replicate | Replicate | Replicate | Replicate |
| column-parallel (Megatron's first linear) | Replicate | Shard(0): rows of n | Shard(0) | Shard(-1) |
| row-parallel (the second linear) | Shard(-1): columns of k | Shard(1) | Partial | Partial (sum) |

Row-parallel's bias is Partial so that DTensor adds it once in the sum, not once per rank. The
backward `scaled_linear_backward(dy, x, W) -> (dx, dW)` follows the same layouts: column-parallel
takes dy Shard(-1) and gives dx Partial (each rank's n-slice contributes to every input feature)
and dW Shard(0); row-parallel takes dy Replicate and gives dx Shard(-1) and dW Shard(1). A gradient
the caller did not ask for is an empty tensor, declared Replicate.

Why a shard computes exactly what the whole tensor would (docs/NUMERICS.md): every operand is
quantized in blocks along its own GEMM's K (x, W along k for fprop; dy, W along n for dgrad; dy, x
along the tokens for wgrad), so a shard whose boundary falls on a block boundary holds whole blocks
and quantizes them bit for bit as the unsharded op does. Column-parallel splits n (W's 128x128
fp8_block tiles and dgrad's blocks along n), row-parallel splits k. `distributed/tensor_parallel.py`
checks the boundaries when it applies a plan. Exceptions: nvfp4's per-tensor fp32 scale is taken
over the shard (a per-shard scale, not one process's bits), and its stochastic rounding draws per
shard position. The Partial results (row-parallel y, column-parallel dx) are summed by an
all-reduce: exact per rank, then one more fp32 rounding per addition than one process's GEMM.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from . import linear  # noqa: F401  (the schemas exist before their rules are registered)

_ops = torch.ops.deepwell


def _layouts(x, bias) -> list[tuple[list, list]]:
    """(output placements, input placements) of `op(x, weight, bias, *non-tensor args)`."""
    last = x.ndim - 1  # register_sharding's strategies need non-negative dims

    def b(p):
        return None if bias is None else p

    return [
        ([Replicate()], [Replicate(), Replicate(), b(Replicate())]),
        ([Shard(last)], [Replicate(), Shard(0), b(Shard(0))]),
        ([Partial()], [Shard(last), Shard(1), b(Partial())]),
    ]


@register_sharding(_ops.scaled_linear.default)
def _scaled_linear_sharding(x, weight, bias, recipe, seed=None):
    return [(out, ins + [None, None]) for out, ins in _layouts(x, bias)]


@register_sharding(_ops.mxfp8_linear.default)
def _mxfp8_linear_sharding(x, weight, bias=None):
    return _layouts(x, bias)


@register_sharding(_ops.scaled_linear_backward.default)
def _backward_sharding(grad_out, x, weight, recipe, seed, need_input, need_weight):
    last = x.ndim - 1

    def outs(dx, dw):
        return [dx if need_input else Replicate(), dw if need_weight else Replicate()]

    tail = [None, None, None, None]  # recipe, seed, need_input, need_weight
    return [
        (outs(Replicate(), Replicate()), [Replicate(), Replicate(), Replicate(), *tail]),
        (outs(Partial(), Shard(0)), [Shard(last), Replicate(), Shard(0), *tail]),
        (outs(Shard(last), Shard(1)), [Replicate(), Shard(last), Shard(1), *tail]),
    ]
