"""One LLaMA MLP, `w2(silu(w1(x)) * w3(x))`, forward + backward on the GPU, in one process: bf16
and torchao float8 tensorwise (the peers) against deepwell's fp8_block MLP as three layers on one
quantization of x (the backend with `fused_mlp=False`) and as `fp8_block_swiglu_mlp`, SwiGLU fused
into the FP8 quantizers (the backend's default), all under torch.compile; then the fused op alone,
forward and backward.

Least traffic the fusion saves per MLP (tokens m, width f, bf16 h = 2 bytes per element): the
forward no longer writes h and reads it back (4·m·f bytes), the backward no longer writes d_gate and
d_up and reads them back (8·m·f), and dx is one GEMM over K = 2f instead of two dx added (6·m·d).

    python benchmarks/bench_mlp.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import deepwell
import deepwell.compiler.backend
from _common import environment, header, time_ms, torchao_float8, torchao_version, write_json

ops = torch.ops.deepwell
# (name, tokens, d, f): the 0.95B LLaMA of bench_train_step (4x2048 tokens) and LLaMA-3-8B's MLP.
SHAPES = [("0.95B", 8192, 2048, 5632), ("8B", 8192, 4096, 14336)]


class Mlp(torch.nn.Module):
    """models/llama.py's FeedForward, between two bf16 layers (the policy keeps a model's first and
    last GEMM sites bf16; here they are the ends, so the MLP's three sites are planned)."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.inp, self.output = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d, bias=False)
        self.w1, self.w3 = torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False)
        self.w2 = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        x = self.inp(x)
        return self.output(self.w2(F.silu(self.w1(x)) * self.w3(x)))


def _step(model, x, dy):
    params = list(model.parameters())
    return lambda: torch.autograd.grad(model(x), [x, *params], dy)


def shape_rows(name: str, m: int, d: int, f: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(m, d, device="cuda", generator=gen).bfloat16()
    model = Mlp(d, f).cuda().bfloat16()
    policy = deepwell.PrecisionPolicy(precision="fp8_block")
    flop = 2 * 3 * (3 * m * d * f + 2 * m * d * d)  # forward + backward, the two bf16 ends included
    runs = {"torch.compile bf16": torch.compile(model)}
    ao = torchao_float8(Mlp(d, f).cuda().bfloat16())
    if ao is not None:
        ao.load_state_dict(model.state_dict())
        runs["torchao float8 tensorwise"] = torch.compile(ao)
    for fused in (False, True):
        options = {"policy": policy, "fused_mlp": fused}
        runs[f"deepwell fp8_block, {'fused' if fused else 'three layers'}"] = torch.compile(
            model, backend="deepwell", options=options
        )
    out, base = [], None
    for what, compiled in runs.items():
        torch._dynamo.reset()
        ms = time_ms(_step(compiled, x, dy), iters=10)
        base = base or ms
        out.append({"shape": name, "m": m, "d": d, "f": f, "what": what, "ms": ms, "speedup": base / ms,
                    "tflops": flop / ms / 1e9})
    torch._dynamo.reset()

    # The fused op alone: forward, and backward from its saved tensors.
    w1, w3, w2 = (model.w1.weight, model.w3.weight, model.w2.weight)
    xd = x.detach()
    codes = ops.fp8_block_quantize_rowcol(xd, True, True)
    fwd = ops.fp8_block_swiglu_mlp(xd, *codes, w1, w3, w2)
    out.append({"shape": name, "what": "fp8_block_swiglu_mlp forward (op)",
                "ms": time_ms(lambda: ops.fp8_block_swiglu_mlp(xd, *codes, w1, w3, w2), iters=10)})
    back = (dy, codes[2], codes[3], *fwd[1:], w1, w3, w2, "fp8_block", True, True)
    out.append({"shape": name, "what": "fp8_block_swiglu_mlp backward (op)",
                "ms": time_ms(lambda: ops.fp8_block_swiglu_mlp_backward(*back), iters=10)})
    for r in out:
        extra = f"{r['speedup']:.2f}x bf16, {r['tflops']:.0f} TFLOP/s" if "speedup" in r else ""
        print(f"{name:>6} {r['what']:>40} {r['ms']:8.3f} ms  {extra}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    args = parser.parse_args()
    env = environment()
    env["torchao"] = torchao_version()
    deepwell.compiler.backend.ensure_registered()  # backend="deepwell" without an installed entry point
    header("bench_mlp: one LLaMA MLP (between two bf16 layers) forward + backward, bf16 activations", env)
    rows = []
    for shape in SHAPES[:1] if args.quick else SHAPES:
        rows += shape_rows(*shape)
    print("wrote", write_json("bench_mlp", env, rows))


if __name__ == "__main__":
    main()
