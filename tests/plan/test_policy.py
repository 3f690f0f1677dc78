"""deepwell.PrecisionPolicy: the Rust policy's decisions through its JSON entry point (the rules
themselves are unit-tested in rust/core/tests/policy.rs)."""

from __future__ import annotations

import pytest

import deepwell
from deepwell import LayerInfo, PrecisionPolicy


def model(n: int = 6, d: int = 4096) -> list[LayerInfo]:
    """embed, n linears, lm_head. The n linears are numbered 0..n-1 as the model's GEMM sites (the
    embedding and the LM head are kept bf16 by their roles, whatever their position)."""
    sites = [LayerInfo("embed", "Embedding", "embedding", 0, n, d, d)]
    sites += [LayerInfo(f"layers.{i}.mlp.up", "Linear", "mlp", i, n, d, d) for i in range(n)]
    sites += [LayerInfo("lm_head", "Linear", "lm_head", n - 1, n, d, 32000)]
    return sites


def test_auto_on_hopper_is_native_fp8_block_with_bf16_ends():
    got = PrecisionPolicy().decide(model(), "sm_90")
    assert [d.recipe for d in got] == ["bf16", "bf16"] + ["fp8_block"] * 4 + ["bf16", "bf16"]
    assert not any(d.emulated for d in got)
    assert [got[0].rule, got[1].rule, got[2].rule, got[6].rule, got[7].rule] == ["Role", "FirstLast", "Precision", "FirstLast", "Role"]
    assert all(d.reason for d in got)


def test_mxfp8_on_hopper_and_cpu_is_emulated_and_says_so():
    for arch in ("sm_90", "cpu"):
        mid = PrecisionPolicy(precision="mxfp8").decide(model(), arch)[3]
        assert mid.recipe == "mxfp8" and mid.emulated and "emulated" in mid.reason
    assert not PrecisionPolicy(precision="mxfp8").decide(model(), "sm_100")[3].emulated


def test_overrides_and_shape_guards():
    policy = PrecisionPolicy(precision="fp8_block", name_overrides={"layers.2.*": "bf16"}, type_overrides={"Embedding": "mxfp8"})
    got = policy.decide(model(), "sm_90")
    assert got[3].recipe == "bf16" and got[3].rule == "NameOverride"
    assert got[0].recipe == "mxfp8" and got[0].rule == "TypeOverride"
    odd = LayerInfo("layers.9.mlp.down", "Linear", "mlp", 5, 10, 4160, 4096)
    d = PrecisionPolicy(precision="fp8_block").decide([odd], "sm_90")[0]
    assert d.recipe == "bf16" and "4160" in d.reason


@pytest.mark.parametrize(
    "kwargs,arch,match",
    [({"precision": "fp4"}, "sm_90", "precision"), ({}, "sm_x", "arch"), ({"name_overrides": {"*": "int8"}}, "cpu", "name_overrides")],
)
def test_bad_requests_raise_value_errors(kwargs, arch, match):
    with pytest.raises(ValueError, match=match):
        PrecisionPolicy(**kwargs).decide(model(), arch)


def test_bad_layer_names_the_index():
    with pytest.raises(ValueError, match=r"layers\[0\].*role"):
        PrecisionPolicy().decide([LayerInfo("x", "Linear", "conv", 0, 1, 64, 64)], "cpu")


def test_exported():
    assert deepwell.PrecisionPolicy is PrecisionPolicy
