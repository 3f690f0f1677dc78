"""What a reliability sweep found, each as a test: allocations that must fail with an error
instead of aborting, storage that was freed under a tensor, truncated shared libraries, settings
that must be refused where they are written, second derivatives, and the JSON planner's strictness.
The meta/cpu mix, the JIT cache and the swizzle overflow live in test_boundary.py and rust/gpu."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import deepwell
from deepwell import _native

ops = torch.ops.deepwell


_UNDER_A_MEMORY_LIMIT = """
import resource, sys, torch, deepwell
# Address space: what the process maps now plus 8 GiB, so the test means the same on every machine.
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 8 * 2**30, resource.RLIM_INFINITY))
x = torch.randn(1, 32).expand(int(sys.argv[1]), 32)
try:
    torch.ops.deepwell.mxfp8_quantize(x)
except RuntimeError as e:
    print(e)
"""


@pytest.mark.parametrize("rows,what", [(2**27, "a host buffer"), (2**30, "torch's allocator")])
def test_a_huge_broadcast_input_is_an_error_not_an_abort(rows, what):
    """A 128-byte tensor expanded to 4 Gi / 32 Gi elements, under an 8 GiB allocation budget: the
    strided copy (16 GiB) or the output (32 GiB) cannot be allocated, and the op raises instead of
    aborting in Vec::with_capacity."""
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_A_MEMORY_LIMIT, str(rows)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "deepwell.mxfp8_quantize: could not allocate" in done.stdout and what in done.stdout, done.stdout


@pytest.mark.parametrize(
    "call",
    [
        lambda w: ops.scaled_linear(torch.randn(4, 128), w, None, "fp8_block", None),
        lambda w: ops.fp8_block_quantize(w),
        lambda w: ops.mxfp8_quantize(w),
    ],
    ids=["scaled_linear", "fp8_block_quantize", "mxfp8_quantize"],
)
def test_a_freed_storage_is_refused(call):
    w = torch.randn(128, 128)
    w.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"storage of 0 bytes \(freed or resized"):
        call(w)


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


def _truncated_copy(tmp_path) -> str:
    src = _native.library_path()
    dst = tmp_path / "libtruncated.so"
    with open(src, "rb") as f:
        dst.write_bytes(f.read(os.path.getsize(src) // 2))
    return str(dst)


def test_a_truncated_deepwell_library_is_an_error_not_sigbus(tmp_path):
    done = _run_python("import deepwell", DEEPWELL_LIBRARY=_truncated_copy(tmp_path))
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "DEEPWELL_LIBRARY" in done.stderr and "is truncated" in done.stderr


def test_a_truncated_nvrtc_is_an_error_not_sigbus(tmp_path):
    code = "import deepwell._native as n; n.nvrtc_path()"
    full = tmp_path / "libcomplete.so"
    shutil.copy(_native.library_path(), full)
    assert _run_python(code, DEEPWELL_NVRTC=str(full)).returncode == 0
    done = _run_python(code, DEEPWELL_NVRTC=_truncated_copy(tmp_path))
    assert done.returncode == 1 and "DEEPWELL_NVRTC" in done.stderr and "is truncated" in done.stderr


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        ({"min_features": -1}, "min_features"),
        ({"min_features": 1.5}, "min_features"),
        ({"min_features": "x"}, "min_features"),
        ({"first_last_bf16": "no"}, "first_last_bf16"),
        ({"precision": 8}, "precision"),
        ({"name_overrides": {"*": 1}}, "name_overrides"),
    ],
)
def test_precision_policy_refuses_invalid_values(kwargs, arg):
    with pytest.raises(ValueError, match=f"deepwell.PrecisionPolicy: '{arg}' must be"):
        deepwell.PrecisionPolicy(**kwargs)


def test_the_planner_refuses_negative_tokens_instead_of_ignoring_them():
    layer = deepwell.LayerInfo("layers.0.mlp.up", "Linear", "mlp", 1, 4, 4096, 14336, tokens=-1)
    with pytest.raises(ValueError, match=r"layers\[0\]: field 'tokens' must be a non-negative integer, got -1"):
        deepwell.PrecisionPolicy().decide([layer], "sm_90")


def test_the_planner_refuses_wrong_types_in_the_json_request():
    """The Rust entry point itself: a present field of the wrong type is an error, not the default."""
    request = {"policy": {"min_features": -1}, "arch": "sm_90", "layers": []}
    with pytest.raises(ValueError, match="field 'min_features' must be a non-negative integer, got -1"):
        _native.call("policy_decide", request)


@pytest.mark.parametrize("kwargs", [{"saturation_threshold": float("nan")}, {"saturation_threshold": 2.0}, {"interval": 0}])
def test_guardrail_config_refuses_invalid_values_at_construction(kwargs):
    with pytest.raises(ValueError, match="deepwell.GuardrailConfig"):
        deepwell.GuardrailConfig(**kwargs)


def test_manual_seed_wants_an_int():
    with pytest.raises(TypeError, match="deepwell.manual_seed: argument 'seed' must be an int, got float 1.5"):
        deepwell.manual_seed(1.5)
    deepwell.manual_seed(-1)  # wraps to 64 bits, as torch.manual_seed does


@pytest.mark.parametrize("op", ["scaled_linear", "mxfp8_linear"])
def test_second_derivatives_raise_instead_of_being_zero(op):
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    y = ops.scaled_linear(x, w, None, "mxfp8", 1) if op == "scaled_linear" else ops.mxfp8_linear(x, w)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"second derivatives \(double backward\) .* are not supported"):
        gx.sum().backward()
