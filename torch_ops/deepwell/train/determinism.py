"""The Trainer's `deterministic` mode: the same inputs give the same bits on every run, so a run
resumed from a checkpoint continues bit for bit, on the CPU and on a GPU (docs/DESIGN.md
"Determinism").

While `fit` runs, `deterministic_kernels` switches on:
- torch.use_deterministic_algorithms(True): ATen's deterministic kernels where it has two (index_put
  accumulation by sorting, the flash-attention backward without atomic dq sums, cuDNN's
  deterministic algorithms; cuDNN attention is not picked: sdp_utils `check_cudnn_deterministic`),
  and an error for an op that has none.
- What Inductor does with that flag while it compiles: index_put and scatter accumulations (the
  embedding's gradient) fall back to those ATen kernels instead of Triton atomic adds, and no
  reduction is split across programs with atomics (torch._inductor.lowering's index_put,
  torch._inductor.utils.use_scatter_fallback, torch._inductor.ir). And Inductor's deterministic
  mode (`torch._inductor.config.deterministic`, which the flag sets too): no kernel, padding or
  reduction config picked by timing, which could pick differently in another process.
- cudnn.benchmark off: the algorithm cuDNN would time and pick could differ between processes.
torch.utils.deterministic.fill_uninitialized_memory stays torch's default (on): every fresh tensor
is filled (NaN), so a kernel that read memory it never wrote would still give one answer.

cuBLAS needs nothing more: torch gives every (handle, stream) its own workspace, which cuBLAS's
"Results reproducibility" section names sufficient, and since torch 2.10 (deepwell's minimum)
torch no longer asks for CUBLAS_WORKSPACE_CONFIG under deterministic algorithms
(pytorch/pytorch#161749; tests/train/test_determinism.py checks it on the GPU).

What else a resume needs, which the Trainer does in either mode: deepwell's stochastic rounding
seeded from (seed, step) at every step; torch's CPU and CUDA generators, Python's and numpy's
restored from the checkpoint (state.py); the data loader's position (TokenBatches' state).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def deterministic_kernels(on: bool = True):
    """Deterministic kernels for the block (the module docs list what that switches); `on=False`
    changes nothing. Every setting is restored after the block."""
    if not on:
        yield
        return
    # Imported at first use, as torch.use_deterministic_algorithms does: `import deepwell` need not
    # load Inductor's package.
    import torch._inductor.config as inductor_config

    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           inductor_config.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    inductor_config.deterministic = True
    # Written only when on: once torch.backends.disable_global_flags() has run (torch's own test
    # utilities call it at import), assigning any cuDNN flag raises, even its current value.
    if was[3]:
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        inductor_config.deterministic = was[2]
        if was[3]:
            torch.backends.cudnn.benchmark = True
