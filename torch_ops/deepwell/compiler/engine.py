"""The step-by-step API on the compile backend's machinery:

    hw = deepwell.probe()                                   # devices and their native recipes
    ir = deepwell.capture(model, (tokens,))                 # the GEMM sites and modules the planner sees
                                                            # (token-id models: inputs optional)
    plan = deepwell.autoplan(ir, hw=hw, seq_len=2048, global_batch=8)
    engine = deepwell.compile(ir, plan=plan)                # the model compiled with that plan
    print(deepwell.dryrun(engine))                          # predicted memory and step time
    loss = engine(tokens).float().square().mean(); loss.backward()
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..core.policy import PrecisionPolicy
from ..core.recipes import Recipe, arch_info, arch_name, device_arch, precision_name
from ..distributed import tensor_parallel as tp  # autoplan's argument `tensor_parallel` is the degree
from ..distributed.fp8_all_gather import choose as fp8_all_gather_choose
from ..distributed.shard import shard
from ..distributed.units import world_size as current_world_size
from ..kernels import SiteOp
from ..nn.moe import DeepwellMoE
from ..plan.hardware import Hardware
from ..plan.memory import codes_of
from ..plan.options import CompileOptions
from ..plan.parallel import check_tensor_degree, plan_parallelism, with_tensor_share
from ..plan.sites import Plan, Site, plan_sites, role_of
from . import backend
from ..plan.attention import AttentionSite, Form, decide
from .attention import capture_attention
from .backend import capture_sites

#: The token-id batch `capture` makes up when given no example inputs: (DEFAULT_BATCH, DEFAULT_SEQ),
#: the sequence shortened to the model's positions.
DEFAULT_BATCH, DEFAULT_SEQ = 2, 128


@dataclass
class ModuleInfo:
    name: str
    type: str
    role: str
    #: parameter name -> (shape, dtype)
    params: dict[str, tuple[tuple[int, ...], str]]


@dataclass
class IR:
    """What the planner sees of a model: its GEMM sites in graph order (from the same Dynamo capture
    the backend uses), its attention sites (kernels decided for the model's device) and its modules
    with parameters, each tagged with a role."""

    model: torch.nn.Module = field(repr=False)
    example_inputs: tuple = field(repr=False)
    sites: list[Site] = field(default_factory=list)
    modules: list[ModuleInfo] = field(default_factory=list)
    graphs: int = 0
    attention: list[AttentionSite] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"IR: {len(self.sites)} GEMM sites and {len(self.attention)} attention sites in {self.graphs} graph(s), "
                 f"{len(self.modules)} modules with parameters"]
        lines.append(f"{'site':<36} {'role':<9} {'type':<10} {'in':>6} {'out':>6} {'tokens':>7}")
        for s in self.sites:
            lines.append(f"{s.name:<36} {s.role:<9} {s.module_type:<10} {s.in_features:>6} {s.out_features:>6} {s.tokens:>7}")
        lines.append(f"{'module':<36} {'role':<9} {'type':<14} params")
        for m in self.modules:
            shapes = ", ".join(f"{k} {list(v[0])}" for k, v in m.params.items())
            lines.append(f"{m.name:<36} {m.role:<9} {m.type:<14} {shapes}")
        for a in self.attention:
            lines.append(f"attention {a.name or '<model>'}: {a.form.value} {a.shape}{' causal' if a.causal else ''} {a.dtype}")
        return "\n".join(lines)


def example_tokens(model: torch.nn.Module, seq_len: int | None = None, batch_size: int | None = None) -> tuple:
    """`(tokens,)`: random token ids of shape (batch_size, seq_len) (defaults DEFAULT_BATCH and
    DEFAULT_SEQ, or the model's positions if fewer) for a model that takes token ids and says its
    vocabulary: `deepwell.models.Llama` (config["vocab"]) or a Hugging Face model (config.vocab_size)."""
    config = getattr(model, "config", None)
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    vocab = get("vocab") or get("vocab_size")
    if not isinstance(vocab, int):
        raise TypeError(f"deepwell.capture: cannot make up inputs for {type(model).__name__} (no config with a vocabulary "
                        "size: deepwell.models.Llama's config['vocab'] or a Hugging Face config.vocab_size); pass "
                        "example_inputs, the positional arguments of one forward call: deepwell.capture(model, (x,))")
    positions = get("max_seq") or get("n_positions") or get("max_position_embeddings")
    seq = seq_len or min(DEFAULT_SEQ, positions or DEFAULT_SEQ)
    if positions and seq > positions:
        raise ValueError(f"deepwell.capture: seq_len={seq} is longer than {type(model).__name__}'s {positions} positions")
    device = next(model.parameters()).device
    tokens = torch.randint(0, vocab, (batch_size or DEFAULT_BATCH, seq), generator=torch.Generator().manual_seed(0))
    return (tokens.to(device),)


def capture(model: torch.nn.Module, example_inputs: tuple | None = None, *, seq_len: int | None = None,
            batch_size: int | None = None) -> IR:
    """Traces `model(*example_inputs)` with Dynamo (no compilation, no gradients) and returns its IR.
    Without `example_inputs`, a token-id model gets a (batch_size, seq_len) batch of random ids
    (`example_tokens`: its defaults, its errors); the forward runs once on it, and dryrun's
    activations are that micro-batch's (autoplan's seq_len / global_batch set the GEMMs' tokens)."""
    if example_inputs is None:
        example_inputs = example_tokens(model, seq_len, batch_size)
    elif seq_len is not None or batch_size is not None:
        raise ValueError("deepwell.capture: seq_len / batch_size shape made-up inputs: give them or example_inputs, not both")
    ir = IR(model, tuple(example_inputs))
    params = list(model.parameters())
    arch = device_arch(params[0].device) if params else "cpu"

    def recorder(gm, inputs, **kw):
        ir.graphs += 1
        ir.sites.extend(g.site for g in capture_sites(gm))
        ir.attention.extend(capture_attention(gm, arch))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=recorder)(*example_inputs)
    torch._dynamo.reset()
    for name, mod in model.named_modules():
        params = {k: (tuple(p.shape), str(p.dtype).replace("torch.", "")) for k, p in mod.named_parameters(recurse=False)}
        if params:
            ir.modules.append(ModuleInfo(name, type(mod).__name__, role_of(name, type(mod).__name__), params))
    return ir


def autoplan(
    ir: IR,
    hw: Hardware | None = None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    arch: str | None = None,
    moe: dict | None = None,
    precision: str = "auto",
    policy: PrecisionPolicy | None = None,
    world_size: int | None = None,
    tensor_parallel: int | None = None,
    fp8_all_gather: bool = False,
    sequence_parallel: bool = False,
) -> Plan:
    """A decision per GEMM site from the Rust planner for `arch` (default: `hw`'s first GPU, else
    this machine). With `seq_len` and `global_batch`, GEMM shapes use seq_len * global_batch tokens
    instead of the captured ones. `plan.parallelism` holds the data and tensor degrees the Rust
    planner picks for `world_size` processes (default: torch.distributed's world, else 1) from the
    devices in `hw` and the model's sizes (the IR's example inputs are one rank's micro-batch), and
    `plan.sharding` how (FSDP2, reshard after forward, predicted bytes per rank, the reason);
    pipeline and expert degrees stay 1. `tensor_parallel` forces the tensor degree (the data degree
    is then world / tensor_parallel): the planner picks tensor parallelism only when data
    parallelism does not fit the devices' memory, never on the CPU, whose memory it does not know.
    `fp8_all_gather=True` makes FSDP2 gather the fp8_block sites' weights as E4M3 codes and tile
    scales instead of their high-precision values (fp8_all_gather.py says which qualify; the
    training step is bit-identical, the gather about half the bytes of bf16):
    `plan.sharding["fp8_all_gather"]`, the weights in `plan.sharding["fp8_gathered"]`, the rest
    explained in its reason. `sequence_parallel=True` (with a tensor degree above 1) also splits
    the residual stream, the norms and their activations along the sequence over the tensor ranks,
    with a vocabulary-parallel embedding and LM head (tensor_parallel.py):
    `plan.sharding["sequence_parallel"]`. `arch` also takes the design's spelling ("blackwell-sm100",
    "hopper-sm90": `arch_name`): a plan is data, made for any arch on any machine; `compile` runs it
    on this one and says what it emulates. `moe` ({"experts", "capacity_factor", "top_k"}) is
    checked against the model's DeepwellMoE blocks (`_moe_plan`); `plan.moe` says what was done
    with each key."""
    tokens = seq_len * global_batch if seq_len and global_batch else None
    sites = [dataclasses.replace(s, tokens=tokens or s.tokens, decision=None) for s in ir.sites]
    arch = arch_name(arch) or (hw.arch if hw is not None else None)
    moe_plan = _moe_plan(ir.model, moe)
    plan = plan_sites(sites, policy or PrecisionPolicy(precision=precision_name(precision)), arch)
    quantized = any(s.recipe != "bf16" for s in plan.sites)
    world = world_size or current_world_size()
    if tensor_parallel is not None:
        check_tensor_degree(world, tensor_parallel)
    par = plan_parallelism(ir.model, ir.example_inputs, hw, world, quantized, codes_of(plan), tensor_parallel)
    sequence = bool(sequence_parallel) and par["tensor"] > 1
    if sequence:
        tp.check(ir.model, par["tensor"], {}, sequence=True)
        tp.check_sequence_degrees(par["data"], par["tensor"])
    par = with_tensor_share(ir.model, ir.example_inputs, par, quantized, sequence)
    plan.parallelism = {"data": par["data"], "tensor": par["tensor"], "pipeline": 1, "expert": 1}
    plan.sharding = {k: par[k] for k in ("fsdp", "reshard_after_forward", "sm_carveout", "collectives", "unit_blocks",
                                       "ends_join_blocks", "forward_prefetch", "per_rank_bytes", "reason", "saved")}
    plan.sharding["fp8_all_gather"], plan.sharding["fp8_gathered"] = bool(fp8_all_gather), []
    plan.sharding["sequence_parallel"] = sequence
    if sequence:
        plan.sharding["reason"] += "; sequence parallel over the tensor ranks (vocabulary-parallel embedding and LM head)"
    elif sequence_parallel:
        plan.sharding["reason"] += "; sequence_parallel=True ignored: it needs a tensor degree above 1"
    if fp8_all_gather and plan.sharding["fsdp"]:
        recipe_of = {s.name: s.recipe for s in plan.sites}
        names, why = fp8_all_gather_choose(ir.model, recipe_of, par["data"], par["tensor"])
        plan.sharding["fp8_gathered"] = names
        plan.sharding["reason"] += f"; {why}"
    plan.moe = moe_plan
    plan.seq_len, plan.global_batch = seq_len, global_batch
    plan.attention = _attention_at(ir, plan.arch, seq_len, global_batch)
    return plan


def _captured_shape(example_inputs: tuple) -> tuple[int, int] | None:
    """(batch, sequence) of the captured call: the first tensor input's first two sizes (token ids
    (B, T), or activations (B, T, D))."""
    first = next((x for x in example_inputs if isinstance(x, torch.Tensor)), None)
    return (int(first.shape[0]), int(first.shape[1])) if first is not None and first.dim() >= 2 else None


def _attention_at(ir: IR, arch: str, seq_len: int | None, global_batch: int | None) -> list[AttentionSite]:
    """The IR's attention sites for a plan on `arch`: at the training shape (seq_len, global_batch)
    where given (`AttentionSite.at_shape`, as the GEMMs' tokens), SDPA kernels decided for `arch`."""
    captured = _captured_shape(ir.example_inputs)
    sites = []
    for s in ir.attention:
        if seq_len and global_batch and captured:
            s = s.at_shape(captured, (global_batch, seq_len))
        else:
            s = dataclasses.replace(s)
        sites.append(decide(s, arch) if s.form is Form.SDPA else s)
    return sites


def _moe_plan(model: torch.nn.Module, moe: Mapping | None) -> dict | None:
    """`autoplan`'s `moe`, checked, with a "notes" entry saying what deepwell does with each key:
    `experts` and `top_k` must match the model's deepwell.DeepwellMoE blocks (their expert GEMMs are
    planned per block, nn/moe.py); `capacity_factor` is set on those blocks by `compile` (None:
    dropless). A model without such blocks gets the keys recorded only, and a note saying so."""
    if moe is None:
        return None
    if not isinstance(moe, Mapping) or set(moe) - {"experts", "capacity_factor", "top_k"}:
        raise ValueError(f"deepwell.autoplan: moe must be a dict of experts, capacity_factor, top_k, got {moe!r}")
    for key in ("experts", "top_k"):
        v = moe.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"deepwell.autoplan: moe['{key}'] must be a positive int, got {v!r}")
    cf = moe.get("capacity_factor")
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
        raise ValueError(f"deepwell.autoplan: moe['capacity_factor'] must be a positive number or None, got {cf!r}")
    blocks = [m for m in model.modules() if isinstance(m, DeepwellMoE)]
    if not blocks:
        note = ("the model has no deepwell.DeepwellMoE blocks (deepwell.optimize swaps Hugging Face ones in): "
                "recorded only")
        return {**moe, "notes": note}
    for key, attr in (("experts", "num_experts"), ("top_k", "top_k")):
        have = {getattr(b, attr) for b in blocks}
        if moe.get(key) is not None and have != {moe[key]}:
            raise ValueError(f"deepwell.autoplan: moe['{key}']={moe[key]}, but the model's DeepwellMoE blocks have {sorted(have)}")
    note = f"{len(blocks)} DeepwellMoE blocks: experts planned per block"
    if "capacity_factor" in moe:
        note += f"; capacity_factor={cf} set on them by deepwell.compile" + (" (dropless)" if cf is None else "")
    return {**moe, "notes": note}


@dataclass
class CompiledOp:
    """One GEMM site of an engine: its name, recipe, and `backend_op`, a zero-argument callable
    running the site's op on representative inputs (kernels.SiteOp), for `KernelProfiler`."""

    name: str
    recipe: str
    backend_op: SiteOp


@dataclass
class Engine:
    """A model compiled by the `deepwell` backend with a fixed plan. Call it like the model."""

    ir: IR
    plan: Plan
    compiled: object
    #: what it was compiled with (`options.plan` is `plan`).
    options: CompileOptions = field(default_factory=CompileOptions)

    def __post_init__(self):
        # The plan says how each site runs under these options, as the backend decides it per
        # graph (codes, fused MLPs): dryrun reads it from there.
        self.options.write_strategies(self.plan.sites)

    def __repr__(self) -> str:
        recipes = sorted({s.recipe for s in self.plan.sites})
        return (
            f"Engine({type(self.model).__name__}, {len(self.plan.sites)} GEMM sites on {self.plan.arch}, "
            f"recipes {recipes}, fallback={self.options.fallback.value!r})"
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.ir.model

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    @property
    def compiled_ops(self) -> list[CompiledOp]:
        """The plan's GEMM sites in graph order, each with a runnable `backend_op` on this model's device."""
        device = next(self.model.parameters()).device
        return [CompiledOp(s.name, s.recipe, SiteOp.of_site(s, device)) for s in self.plan.sites]


def _replanned(plan: Plan, precision: str) -> Plan:
    """`plan`'s sites decided again with `precision` for the same arch; the rest of the plan kept."""
    policy = dataclasses.replace(plan.policy, precision=precision)
    sites = plan_sites([dataclasses.replace(s, decision=None) for s in plan.sites], policy, plan.arch).sites
    return dataclasses.replace(plan, policy=policy, sites=sites)


def _say_how_it_runs(plan: Plan, model: torch.nn.Module) -> None:
    """Warns when `plan` was made for another arch than the model's device: which of its recipes
    this device emulates (exact numerics: dequantize + high-precision GEMM)."""
    params = list(model.parameters())
    here = device_arch(params[0].device) if params else "cpu"
    if plan.arch == here:
        return
    recipes = sorted({s.recipe for s in plan.sites if s.recipe != "bf16"})
    emulated = [r for r in recipes if not Recipe.parse(r).native_on(here)]
    how = (f"{', '.join(emulated)} emulated here (exact numerics: dequantize + high-precision GEMM)" if emulated
           else "natively" if recipes else "in bf16 (the plan quantizes no site)")
    warnings.warn(f"deepwell.compile: the plan is for {plan.arch} ({arch_info(plan.arch)['family']}); this machine's "
                  f"{here} runs it {how}", stacklevel=3)


def compile(
    ir: IR, plan: Plan | None = None, precision: str | None = None, fallback: str | None = None,
    cudagraphs: bool | None = None, fp8_block_codes: bool | None = None, fused_mlp: bool | None = None,
    graph_ops: bool | None = None, recompute_codes: bool | None = None, options: CompileOptions | None = None,
) -> Engine:
    """The IR's model under `torch.compile(backend="deepwell")` with `plan` (default: autoplan with
    the options' precision and policy). The keywords are `CompileOptions` fields (plan/options.py
    says what each does), applied over `options` where given (not None).
    A plan for several processes first shards the model in place (`shard.py`): tensor parallelism
    on its LLaMA blocks through DTensor, then FSDP2 over the data ranks.
    `precision` with a `plan` whose policy has another precision re-plans the plan's sites with it,
    for the plan's arch, and warns so; a plan for another arch than the device's runs with its
    non-native recipes emulated, and warns so. A plan's moe capacity_factor is set on the model's
    DeepwellMoE blocks."""
    backend.ensure_registered()  # a source checkout has no entry point naming the backend
    options = (options or CompileOptions()).replace(
        precision=precision, fallback=fallback, cudagraphs=cudagraphs, fp8_block_codes=fp8_block_codes,
        fused_mlp=fused_mlp, graph_ops=graph_ops, recompute_codes=recompute_codes)
    plan = plan or options.plan
    if plan is None:
        plan = autoplan(ir, precision=options.precision, policy=options.policy)
    elif precision is not None and precision_name(precision) != plan.policy.precision:
        before = plan.policy.precision
        plan = _replanned(plan, options.precision)
        warnings.warn(f"deepwell.compile: precision={options.precision!r} differs from the plan's ({before!r}): its "
                      f"{len(plan.sites)} sites were planned again with it for {plan.arch}", stacklevel=2)
    _say_how_it_runs(plan, ir.model)
    if plan.moe and "capacity_factor" in plan.moe:
        for m in ir.model.modules():
            if isinstance(m, DeepwellMoE):
                m.capacity_factor = plan.moe["capacity_factor"]
    options = options.replace(plan=plan)
    shard(ir.model, plan.parallelism, plan.sharding or {}, {s.name: s.recipe for s in plan.sites})
    compiled = torch.compile(ir.model, backend="deepwell", options=options)
    return Engine(ir, plan, compiled, options)
