"""Every usage example the design documents promised their users (docs/OPS.md "Seed API aliases"
lists the names they spell differently), copied as written, on a small model with a list of batches as the loader. The
examples' own lines are verbatim between the `# --- example` markers: a failure here means a
promised spelling broke."""

from __future__ import annotations

import warnings

import pytest
import torch

import deepwell
import deepwell as dw
from deepwell import MicroscalingConfig, Precision
from deepwell.models import Llama

VOCAB, DIM = 512, 512


def small_llama(max_seq=256):
    torch.manual_seed(0)
    return Llama(VOCAB, DIM, 2, 8, 1024, max_seq=max_seq)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_1_quick_optimization(capsys):
    torch.manual_seed(0)
    model = Llama(256, 64, 1, 2, 128, max_seq=2048)  # tiny: capture runs one forward at 32 x 2048
    # --- example
    engine = dw.optimize_for_blackwell(model, precision="mxfp8", seq_len=2048, batch_size=32)  # or "nvfp4"
    results = dw.dryrun(engine)
    print(f"Expected speedup: {results['expected_speedup']}x")
    print(f"Memory usage: {results['memory_gb']} GB")
    # --- end
    out = capsys.readouterr().out
    assert "Expected speedup: " in out and "Memory usage: " in out
    plan = engine.deepwell_engine.plan
    assert plan.seq_len == 2048 and plan.global_batch == 32 and all(s.tokens == 2048 * 32 for s in plan.sites)
    assert results["memory_gb"] > 0 and results["expected_speedup"] == round(results.speedup, 2)
    with pytest.raises(KeyError, match="expected_speedup"):
        results["nope"]


def test_1_dryrun_of_a_lazy_optimize_names_what_to_pass():
    with pytest.raises(TypeError, match="seq_len"):
        dw.dryrun(dw.optimize(small_llama()))


def test_2_step_by_step_and_4_precision_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = small_llama()
    train_loader = [torch.randint(0, VOCAB, (2, 65), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # --- example
        hw = dw.probe()
        ir = dw.capture(model)
        plan = dw.autoplan(ir, hw=hw, seq_len=32_768, global_batch=4096,
                           arch="blackwell-sm100",          # or "blackwell-sm120", per probe()
                           moe={"experts": 8, "capacity_factor": 1.25})
        engine = dw.compile(ir, plan=plan, precision="mxfp8",  # FP4 via NVFP4 later, guarded
                            fallback="safe")                   # BF16 fallback for fragile layers
        dw.dryrun(engine)
        trainer = dw.Trainer.from_engine(engine, optimizer="adamw_dw", dataloader=train_loader,
                                         elastic=True)       # external launcher, re-shardable checkpoints
        trainer.fit()
        artifact = dw.export(engine, path="llama70b_b200.engine")
        # --- end
    said = " | ".join(str(w.message) for w in caught)
    assert "planned again" in said and "plan is for sm_100" in said
    assert plan.arch == "sm_100" and "no deepwell.DeepwellMoE" in plan.moe["notes"]
    assert engine.plan.policy.precision == "mxfp8" and "mxfp8" in {s.recipe for s in engine.plan.sites}
    assert ir.example_inputs[0].shape == (2, 128) and trainer.step == 2 and trainer.checkpoint_format == "sharded"
    assert artifact is not None and (tmp_path / "llama70b_b200.engine").exists()

    # --- example
    policy = dw.PrecisionPolicy(default_compute=Precision.MXFP8,
                                sensitive_layers=["embedding", "final_linear"],
                                microscaling=MicroscalingConfig(block_size=32))
    # --- end
    assert policy.precision == "mxfp8"
    sites = dw.autoplan(ir, policy=policy, arch="sm_100").sites
    by = {s.name: s.recipe for s in sites}
    assert by["output"] == "bf16" and by["layers.0.attention.wk"] == "mxfp8"
    kept = dw.autoplan(ir, policy=dw.PrecisionPolicy(default_compute="mxfp8", sensitive_layers=["attention", "*.w2"]),
                       arch="sm_100").sites
    assert all(s.recipe == "bf16" for s in kept if s.role == "attention" or s.name.endswith("w2"))
    assert any(s.recipe == "mxfp8" for s in kept)
    with pytest.raises(ValueError, match="block_size=16"):
        dw.PrecisionPolicy(precision="mxfp8", microscaling=MicroscalingConfig(block_size=16))
    assert {p.value for p in Precision} == {"auto", *deepwell.core.recipes.names()}


def test_2_aliases_and_errors():
    model = small_llama()
    ir = dw.capture(model, seq_len=64, batch_size=1)
    assert ir.example_inputs[0].shape == (1, 64)
    for spelled, arch in (("blackwell-sm120", "sm_120"), ("hopper-sm90", "sm_90"), ("sm100", "sm_100")):
        assert dw.autoplan(ir, arch=spelled).arch == arch
    with pytest.raises(ValueError, match="Hopper, not blackwell"):
        dw.autoplan(ir, arch="blackwell-sm90")
    with pytest.raises(ValueError, match="capacity_factor"):
        dw.autoplan(ir, moe={"experts": 8, "capacity_factor": -1})
    with pytest.raises(TypeError, match="example_inputs"):
        dw.capture(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    engine = dw.compile(ir, precision="bf16")
    with pytest.raises(ValueError, match="adamw_dw"):
        dw.Trainer.from_engine(engine, optimizer="sgd")
    with pytest.raises(ValueError, match="no training data"):
        dw.Trainer.from_engine(engine).fit()


def test_3_hardware(capsys):
    # --- example
    hw = dw.probe()
    dw.print_hardware_info(hw)
    for gpu in hw.gpus:
        if gpu.is_blackwell:
            print(gpu.blackwell_variant, gpu.supports_mxfp8, gpu.supports_fp4)
    from deepwell.kernels.cutlass_bindings import CUTLASS_AVAILABLE   # deepwell has no CUTLASS: say so, don't crash
    # --- end
    assert CUTLASS_AVAILABLE is False and "torch" in capsys.readouterr().out
    for gpu in hw.gpus:
        assert gpu.supports_mxfp8 == ("mxfp8" in gpu.native_recipes)


def test_5_kernel_profiling(capsys):
    model = small_llama()
    engine = dw.compile(dw.capture(model), precision="mxfp8")
    # --- example
    from deepwell.kernels.cutlass_bindings import KernelProfiler
    profile = KernelProfiler.profile_kernel(engine.compiled_ops[0].backend_op,
                                            warmup_iterations=10, profile_iterations=100)
    print(profile["tflops"], profile["sm_efficiency"], profile["tmem_utilization"])
    # --- end
    on_gpu = engine.compiled_ops[0].backend_op.device.type == "cuda"  # the model's device: the CPU here
    assert profile["tflops"] > 0 and profile["timer"] == ("CUDA events" if on_gpu else "wall clock")
    if not on_gpu:
        assert "not applicable" in profile["tmem_utilization"] and "not applicable" in profile["peak_tflops"]
    op = engine.compiled_ops[1].backend_op
    assert op.recipe == "mxfp8" and op().shape == (op.rows, op.out_features)


class _LossModel(torch.nn.Module):
    """The example's `model(batch)` returns a loss: next-token loss around a small Llama."""

    def __init__(self):
        super().__init__()
        self.lm = small_llama()

    def forward(self, batch):
        logits = self.lm(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def test_6_one_line_optimize():
    model = _LossModel()
    dataloader = [torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    before = model.lm.output.weight.detach().clone()
    # --- example
    import deepwell
    model = deepwell.optimize(model)                 # existing model, no changes; train normally
    optimizer = torch.optim.AdamW(model.parameters())
    for batch in dataloader:
        loss = model(batch); loss.backward(); optimizer.step()
    # --- end
    assert not torch.equal(before, model.lm.output.weight)


def test_6_verbose_on_hf_gpt2(capsys):
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2Model(transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=512, n_layer=2, n_head=8,
                                                           bos_token_id=0, eos_token_id=0))
    model = deepwell.optimize(model, verbose=True)   # prints what it replaced
    model(torch.randint(0, 512, (2, 32))).last_hidden_state.float().mean().backward()
    out = capsys.readouterr().out
    assert "8 GEMM sites" in out and "HF Conv1D" in out and "attention: 2 modules" in out
    assert {s.module_type for s in deepwell.last_plan().sites} == {"Conv1D"}
