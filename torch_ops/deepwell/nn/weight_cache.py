"""When the linear layers reuse a weight's quantized operands (rust/ops/src/ops/linear/weight_cache.rs).

By default they never do: each forward quantizes the weight for its GEMM and each backward quantizes
the weight it was given for its own, so any write to a weight, seen by torch or not, is used by the
next call. Inside `microbatches()` (gradient accumulation), a weight is quantized once, by the first
pass that needs it, and reused while none of these changed: the scope, its storage (data pointer,
shape, strides, dtype, device), its version counter, the optimizer step count (every
`torch.optim.Optimizer.step` ends reuse, through torch's global optimizer step hooks), and no CUDA
graph is being captured.

    for batch in loader:
        with deepwell.microbatches():
            for mb in batch.chunk(accum):
                loss_fn(model(mb)).backward()
        opt.step()
        opt.zero_grad()
"""

from __future__ import annotations

import contextlib


from .. import _native

__all__ = ["clear_weight_cache", "microbatches", "weight_cache_info"]


def weight_cache_info() -> dict[str, int]:
    """Live entries, hits (reuses) and misses (quantizations of a weight) since the process started."""
    return _native.call("weight_cache_stats")


def clear_weight_cache() -> None:
    """Drops every cached weight operand (and the weight aliases they hold)."""
    _native.call("weight_cache_clear")


@contextlib.contextmanager
def microbatches():
    """A reuse scope: the caller promises the weights do not change inside it, except through
    optimizer steps and writes that move their version counter or storage, all of which deepwell
    sees. A write that bypasses those inside the scope (`w.data.add_()`) is not seen; outside any
    scope nothing is cached. Scopes nest; closing the outermost drops every entry."""
    _native.call("weight_cache_scope", {"enter": True}, "deepwell.microbatches")
    try:
        yield
    finally:
        _native.call("weight_cache_scope", {"enter": False}, "deepwell.microbatches")


def _new_epoch(*_args) -> None:
    _native.call("weight_cache_new_epoch")


def install_optimizer_hooks() -> None:
    """Registers torch's global optimizer step pre- and post-hooks (every torch.optim.Optimizer:
    fused, foreach, capturable) so that no step can leave a cached operand behind."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_new_epoch)
    register_optimizer_step_post_hook(_new_epoch)
