"""deepwell's kernels, as the design documents name them. deepwell has no CUTLASS: its GEMMs and
quantizers are its own CUDA kernels, compiled at run time by NVRTC for the device's arch, and
cuBLASLt's block-scaled GEMMs, called from the Rust core (docs/DESIGN.md). This package holds what
the documents promise about kernels: `cutlass_bindings.CUTLASS_AVAILABLE` (False, saying so) and
`KernelProfiler`, which times deepwell's ops (profiler.py)."""

from .profiler import CUTLASS_AVAILABLE, KernelProfiler, SiteOp

__all__ = ["CUTLASS_AVAILABLE", "KernelProfiler", "SiteOp"]
