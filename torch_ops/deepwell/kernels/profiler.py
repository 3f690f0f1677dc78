"""`KernelProfiler.profile_kernel(op, warmup_iterations, profile_iterations)`: the time and the
achieved TFLOP/s of one of deepwell's ops, and their share of the device's rate for that recipe.

Timing: CUDA events around the iterations on a GPU, the wall clock on the CPU. The peak is the rate
deepwell's cost model gives that recipe on the device (rust/core/src/policy/cost.rs: H100
measurements for Hopper, B200 datasheet peaks for Blackwell, borrowed Hopper rates elsewhere,
`peak_from` says which), read through the `step_cost` entry for one large GEMM; on the CPU there is
none. `sm_efficiency` and `tmem_utilization` need hardware counters (Nsight Compute), which events
cannot read: they are reported as not measured (TMEM exists only on Blackwell: elsewhere, not
applicable)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import _native
from ..core.recipes import arch_info, device_arch, family
from ..ops import scaled_linear

#: deepwell has no CUTLASS bindings: its kernels are its own (this package's docs).
CUTLASS_AVAILABLE = False

#: The rows of a representative call: the site's tokens, at most this many (a planned 32k x 4096
#: batch would not fit next to the model), at least one.
MAX_ROWS = {"cuda": 16384, "cpu": 1024}


@dataclass
class SiteOp:
    """One GEMM site's op on representative inputs: `op()` runs `x @ w.T` in the site's recipe
    (`deepwell.scaled_linear`; bf16 sites: torch's linear) with random x and w of the site's shape
    on `device` (bf16 on a GPU, fp32 on the CPU), made at the first call. `flops`: one forward."""

    name: str
    recipe: str
    rows: int
    in_features: int
    out_features: int
    device: torch.device
    _inputs: tuple | None = field(default=None, repr=False)

    @classmethod
    def of_site(cls, site, device: torch.device) -> "SiteOp":
        device = torch.device(device)
        rows = max(1, min(site.tokens or 1, MAX_ROWS.get(device.type, 1024)))
        return cls(site.name, site.recipe, rows, site.in_features, site.out_features, device)

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.in_features * self.out_features

    def __call__(self) -> torch.Tensor:
        if self._inputs is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
            g = torch.Generator().manual_seed(0)
            x = torch.randn(self.rows, self.in_features, generator=g).to(self.device, dtype)
            w = (torch.randn(self.out_features, self.in_features, generator=g) / self.in_features**0.5).to(self.device, dtype)
            self._inputs = (x, w)
        x, w = self._inputs
        recipe = family(self.recipe)
        return F.linear(x, w) if recipe == "bf16" else scaled_linear(x, w, recipe=recipe)


def peak_tflops(recipe: str, arch: str) -> tuple[float, str]:
    """The cost model's TFLOP/s for `recipe`'s GEMMs on `arch`: a 16384-cube GEMM's three passes
    over the `step_cost` entry's time (its quantizers' bytes add about 1%), and where the rates come from."""
    n = 16384
    cost = _native.call("step_cost", {"arch": arch, "sites": [{"tokens": n, "in_features": n, "out_features": n,
                                                                "recipe": family(recipe)}], "other_bytes": 0},
                        "deepwell.kernels")
    return 3 * 2 * n**3 / (cost["step_ms"] * 1e-3) / 1e12, cost["rates_from"]


class KernelProfiler:
    """Times deepwell's ops (this module's docs)."""

    @staticmethod
    def profile_kernel(op, warmup_iterations: int = 10, profile_iterations: int = 100, flops: int | None = None,
                       device: str | torch.device | None = None) -> dict:
        """{"ms", "tflops", "peak_tflops", "percent_of_peak", "peak_from", "timer", "sm_efficiency",
        "tmem_utilization", ...} of `op()`: a zero-argument callable such as an engine's
        `compiled_ops[i].backend_op` (which knows its `flops`, `device` and `recipe`; else pass them)."""
        for name, v in (("warmup_iterations", warmup_iterations), ("profile_iterations", profile_iterations)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name[0] == "w" else 1):
                raise ValueError(f"deepwell.KernelProfiler: {name} must be a {'non-negative' if name[0] == 'w' else 'positive'} int, got {v!r}")
        if not callable(op):
            raise ValueError(f"deepwell.KernelProfiler: op must be a zero-argument callable, got {op!r}")
        flops = flops if flops is not None else getattr(op, "flops", None)
        device = torch.device(device if device is not None else getattr(op, "device", "cpu"))
        recipe = getattr(op, "recipe", None)
        for _ in range(warmup_iterations):
            op()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(profile_iterations):
                op()
            end.record()
            end.synchronize()
            ms, timer = start.elapsed_time(end) / profile_iterations, "CUDA events"
        else:
            t0 = time.perf_counter()
            for _ in range(profile_iterations):
                op()
            ms, timer = (time.perf_counter() - t0) * 1e3 / profile_iterations, "wall clock"
        tflops = flops / (ms * 1e-3) / 1e12 if flops and ms > 0 else None
        result = {"op": getattr(op, "name", getattr(op, "__name__", repr(op))), "recipe": recipe, "device": str(device),
                  "timer": timer, "ms": ms, "tflops": tflops, "peak_tflops": "not applicable (no GPU rate for the CPU)",
                  "percent_of_peak": "not applicable", "peak_from": None}
        if device.type == "cuda":
            arch = device_arch(device)
            if recipe is not None:
                peak, source = peak_tflops(recipe, arch)
                result.update(peak_tflops=peak, peak_from=source,
                              percent_of_peak=100 * tflops / peak if tflops else "not measured (no flops)")
            blackwell = "Blackwell" in arch_info(arch)["family"]
            result["sm_efficiency"] = "not measured: needs hardware counters (Nsight Compute); see percent_of_peak"
            result["tmem_utilization"] = ("not measured: needs hardware counters (Nsight Compute)" if blackwell
                                          else f"not applicable: TMEM exists only on Blackwell, this is {arch}")
        else:
            result["sm_efficiency"] = "not applicable (CPU)"
            result["tmem_utilization"] = "not applicable: TMEM exists only on Blackwell GPUs"
        return result
