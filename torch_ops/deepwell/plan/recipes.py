"""The recipe table and the per-device facts, as the Rust library states them (rust/core/src/policy,
through the `recipes`, `arch_info` and `roles` entries of rust/ops/src/capi.rs). The Python package
keeps no copy of them: the fake kernels' block sizes, `deepwell.Linear(recipe="auto")`, the
guardrails' clip limits, `probe()` and the planner's roles all read them from here."""

from __future__ import annotations

import functools

import torch

from .. import _native


@functools.cache
def table() -> dict[str, dict]:
    """recipe name -> {"name", "block_k" (None for bf16), "low_precision", "elem": {"name", "max",
    "max_code", "half_ulp_at_max"} (None for bf16)}."""
    return {r["name"]: r for r in _native.call("recipes")}


def names() -> tuple[str, ...]:
    return tuple(table())


def block_k(recipe: str) -> int | None:
    """Elements per scale along K (both weight dims must be multiples: each is some pass's K)."""
    return table()[recipe]["block_k"]


@functools.cache
def arch_info(arch: str) -> dict:
    """{"arch", "family", "variant" (the NVRTC target, None for "cpu"), "native", "auto", "auto_reason"}."""
    return _native.call("arch_info", {"arch": arch})


def auto(arch: str | None = None) -> str:
    """`precision="auto"`'s recipe on `arch` (default: this machine's)."""
    return arch_info(arch or current_arch())["auto"]


def device_arch(device: str | torch.device) -> str:
    """The policy's arch name of a torch device: "cpu", or "sm_90" for a Hopper "cuda:0"."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def current_arch() -> str:
    """This machine's arch: its current CUDA device's, or "cpu" without a GPU."""
    return device_arch("cuda") if torch.cuda.is_available() else "cpu"


def roles(sites: list[tuple[str, str]]) -> list[str]:
    """The role of each (qualified name, module type) site (deepwell_core `Role::of_module`)."""
    return _native.call("roles", {"sites": [list(s) for s in sites]}) if sites else []


def role_of(name: str, module_type: str = "") -> str:
    """embedding / attention / mlp / experts / router / norm / lm_head / other."""
    return roles([(name, module_type)])[0]
