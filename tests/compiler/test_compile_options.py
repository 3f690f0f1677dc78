"""`deepwell.CompileOptions`: validated once, defaults in one place, the same object from
`deepwell.optimize` / `deepwell.compile` down to the backend, and each site's strategy written
into the plan by one rule that dryrun reads too."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deepwell
from deepwell import Codes, CompileOptions, Recipe
from deepwell.compiler import backend
from deepwell.plan.memory import codes_of
from deepwell.plan.options import Fallback


def test_defaults_live_in_one_place():
    o = CompileOptions()
    assert (o.precision, o.fallback, o.fp8_block_codes, o.recompute_codes, o.fused_mlp, o.graph_ops) == (
        "auto", Fallback.SAFE, True, False, False, True)
    assert CompileOptions.of(None) == o and CompileOptions.of({}) == o
    assert CompileOptions.of({"fused_mlp": None}) == o, "None keeps the default"
    assert CompileOptions.of(o) is o
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.precision = "bf16"


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("precision", "fp9", "one of auto, mxfp8"),
        ("precision", "fp8_block@sm_90", "one of auto"),
        ("precision", 8, "one of auto"),
        ("fallback", "maybe", "'safe', 'error' or 'none'"),
        ("guardrails", {"intervall": 2}, "a deepwell.GuardrailConfig"),
        ("guardrails", None, "a deepwell.GuardrailConfig"),
        ("fused_mlp", 1, "a bool"),
        ("cudagraphs", "yes", "a bool"),
        ("policy", {"precision": "mxfp8"}, "a deepwell.PrecisionPolicy"),
        ("plan", "plan.json", "a deepwell.Plan"),
        ("arch", 90, "an arch name"),
    ],
)
def test_bad_values_name_the_field(field, value, expected):
    with pytest.raises(ValueError, match=rf"CompileOptions: '{field}' must be {expected}"):
        CompileOptions(**{field: value})


def test_unknown_keys_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown options \['fp8_codes'\].*fp8_block_codes"):
        CompileOptions.of({"fp8_codes": True})
    with pytest.raises(TypeError, match="CompileOptions or a dict"):
        CompileOptions.of(["precision"])


def test_fallback_takes_its_spelling():
    assert CompileOptions(fallback="error").fallback is Fallback.ERROR
    assert CompileOptions(fallback="none").fallback is Fallback.NONE


def test_replace_keeps_what_is_none():
    o = CompileOptions(precision="fp8_block", fused_mlp=True)
    assert o.replace(precision=None, fused_mlp=None) == o
    assert o.replace(fused_mlp=False).fused_mlp is False and o.fused_mlp is True


@pytest.mark.parametrize(
    "recipe, tokens, options, want",
    [
        ("fp8_block", 256, {}, Codes.SAVED),
        ("fp8_block", 256, {"recompute_codes": True}, Codes.RECOMPUTED),
        ("fp8_block", 256, {"fp8_block_codes": False}, Codes.X),
        ("fp8_block", 200, {}, Codes.X),  # the column copy's 1x128 blocks run along the tokens
        ("fp8_block@sm_90", 128, {}, Codes.SAVED),
        ("fp8_tensor", 3, {"fp8_block_codes": False}, Codes.SAVED),
        ("fp8_tensor", 3, {"recompute_codes": True}, Codes.RECOMPUTED),
        ("mxfp8", 256, {}, Codes.X),
        ("bf16", 256, {}, Codes.X),
    ],
)
def test_one_rule_for_each_site_strategy(recipe, tokens, options, want):
    assert CompileOptions(**options).codes_for(recipe, tokens) is want


def test_recipe_parses_once_from_the_rust_table():
    r = Recipe.parse("fp8_block@sm_90")
    assert (r.name, r.block_k, r.low_precision, r.modelled_arch, str(r)) == ("fp8_block", 128, True, "sm_90", "fp8_block@sm_90")
    assert Recipe.parse("fp8_block@sm_90") is r
    assert Recipe.parse("bf16").block_k is None and not Recipe.parse("bf16").low_precision
    assert Recipe.parse("fp8_block").native_on("sm_90") and not Recipe.parse("mxfp8").native_on("sm_90")
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        Recipe.parse("fp8")


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(256, 512, bias=False)
        self.w2 = torch.nn.Linear(512, 256, bias=False)
        self.w3 = torch.nn.Linear(256, 256, bias=False)

    def forward(self, x):
        return self.w3(self.w2(torch.relu(self.w1(x))))


POLICY = deepwell.PrecisionPolicy(precision="fp8_block", first_last_bf16=False, min_features=128)


@pytest.mark.parametrize("options, want", [
    ({}, Codes.SAVED), ({"recompute_codes": True}, Codes.RECOMPUTED), ({"fp8_block_codes": False}, Codes.X)])
def test_the_backend_writes_the_strategy_into_the_plan_and_dryrun_reads_it(options, want):
    """The plan the backend compiled (`deepwell.last_plan()`) carries each site's strategy, and the
    memory estimate's code-saving sites are exactly the plan's SAVED ones."""
    torch._dynamo.reset()
    opts = CompileOptions(policy=POLICY, **options)
    model, x = _Mlp(), torch.randn(256, 256)
    torch.compile(model, backend="deepwell", options=opts)(x)
    plan = deepwell.last_plan()
    assert [s.codes for s in plan.sites] == [want] * 3
    assert plan.to_dict()["sites"][0]["codes"] == want.value
    saved = {s.name for s in plan.sites if s.codes is Codes.SAVED}
    assert set(codes_of(plan, opts)) == saved


def test_the_backend_and_compile_take_one_options_object():
    seen = []

    def spy(gm, example_inputs, options=None, **kw):
        seen.append(options)
        return backend.backend(gm, example_inputs, options, **kw)

    torch._dynamo.reset()
    compiled = torch.compile(_Mlp(), backend=spy, options=CompileOptions(policy=POLICY, fused_mlp=True))
    compiled(torch.randn(256, 256))
    assert isinstance(seen[-1], CompileOptions) and seen[-1].fused_mlp is True

    ir = deepwell.capture(_Mlp(), (torch.randn(256, 256),))
    plan = deepwell.autoplan(ir, policy=POLICY)
    engine = deepwell.compile(ir, plan, recompute_codes=True, options=CompileOptions(fused_mlp=True))
    assert engine.options.plan is plan and engine.options.recompute_codes and engine.options.fused_mlp
    engine(torch.randn(256, 256))
    assert [s.codes for s in deepwell.last_plan().sites] == [Codes.RECOMPUTED] * 3


def test_optimize_validates_before_compiling():
    with pytest.raises(ValueError, match="'precision' must be one of"):
        deepwell.optimize(_Mlp(), precision="fp8")
