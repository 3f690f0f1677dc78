"""What a model keeps in memory during a training step, measured without a device: the tensors one
forward saves for its backward, on fake tensors. Used by `dryrun` and the parallel planner.

The engine runs under torch.compile, where AOTAutograd's min-cut partitioner decides what the
forward saves and what the backward recomputes; that is much less than eager autograd saves (the
0.95B LLaMA of benchmarks/bench_train_step.py: 13.8 GiB saved eagerly, 6.3 GiB in the compiled
partition with fp8_block sites). So the measurement traces the model's joint forward + backward graph with AOTAutograd
on fake tensors and partitions it as the deepwell backend's Inductor compile does (the same
partitioner, `compiler="inductor"`, and the backend's `partitioner_options`). The deepwell ops
themselves are not in that graph (the backend's rewrite needs Dynamo); where they would be, the
plain GEMMs stand in: both read their bf16 input in the backward, which is what the partitioner's
choice depends on. The exception is the sites that save x's FP8 codes instead (fp8_tensor, and
fp8_block under the backend's `fp8_block_codes`; 1 byte per element, once per input shared by
several sites): their forwards are traced as the backend runs them (`saved_codes`), and so are the
SwiGLU MLPs the plan fuses into `fp8_block_swiglu_mlp` (`Plan.fused_mlps`). A model AOTAutograd
cannot trace on fake tensors (data-dependent Python control flow, e.g. a per-expert loop that reads
group sizes on the host) falls back to counting what eager autograd saves, an upper bound."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..core.recipes import family
from ..distributed import tensor_parallel
from ..ops.fp8_tensor import amax_of
from .options import CompileOptions
from .sites import Codes


def saved_activation_bytes(
    model: torch.nn.Module, example_inputs: tuple, quantized: bool | None = None, tensor: int = 1,
    sequence: bool = False, codes: dict[str, str] | None = None, mlps: set[tuple[str, str, str]] = frozenset()
) -> tuple[int, int, int, int]:
    """(total, largest, output, output elements): bytes of the activations one training forward
    saves, of the largest of them and of the forward's outputs, and the outputs' element count.
    `quantized`: whether the plan runs deepwell GEMMs (the backend then lets the partitioner
    recompute their inputs); None counts what eager autograd saves. `tensor` > 1: one rank's share
    under tensor parallelism of that degree (distributed/tensor_parallel.py: the split layers traced at
    their local shapes, the attention at its local heads; the compiled count only), with
    `sequence` the residual stream at 1/tensor of the sequence (`tensor_parallel.local_sequence`).
    `codes`: the sites that save x's codes (qualified nn.Linear name -> recipe, `codes_of`; the
    compiled count, without tensor parallelism: the backend keeps scaled_linear on split weights);
    `mlps`: the (gate, up, down) names of the SwiGLU MLPs that run fused (`Plan.fused_mlps`)."""
    if quantized is not None:
        try:
            return compiled_saved_bytes(model, example_inputs, quantized, tensor, sequence, codes, mlps)
        except Exception:  # noqa: BLE001 - any tracing failure: the eager count is an upper bound
            pass
    return eager_saved_bytes(model, example_inputs)


def eager_saved_bytes(model: torch.nn.Module, example_inputs: tuple) -> tuple[int, int, int, int]:
    """`saved_activation_bytes`'s four figures for what autograd saves in one eager forward, on fake
    tensors."""
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
            out = model(*inputs)
    outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    output = sum(t.numel() * t.element_size() for t in outs)
    return sum(seen.values()), max(seen.values(), default=0), output, sum(t.numel() for t in outs)


def compiled_saved_bytes(
    model: torch.nn.Module, example_inputs: tuple, quantized: bool, tensor: int = 1, sequence: bool = False,
    codes: dict[str, str] | None = None, mlps: set[tuple[str, str, str]] = frozenset()
) -> tuple[int, int, int, int]:
    """`saved_activation_bytes`'s four figures under torch.compile. Saved: the storages behind the
    backward graph's inputs other than the output gradients (`tangents_*`) and the parameters, each
    counted once (a saved view and its base share one), from AOTAutograd's partition of the model's
    joint graph on fake tensors (see the module docs); outputs: the forward graph's."""
    from functools import partial

    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.func import functional_call

    names = [n for n, _ in model.named_parameters()]
    buffers = dict(model.named_buffers())
    sizes: dict[str, int] = {}
    outputs: list[torch.Tensor] = []
    partitioner = partial(min_cut_rematerialization_partition, compiler="inductor")

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = partitioner(joint, joint_inputs, **kwargs)
        produced = {n.name: n for n in fw.graph.nodes}
        returned = next(n for n in fw.graph.nodes if n.op == "output").args[0][: kwargs["num_fwd_outputs"]]
        outputs.extend(v for n in returned if isinstance(v := n.meta.get("val"), torch.Tensor))

        def base(n):  # the node whose storage a view reads
            while n.op == "call_function" and getattr(n.target, "is_view", False):
                n = n.args[0]
            return n

        for n in bw.graph.nodes:
            if n.op != "placeholder" or n.name.startswith("tangents") or n.name not in produced:
                continue
            b = base(produced[n.name])
            val = b.meta.get("val")
            # Parameters (and views of them) have no memory of their own; views share their base's.
            if isinstance(val, torch.Tensor) and not (b.op == "placeholder" and _primal_index(b.name) < len(names)):
                sizes[b.name] = val.untyped_storage().nbytes()
        return fw, bw

    def forward(*args):
        return functional_call(model, {**dict(zip(names, args[: len(names)])), **buffers}, args[len(names) :])

    local = tensor_parallel.local_shapes(model, tensor) if tensor > 1 else {}
    heads = tensor_parallel.local_heads(model, tensor) if tensor > 1 else contextlib.nullcontext()
    split = tensor_parallel.local_sequence(model, tensor) if tensor > 1 and sequence else contextlib.nullcontext()
    with_codes = bool(codes) and tensor == 1
    saves_codes = saved_codes(model, codes, mlps) if with_codes else contextlib.nullcontext()
    options = partitioner_options(1 if quantized else 0)
    with torch._functorch.config.patch(options), FakeTensorMode(allow_non_fake_inputs=True) as mode, heads, split, saves_codes:
        params = [
            (mode.from_tensor(p).new_empty(local[n]) if n in local else mode.from_tensor(p)).requires_grad_(p.requires_grad)
            for n, p in model.named_parameters()
        ]
        inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        traced = aot_function(forward, fw_compiler=_identity, bw_compiler=_identity, partition_fn=partition)
        traced(*params, *inputs)
    output = sum(t.numel() * t.element_size() for t in outputs)
    return sum(sizes.values()), max(sizes.values(), default=0), output, sum(t.numel() for t in outputs)


def codes_of(plan, options: CompileOptions | None = None) -> dict[str, str]:
    """The plan's sites whose forward saves x's codes for the backward instead of x, name -> recipe:
    the ones whose strategy under `options` (default: the backend's defaults) is `Codes.SAVED`
    (`CompileOptions.codes_for`, the rule the backend writes into the plan)."""
    options = options or CompileOptions()
    return {s.name: s.recipe for s in plan.sites if options.codes_for(s.recipe, s.tokens) is Codes.SAVED}


@contextlib.contextmanager
def saved_codes(model: torch.nn.Module, codes: dict[str, str], mlps: set[tuple[str, str, str]] = frozenset()):
    """The code-saving sites' forwards as the backend rewrites them (compiler/backend.py `rewrite`): each
    input tensor quantized once per recipe family however many sites read it (q/k/v, gate/up), by
    `fp8_tensor_quantize_rowcol` (from its amax) or `fp8_block_quantize_rowcol`, the sites' GEMMs the
    family's `fp8_*_linear` on both copies, whose backward keeps the transposed codes and their scales
    instead of x. The MLPs of `mlps` ((gate, up, down) names, `Plan.fused_mlps`) as the backend fuses
    them: down's forward returns `fp8_block_swiglu_mlp` on gate's input and codes, which saves gate
    and up's output (one tensor), h's column codes and their scales; gate's, up's, the silu's and
    the product's values, which nothing else reads, drop out of the traced graph."""
    ops = torch.ops.deepwell
    quantized: dict[tuple, tuple] = {}  # (id(x), family) -> (x, its codes); x kept so that its id stays unique
    modules = {name: m for name, m in model.named_modules() if name in codes and type(m) is torch.nn.Linear}
    gates = {down: (gate, up) for gate, up, down in mlps}  # a fused MLP's down -> its gate and up
    gate_inputs: dict[str, tuple] = {}  # a fused MLP's gate -> (x, its codes) of its latest call

    def forward_of(name: str, m: torch.nn.Linear, recipe: str):
        kind = family(recipe)

        def forward(x):
            if name in gates:
                gate, up = gates[name]
                x_gate, x_codes = gate_inputs[gate]
                w_gate, w_up = modules[gate].weight, modules[up].weight
                return ops.fp8_block_swiglu_mlp(x_gate, *x_codes, w_gate, w_up, m.weight, recipe)[0]
            key = (id(x), kind)
            if key not in quantized:
                x2 = x.detach().reshape(-1, m.in_features)
                if kind == "fp8_block":
                    quantized[key] = (x, ops.fp8_block_quantize_rowcol(x2, True, True))
                else:
                    quantized[key] = (x, ops.fp8_tensor_quantize_rowcol(x2, "e4m3", amax_of(x2)))
            if any(name == gate for gate, _ in gates.values()):
                gate_inputs[name] = quantized[key]
            if kind == "fp8_block":
                return ops.fp8_block_linear(x, m.weight, m.bias, recipe, *quantized[key][1])[0]
            x_codes, x_codes_t, x_scale = quantized[key][1]
            return ops.fp8_tensor_linear(x, m.weight, m.bias, recipe, x_codes, x_scale, x_codes_t)[0]

        return forward

    before = {name: m.__dict__.get("forward") for name, m in modules.items()}  # an instance's own forward
    for name, m in modules.items():
        m.forward = forward_of(name, m, codes[name])
    try:
        yield
    finally:
        for name, m in modules.items():
            if before[name] is None:
                del m.forward  # back to nn.Linear.forward
            else:
                m.forward = before[name]


def _identity(gm, example_inputs):
    return gm


def _primal_index(name: str) -> int:
    """i - 1 for AOTAutograd's `primals_i` (the i-th flat input), a large number otherwise."""
    head, _, tail = name.partition("_")
    return int(tail) - 1 if head == "primals" and tail.isdigit() else 1 << 62


def partitioner_options(rewritten: int) -> dict:
    """AOTAutograd partitioner settings for a graph with `rewritten` deepwell GEMMs.

    By default the partitioner never recomputes a tensor that a non-fusible backward op reads
    (`ban_recompute_materialized_backward`): recomputing it would write it out again anyway. Every
    deepwell GEMM's backward reads its bf16 input x (it quantizes x along the tokens for wgrad), so
    the normed activations and SwiGLU outputs feeding them were saved from forward to backward in
    bf16, 2 bytes per element, although each is one fused pointwise kernel away from tensors the
    backward keeps anyway (the residual stream and the norm's rstd; SwiGLU's two inputs). Lifting
    the ban lets the min-cut partitioner recompute them in the backward, which is the trade torchao's
    float8 casts get: same saved set as its Inductor-visible casts (benchmarks/bench_train_step.py
    measures both; tests/compiler/test_backend.py proves the saved bytes never exceed bf16's). The other bans
    stay: reductions, long fusible chains and GEMMs are never recomputed."""
    return {"ban_recompute_materialized_backward": False} if rewritten else {}
