"""The Trainer and the compiled sites' guardrails (compiler/guard.py): a site whose weight goes
non-finite falls back alone, the log says so, training goes on; the checkpoint keeps the
fallen-back sites, and a run resumed from it in a fresh model starts with them bf16 under the same
plan, bit for bit as the run that saved it."""

from __future__ import annotations

import json
import math

import pytest
import torch

import deepwell
from _training import CONFIG, batches, losses, trainer
from deepwell.compiler import guard
from deepwell.train.log import read

W2 = "layers.0.feed_forward.w2"


def _engine(seed: int = 0, **options):
    model = CONFIG.build(torch.device("cpu"), seed)
    ir = deepwell.capture(model, (torch.zeros(CONFIG.batch, CONFIG.seq_len, dtype=torch.long),))
    plan = deepwell.autoplan(ir, policy=deepwell.PrecisionPolicy(precision="mxfp8", min_features=CONFIG.min_features))
    return deepwell.compile(ir, plan=plan, options=deepwell.CompileOptions(guardrails={"interval": 2}, **options))


def _running(model) -> dict[str, str]:
    return {n: r.active_recipe for n, r in guard.records_of(model).items()}


def test_a_fallen_back_site_is_logged_checkpointed_and_resumed(tmp_path):
    eng = _engine()
    data = batches()
    t = trainer(eng, 1, checkpoint_dir=tmp_path, plot=False)  # 2 micro-batches a step: every step's second call observed
    t.fit(data)
    quantized = {n for n, r in _running(eng.model).items() if r == "mxfp8"}
    assert f"{W2}.weight" in quantized and len(quantized) == 6

    w2 = eng.model.get_parameter(f"{W2}.weight")
    clean = w2.detach().clone()
    with torch.no_grad():
        w2[3, 4] = math.inf
    with pytest.warns(UserWarning, match=f"GEMM site '{W2}' falls back from mxfp8 to bf16"):
        t.max_steps = 3  # step 2 observes the inf, step 3 reads it (2 * interval calls)
        t.fit(data)
    assert _running(eng.model) == {n: ("bf16" if n == f"{W2}.weight" else "mxfp8") for n in quantized}
    with torch.no_grad():
        w2.copy_(clean)
    t.max_steps = 5
    t.fit(data)  # saves step 5
    assert all(math.isfinite(v) for v in losses(t)[3:]) and not math.isfinite(losses(t)[1])

    records = read(tmp_path / "metrics.jsonl")
    fallbacks = [r for r in records if r.get("event") == "guardrail_fallback"]
    assert len(fallbacks) == 1 and fallbacks[0]["site"] == W2 and fallbacks[0]["running"] == "bf16"
    assert "non-finite output values" in fallbacks[0]["detail"] and fallbacks[0]["step"] == 3
    manifest = json.loads((tmp_path / "step_00000005" / "manifest.json").read_text())
    saved = manifest["state"]["quantization"]["site_fallbacks"]
    assert list(saved) == [f"{W2}.weight"] and saved[f"{W2}.weight"]["recipe"] == "mxfp8"

    # A fresh model resumed from step 5 plans w2 bf16 from its first call, the others mxfp8, under
    # the engine's own (unchanged) plan; its step 6 is the saving run's step 6.
    fresh = _engine()
    assert fresh.plan.to_dict() == eng.plan.to_dict()
    r = trainer(fresh, 6, checkpoint_dir=tmp_path, plot=False).fit(batches(), resume=True)
    assert guard.fallback_state(fresh.model) == guard.fallback_state(eng.model)
    assert _running(fresh.model) == _running(eng.model)
    plan = {s.name: s for s in deepwell.last_plan().sites}
    assert plan[W2].recipe == "bf16" and plan[W2].decision.rule == "Guardrail"
    assert {n for n, s in plan.items() if s.recipe == "mxfp8"} == {n.removesuffix(".weight") for n in quantized} - {W2}
    (g,) = guard.graphs_of(fresh.model)
    assert g.forced == {W2}
    t.max_steps = 6
    t.fit(data)
    assert losses(r)[-1] == losses(t)[-1]
    assert not [x for x in read(tmp_path / "metrics.jsonl") if x.get("event") == "guardrail_fallback" and x["step"] > 3]


def test_an_unguarded_run_saves_no_site_fallbacks(tmp_path):
    eng = _engine(fallback="none")
    trainer(eng, 1, checkpoint_dir=tmp_path, plot=False).fit(batches())
    assert guard.records_of(eng.model) == {} and guard.graphs_of(eng.model) == []
    manifest = json.loads((tmp_path / "step_00000001" / "manifest.json").read_text())
    assert manifest["state"]["quantization"]["site_fallbacks"] == {}


def test_a_site_fallback_naming_no_parameter_is_refused():
    eng = _engine()
    with pytest.raises(ValueError, match="'nope.weight', which is no parameter of the model"):
        guard.restore_fallbacks(eng.model, {"nope.weight": {"site": "nope", "recipe": "mxfp8", "events": []}}, "here")
    with pytest.raises(ValueError, match="must be {site, recipe"):
        guard.restore_fallbacks(eng.model, {f"{W2}.weight": {"site": W2, "recipe": "bf16", "events": []}}, "here")
    assert guard.fallback_state(eng.model) == {}
