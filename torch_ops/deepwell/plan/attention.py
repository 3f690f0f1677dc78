"""Attention sites: each scaled-dot-product attention of a captured graph, the kernel torch runs it
with and why, and what it costs a training step. deepwell does not rewrite attention (its bf16
SDPA kernels are exact and already fast) unless the user asks for `CompileOptions.attention="fp8"`
(compiler/fp8_attention.py: an EMULATED FP8 forward, which `dryrun` still prices at SDPA's rate):
the plan lists it so that the plan table says what runs and `dryrun` prices the whole step, not
only its GEMMs.

The backend finds the sites (compiler/attention.py); this module decides what torch runs them
with (`kernel`), their FLOPs, the bytes they save for the backward (`saved_bytes`) and their time
(`attention_ms`).

Kernel (`sdpa_kernel`): torch's `scaled_dot_product_attention` picks its backend per call, in
order of priority, the first whose checks pass (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
`select_sdp_backend`). On CUDA the order is flash, memory-efficient, math, except on sm_90 / sm_100
/ sm_103 with a runtime cuDNN newer than 9.15.0, where cuDNN attention goes first
(`check_prefer_cudnn_attention`); flash and cuDNN take fp16/bf16 only, flash no attn_mask. Those
checks read shapes, strides and the installed cuDNN, so a plan made without that device says what
torch is expected to pick and that torch chooses at run time. A CPU plan asks this torch which it
picks (`torch._fused_sdp_choice` on small tensors of the site's dtype and head size).

Time: a fused site's FLOPs, 4·B·H·Tq·Tk·D in the forward (QKᵀ and PV, 2 FLOPs per multiply-add)
and 2.5 times that in the backward (FlashAttention-2's count, arXiv:2307.08691 §3.1: five matmuls
of that size, one of them recomputing QKᵀ, against the forward's two), halved for a causal site
(the kernel skips the masked tiles), at the device's measured SDPA rate (`SDPA_RATES`). An
explicit site runs its two matmuls as bf16 GEMMs at the cost model's bf16 rate (the `step_cost`
entry, rust/core/src/policy/cost.rs: the full Tq x Tk square, a mask saves nothing) plus the
probabilities' memory traffic at copy bandwidth (`EXPLICIT_PASSES`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict, dataclass
from enum import Enum

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.attention import SDPBackend

from .. import _native


class Form(str, Enum):
    """How a site computes attention."""

    #: `F.scaled_dot_product_attention` (also nn.MultiheadAttention called with need_weights=False):
    #: a fused kernel, or torch's math fallback.
    SDPA = "sdpa"
    #: matmul -> softmax -> matmul written out (Hugging Face eager attention, nn.MultiheadAttention
    #: with need_weights=True): the (Tq, Tk) probabilities materialised, in the forward and the backward.
    EXPLICIT = "explicit"


@dataclass
class AttentionSite:
    """One attention of a graph. Shapes are those of the captured call; 0 where the graph does not
    say (symbolic sizes). `batch` and `heads` are None where the graph folds them into one
    dimension (nn.MultiheadAttention's (B·H, T, D) bmms): `batch_heads` is their product."""

    #: The qualified name of the module computing it ("model.layers.0.self_attn"; "" for the root),
    #: with "#2", "#3", ... for a module's second, third, ... attention.
    name: str
    module_type: str
    form: Form
    batch_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    #: The kernel computes only the lower triangle (SDPA's is_causal): half the FLOPs.
    causal: bool
    dtype: str
    device: str
    batch: int | None = None
    heads: int | None = None
    #: Key/value heads where fewer than the query heads (grouped-query attention).
    kv_heads: int | None = None
    #: An attn_mask (or key_padding_mask) is applied.
    masked: bool = False
    dropout: bool = False
    #: What runs it, and why (`decide`).
    kernel: str = ""
    why: str = ""

    @property
    def shape(self) -> str:
        """"B x H x Tq x Tk x D" as the table prints it."""
        d = lambda v: str(v) if v else "?"  # noqa: E731
        bh = f"{self.batch}x{self.heads}" if self.batch and self.heads else f"({d(self.batch_heads)})"
        return f"{bh}x{d(self.q_len)}x{d(self.kv_len)}x{d(self.head_dim)}"

    @property
    def forward_flops(self) -> float:
        """QKᵀ and PV: 4·B·H·Tq·Tk·D, halved when causal (explicit sites compute the full square)."""
        flops = 4.0 * self.batch_heads * self.q_len * self.kv_len * self.head_dim
        return flops / 2 if self.causal and self.form is Form.SDPA else flops

    @property
    def training_flops(self) -> float:
        """Forward and backward: the backward is `BACKWARD_FACTOR` forwards."""
        return (1 + BACKWARD_FACTOR) * self.forward_flops

    @property
    def materialises(self) -> bool:
        """Whether the (Tq, Tk) probabilities exist as a tensor (explicit sites, torch's math kernel)."""
        return self.form is Form.EXPLICIT or self.kernel.startswith("math")

    @property
    def element_size(self) -> int:
        return _dtype(self.dtype).itemsize

    def saved_bytes(self) -> int:
        """What the site's forward keeps for its backward beyond q, k and v (the projections'
        outputs, counted with them): a fused kernel its output and the fp32 logsumexp of each
        query row (B·H·Tq); an explicit one its output and the probabilities (B·H·Tq·Tk), which the
        PV matmul's backward reads."""
        rows = self.batch_heads * self.q_len
        out = rows * self.head_dim * self.element_size
        if self.materialises:
            return out + rows * self.kv_len * self.element_size
        return out + rows * 4

    def at_shape(self, seq: tuple[int, int], to: tuple[int, int]) -> AttentionSite:
        """The site at another training shape: `seq` (captured batch, sequence) -> `to` (batch,
        sequence). Sizes equal to the captured sequence become the new one, the batch likewise
        (a cross-attention's fixed memory length stays)."""
        (b0, t0), (b1, t1) = seq, to
        scale = lambda n, old, new: new if n == old else n  # noqa: E731
        batch = scale(self.batch, b0, b1) if self.batch else None
        per_batch = self.batch_heads // self.batch if self.batch else None
        batch_heads = batch * per_batch if batch else self.batch_heads
        return dataclasses.replace(self, batch=batch, batch_heads=batch_heads, q_len=scale(self.q_len, t0, t1),
                        kv_len=scale(self.kv_len, t0, t1))

    def to_dict(self) -> dict:
        return {**asdict(self), "form": self.form.value, "shape": self.shape}


#: The backward's FLOPs in forwards (FlashAttention-2's count: see the module docs).
BACKWARD_FACTOR = 2.5

#: torch's default SDPA on an H200 (cuDNN attention there), bf16, causal, forward + backward, head
#: size 128, in TFLOP/s of `training_flops`, by key length: (B, H, T) = (4, 16, 2048), (1, 16, 8192),
#: (1, 32, 32768). Between them, interpolated in log2(Tk); outside, the nearest (the shortest's rate
#: is optimistic for shorter keys).
SDPA_RATES = {"Hopper": ((2048, 384.0), (8192, 524.0), (32768, 557.0))}
SDPA_RATES_FROM = "torch SDPA bf16 causal fwd+bwd measured on an H200 (384-557 TFLOP/s)"

#: Times an explicit site's probabilities (B·H·Tq·Tk elements) cross memory in a training step:
#: the forward writes the scores, reads them into the softmax (scale and mask fused), writes the
#: probabilities and the PV matmul reads them; the backward writes dP, reads it with P into dS
#: (softmax's backward), writes dS and the two matmuls read it.
EXPLICIT_PASSES = 9


def sdpa_rate(arch: str, kv_len: int) -> tuple[float, str]:
    """(TFLOP/s, where it comes from) of a fused site on `arch`: its family's measured rate, or
    Hopper's, borrowed, where none was measured (Blackwell's attention rate is unmeasured)."""
    family = _family(arch)
    points = SDPA_RATES.get(family)
    source = SDPA_RATES_FROM
    if points is None:
        points, source = SDPA_RATES["Hopper"], f"{SDPA_RATES_FROM} (no attention rate for {arch}: borrowed)"
    if kv_len <= points[0][0]:
        return points[0][1], source
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
        if kv_len <= t1:
            w = (math.log2(kv_len) - math.log2(t0)) / (math.log2(t1) - math.log2(t0))
            return r0 + w * (r1 - r0), source
    return points[-1][1], source


@dataclass
class AttentionCost:
    """The attention sites' share of a training step."""

    ms: float
    flops: float
    sites: int
    rates_from: str


def attention_cost(sites: list[AttentionSite], arch: str) -> AttentionCost:
    """Milliseconds and FLOPs of `sites` per training step on `arch` (module docs)."""
    ms = flops = 0.0
    explicit = []
    for s in sites:
        flops += s.training_flops
        if s.form is Form.EXPLICIT:
            explicit.append(s)
        elif s.training_flops:
            rate, _ = sdpa_rate(arch, s.kv_len)
            ms += s.training_flops / (rate * 1e12) * 1e3
    _, source = sdpa_rate(arch, 0)
    gemms, traffic = [], 0.0
    for s in explicit:
        rows = s.batch_heads * s.q_len
        if rows and s.kv_len and s.head_dim:
            gemms += [{"tokens": rows, "in_features": s.head_dim, "out_features": s.kv_len, "recipe": "bf16"},
                      {"tokens": rows, "in_features": s.kv_len, "out_features": s.head_dim, "recipe": "bf16"}]
            traffic += EXPLICIT_PASSES * rows * s.kv_len * s.element_size
    if gemms:
        cost = _native.call("step_cost", {"arch": arch, "sites": gemms, "other_bytes": traffic}, "deepwell.dryrun")
        ms += cost["bf16_step_ms"]
        source += f"; explicit attention: bf16 GEMMs and the probabilities' traffic ({cost['rates_from']})"
    return AttentionCost(ms, flops, len(sites), source)


def _family(arch: str) -> str:
    """"Hopper" for sm_90, ..., "CPU", "GPU" for an arch this module cannot name."""
    major, _ = _sm(arch)
    return {9: "Hopper", 10: "Blackwell", 12: "Blackwell"}.get(major, "CPU" if arch == "cpu" else "GPU")


def _sm(arch: str) -> tuple[int, int]:
    """(major, minor) of "sm_90" / "sm_103"; (0, 0) for "cpu"."""
    m = re.fullmatch(r"sm_(\d+)(\d)", arch or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None) if name else None
    return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16


def _fix(module_type: str, from_transformers: bool) -> str:
    """What `deepwell.optimize` does about an explicit site computed in a module of that type."""
    if module_type in ("MultiheadAttention", "DeepwellMultiheadAttention"):
        return "deepwell.optimize swaps nn.MultiheadAttention for DeepwellMultiheadAttention (SDPA)"
    if from_transformers:
        return "deepwell.optimize switches the Hugging Face model to attn_implementation='sdpa'"
    return "call F.scaled_dot_product_attention instead (deepwell.optimize cannot swap this module)"


def decide(site: AttentionSite, arch: str, from_transformers: bool = False) -> AttentionSite:
    """Writes the site's kernel and why for a plan made for `arch`; returns the site."""
    if site.form is Form.EXPLICIT:
        site.kernel = f"explicit matmuls+softmax ({site.dtype.replace('torch.', '')})"
        site.why = (f"eager: misses the fused kernel, materialising the B·H·Tq·Tk probabilities; "
                    f"{_fix(site.module_type, from_transformers)}")
    else:
        site.kernel, site.why = sdpa_kernel(site, arch)
    return site


def sdpa_kernel(site: AttentionSite, arch: str) -> tuple[str, str]:
    """(kernel, why) of an SDPA site on `arch` (module docs: torch's priority order)."""
    dtype = _dtype(site.dtype)
    if arch == "cpu":
        return _cpu_kernel(site, dtype)
    major, minor = _sm(arch)
    half = dtype in (torch.float16, torch.bfloat16)
    run_time = "chosen by torch at run time"
    if not half:
        return ("memory-efficient", f"{run_time}: flash and cuDNN attention take fp16/bf16 only, "
                f"the memory-efficient kernel takes {site.dtype.replace('torch.', '')}")
    if major < 8:
        return "memory-efficient", f"{run_time}: flash and cuDNN attention need sm_80 or newer"
    mask = " (flash takes no attn_mask)" if site.masked else ""
    if major in (9, 10) and minor in (0, 3):
        here = _cudnn_here(arch)
        if here is None:
            return ("cuDNN" + (" or memory-efficient" if site.masked else ""),
                    f"{run_time}: torch puts cuDNN attention first on {arch} when its cuDNN is newer than "
                    f"9.15.0 (else flash{' / memory-efficient' + mask if site.masked else ''}); the fastest "
                    "exact kernel measured on the H200")
        if here > 91500:
            return "cuDNN", (f"{run_time}: this torch's cuDNN {here} is newer than 9.15.0, so cuDNN attention goes "
                             f"first on {arch} if its checks pass (head size, layout{', mask' if site.masked else ''})")
        fallback = "memory-efficient" if site.masked else "flash"
        return fallback, f"{run_time}: this torch's cuDNN {here} is not newer than 9.15.0: {fallback} first{mask}"
    if site.masked:
        return "memory-efficient", f"{run_time}: flash first on {arch}, but it takes no attn_mask"
    if site.head_dim and (site.head_dim > 256 or site.head_dim % 8):
        return "memory-efficient", f"{run_time}: flash takes head sizes up to 256 in multiples of 8, not {site.head_dim}"
    return "flash", f"{run_time}: flash first on {arch} (fp16/bf16, no mask)"


def _cudnn_here(arch: str) -> int | None:
    """The runtime cuDNN version when this machine's first GPU is `arch`, else None."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    if f"sm_{major}{minor}" != arch or not torch.backends.cudnn.is_available():
        return None
    return torch.backends.cudnn.version()


_CPU_KERNELS = {"FLASH_ATTENTION": "flash (CPU)", "MATH": "math"}


def _cpu_kernel(site: AttentionSite, dtype: torch.dtype) -> tuple[str, str]:
    """What this torch runs the site with on the CPU: `torch._fused_sdp_choice` on tensors of the
    site's dtype, heads and head size (its CPU checks read those, the mask and dropout, not the
    lengths)."""
    if not site.head_dim:
        return "chosen by torch at run time", "the graph does not say the head size"
    heads = site.heads or 1
    kv_heads = site.kv_heads or heads
    with unset_fake_temporarily(), torch.no_grad():
        q = torch.zeros(1, heads, 4, site.head_dim, dtype=dtype)
        kv = torch.zeros(1, kv_heads, 4, site.head_dim, dtype=dtype)
        mask = torch.zeros(4, 4, dtype=dtype) if site.masked else None
        choice = torch._fused_sdp_choice(q, kv, kv, attn_mask=mask, dropout_p=0.1 if site.dropout else 0.0,
                                         is_causal=site.causal and not site.masked, enable_gqa=kv_heads != heads)
    name = SDPBackend(choice).name
    kernel = _CPU_KERNELS.get(name, name.lower())
    return kernel, f"this torch's choice on the CPU for {site.dtype.replace('torch.', '')}, head size {site.head_dim}"
