"""deepwell.train.AdamW (train/optim.py) against torch.optim.AdamW, and the Trainer's gradient clipping
(train/clip.py) against torch.nn.utils.clip_grad_norm_: on FSDP2-sharded models, under
every update torch has (fused, foreach, per tensor) and the settings that change its arithmetic, it
must leave every parameter and state shard equal bit for bit, step after step, while running on the
local shards; and stay torch's where it cannot (tests/train/_optim_worker.py runs both side by side)."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import deepwell
from _optim_worker import CASES, STEPS
from _util import spawn


def _check(result: dict) -> None:
    for name in CASES:
        case = result[name]
        assert case["equal"], f"{name}: a parameter or state shard differs from torch.optim.AdamW's"
        assert case["local"] and all(case["local"]), f"{name}: the update did not run on the local shards: {case['local']}"
    # Torch's global optimizer hooks (deepwell's weight cache ends reuse there) see every step.
    assert result["hooks_fired"] == len(CASES) * STEPS
    assert result["resume"] == {"equal": True, "dtensor_states": True}
    assert result["fallback"] == {"equal": True, "local": [False]}
    assert result["mixed"] == {"equal": True, "torch_fused_refuses": True}
    for name, case in result["clip"].items():
        assert case["norm"] and case["grads"], f"clip {name}: differs from torch.nn.utils.clip_grad_norm_: {case}"
        assert case["local"] == (name != "replicated_grad"), f"clip {name}: local shards {case['local']}"


@pytest.mark.distributed
def test_adamw_on_local_shards_equals_torch_on_two_processes(tmp_path):
    """2 gloo processes on the CPU."""
    _check(spawn(tmp_path, "train/_optim_worker.py", 2, "optim"))


@pytest.mark.distributed
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_adamw_on_local_shards_equals_torch_on_two_gpus(tmp_path):
    """2 GPUs over NCCL: torch's CUDA kernels for each update."""
    _check(spawn(tmp_path, "train/_optim_worker.py", 2, "optim-cuda", DEEPWELL_TEST_DEVICE="cuda"))


def test_adamw_without_dtensors_is_torch_adamw():
    """Plain parameters (one process): the same steps as torch.optim.AdamW, and the same hooks."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = [deepwell.train.AdamW(params, lr=1e-2, fused=True), torch.optim.AdamW(twins, lr=1e-2, fused=True)]
    seen = []
    handle = register_optimizer_step_post_hook(lambda o, args, kwargs: seen.append(type(o)))
    try:
        for step in range(3):
            for ps, opt in ((params, opts[0]), (twins, opts[1])):
                for i, p in enumerate(ps):
                    p.grad = torch.full_like(p, 0.1 * (step + i + 1))
                opt.step()
    finally:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(params, twins))
    assert seen.count(deepwell.train.AdamW) == 3 and seen.count(torch.optim.AdamW) == 3


def test_the_trainer_defaults_to_deepwell_adamw(tmp_path):
    from _training import EagerEngine

    t = deepwell.Trainer.from_engine(EagerEngine(torch.nn.Linear(4, 4)), max_steps=1, checkpoint_dir=tmp_path, progress=False, plot=False)
    assert type(t.optimizer) is deepwell.train.AdamW
    assert t.optimizer.defaults["betas"] == (0.9, 0.95) and t.optimizer.defaults["weight_decay"] == 0.1
