"""deepwell.export / deepwell.load (deepwell.artifact.export): the artifact holds the plan, the policy
and each low-precision site's weight pre-quantized exactly as the recipe's forward quantizes it; on
the CPU the loaded model's logits are bit-identical to the trained model run eagerly with its plan,
and close to the compiled engine's (Inductor's fusions move last bits, which a quantizer can round
to a neighbouring code: the module docs of deepwell.artifact.export)."""

from __future__ import annotations

import json

import pytest
import torch

import deepwell
from _training import CONFIG, engine, heldout
from deepwell.artifact.quantized import QuantizedLinear, quantize_weight
from deepwell.artifact.export import planned_eager
from deepwell.train import CheckpointError


@pytest.fixture(scope="module", params=["mxfp8", "fp8_block", "nvfp4"])
def trained(request):
    """An engine of `recipe` after a few optimizer steps (weights no longer at their init)."""
    eng = engine(request.param)
    opt = torch.optim.AdamW(eng.model.parameters(), lr=1e-2)
    for batch in heldout(3):
        torch.nn.functional.cross_entropy(eng(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return request.param, eng


def test_loaded_logits_match_the_trained_model(trained, tmp_path):
    recipe, eng = trained
    loaded = deepwell.load(deepwell.export(eng, tmp_path / "artifact"))
    tokens = heldout(1)[0][:, :-1]
    with torch.no_grad():
        got, eager, compiled = loaded(tokens), planned_eager(eng)(tokens), eng(tokens)
    assert torch.equal(got, eager)
    # The compiled engine: Inductor's fused kernels differ from eager in last bits (~3e-7 of the
    # largest logit here), and a last-bit difference before a quantizer can, rarely, move one value
    # to the next code; 5e-3 leaves room for that and still catches a wrong weight or recipe.
    assert (got - compiled).abs().max() <= 5e-3 * compiled.abs().max()
    quantized = [m for m in loaded.modules() if isinstance(m, QuantizedLinear)]
    planned = [s for s in eng.plan.sites if s.recipe == recipe]
    assert len(quantized) == len(planned) == 6 and all(m.recipe == recipe for m in quantized)
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training


def test_the_artifact_stores_the_forward_s_codes_plan_and_policy(trained, tmp_path):
    recipe, eng = trained
    path = deepwell.export(eng, tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["plan"]["sites"] == eng.plan.to_dict()["sites"]
    assert manifest["policy"]["precision"] == recipe and manifest["model"]["config"]["dim"] == CONFIG.dim
    from safetensors.torch import load_file

    weights = load_file(str(path / "weights.safetensors"))
    w = eng.model.layers[0].feed_forward.w1.weight
    want = quantize_weight(w, recipe)
    for part, t in want.items():
        got = weights[f"layers.0.feed_forward.w1.weight.{part}"]
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)) if t.element_size() == 1 else torch.equal(got, t)
    assert "layers.0.feed_forward.w1.weight" not in weights  # only the quantized copy ships
    assert torch.equal(weights["tok_embeddings.weight"], eng.model.tok_embeddings.weight.detach())


def test_a_damaged_artifact_is_refused(trained, tmp_path):
    _, eng = trained
    path = deepwell.export(eng, tmp_path / "artifact")
    w = path / "weights.safetensors"
    w.write_bytes(w.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"weights\.safetensors has \d+ bytes"):
        deepwell.load(path)
    with pytest.raises(CheckpointError, match="no such directory"):
        deepwell.load(tmp_path / "missing")


def test_a_model_without_a_config_is_loaded_into_a_given_instance(trained, tmp_path):
    _, eng = trained
    path = deepwell.export(eng, tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["model"]["class"] == "deepwell.models.llama.Llama"
    fresh = CONFIG.build(torch.device("cpu"), seed=99)
    loaded = deepwell.load(path, model=fresh)
    assert loaded is fresh and torch.equal(loaded.tok_embeddings.weight, eng.model.tok_embeddings.weight)


def test_quantize_weight_refuses_other_recipes():
    with pytest.raises(ValueError, match="recipe must be one of .*got 'bf16'"):
        quantize_weight(torch.ones(32, 32), "bf16")


def _round_trip(w: torch.Tensor, recipe: str) -> torch.Tensor:
    """dequantize(quantize_weight(w)) in fp32, NVFP4's per-tensor decode scale included."""
    ops = torch.ops.deepwell
    q = quantize_weight(w, recipe)
    if recipe == "mxfp8":
        return ops.mxfp8_dequantize(q["data"], q["scale"], -1, torch.float32)
    if recipe == "fp8_block":
        return ops.fp8_block_dequantize(q["data"], q["scale"], 128, 128, torch.float32)
    return ops.nvfp4_dequantize(q["data"], q["scale"], q["global_scale"], torch.float32)


def test_why_codes_are_stored_requantizing_is_not_the_identity_for_nvfp4():
    """dequantize(quantize(W)) re-quantizes to itself for the power-of-two scales of mxfp8 and
    fp8_block, not for NVFP4 (its per-tensor and E4M3 block scales are recomputed from rounded
    values): the artifact stores codes, so its forward never depends on this."""
    g = torch.Generator().manual_seed(0)
    changed = 0
    for _ in range(20):
        w = torch.randn(256, 512, generator=g) * torch.exp(torch.randn(256, 1, generator=g) * 3)
        for recipe in ("mxfp8", "fp8_block"):
            once = _round_trip(w, recipe)
            assert torch.equal(_round_trip(once, recipe), once), recipe
        once = _round_trip(w, "nvfp4")
        changed += not torch.equal(_round_trip(once, "nvfp4"), once)
    assert changed > 0


def test_a_bf16_model_loads_in_bf16_and_matches(tmp_path):
    """The artifact records the dtype the model trained in; the loaded model computes in it (x, the
    rotary tables, the output rounding), bit-identical to the eager plan on the CPU."""
    import dataclasses

    from deepwell.train.parity import build_engine

    eng = build_engine(dataclasses.replace(CONFIG, dtype="bfloat16"), "nvfp4", torch.device("cpu"))  # never called: no Inductor
    loaded = deepwell.load(deepwell.export(eng, tmp_path / "artifact"))
    assert loaded.tok_embeddings.weight.dtype == torch.bfloat16 and loaded.cos.dtype == torch.bfloat16
    tokens = heldout(1)[0][:, :-1]
    with torch.no_grad():
        got, want = loaded(tokens), planned_eager(eng)(tokens)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
