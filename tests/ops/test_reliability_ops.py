"""Argument validation of the MoE and grouped ops, the fp8_tensor amax arguments and
deepwell.DeepwellMoE, each case of the reliability issue as a test: a size argument that drove an
allocation until the process aborted, offsets and amaxes that gave silently wrong results, numbers
that made DeepwellMoE divide by zero or return NaN, and an input whose hidden size gave torch's
matmul message instead of one naming the block."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import deepwell
from deepwell.ops.fp8_tensor import amax_of
from deepwell.ops.moe import MAX_EXPERTS

ops = torch.ops.deepwell

# ---------------------------------------------------------------------------------------------
# Crashes: moe_permute_index's num_experts and align drove host allocations of E·(align − 1) rows


_PERMUTE_UNDER_A_MEMORY_LIMIT = """
import resource, sys, torch, deepwell
# Address space: what the process maps now plus 8 GiB, so a regression fails fast on any machine.
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 8 * 2**30, resource.RLIM_INFINITY))
experts, dropped = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.bool)
for num_experts, align in zip(map(int, sys.argv[1::2]), map(int, sys.argv[2::2])):
    try:
        torch.ops.deepwell.moe_permute_index(experts, dropped, num_experts, align)
        print("no error", flush=True)
    except RuntimeError as e:
        print(e, flush=True)
"""

_HUGE_PERMUTES = [(2**21, 1024), (2**31 - 2, 1)]


def test_permute_index_refuses_too_many_experts_instead_of_aborting(tmp_path):
    """2^21 experts padded to 1024 rows asked for a 32 GiB host buffer (an abort: "memory
    allocation of 34326200320 bytes failed"); 2^31 − 2 experts for 16 GiB of counts. Now E is
    bounded before anything is allocated. In a subprocess (one for both cases: starting torch is
    most of the time): a regression must not kill pytest."""
    args = [str(v) for case in _HUGE_PERMUTES for v in case]
    done = subprocess.run([sys.executable, "-c", _PERMUTE_UNDER_A_MEMORY_LIMIT, *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    want = [f"deepwell.moe_permute_index: argument 'num_experts' must be at most {MAX_EXPERTS}, got {e}"
            for e, _ in _HUGE_PERMUTES]
    assert done.stdout.splitlines() == want, done.stdout + done.stderr[-2000:]


def test_permute_index_refuses_one_expert_past_the_bound():
    experts, dropped = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=rf"argument 'num_experts' must be at most {MAX_EXPERTS}, "
                                           rf"got {MAX_EXPERTS + 1}$"):
        ops.moe_permute_index(experts, dropped, MAX_EXPERTS + 1, 1)


def test_permute_index_fake_kernel_refuses_too_many_experts_alike():
    """The meta kernel mirrors the bound with the same message (tracing fails like the real op)."""
    experts = torch.zeros(4, 2, dtype=torch.int32, device="meta")
    dropped = torch.zeros(4, 2, dtype=torch.bool, device="meta")
    want = f"deepwell.moe_permute_index: argument 'num_experts' must be at most {MAX_EXPERTS}, got {2**21}"
    with pytest.raises(RuntimeError) as err:
        ops.moe_permute_index(experts, dropped, 2**21, 1024)
    assert str(err.value) == want


def test_permute_index_at_the_expert_bound_still_runs():
    """E = MAX_EXPERTS with padding: the static buffer and the offsets, CPU reference as before."""
    experts = torch.tensor([[MAX_EXPERTS - 1, 0]], dtype=torch.int32)
    dropped = torch.tensor([[False, True]])
    row_of_slot, slot_of_row, offsets = ops.moe_permute_index(experts, dropped, MAX_EXPERTS, 4)
    rows = deepwell.ops.moe.static_rows(2, MAX_EXPERTS, 4)
    assert slot_of_row.shape == (rows,) and offsets.shape == (MAX_EXPERTS + 1,)
    assert row_of_slot.tolist() == [[0, -1]]  # every other group is empty: expert E-1 starts at 0
    assert slot_of_row[0].item() == 0 and (slot_of_row[1:] == -1).all()
    assert (offsets[:-1] == 0).all() and offsets[-1].item() == rows


# ---------------------------------------------------------------------------------------------
# Silent wrong results: grouped_linear's offsets


_BAD_OFFSETS = {
    "ends-before-the-rows": [0, 10, 10, 30],  # rows 30-39 came back uninitialised (bf16) or zero (fp8)
    "decreasing": [0, 30, 10, 40],
    "negative": [-5, 10, 10, 40],
    "past-the-rows": [0, 10, 10, 50],
    "not-from-zero": [5, 10, 10, 40],
}


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "mxfp8"])
@pytest.mark.parametrize("case", list(_BAD_OFFSETS))
def test_grouped_linear_refuses_bad_offsets_on_cpu(recipe, case, gen):
    """offsets must run from 0 to the rows of x without decreasing (the contract of
    fp8_block_grouped_gemm's CPU check, and its message); each backend took these silently."""
    x = torch.randn(40, 128, generator=gen)
    w = torch.randn(3, 128, 128, generator=gen)
    offsets = torch.tensor(_BAD_OFFSETS[case], dtype=torch.int32)
    want = (f"deepwell.grouped_linear: argument 'offsets' must run from 0 to the rows of x (40) without "
            f"decreasing, got {_BAD_OFFSETS[case]}")
    with pytest.raises(RuntimeError) as err:
        deepwell.grouped_linear(x, w, offsets, recipe)
    assert str(err.value) == want


@pytest.mark.gpu
def test_grouped_linear_per_expert_loop_checks_cuda_offsets_it_reads_anyway(gen):
    """The per-expert loop (fp8_block with unpadded groups) reads the offsets to the host on CUDA
    too, so it checks them there; the other CUDA paths leave them to the caller (no host sync)."""
    x = torch.randn(40, 128, generator=gen).cuda()
    w = torch.randn(3, 128, 128, generator=gen).cuda()
    offsets = torch.tensor([0, 10, 10, 30], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"deepwell.grouped_linear: argument 'offsets' must run from 0 to the rows "
                                           r"of x \(40\) without decreasing, got \[0, 10, 10, 30\]"):
        deepwell.grouped_linear(x, w, offsets, "fp8_block")


def test_grouped_linear_with_good_offsets_writes_every_row(gen):
    """The same call with offsets that end at the rows: each group is its expert's product."""
    x, w = torch.randn(40, 16, generator=gen), torch.randn(3, 8, 16, generator=gen)
    offsets = [0, 10, 10, 40]
    y = deepwell.grouped_linear(x, w, torch.tensor(offsets, dtype=torch.int32))
    want = torch.cat([x[lo:hi] @ w[e].T for e, (lo, hi) in enumerate(zip(offsets, offsets[1:]))])
    torch.testing.assert_close(y, want)


def test_grouped_linear_checks_the_promised_alignment_on_cpu(gen):
    """groups_aligned=True promises groups of whole blocks; on the CPU the offsets are checked."""
    x, w = torch.randn(40, 128, generator=gen), torch.randn(3, 128, 128, generator=gen)
    offsets = torch.tensor([0, 10, 20, 40], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"must run from 0 to the rows of x \(40\) without decreasing, in multiples "
                                           r"of 128, got \[0, 10, 20, 40\]"):
        deepwell.grouped_linear(x, w, offsets, "fp8_block", groups_aligned=True)
    deepwell.grouped_linear(x, w, offsets, "fp8_block")  # no promise: the per-expert loop takes them


def test_swiglu_experts_refuses_bad_offsets_on_cpu(gen):
    """The experts' FFN takes grouped_linear's offsets contract."""
    from deepwell.ops.swiglu_experts import swiglu_experts

    x = torch.randn(40, 32, generator=gen)
    gate_up, down = torch.randn(3, 64, 32, generator=gen), torch.randn(3, 32, 32, generator=gen)
    with pytest.raises(RuntimeError, match=r"deepwell.grouped_linear: argument 'offsets' must run from 0 to the rows "
                                           r"of x \(40\) without decreasing, got \[0, 10, 10, 30\]"):
        swiglu_experts(x, gate_up, down, torch.tensor([0, 10, 10, 30], dtype=torch.int32), ("bf16", "bf16"))


def test_grouped_offsets_messages_match_the_fp8_grouped_gemm():
    """One contract, one wording: the Rust FP8 grouped GEMM's CPU check says the same thing."""
    x = torch.randn(40, 128).to(torch.float8_e4m3fn)
    w = torch.randn(3, 128, 128).to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"argument 'offsets' must run from 0 to the rows of a \(40\) without "
                                           r"decreasing, got \[0, 10, 10, 30\]"):
        ops.fp8_block_grouped_gemm(x, torch.ones(40, 1), w, torch.ones(3, 1, 1),
                                   torch.tensor([0, 10, 10, 30], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# Silent wrong results: fp8_tensor amax arguments (checked against the tensor on the CPU)


def _rows(x):
    codes, _, scale = ops.fp8_tensor_quantize_rowcol(x, "e4m3", None, "rows")
    return codes, scale


@pytest.mark.parametrize("arg", ["weight_amax", "x_amax"])
@pytest.mark.parametrize("wrong", ["an-eighth", "ten-times", "nan", "negative", "zero"])
def test_the_row_copy_layer_refuses_an_amax_that_is_not_the_tensors(arg, wrong, gen):
    """fp8_tensor_linear on x's row codes quantized W with whatever amax it was given (an eighth saturates W's largest
    values; NaN quantizes with scale 1) and its backward x the same way; on CPU tensors the amax is
    now checked against the tensor."""
    x, w = torch.randn(4, 32, generator=gen).bfloat16(), torch.randn(16, 32, generator=gen).bfloat16()
    of = {"weight_amax": w, "x_amax": x}[arg]
    true = amax_of(of)
    bad = {"an-eighth": true / 8, "ten-times": true * 10, "nan": torch.tensor(math.nan),
           "negative": -true, "zero": torch.zeros(())}[wrong]
    amaxes = {"weight_amax": amax_of(w), "x_amax": amax_of(x), arg: bad}
    name = arg.removesuffix("_amax")
    with pytest.raises(RuntimeError, match=rf"deepwell.fp8_tensor_linear: argument '{arg}' must be the amax "
                                           rf"of '{name}' \(NaN-propagating max \|{name}\| = "):
        ops.fp8_tensor_linear(x, w, None, "fp8_tensor", *_rows(x), None, amaxes["weight_amax"], amaxes["x_amax"])


def test_the_row_copy_layer_takes_the_true_amax_nan_and_inf_included(gen):
    """What the backend gives (amax_of of the tensor) passes, NaN for a tensor holding a NaN too,
    and the result is the op's own."""
    x, w = torch.randn(4, 32, generator=gen).bfloat16(), torch.randn(16, 32, generator=gen).bfloat16()
    own = ops.fp8_tensor_linear(x, w, None, "fp8_tensor", *_rows(x), None, None, None)[0]
    given = ops.fp8_tensor_linear(x, w, None, "fp8_tensor", *_rows(x), None, amax_of(w), amax_of(x))[0]
    assert torch.equal(own, given)
    for special in (math.nan, math.inf):
        w2 = w.clone()
        w2[3, 5] = special
        ops.fp8_tensor_linear(x, w2, None, "fp8_tensor", *_rows(x), None, amax_of(w2), amax_of(x))


def test_the_other_amax_arguments_are_checked_alike(gen):
    """The check is the shared one of every amax argument: the quantizer's and the backward's."""
    x = torch.randn(8, 32, generator=gen)
    with pytest.raises(RuntimeError, match=r"fp8_tensor_quantize_rowcol: argument 'amax' must be the amax of 'x'"):
        ops.fp8_tensor_quantize_rowcol(x, "e4m3", amax_of(x) / 8)
    w, dy = torch.randn(16, 32, generator=gen), torch.randn(8, 16, generator=gen)
    _, codes_t, scale = ops.fp8_tensor_quantize_rowcol(x, "e4m3")
    with pytest.raises(RuntimeError, match=r"fp8_tensor_linear_backward: argument 'grad_amax' must be the amax of "
                                           r"'grad_out'"):
        ops.fp8_tensor_linear_backward(dy, codes_t.view(torch.uint8), scale, w, "fp8_tensor", True, True,
                                       torch.tensor(math.nan), None)


# ---------------------------------------------------------------------------------------------
# DeepwellMoE: every numeric constructor argument, and the input's hidden size


_GOOD = dict(dim=32, ffn_dim=16, num_experts=4, top_k=2)

_BAD_CONFIGS = [
    (dict(dim=0), "dim must be an int >= 1, got 0"),  # was a ZeroDivisionError in the router's init
    (dict(dim=-4), "dim must be an int >= 1, got -4"),
    (dict(ffn_dim=-1), "ffn_dim must be an int >= 1, got -1"),
    (dict(num_experts=0), "num_experts must be an int in [1, 65536] (moe_permute_index's MAX_EXPERTS), got 0"),
    (dict(num_experts=2**21), "num_experts must be an int in [1, 65536] (moe_permute_index's MAX_EXPERTS), "
                              "got 2097152"),
    (dict(top_k=0), "top_k must be an int in [1, 4] (num_experts), got 0"),
    (dict(top_k=2.0), "top_k must be an int, got 2.0"),
    (dict(route_scale=math.nan), "route_scale must be a finite number, got nan"),  # was an all-NaN output
    (dict(route_scale=0.0), "route_scale must be > 0, got 0.0"),
    (dict(n_group=-1), "n_group must be an int >= 0, got -1"),
    (dict(n_group=3), "n_group must be 0 (no groups) or split the 4 experts into groups of at least 2, got 3"),
    (dict(n_group=2, topk_group=0), "topk_group must be in [1, 2] and keep at least top_k=2 experts, got 0"),
    (dict(capacity_factor=-1.0), "capacity_factor must be None or > 0, got -1.0"),
    (dict(capacity_factor=math.inf), "capacity_factor must be None or a finite number, got inf"),
    (dict(bias_update_rate=math.nan), "bias_update_rate must be a finite number, got nan"),
    (dict(num_shared_experts=-1), "num_shared_experts must be an int >= 0, got -1"),  # was no shared experts
    (dict(num_shared_experts=1, shared_ffn_dim=0), "shared_ffn_dim must be an int >= 1, got 0"),
    (dict(aux_loss_coef=-0.01), "aux_loss_coef must be >= 0, got -0.01"),
    (dict(aux_loss_coef=math.nan), "aux_loss_coef must be a finite number, got nan"),
    (dict(z_loss_coef=-1.0), "z_loss_coef must be >= 0, got -1.0"),
    (dict(z_loss_coef=math.inf), "z_loss_coef must be a finite number, got inf"),
]


@pytest.mark.parametrize("kw,message", _BAD_CONFIGS, ids=[",".join(f"{k}={v}" for k, v in kw.items())
                                                          for kw, _ in _BAD_CONFIGS])
def test_deepwell_moe_refuses_bad_numbers_at_construction(kw, message):
    with pytest.raises(ValueError) as err:
        deepwell.DeepwellMoE(**{**_GOOD, **kw})
    assert str(err.value) == f"deepwell.DeepwellMoE: {message}"


def test_deepwell_moe_names_the_hidden_size_of_a_wrong_input(gen):
    """Was torch's "mat1 and mat2 shapes cannot be multiplied (3x16 and 32x4)"."""
    moe = deepwell.DeepwellMoE(**_GOOD)
    for x in (torch.randn(3, 16, generator=gen), torch.randn(2, 3, 33, generator=gen), torch.tensor(1.0)):
        shape = "[" + ", ".join(str(s) for s in x.shape) + "]"
        with pytest.raises(RuntimeError) as err:
            moe(x)
        assert str(err.value) == f"deepwell.DeepwellMoE: the input must be (..., dim) with dim=32, got shape {shape}"
    assert moe(torch.randn(2, 3, 32, generator=gen)).shape == (2, 3, 32)
