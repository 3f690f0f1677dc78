"""Guardrails: the Rust rule behind the `guardrail_check` entry, statistics collected from real layers,
and the bf16 fallback of a deepwell.Linear triggered by an injected overflow, recorded in
`deepwell.policy_report()`."""

from __future__ import annotations

import math

import pytest
import torch

import deepwell
from _util import same_bits
from deepwell.nn import guardrails as g

OK = [0, 0, 0, 1000, 3.0, 10.0]


def test_the_rule_keeps_healthy_layers():
    assert g.check(OK, 1e-3) is None


@pytest.mark.parametrize(
    "stats,says",
    [
        ([5, 0, 0, 1000, 3.0, 10.0], "5 non-finite input values"),
        ([0, 2, 0, 1000, 3.0, math.inf], "2 non-finite output values"),
        ([0, 0, 0, 1000, math.nan, 1.0], "input amax NaN"),
        ([0, 0, 2, 1000, 3.0, 1.0], "2 of 1000 elements saturated"),
    ],
)
def test_the_rule_names_what_tripped(stats, says):
    reason = g.check(stats, 1e-3)
    assert reason is not None and says in reason and "bf16 fallback" in reason


def test_saturation_threshold_is_strict():
    assert g.check([0, 0, 1, 1000, 1.0, 1.0], 1e-3) is None  # exactly at the threshold
    assert g.check([0, 0, 2, 1000, 1.0, 1.0], 1e-3) is not None


def test_bad_stats_are_a_clear_error():
    with pytest.raises(ValueError, match="input_nonfinite"):
        g.check([-1, 0, 0, 1, 1.0, 1.0], 1e-3)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block", "nvfp4"])
def test_layer_stats_of_healthy_data(recipe, gen):
    """Gaussian inputs: nothing non-finite, nothing clipped (NVFP4's rounded-down block scales
    are rounding, not clipping)."""
    x = torch.randn(256, 256, generator=gen)
    y = torch.randn(256, 64, generator=gen)
    s = g.layer_stats(x, y, recipe).tolist()
    assert s[:4] == [0, 0, 0, 256 * 256]
    assert s[4] == x.abs().max().item() and s[5] == y.abs().max().item()


def test_clipping_is_counted():
    """Amax-derived scales never clip; an NVFP4 global amax 4x below the true one clips every value
    above a quarter of it (the counter's definition, on a case where clipping happens)."""
    x = torch.linspace(-8.0, 8.0, 64).reshape(2, 32)
    for recipe in ("mxfp8", "fp8_block", "nvfp4"):
        assert g._clipped(x.repeat(1, 4), recipe).item() == 0
    clipped = g._clipped(x, "nvfp4", torch.tensor([2.0]))
    assert clipped.item() == (x.abs() > 2.0 * (1 + 1 / 6)).sum().item()


def test_injected_overflow_falls_back_to_bf16_and_says_why(gen):
    layer = deepwell.Linear(
        64, 32, recipe="mxfp8", name="test.injected", guardrail_config=deepwell.GuardrailConfig(interval=1)
    )
    x = torch.randn(8, 64, generator=gen)
    layer(x)
    assert layer.guardrail.poll(block=True) is None and layer.guardrail.recipe == "mxfp8"
    bad = x.clone()
    bad[3, 5] = math.inf
    layer(bad)
    reason = layer.guardrail.poll(block=True)
    assert reason is not None and "1 non-finite input values" in reason
    assert layer.guardrail.recipe == "bf16"
    with torch.no_grad():
        want = torch.ops.deepwell.scaled_linear(x, layer.weight, layer.bias, "bf16")
        assert same_bits(layer(x), want)
    record = next(r for r in deepwell.policy_report() if r.name == "test.injected")
    assert (record.recipe, record.active_recipe) == ("mxfp8", "bf16")
    assert "call 2" in record.events[0] and "non-finite" in record.events[0]
    assert "test.injected" in deepwell.format_report()


def test_statistics_wait_for_the_interval(gen):
    layer = deepwell.Linear(64, 32, recipe="mxfp8", name="test.interval",
                            guardrail_config=deepwell.GuardrailConfig(interval=3))
    bad = torch.randn(4, 64, generator=gen)
    bad[0, 0] = math.nan
    layer(bad)
    layer(bad)
    assert layer.guardrail.poll(block=True) is None  # no statistics yet (calls 1, 2)
    layer(bad)
    assert layer.guardrail.poll(block=True) is not None


def test_linear_from_linear_shares_parameters(gen):
    lin = torch.nn.Linear(64, 32)
    d = deepwell.Linear.from_linear(lin, recipe="mxfp8", guardrails=False)
    assert d.weight is lin.weight and d.bias is lin.bias
    x = torch.randn(4, 64, generator=gen)
    assert same_bits(d(x), torch.ops.deepwell.scaled_linear(x, lin.weight, lin.bias, "mxfp8"))


def test_linear_refuses_a_shape_its_recipe_cannot_take_at_construction():
    with pytest.raises(ValueError, match=r"deepwell.Linear: mxfp8 needs in_features and out_features divisible by 32, got \(100, 100\)"):
        deepwell.Linear(100, 100, recipe="mxfp8")
    with pytest.raises(ValueError, match="deepwell.Linear: argument 'recipe' must be one of"):
        deepwell.Linear(512, 512, recipe="fp4")


def test_auto_linear_plans_bf16_for_a_shape_no_recipe_takes(monkeypatch):
    from deepwell.core import recipes

    monkeypatch.setattr("deepwell.nn.linear.auto_recipe", lambda: "fp8_block")
    layer = deepwell.Linear(100, 256, recipe="auto")
    assert layer.recipe == "bf16"
    assert recipes.block_k("fp8_block") == 128
