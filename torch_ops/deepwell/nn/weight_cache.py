"""When the linear layers reuse a weight's quantized operands (rust/ops/src/ops/linear/weight_cache.rs).

By default they never do: each forward quantizes the weight for its GEMM and each backward quantizes
the weight it was given for its own, so any write to a weight, seen by torch or not, is used by the
next call. Inside `microbatches()` (gradient accumulation), a weight is quantized once, by the first
pass that needs it, and reused while none of these changed: the scope, its storage (data pointer,
shape, strides, dtype, device), its version counter, the optimizer step count (every
`torch.optim.Optimizer.step` ends reuse, through torch's global optimizer step hooks, registered
while a scope is open), and no CUDA graph is being captured. Once a model is compiled with CUDA
graphs (`deepwell.optimize(..., cudagraphs=True)`), scopes reuse nothing in the process: the graphs'
warm-up runs allocate from their private pool, where a cached operand would be a live tensor the
graphs do not track (and weight quantization costs the host nothing in a replay anyway).

    for batch in loader:
        with deepwell.microbatches():
            for mb in batch.chunk(accum):
                loss_fn(model(mb)).backward()
        opt.step()
        opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import threading

from .. import _native

__all__ = ["clear_weight_cache", "microbatches", "weight_cache_info"]


def weight_cache_info() -> dict[str, int]:
    """Live entries, hits (reuses) and misses (quantizations of a weight) since the process started."""
    return _native.call("weight_cache_stats")


def clear_weight_cache() -> None:
    """Drops every cached weight operand (and the weight aliases they hold)."""
    _native.call("weight_cache_clear")


def allow_reuse(allowed: bool) -> None:
    """Switches reuse inside `microbatches()` on or off for the process (off: every entry is dropped
    and scopes cache nothing). The deepwell backend switches it off when it compiles CUDA graphs."""
    _native.call("weight_cache_reuse", {"allowed": allowed}, "deepwell.nn.weight_cache.allow_reuse")


@contextlib.contextmanager
def microbatches():
    """A reuse scope: the caller promises the weights do not change inside it, except through
    optimizer steps and writes that move their version counter or storage, all of which deepwell
    sees. A write that bypasses those inside the scope (`w.data.add_()`) is not seen; outside any
    scope nothing is cached. Scopes nest; closing the outermost drops every entry.

    While a scope is open, torch's global optimizer step hooks drop every entry at each step (every
    torch.optim.Optimizer: fused, foreach, capturable). They are registered only then: outside a
    scope there is nothing to drop, and an optimizer step (compiled or not) runs untouched."""
    _native.call("weight_cache_scope", {"enter": True}, "deepwell.microbatches")
    _optimizer_hooks.acquire()
    try:
        yield
    finally:
        _optimizer_hooks.release()
        _native.call("weight_cache_scope", {"enter": False}, "deepwell.microbatches")


class _OptimizerHooks:
    """torch's global optimizer step pre- and post-hooks, held while any scope is open."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._handles: list = []

    @staticmethod
    def _new_epoch(*_args) -> None:
        _native.call("weight_cache_new_epoch")

    def acquire(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        with self._lock:
            if self._users == 0:
                self._handles = [
                    register_optimizer_step_pre_hook(self._new_epoch),
                    register_optimizer_step_post_hook(self._new_epoch),
                ]
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for h in self._handles:
                    h.remove()
                self._handles = []


_optimizer_hooks = _OptimizerHooks()
