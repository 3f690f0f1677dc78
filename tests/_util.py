"""Helpers shared by the tests: conversions to the float64 reference model's numpy world, random
inputs spanning many magnitudes, saved-activation bytes, the multi-process (gloo) launcher, the
bound between FP8 training runs on different numbers of processes, the deepwell ops a call
makes, a few uncached AdamW steps of a compiled model, and a float64 torch._scaled_grouped_mm
for MXFP8 operands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def np_f32(x: torch.Tensor) -> np.ndarray:
    """x widened exactly to float32, as the model (and the kernels) see it."""
    return x.detach().float().contiguous().numpy()


def bytes_of(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a 1-byte tensor (fp8, e8m0, uint8) as uint8."""
    return t.contiguous().view(torch.uint8).numpy()


def rounded(values_f32: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The model's float32 values rounded (RNE) to `dtype`, as the dequantizers do."""
    return torch.from_numpy(np.ascontiguousarray(values_f32, dtype=np.float32)).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of floats, signed zeros included. NaN payloads are not part of the contract
    (CUDA's arithmetic makes a canonical NaN, CPUs propagate payloads): NaN must meet NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.element_size() == 1:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    bits_a, bits_b = a.contiguous().view(ints), b.contiguous().view(ints)
    return torch.equal(bits_a[~nan_a], bits_b[~nan_b])


def wide_range(shape, gen: torch.Generator, dtype=torch.float32, lo=-30.0, hi=30.0) -> torch.Tensor:
    """Normal samples scaled by 10^u, u uniform in [lo, hi] per row (spans 1e-30..1e30 in fp32),
    with random signs and some exact zeros, then cast to `dtype` (which may saturate or flush)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    exps = torch.empty(shape[:-1] + (1,), dtype=torch.float64).uniform_(lo, hi, generator=gen)
    x = x * torch.pow(10.0, exps)
    x[torch.rand(shape, generator=gen) < 0.02] = 0.0
    return x.to(dtype)



def saved_activation_bytes(run, inputs, model: torch.nn.Module) -> int:
    """Bytes of the distinct storages, other than `model`'s parameters and buffers, that one forward
    `run(inputs)` saves for its backward, as autograd's saved-tensor hooks see them; runs that
    backward. Under torch.compile a lower bound: AOTAutograd keeps some saved tensors outside
    save_for_backward (`ctx._tensors_no_vc_check`), out of the hooks' sight."""
    storages = {}
    resident = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def pack(t):
        if t.untyped_storage().data_ptr() not in resident:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(inputs)
    out.float().square().mean().backward()
    return sum(storages.values())


# How closely an FP8-trained model's losses on another number of processes follow one process's.
# The first step's loss (same weights, same data) agrees to float32 rounding. Later steps agree
# only to the run's own noise floor: a last-bit difference in an fp32 sum (FSDP's reduce-scatter, a
# tensor-parallel Partial) flips some e4m3 codes where the gradient is quantized, which moves weight
# gradients by up to ~5e-3 of their largest element, and AdamW's normalised step carries that into
# every weight. Measured on tests/distributed/_fsdp_worker.py's one-process fp8_block run: scaling
# its loss by 1 + 1e-7 before backward moves the later losses by up to 4.6e-5 (relative); 2
# processes differ from 1 by up to 5.0e-5. The bound keeps 6x over that floor and stays 5x under one
# step's loss change (1.6e-3 relative); tests/distributed/test_tensor_parallel.py also checks the first step's
# gradients, where a missing or doubled reduction shows as an O(1) error.
FP8_TRAINING_REL = 3e-4


def trains_alike(a: list[float], b: list[float], rel: float = FP8_TRAINING_REL) -> bool:
    """`a` and `b` (per-step losses, then optionally gradient norms) agree: the first within 1e-6,
    the rest within `rel`, both relative to `a`."""
    return len(a) == len(b) and all(abs(x - y) <= (1e-6 if i == 0 else rel) * abs(x) for i, (x, y) in enumerate(zip(a, b)))


def finish_rank(result: dict, rank: int, world: int, out) -> None:
    """The end of a process that `spawn` started: rank 0 writes `result` to `out` as JSON, then
    every rank leaves the process group together."""
    import torch.distributed as dist

    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def spawn(tmp_path, script: str, world: int, tag: str, **env_extra) -> dict:
    """Runs `world` processes of tests/`script` (a path under tests/, `distributed/_fsdp_worker.py`;
    RANK WORLD STORE OUT: gloo on the CPU, joined
    through a file store) with `env_extra` added to the environment; fails with a rank's log if
    one exits non-zero, else returns the JSON rank 0 wrote to OUT (tmp_path/<tag>.json)."""
    out, store = tmp_path / f"{tag}.json", tmp_path / f"{tag}-store"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    procs = [
        subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), script), str(r), str(world), str(store), str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} of {world} exited with {p.returncode}:\n{log[-4000:]}"
    return json.loads(out.read_text())


def linear_runs(fns, x, w, b, dy) -> list[tuple]:
    """(y, dx, dw[, db]) of each `fn(x, w, b)` in `fns`, on fresh leaves of the same values: the
    ways of running one linear layer whose outputs and gradients a test compares."""
    outs = []
    for fn in fns:
        leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
        y = fn(leaves[0], leaves[1], leaves[2] if b is not None else None)
        outs.append((y, *torch.autograd.grad(y, leaves, dy)))
    return outs


def deepwell_calls(run) -> list[str]:
    """The deepwell ops `run()` calls, in order, by name: `deepwell::<op>` from eager code and
    `deepwell_graph::<op>`, its twin without autograd, from the backend's compiled graphs
    (compiler/graph_ops.py). Compiled code calls them through the dispatcher, which the profiler records."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return [name for ns, _, name in (e.name.partition("::") for e in prof.events())
            if ns in ("deepwell", "deepwell_graph") and name]


def adamw_steps(compiled, model: torch.nn.Module, tokens: torch.Tensor, steps: int, observe):
    """`steps` AdamW steps (lr 1e-3) of `compiled`, which runs `model`, on `tokens` with a mean-square
    loss, and Inductor's and AOTAutograd's caches off: a graph loaded from them would be neither
    partitioned nor passed over again, which the callers check. Returns the losses, the final
    weights, and what `observe(step)` returns, having run the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []

    def step():
        loss = compiled(tokens).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for _ in range(steps - 1):
            step()
        seen = observe(step)
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], seen


def _decode_mxfp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP8 codes times their E8M0 scales (blocks of 32 along the last dimension), in float64."""
    exp = scales.view(torch.uint8).double() - 127
    return codes.double() * torch.exp2(exp).repeat_interleave(32, dim=-1)


def decoding_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, **_):
    """What torch._scaled_grouped_mm computes with MXFP8 operands, read back from the layouts
    torchao hands it, group by group through `unswizzle_scales`, in float64 (what the tests put in
    its place: tests/ops/test_mxfp8_grouped.py, tests/nn/test_weight_cache_experts.py)."""
    from deepwell.ops.swizzle import unswizzle_scales

    def _ceil(n: int, m: int) -> int:
        return -(-n // m) * m

    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # 2-D x 3-D: a's rows grouped (forward, dgrad)
        experts, k, n = b.shape
        out, first = torch.zeros(a.shape[0], n, dtype=torch.float64), 0
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                sa = unswizzle_scales(scale_a.reshape(-1)[first * (k // 32):(first + _ceil(e - s, 128)) * (k // 32)], e - s, k // 32)
                out[s:e] = _decode_mxfp8(a[s:e], sa) @ _decode_mxfp8(b[g].t(), unswizzle_scales(scale_b[g], n, k // 32)).t()
            first += _ceil(e - s, 128)
    else:  # 2-D x 2-D: the tokens grouped (wgrad)
        n, k = a.shape[0], b.shape[1]
        out, first = torch.zeros(len(ends), n, k, dtype=torch.float64), 0
        for g, (s, e) in enumerate(zip(starts, ends)):
            width = (e - s) // 32
            if width:
                region = slice(first * _ceil(n, 128), (first + _ceil(width, 4)) * _ceil(n, 128))
                sa = unswizzle_scales(scale_a.reshape(-1)[region], n, width)
                region = slice(first * _ceil(k, 128), (first + _ceil(width, 4)) * _ceil(k, 128))
                sb = unswizzle_scales(scale_b.reshape(-1)[region], k, width)
                out[g] = _decode_mxfp8(a[:, s:e], sa) @ _decode_mxfp8(b[s:e].t(), sb).t()
            first += _ceil(width, 4)
    return out.to(out_dtype)
