"""The main job's training demo: a small LLaMA-style model trained for a few steps with
`deepwell.optimize` (the `deepwell` torch.compile backend), printing the plan and the loss.

On a GPU, precision="auto" (the device's fastest native recipe: fp8_block on Hopper, mxfp8 on
Blackwell, bf16 elsewhere). On the CPU nothing is native, so the demo asks for mxfp8, which runs as
exact emulation, to show the quantized path."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..plan import backend
from ..api import optimize
from ..models import Llama


def train_demo(device: torch.device, steps: int = 30, precision: str | None = None) -> list[float]:
    """Trains on one fixed batch (so the loss must fall); returns the losses. `precision` None: "auto"
    on a GPU; mxfp8 on the CPU, where nothing is native, to show the (emulated) quantized path."""
    backend.ensure_registered()
    precision = precision or ("auto" if device.type == "cuda" else "mxfp8")
    torch.manual_seed(0)
    model = Llama(vocab=512, dim=512, layers=2, heads=8, hidden=1024, max_seq=64).to(device)
    if device.type == "cuda":
        model = model.bfloat16()
    tokens = torch.randint(0, 512, (4, 64), device=device, generator=torch.Generator(device).manual_seed(1))
    print(f"\ntraining demo: LLaMA-style, 2 layers, d=512, {tokens.numel()} tokens/step, AdamW, precision={precision!r}")
    torch._dynamo.reset()
    compiled = optimize(model, precision=precision, verbose=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        logits = compiled(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 512).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"  step {step:3d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.1f} s since the start, compile included)")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps")
    return losses
