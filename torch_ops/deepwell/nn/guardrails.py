"""Run-time guardrails of low-precision layers: per-layer statistics collected on the device, and a
fallback to bf16 when a layer's inputs or outputs go non-finite or its quantized input saturates
beyond a threshold. The rule lives in Rust (deepwell_core::policy::guardrail::check, reached through
the `guardrail_check` entry); every fallback is recorded with its reason and readable from
`deepwell.policy_report()`.

Cost: every `interval` steps a layer reduces its input and output once (non-finite counts, amax) and
re-quantizes its input to count clipped (saturated) elements; the results stay on the device and are copied to
the host without blocking. They are read (and the rule applied) at the layer's next statistics step,
or at once by `poll(block=True)`. So a fallback takes effect at most `2 * interval` steps after the
event, without a host synchronisation in the training loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import _native
from ..core import recipes

ops = torch.ops.deepwell

@dataclass
class GuardrailConfig:
    #: Largest accepted fraction of the input's quantized elements that were clipped.
    saturation_threshold: float = 1e-3
    #: Collect statistics every this many forward calls (1 = every call).
    interval: int = 16

    def __post_init__(self):
        t = self.saturation_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise ValueError(f"deepwell.GuardrailConfig: 'saturation_threshold' must be a number in [0, 1], got {t!r}")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"deepwell.GuardrailConfig: 'interval' must be a positive int, got {self.interval!r}")


def _clipped(x2: torch.Tensor, recipe: str, global_amax: torch.Tensor | None = None) -> torch.Tensor:
    """How many elements of x (rows, K) the recipe clips: quantized to the element format's largest
    magnitude although they exceed it by more than half that value's ulp (so rounding is not
    counted: NVFP4's E4M3 block scales round down by up to 1/16, which RNE would round anyway).

    With amax-derived scales (rceil E8M0, pow2 fp32, NVFP4 with its computed global amax) nothing
    clips by construction; the counter guards against inputs and recipes where it can
    (`global_amax` below the true amax, as a stale per-tensor scale would be)."""
    f32 = torch.float32
    elem = recipes.table()[recipe]["elem"]
    if elem is None:
        return torch.zeros((), dtype=torch.float64, device=x2.device)
    if recipe == "mxfp8":
        d, s = ops.mxfp8_quantize(x2)
        dq, codes = ops.mxfp8_dequantize(d, s, -1, f32), d.view(torch.uint8) & 0x7F
    elif recipe == "fp8_block":
        d, s = ops.fp8_block_quantize(x2, 1, 128)
        dq, codes = ops.fp8_block_dequantize(d, s, 1, 128, f32), d.view(torch.uint8) & 0x7F
    else:  # nvfp4: two E2M1 codes per byte, low nibble first
        d, s, g = ops.nvfp4_quantize(x2, global_amax)
        codes = torch.stack([d & 0x7, (d >> 4) & 0x7], dim=-1).reshape(x2.shape)
        dq = ops.nvfp4_dequantize(d, s, g, f32)
    # The largest magnitude's code, and half its ulp relative to it (E4M3: 16/448, E2M1: 1/6).
    top, half_ulp = elem["max_code"], elem["half_ulp_at_max"] / elem["max"]
    clipped = (codes == top) & (x2.float().abs() > dq.abs() * (1 + half_ulp))
    return clipped.sum().double()


def layer_stats(x: torch.Tensor, y: torch.Tensor, recipe: str) -> torch.Tensor:
    """float64 [input_nonfinite, output_nonfinite, saturated (clipped), numel, amax_input,
    amax_output], on the device (amax over all values, NaN-propagating)."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    y = y.detach()
    amax = lambda t: t.abs().amax().double() if t.numel() else torch.zeros((), device=t.device)  # noqa: E731
    return torch.stack(
        [
            (~torch.isfinite(x2)).sum().double(),
            (~torch.isfinite(y)).sum().double(),
            _clipped(torch.nan_to_num(x2), recipe),
            torch.tensor(float(x2.numel()), dtype=torch.float64, device=x2.device),
            amax(x2),
            amax(y),
        ]
    )


def check(stats: list[float], saturation_threshold: float) -> str | None:
    """The Rust guardrail rule on host statistics: the fallback reason, or None."""
    names = ("input_nonfinite", "output_nonfinite", "saturated", "numel", "amax_input", "amax_output")
    fields = {k: (int(v) if i < 4 else (v if math.isfinite(v) else str(v))) for i, (k, v) in enumerate(zip(names, stats))}
    request = {"stats": fields, "saturation_threshold": saturation_threshold}
    return _native.call("guardrail_check", request, "deepwell guardrail")["fallback"]


@dataclass
class LayerRecord:
    """What `policy_report()` says about one layer."""

    name: str
    recipe: str
    reason: str
    active_recipe: str
    events: list[str] = field(default_factory=list)


#: name -> record, for every guarded layer alive or dead in this process.
_REPORT: dict[str, LayerRecord] = {}


def register(record: LayerRecord) -> None:
    """Lists `record` in `policy_report()` (a deepwell.Linear's, or a compiled GEMM site's:
    compiler/guard.py), replacing an earlier one of the same name."""
    _REPORT[record.name] = record


def policy_report() -> list[LayerRecord]:
    """Every guarded layer and compiled GEMM site: its planned recipe and why, the recipe it runs
    now, and each fallback."""
    return list(_REPORT.values())


def format_report() -> str:
    """`policy_report()` as a table."""
    lines = [f"{'layer':<32} {'planned':<10} {'running':<10} reason"]
    for r in _REPORT.values():
        lines.append(f"{r.name:<32} {r.recipe:<10} {r.active_recipe:<10} {r.reason}")
        lines.extend(f"{'':<32} {'':<10} {'':<10} {e}" for e in r.events)
    return "\n".join(lines)


class Guardrail:
    """One layer's statistics and fallback state."""

    def __init__(self, name: str, recipe: str, reason: str, config: GuardrailConfig | None = None):
        self.config = config or GuardrailConfig()
        self.calls = 0
        self._pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
        self.record = LayerRecord(name, recipe, reason, recipe)
        register(self.record)

    @property
    def recipe(self) -> str:
        """The recipe to run now: the planned one, or bf16 after a fallback."""
        return self.record.active_recipe

    def observe(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Counts a forward call; on statistics steps, reads the previous statistics and collects new
        ones (device work only; the copy to the host does not block)."""
        self.calls += 1
        if self.recipe == "bf16" or self.calls % max(self.config.interval, 1) != 0:
            return
        self.poll(block=False)
        with torch.no_grad():
            stats = layer_stats(x, y, self.recipe)
        if stats.is_cuda:
            host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            host.copy_(stats, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (self.calls, host, event)
        else:
            self._pending = (self.calls, stats, None)

    def poll(self, block: bool = False) -> str | None:
        """Applies the rule to the pending statistics when they have reached the host (at once with
        `block=True`); returns the fallback reason if this call made the layer fall back."""
        if self._pending is None:
            return None
        call, host, event = self._pending
        if event is not None and not event.query():
            if not block:
                return None
            event.synchronize()
        self._pending = None
        reason = check(host.tolist(), self.config.saturation_threshold)
        if reason is None or self.recipe == "bf16":
            return None
        self.record.active_recipe = "bf16"
        self.record.events.append(f"call {call}: {reason}")
        return reason
