"""Deterministic mode (deepwell.train.determinism, the Trainer's `deterministic`, the main job's
--deterministic): the settings fit switches and restores, the flag's plumbing through the job and
what it prints; on the GPU, a compiled quantized model with an embedding trained N steps and resumed
from its checkpoint at N/2 continues bit for bit, with no cuBLAS setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch._inductor.config as inductor_config

import deepwell
from _training import EagerEngine, corpus, losses
from deepwell.cli import demo
from deepwell.cli.report import parse_args
from deepwell.train import TokenBatches, Trainer, determinism, heldout_batches
from deepwell.train.parity import ModelConfig, build_engine, make_trainer


# ---------------------------------------------------------------------------------------------
# What fit switches


def test_deterministic_kernels_switches_and_restores_everything():
    # torch's test utilities (imported by other test files of this process) lock the cuDNN flags
    # (torch.backends.disable_global_flags); this test sets them, as a user's script may.
    with torch.backends.__allow_nonbracketed_mutation():
        _switches_and_restores_everything()


def _switches_and_restores_everything():
    before = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(False)
    inductor_config.deterministic = True  # as TORCHINDUCTOR_DETERMINISTIC=1 would
    torch.backends.cudnn.benchmark = True
    try:
        with determinism.deterministic_kernels(True):
            assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
            assert inductor_config.deterministic is True and torch.backends.cudnn.benchmark is False
        assert not torch.are_deterministic_algorithms_enabled()
        assert inductor_config.deterministic is True and torch.backends.cudnn.benchmark is True
        with determinism.deterministic_kernels(False):
            assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark is True
        torch.use_deterministic_algorithms(True, warn_only=True)
        inductor_config.deterministic = False
        with determinism.deterministic_kernels(True):
            assert inductor_config.deterministic is True and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert inductor_config.deterministic is False
    finally:
        torch.use_deterministic_algorithms(False)  # (and Inductor's mode off, its default)
        torch.backends.cudnn.benchmark = before


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)


@pytest.mark.parametrize("deterministic", [None, True, False])
def test_fit_runs_the_steps_in_the_trainers_mode(deterministic):
    """The loss function sees the mode the Trainer was given (None: the CPU's default, on); after
    fit the flag is what it was."""
    seen = []

    def loss_fn(engine, batch):
        seen.append((torch.are_deterministic_algorithms_enabled(), inductor_config.deterministic))
        return engine.model.fc(batch).square().mean()

    t = Trainer.from_engine(EagerEngine(_Net()), max_steps=2, loss_fn=loss_fn, progress=False, plot=False,
                            deterministic=deterministic)
    assert t.deterministic is (deterministic is not False)
    t.fit([torch.randn(4, 8) for _ in range(2)])
    assert seen == [(t.deterministic, t.deterministic)] * 2
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_must_be_a_bool():
    with pytest.raises(ValueError, match="deepwell.Trainer: deterministic must be a bool or None, got 'yes'"):
        Trainer.from_engine(EagerEngine(_Net()), max_steps=1, progress=False, deterministic="yes")


# ---------------------------------------------------------------------------------------------
# The main job


def test_the_job_is_deterministic_unless_told_otherwise():
    assert parse_args([]).deterministic is True
    assert parse_args(["--deterministic"]).deterministic is True
    assert parse_args(["--no-deterministic"]).deterministic is False


def test_the_resume_line_says_which_mode_ran():
    assert demo.resume_result(True, 0.0, True) == "bit-identical to the first run (deterministic: resumed bit-identical)"
    assert demo.resume_result(False, 0.0123, True).startswith("differ by up to 1.23e-02 from the first run although both ran deterministic")
    assert demo.resume_result(False, 0.058, False).startswith("differ by up to 5.80e-02 (non-deterministic kernels:")
    assert demo.resume_result(True, 0.0, False).startswith("bit-identical to the first run (non-deterministic kernels: not guaranteed")
    assert demo.mode_line(True).startswith("mode: deterministic") and "--no-deterministic" in demo.mode_line(True)
    assert demo.mode_line(False).startswith("mode: non-deterministic kernels") and "--deterministic" in demo.mode_line(False)


def test_the_job_without_determinism_says_so(tmp_path):
    """--no-deterministic: the mode line, the resume line and summary.json name the mode (the
    default's are tests/train/test_parity.py's job's)."""
    cmd = [sys.executable, "-m", "deepwell", "--device", "cpu", "--quick", "--steps", "2", "--parity-steps", "0",
           "--no-deterministic", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mode: non-deterministic kernels" in done.stdout
    line = next(s for s in done.stdout.splitlines() if s.startswith("resumed from"))
    assert "steps 2..2" in line and "(non-deterministic kernels:" in line, line
    summary = json.loads((tmp_path / "run-1" / "summary.json").read_text())
    assert summary["deterministic"] is False and summary["mode"] == "non-deterministic"
    assert summary["resume"]["steps"] == [2, 2] and summary["resume"]["result"] in line
    assert summary["device"] == "cpu" and summary["precision"] == "mxfp8" and summary["export_equal"] is True


# ---------------------------------------------------------------------------------------------
# On the GPU

#: The main job's GPU model (byte-level LLaMA, d=1024, 8 layers, 16 x 512 tokens, bf16) and Trainer
#: settings (parity.make_trainer), 40 steps as benchmarks/bench_determinism.py. Without deterministic
#: mode, runs of it on an H200 differed in some tries (29 of 75 weights after 3 steps; losses by up
#: to 5.8e-2 within 40) and agreed in others (12 steps, resumed at 6), as did every try of 2-layer
#: models: atomic adds change order only when their timing does. So this test catches a lost
#: determinism often, not always; the steps are cheap (~20 ms each), the compiles are not.
STEPS, HALF = 40, 20


def _straight_and_resumed(tmp_path, precision: str, deterministic: bool = True) -> tuple[Trainer, Trainer]:
    """A run of STEPS steps checkpointed at HALF, and a fresh engine from other initial weights and
    another global RNG state resumed from that checkpoint."""
    device, config, data = torch.device("cuda"), ModelConfig.for_device(torch.device("cuda")), corpus()
    heldout = heldout_batches(data.heldout, config.batch, config.seq_len, 2)

    def run(seed: int, checkpoint_dir=None, resume=None) -> Trainer:
        engine = build_engine(config, precision, device, seed=seed)
        recipe = deepwell.probe().devices[0].auto_recipe if precision == "auto" else precision
        assert recipe == "bf16" or any(s.recipe == recipe for s in engine.plan.sites), engine.plan.table()
        t = make_trainer(engine, STEPS, log_every=1, progress=False, plot=False, deterministic=deterministic,
                         checkpoint_dir=checkpoint_dir, checkpoint_every=HALF)
        t.fit(TokenBatches(data.train, config.batch, config.seq_len, seed=0), heldout, resume=resume)
        return t

    straight = run(0, checkpoint_dir=tmp_path / "ckpt")
    torch.manual_seed(12345)
    torch.cuda.manual_seed_all(12345)
    return straight, run(7, resume=tmp_path / "ckpt" / f"step_{HALF:08d}")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["auto", "nvfp4"])
def test_a_deterministic_gpu_run_resumes_bit_for_bit(tmp_path, precision):
    """"auto", the main job's: the device's native recipe (fp8_block on Hopper: deepwell's FP8 GEMM
    or cuBLASLt). nvfp4's quantizers run on the GPU (amax by atomicMax, stochastic rounding of the
    gradients), its GEMMs native on Blackwell, emulated elsewhere. The embedding's gradient is an
    accumulation Inductor makes with atomic adds outside deterministic mode. The run resumed at step
    N/2: losses, held-out loss, weights and AdamW's moments equal the straight run's bit for bit,
    with CUBLAS_WORKSPACE_CONFIG as the environment has it (unset: see the next test)."""
    straight, resumed = _straight_and_resumed(tmp_path, precision)
    assert not torch.are_deterministic_algorithms_enabled()  # fit put the flag back
    assert len(losses(resumed)) == STEPS and losses(resumed) == losses(straight)
    evals = lambda t: [(r["step"], r["eval_loss"]) for r in t.history if "eval_loss" in r]  # noqa: E731
    assert evals(resumed)[-1] == evals(straight)[-1]
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    for pa, pb in zip(straight.model.parameters(), resumed.model.parameters()):
        a, b = straight.optimizer.state[pa], resumed.optimizer.state[pb]
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


@pytest.mark.gpu
def test_cublas_gemms_need_no_workspace_setting_under_deterministic_algorithms():
    """What deepwell relies on instead of setting CUBLAS_WORKSPACE_CONFIG (train/determinism.py):
    torch >= 2.10 runs cuBLAS GEMMs under deterministic algorithms without it (torch gives every
    handle and stream its own workspace); a torch that asked for it again would fail here."""
    code = ("import torch; torch.use_deterministic_algorithms(True); a = torch.randn(64, 64, device='cuda'); "
            "b = a.bfloat16(); print(torch.equal(a @ a, a @ a), torch.equal(b @ b, b @ b))")
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True"], done.stdout + done.stderr[-3000:]
