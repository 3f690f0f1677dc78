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
import ctypes


from . import _native

__all__ = ["clear_weight_cache", "microbatches", "weight_cache_info"]


def weight_cache_info() -> dict[str, int]:
    """Live entries, hits (reuses) and misses (quantizations of a weight) since the process started."""
    out = (ctypes.c_uint64 * 3)()
    if _native.load().deepwell_weight_cache_stats(out) != 0:
        raise RuntimeError("deepwell: reading the weight cache statistics failed")
    return {"entries": out[0], "hits": out[1], "misses": out[2]}


def clear_weight_cache() -> None:
    """Drops every cached weight operand (and the weight aliases they hold)."""
    if _native.load().deepwell_weight_cache_clear() != 0:
        raise RuntimeError("deepwell: clearing the weight cache failed")


@contextlib.contextmanager
def microbatches():
    """A reuse scope: the caller promises the weights do not change inside it, except through
    optimizer steps and writes that move their version counter or storage, all of which deepwell
    sees. A write that bypasses those inside the scope (`w.data.add_()`) is not seen; outside any
    scope nothing is cached. Scopes nest; closing the outermost drops every entry."""
    lib = _native.load()
    if lib.deepwell_weight_cache_scope(1) != 0:
        raise RuntimeError("deepwell.microbatches: opening the scope failed")
    try:
        yield
    finally:
        lib.deepwell_weight_cache_scope(0)


def _new_epoch(*_args) -> None:
    _native.load().deepwell_weight_cache_new_epoch()


def install_optimizer_hooks() -> None:
    """Registers torch's global optimizer step pre- and post-hooks (every torch.optim.Optimizer:
    fused, foreach, capturable) so that no step can leave a cached operand behind."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_new_epoch)
    register_optimizer_step_post_hook(_new_epoch)
