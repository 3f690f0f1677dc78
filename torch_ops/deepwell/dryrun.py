"""`deepwell.dryrun(engine)`: predicted peak memory and step time of a training step (forward,
backward, AdamW) from a cost model, without running the model on the device.

Memory (bytes). The peak of a step comes at the start of the backward pass: weights and AdamW's two
states (in the parameter dtype, as torch.optim.AdamW keeps them) are resident, the forward's saved
activations are all alive, one site's quantized weight operand exists, and the loss's gradient is
being formed. Gradients (with `zero_grad(set_to_none=True)`) are allocated while the activations they
depend on are freed, so they count only when they outgrow the activations:
  peak = weights + optimizer + quantized weight + max(activations + transient, gradients)
- weights and gradients: from the parameters;
- activations: every tensor autograd saves during one forward, measured by running the forward on
  fake tensors (no device memory) under `saved_tensors_hooks`, each storage counted once;
- quantized weights: the largest site's weight operand (FP8 data + scales natively; a dequantized
  bf16 copy for emulated recipes). Each call quantizes its weight and frees the operand after its
  GEMM: nothing is cached across calls outside `deepwell.microbatches()` (weight_cache.py);
- transient: the largest saved tensor twice (a gradient being formed next to its input).

Time: each site's three GEMMs at the rate of its kernel on the device, plus the quantizers' bytes
(activations, gradients, and the weight twice: for fprop and for dgrad) at the device's copy
bandwidth, plus everything else approximated as the memory traffic of the
saved activations (read once, written once). Rates are measured H100 numbers (docs/BASELINES.md and
benchmarks/results/bench_linear-*); other devices get them too, labelled as such.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .engine import Engine

#: H100 SXM rates (TFLOP/s, TB/s): bf16 cuBLAS, cuBLASLt FP8 blockwise 1x128 x 128x128 and
#: 1x128 x 1x128, and device-copy bandwidth (docs/BASELINES.md; bench_linear on 2026-11-22).
RATES = {"bf16": 690.0, "fp8_fprop": 1150.0, "fp8_wgrad": 900.0, "copy_tbps": 3.0}


@dataclass
class Estimate:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    quantized_weights: int
    transient: int
    step_ms: float
    bf16_step_ms: float
    rates_from: str

    @property
    def peak_bytes(self) -> int:
        resident = self.weights + self.optimizer + self.quantized_weights
        return resident + max(self.activations + self.transient, self.gradients)

    @property
    def speedup(self) -> float:
        return self.bf16_step_ms / self.step_ms if self.step_ms else 1.0

    def __str__(self) -> str:
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        return "\n".join(
            [
                f"predicted peak memory {gib(self.peak_bytes)}: weights {gib(self.weights)}, gradients {gib(self.gradients)}, "
                f"AdamW states {gib(self.optimizer)}, activations {gib(self.activations)}, largest quantized weight "
                f"{gib(self.quantized_weights)}, transient {gib(self.transient)}",
                f"predicted step {self.step_ms:.2f} ms vs {self.bf16_step_ms:.2f} ms in bf16: {self.speedup:.2f}x ({self.rates_from})",
            ]
        )


def _saved_activation_bytes(model: torch.nn.Module, example_inputs: tuple) -> tuple[int, int]:
    """(total, largest) bytes of the tensors autograd saves in one eager forward, on fake tensors."""
    seen: dict[int, int] = {}
    params = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}

    def pack(t):
        if id(t) not in params:
            storage = t.untyped_storage()  # views share it; its C pointer identifies it
            seen[storage._cdata] = storage.nbytes()
        return t

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        inputs = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs)
    return sum(seen.values()), max(seen.values(), default=0)


def _gemm_ms(m: int, n: int, k: int, rate_tflops: float) -> float:
    return 2.0 * m * n * k / (rate_tflops * 1e12) * 1e3


def dryrun(engine: Engine) -> Estimate:
    """The estimate for one training step of `engine` on its example inputs' shapes."""
    model, plan = engine.model, engine.plan
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    activations, largest = _saved_activation_bytes(model, engine.ir.example_inputs)
    quantized = 0
    step = bf16 = 0.0
    copy_bps = RATES["copy_tbps"] * 1e12
    for s in plan.sites:
        m, k, n = s.tokens, s.in_features, s.out_features
        dense = sum(_gemm_ms(*shape, RATES["bf16"]) for shape in ((m, n, k), (m, k, n), (n, k, m)))
        bf16 += dense
        recipe = s.recipe
        native = s.decision is not None and not s.decision.emulated
        if recipe == "bf16":
            step += dense
            continue
        if recipe == "fp8_block" and native:
            step += 2 * _gemm_ms(m, n, k, RATES["fp8_fprop"]) + _gemm_ms(n, k, m, RATES["fp8_wgrad"])
            quantized = max(quantized, n * k + 4 * (n // 128) * (k // 128))
            # x rows (fwd), x rowcol (bwd), dy rowcol: bf16 read + fp8 written, per copy; W
            # quantized in the forward and again (plus an FP8 transpose) in the backward.
            qbytes = m * k * (2 + 1) + m * k * (2 + 2) + m * n * (2 + 2) + n * k * (3 + 3 + 2)
        else:
            step += dense  # emulation: bf16 GEMMs on dequantized operands
            quantized = max(quantized, n * k * 2)
            # quantize (2 -> 1 byte) then dequantize (1 -> 2 bytes) of x twice, dy twice, W twice.
            qbytes = (2 * (m * k + m * n) + 2 * n * k) * (3 + 3)
        step += qbytes / copy_bps * 1e3
    # Everything else: the saved activations' traffic, the same in both precisions.
    other = 2 * activations / copy_bps * 1e3
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return Estimate(
        weights=weights,
        gradients=weights,
        optimizer=2 * weights,
        activations=activations,
        quantized_weights=quantized,
        transient=2 * largest,
        step_ms=step + other,
        bf16_step_ms=bf16 + other,
        rates_from=f"H100 rates (this machine: {gpu})",
    )
