"""The recipe table and the per-device facts, as the Rust library states them (rust/core/src/policy,
through the `recipes`, `arch_info` and `roles` entries of rust/ops/src/capi.rs). The Python package
keeps no copy of them: the fake kernels' block sizes, `deepwell.Linear(recipe="auto")`, the
guardrails' clip limits, `probe()` and the planner's roles all read them from here."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import Enum

import torch

from .. import _native


@functools.cache
def table() -> dict[str, dict]:
    """recipe name -> {"name", "block_k" (None for bf16), "low_precision", "elem": {"name", "max",
    "max_code", "half_ulp_at_max"} (None for bf16)}."""
    return {r["name"]: r for r in _native.call("recipes")}


def names() -> tuple[str, ...]:
    return tuple(table())


@dataclass(frozen=True)
class Recipe:
    """One recipe as the Rust table states it, parsed once from its spelling: "fp8_block", or
    "fp8_block@sm_90" (CPU tensors only: the GEMMs that GPU would run, through a CPU model;
    docs/OPS.md "Linear layers")."""

    #: "mxfp8", "nvfp4", "fp8_block", "fp8_tensor" or "bf16".
    name: str
    #: elements per scale along K (None for bf16, 1 for fp8_tensor).
    block_k: int | None
    #: every recipe but bf16.
    low_precision: bool
    #: the GPU whose GEMMs a CPU model stands in for ("recipe@arch"), else None.
    modelled_arch: str | None = None

    @staticmethod
    @functools.cache
    def parse(text: str) -> Recipe:
        name, at, arch = text.partition("@")
        if name not in table():
            raise ValueError(f"deepwell: unknown recipe {text!r} (one of {', '.join(names())}, optionally '@<arch>')")
        row = table()[name]
        return Recipe(name, row["block_k"], row["low_precision"], arch if at else None)

    def native_on(self, arch: str) -> bool:
        """Whether `arch` runs this recipe's GEMMs natively (else exact emulation)."""
        return self.name in arch_info(arch)["native"]

    def __str__(self) -> str:
        return self.name if self.modelled_arch is None else f"{self.name}@{self.modelled_arch}"


class Precision(str, Enum):
    """The recipes by name, for code that prefers an enum to a string (the design documents write
    `Precision.MXFP8`): each member is its recipe's string, so it goes wherever a precision does.
    tests/compiler/test_seed_api.py checks the members against the Rust table."""

    AUTO = "auto"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"
    FP8_BLOCK = "fp8_block"
    FP8_TENSOR = "fp8_tensor"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value


def precision_name(precision):
    """A precision as the planner spells it: a `Precision` member's string, anything else as given."""
    return precision.value if isinstance(precision, Precision) else precision


#: "blackwell-sm100", "hopper_sm90", "sm100", "sm_100a": an optional family word and the SM number.
_ARCH_SPELLING = re.compile(r"^(?:(?P<family>[a-z]+)[-_ ])?sm_?(?P<sm>\d{2,3}[a-z]?)$")


def arch_name(text: str | None) -> str | None:
    """The planner's spelling ("sm_100") of an arch written the design's way ("blackwell-sm100",
    "blackwell-sm120", "hopper-sm90") or as "sm100"; a family word must match the Rust table's
    family of that SM (docs/OPS.md "Seed API aliases"). Other text passes through for Rust to judge."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"deepwell: an arch is a string such as 'sm_100' or 'blackwell-sm100', got {text!r}")
    m = _ARCH_SPELLING.match(text.strip().lower())
    if m is None:
        return text
    arch = f"sm_{m['sm']}"
    fam = arch_info(arch)["family"]
    if m["family"] and m["family"] not in fam.lower():
        raise ValueError(f"deepwell: arch {text!r}: {arch} is {fam}, not {m['family']}")
    return arch


def family(recipe: str) -> str:
    """The recipe's name without a modelled arch: "fp8_block" for "fp8_block@sm_90"."""
    return Recipe.parse(recipe).name


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
