"""`deepwell.dryrun(engine)`: predicted peak memory and step time of a training step (forward,
backward, AdamW) from a cost model, without running the model on the device.

Memory (bytes). The peak of a step comes at the start of the backward pass: weights and AdamW's two
states (in the parameter dtype, as torch.optim.AdamW keeps them) are resident, the forward's saved
activations are all alive, one site's quantized weight operand exists, and the loss's gradient is
being formed. Gradients (with `zero_grad(set_to_none=True)`) are allocated while the activations they
depend on are freed, so they count only when they outgrow the activations:
  peak = weights + optimizer + quantized weight + gathered + staging
         + max(activations + transient + loss, gradients)
With several processes the figures are per rank: FSDP2 shards weights, gradients and AdamW states
over the ranks (the plan's data x tensor degrees), and gathers a unit's weights at a time (a unit:
a group of the plan's `unit_blocks` blocks, or the embedding, or the final norm and LM head; parallel.py
`fsdp_units`) (`gathered`: the largest unit twice, the one computing and the one prefetched; with
reshard_after_forward off, every unit's gathered weights stay until the backward; a weight on the
FP8 all-gather, `autoplan(..., fp8_all_gather=True)`, counts its E4M3 codes at a byte per element
and its fp32 tile scales, distributed/fp8_all_gather.py `gathered_bytes`);
activations are those of the captured micro-batch, which is one rank's. `staging`: with the plan's
collectives on the copy engines, their symmetric staging buffers (distributed/copy_engine.py
`staging_bytes`: the largest unit's shard, and as many bytes from each other rank).
- weights and gradients: from the parameters;
- activations: what the compiled forward saves for the backward: AOTAutograd's partition of the
  model's forward + backward traced on fake tensors (no device memory), as the backend partitions
  it (plan/memory.py; eager autograd's saved tensors where the model cannot be traced);
- quantized weights: the largest site's weight operand (FP8 data + scales natively; a dequantized
  bf16 copy for emulated recipes). Each call quantizes its weight and frees the operand after its
  GEMM: nothing is cached across calls outside `deepwell.microbatches()` (nn/weight_cache.py);
- transient: the largest saved tensor twice (a gradient being formed next to its input);
- loss: the usual cross-entropy's working set on the model's outputs (`_loss_bytes`).

Time: the Rust cost model (rust/core/src/policy/cost.rs, the `step_cost` entry): each pass of each
site at the rate of the kernel the dispatch table picks for it on the plan's device (native
recipes at their block-scaled rates, emulated ones as bf16 GEMMs plus dequantization traffic), the
quantizers' bytes (activations, gradients, and the weight twice: for fprop and for dgrad) and
everything else approximated as the memory traffic of the saved activations (read once, written
once) at copy bandwidth. Rates: measured on an H100 for Hopper, the B200 datasheet for Blackwell,
Hopper's (labelled as borrowed) elsewhere. Attention (the plan's attention sites, plan/attention.py
`attention_cost`): a fused site's FLOPs at torch SDPA's rate measured on an H200 (Hopper's, borrowed,
elsewhere), an explicit one's matmuls as bf16 GEMMs plus its probabilities' traffic; the same in
both plans (attention stays torch's). Its saved tensors (outputs and logsumexp; an explicit site's
probabilities) are part of the measured activations; the estimate shows their share, not added again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import _native
from ..distributed.copy_engine import staging_bytes, unit_params
from ..distributed.fp8_all_gather import gathered_bytes
from ..distributed.units import nbytes, plan_units
from .attention import attention_cost
from .memory import saved_activation_bytes
from .sites import Codes

if TYPE_CHECKING:  # the engine is the compiler's, a layer above: only its type is read here
    from ..compiler.engine import Engine


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

    #: Weights FSDP holds gathered at once (0 for one process), and the processes the plan is for.
    gathered: int = 0
    ranks: int = 1
    #: The loss's working set on the model's outputs at the start of the backward (see `_loss_bytes`).
    loss: int = 0
    #: The copy-engine collectives' staging buffers (0 on the process group's collectives).
    staging: int = 0
    #: The attention sites' time (in step_ms and bf16_step_ms both), their count, what they save for
    #: the backward (part of `activations`) and where their rates come from.
    attention_ms: float = 0.0
    attention_sites: int = 0
    attention_bytes: int = 0
    attention_from: str = ""

    @property
    def peak_bytes(self) -> int:
        resident = self.weights + self.optimizer + self.quantized_weights + self.gathered + self.staging
        return resident + max(self.activations + self.transient + self.loss, self.gradients)

    @property
    def speedup(self) -> float:
        return self.bf16_step_ms / self.step_ms if self.step_ms else 1.0

    #: The keys `estimate[key]` answers (the design documents read the estimate as a dict):
    #: rounded figures for printing; the attributes hold the exact ones.
    KEYS = ("expected_speedup", "memory_gb", "peak_bytes", "step_ms", "bf16_step_ms")

    def __getitem__(self, key: str):
        if key == "expected_speedup":
            return round(self.speedup, 2)
        if key == "memory_gb":
            return round(self.peak_bytes / 1e9, 2)  # decimal GB, as the key says (str() prints GiB)
        if key in self.KEYS:
            return getattr(self, key)
        raise KeyError(f"deepwell.Estimate has no key {key!r}: {', '.join(self.KEYS)} (its attributes hold the rest)")

    def keys(self) -> tuple[str, ...]:
        return self.KEYS

    def to_dict(self) -> dict:
        return {k: self[k] for k in self.KEYS}

    def __str__(self) -> str:
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        return "\n".join(
            [
                f"predicted peak memory{' per rank' if self.ranks > 1 else ''} {gib(self.peak_bytes)}: weights {gib(self.weights)}, gradients {gib(self.gradients)}, "
                f"AdamW states {gib(self.optimizer)}, activations {gib(self.activations)}, largest quantized weight "
                f"{gib(self.quantized_weights)}, transient {gib(self.transient)}, loss on the outputs {gib(self.loss)}"
                + (f", gathered by FSDP {gib(self.gathered)} ({self.ranks} ranks)" if self.ranks > 1 else "")
                + (f", copy-engine staging {gib(self.staging)}" if self.staging else ""),
                f"predicted step {self.step_ms:.2f} ms vs {self.bf16_step_ms:.2f} ms in bf16: {self.speedup:.2f}x ({self.rates_from})",
            ]
            + ([f"attention: {self.attention_sites} sites, {self.attention_ms:.2f} ms of the step "
                f"({100 * self.attention_share:.1f}%), {gib(self.attention_bytes)} of the activations ({self.attention_from})"]
               if self.attention_sites else [])
        )

    @property
    def attention_share(self) -> float:
        """Attention's fraction of the predicted step."""
        return self.attention_ms / self.step_ms if self.step_ms else 0.0


def _local(p):
    """A parameter's tensor on this rank (a DTensor's local shard)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _loss_bytes(output: list[int]) -> int:
    """What a loss over the model's outputs (bytes, elements) holds when the backward starts, for the
    usual `cross_entropy(logits.float(), targets)`: the outputs themselves, the fp32 log-softmax it
    saves and the fp32 gradient the backward forms next to it. The loss is the user's code, outside
    the model: an estimate of the usual one (0 for a plan measured before outputs were counted)."""
    if len(output) < 2:
        return 0
    nbytes, elements = output[:2]
    return nbytes + 2 * 4 * elements


def _saved_codes(engine: Engine) -> dict[str, str]:
    """The sites whose FP8 codes of x the forward saves, as the plan's strategies say (`Site.codes`,
    written under the engine's options); none of them with `recompute_codes`, whose saved set is the
    recomputing partition's, which the plain GEMMs standing in for deepwell's trace."""
    return {s.name: s.recipe for s in engine.plan.sites if s.codes is Codes.SAVED}


def dryrun(engine: Engine) -> Estimate:
    """The estimate for one training step of `engine` on its example inputs' shapes. `engine`: a
    `deepwell.compile` result, or a `deepwell.optimize` one given a training shape (seq_len=,
    batch_size=), which carries its Engine as `deepwell_engine` (api.py)."""
    engine = getattr(engine, "deepwell_engine", engine)
    if not all(hasattr(engine, a) for a in ("model", "plan", "ir", "options")):
        raise TypeError(
            f"deepwell.dryrun: expected a deepwell.Engine (deepwell.compile) or a deepwell.optimize(model, seq_len=..., "
            f"batch_size=...) result, got {type(engine).__name__}; an optimize() result without a training shape plans "
            "lazily, at its first call, so there is nothing to estimate yet")
    model, plan = engine.model, engine.plan
    weights = nbytes(model.parameters())
    data, tensor = plan.parallelism["data"], plan.parallelism["tensor"]
    ranks = data * tensor
    share = weights // ranks
    if tensor > 1:
        # Tensor parallelism splits the blocks' linears (and, with sequence parallelism, the embedding
        # and the LM head): the rank's share is what it holds, read from the shards once compile has
        # split them.
        share = sum(local.numel() * local.element_size() for local in map(_local, model.parameters()))
    staging = 0
    if ranks > 1:
        modules = plan_units(model, plan.sharding)
        units = [gathered_bytes(p for m in unit for p in m.parameters()) for unit in modules]
        keep = not plan.sharding["reshard_after_forward"]
        gathered = (sum(units) if keep else 2 * max(units, default=0)) // tensor if data > 1 else 0
        if data > 1 and plan.sharding.get("collectives") == "copy_engine":
            staging = staging_bytes(unit_params(model, modules), data)
        # Measured by autoplan before sharding, for one rank: under tensor parallelism with the
        # split layers at their local shapes (the heads' and hidden units' activations split; the
        # residual stream and the norms' replicated, or split along the sequence with sequence
        # parallelism).
        activations, largest, *output = plan.sharding["saved"]  # 2 fields in plans saved before outputs were counted
    else:
        gathered = 0
        quantized = any(s.recipe != "bf16" for s in plan.sites)
        activations, largest, *output = saved_activation_bytes(model, engine.ir.example_inputs, quantized,
                                                               codes=_saved_codes(engine),
                                                               mlps=engine.plan.fused_mlps())
    quantized = 0
    for s in plan.sites:
        n, k = s.out_features, s.in_features
        native = s.decision is not None and not s.decision.emulated
        if s.recipe == "fp8_block" and native:
            quantized = max(quantized, n * k + 4 * (n // 128) * (k // 128))  # FP8 data + fp32 tile scales
        elif native and s.recipe != "bf16":
            quantized = max(quantized, n * k)  # MX/NV data and scales: at most a byte per element
        elif s.recipe != "bf16":
            quantized = max(quantized, n * k * 2)  # emulated: a dequantized bf16 copy
    sites = [
        {"tokens": s.tokens, "in_features": s.in_features, "out_features": s.out_features, "recipe": s.recipe}
        for s in plan.sites
    ]
    cost = _native.call("step_cost", {"arch": plan.arch, "sites": sites, "other_bytes": 2 * activations}, "deepwell.dryrun")
    attention = attention_cost(plan.attention, plan.arch)
    # Saved bytes at the captured micro-batch's shapes, as the activations are measured; one rank's
    # heads under tensor parallelism.
    attention_bytes = sum(a.saved_bytes() for a in getattr(engine.ir, "attention", [])) // tensor
    return Estimate(
        weights=share,
        gradients=share,
        optimizer=2 * share,
        activations=activations,
        quantized_weights=quantized,
        transient=2 * largest,
        loss=_loss_bytes(output),
        step_ms=cost["step_ms"] + attention.ms,
        bf16_step_ms=cost["bf16_step_ms"] + attention.ms,
        rates_from=f"{cost['rates_from']}; plan for {plan.arch}",
        gathered=gathered,
        ranks=ranks,
        staging=staging,
        attention_ms=attention.ms,
        attention_sites=attention.sites,
        attention_bytes=attention_bytes,
        attention_from=attention.rates_from,
    )
