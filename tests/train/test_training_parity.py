"""Training parity on the CPU: a LLaMA-style model compiled with the deepwell backend in a quantized
recipe trains like the same model in eager bf16, step for step, with the optimizer torchtitan uses
(AdamW, fused). A stale quantized weight (the weight cache once missed fused optimizers' updates)
shows up here within two steps: the quantized run stops following bf16's loss curve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepwell.models import Llama

VOCAB, DIM, LAYERS, HEADS, HIDDEN = 512, 512, 2, 8, 1024
STEPS = 24


def _data(batches=3, batch=2, seq=64):
    """A few fixed batches seen in turn: a task the model can learn in a few dozen steps."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (batch, seq + 1), generator=g) for _ in range(batches)]


def _losses(model, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data, losses = _data(), []
    for step in range(steps):
        tokens = data[step % len(data)]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _model():
    torch.manual_seed(0)
    return Llama(VOCAB, DIM, LAYERS, HEADS, HIDDEN, max_seq=128).to(torch.bfloat16)


@pytest.mark.parametrize("precision", ["fp8_block", "fp8_tensor"])
def test_compiled_quantized_training_follows_eager_bf16(precision):
    reference = _losses(_model(), STEPS)
    torch._dynamo.reset()
    compiled = torch.compile(_model(), backend="deepwell", options={"precision": precision})
    losses = _losses(compiled, STEPS)
    torch._dynamo.reset()
    assert reference[-1] < 0.8 * reference[0], f"the task is not learned: {reference}"
    # 3% of the loss, with a floor once the batches are memorised (losses near 0.05 differ by a few
    # 1e-3 from run to run of the same recipe); a frozen weight misses by more than 1.0 by step 3.
    for step, (got, want) in enumerate(zip(losses, reference)):
        why = f"step {step}: {got:.4f} vs bf16 {want:.4f}\n{losses}\n{reference}"
        assert abs(got - want) <= 0.03 * want + 0.01, why
