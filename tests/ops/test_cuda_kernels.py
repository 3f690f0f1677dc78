"""The CUDA kernels: bit-exact with the CPU reference (itself checked against the float64 model) on
every op case, random wide-range inputs, odd shapes, strided and misaligned views; outputs are
poisoned first; launches follow torch's current stream, also inside CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import deepwell
from _util import FLOAT_DTYPES, same_bits, wide_range
from gemm_calls import GEMM_RTOL, cpu_call_with_gemms
from op_cases import cases

pytestmark = pytest.mark.gpu
ops = torch.ops.deepwell


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _outs(x):
    return x if isinstance(x, (tuple, list)) else (x,)


def poison(nbytes: int = 1 << 28) -> None:
    """Fill a large stretch of the caching allocator with 0xA5 and free it, so outputs allocated
    next start as garbage: an element a kernel forgets to write cannot pass as correct."""
    junk = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    del junk


def assert_cuda_matches_cpu(fn, *args, rtol=0.0, **kwargs):
    """Bit-exact (rtol 0), or within `rtol` (norm-wise) for ops whose GEMMs accumulate differently
    on the two devices; `rtol=None` derives which from the CPU call (`GEMM_RTOL` when it ran a GEMM)."""
    if rtol is None:
        want, gemm = cpu_call_with_gemms(fn, *args, **kwargs)
        rtol = GEMM_RTOL if gemm else 0.0
        want = _outs(want)
    else:
        want = _outs(fn(*args, **kwargs))
    poison()
    got = _outs(fn(*_to(args, "cuda"), **_to(kwargs, "cuda")))
    torch.cuda.synchronize()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.is_cuda and g.shape == w.shape and g.dtype == w.dtype
        if rtol == 0.0:
            assert same_bits(g.cpu(), w), f"{getattr(fn, '__name__', fn)}: CUDA differs from the CPU reference"
        elif w.numel():
            err = ((g.cpu().double() - w.double()).norm() / w.double().norm()).item()
            assert err < rtol, f"{getattr(fn, '__name__', fn)}: CUDA vs CPU relative error {err}"


CASES = [(name, i) for name, calls in cases().items() for i in range(len(calls))]


@pytest.mark.parametrize("name,i", CASES)
def test_every_op_case(name, i):
    """Ops whose CPU reference runs a GEMM (seen by the profiler, so no table can miss a new op)
    are compared within GEMM_RTOL, every other op bit for bit."""
    args, kwargs = cases()[name][i]
    if any(isinstance(a, str) and "@" in a for a in (*args, *kwargs.values())):
        pytest.skip("a recipe modelling another GPU ('recipe@sm_XX') runs on CPU tensors only")
    assert_cuda_matches_cpu(getattr(ops, name).default, *args, rtol=None, **kwargs)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_mxfp8_random(dtype, mode, elem, gen):
    x = wide_range((512, 1024), gen, dtype)
    for dim in (-1, 0):
        assert_cuda_matches_cpu(ops.mxfp8_quantize, x, dim, mode, elem)
    for transposed in (False, True):
        assert_cuda_matches_cpu(ops.mxfp8_quantize_rowcol, x, mode, elem, transposed, False)
    data, scale = ops.mxfp8_quantize(x, -1, mode, elem)
    for out in FLOAT_DTYPES:
        assert_cuda_matches_cpu(ops.mxfp8_dequantize, data, scale, -1, out)


@pytest.mark.parametrize("shape,dim", [((32, 32), -1), ((3, 64, 5), 1), ((7, 96), -1), ((2, 32, 3, 8), 1), ((32,), 0), ((64, 33), 0)])
def test_mxfp8_odd_shapes(shape, dim, gen):
    x = torch.randn(shape, generator=gen).bfloat16()
    assert_cuda_matches_cpu(ops.mxfp8_quantize, x, dim)


def test_strided_and_misaligned_views(gen):
    base = torch.randn(160, 257, generator=gen).bfloat16()
    misaligned = base[:, 1:]  # element 0 at a 2-byte offset: vector loads must not assume alignment
    assert_cuda_matches_cpu(ops.mxfp8_quantize, misaligned[:, :256], -1)
    assert_cuda_matches_cpu(ops.mxfp8_quantize, misaligned[:128, :64], 0)
    assert_cuda_matches_cpu(ops.mxfp8_quantize, base[:, :128].t(), -1)
    assert_cuda_matches_cpu(ops.nvfp4_quantize, misaligned[:, :256])
    assert_cuda_matches_cpu(ops.fp8_block_quantize, misaligned[:128, :256])
    assert_cuda_matches_cpu(ops.fp8_tensor_quantize, misaligned)
    assert_cuda_matches_cpu(ops.fp8_tensor_quantize_rowcol, misaligned)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
def test_nvfp4_random(dtype, block_2d, hadamard, stochastic, gen):
    x = (torch.randn(256, 512, generator=gen) * torch.rand(256, 1, generator=gen) * 20).to(dtype)
    assert_cuda_matches_cpu(ops.nvfp4_quantize, x, None, block_2d, stochastic, 1234, hadamard)
    assert_cuda_matches_cpu(ops.nvfp4_quantize, x, torch.tensor([7.5]), block_2d, stochastic, 99, hadamard)
    data, scale, gs = ops.nvfp4_quantize(x)
    for out in FLOAT_DTYPES:
        assert_cuda_matches_cpu(ops.nvfp4_dequantize, data, scale, gs, out)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block", [(1, 128), (128, 1), (128, 128)])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_block_random(dtype, block, pow2, gen):
    x = wide_range((384, 512), gen, dtype, lo=-6, hi=6)
    assert_cuda_matches_cpu(ops.fp8_block_quantize, x, *block, pow2)
    data, s = ops.fp8_block_quantize(x, *block, pow2)
    assert_cuda_matches_cpu(ops.fp8_block_dequantize, data, s, *block, torch.float32)
    for m_major in (False, True):
        assert_cuda_matches_cpu(ops.fp8_block_quantize_rowcol, x, pow2, m_major)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(384, 512), (1, 1), (65, 127), (200, 8), (3, 1000)])
def test_fp8_tensor_random(dtype, elem, shape, gen):
    """Whole 64 x 64 tiles, partial edge tiles, rows shorter than a 16-byte chunk, and runs of
    the transposed store that are not 16-byte aligned (m % 16 != 0)."""
    x = wide_range(shape, gen, dtype, lo=-3, hi=3)
    assert_cuda_matches_cpu(ops.fp8_tensor_quantize, x, elem)
    assert_cuda_matches_cpu(ops.fp8_tensor_quantize_rowcol, x, elem)
    data, s = ops.fp8_tensor_quantize(x, elem)
    for out in FLOAT_DTYPES:
        assert_cuda_matches_cpu(ops.fp8_tensor_dequantize, data, s, out)


def test_special_values(gen):
    x = torch.randn(128, 256, generator=gen)
    x[0, 3], x[1, 40], x[2, 100] = float("nan"), float("inf"), float("-inf")
    x[3] = 0.0
    x[4, :32] = -0.0
    x[5] = 2.0**-140  # fp32 subnormals
    x[6] = 3e38
    for fn, args in [
        (ops.mxfp8_quantize, (x,)),
        (ops.mxfp8_quantize, (x, -1, "floor", "e5m2")),
        (ops.mxfp8_quantize_rowcol, (x, "rceil", "e4m3", True, False)),
        (ops.nvfp4_quantize, (x,)),
        (ops.nvfp4_quantize, (x[3:],)),
        (ops.fp8_block_quantize, (x,)),
        (ops.fp8_block_quantize, (x, 128, 1)),
        (ops.fp8_tensor_quantize, (x,)),
        (ops.fp8_tensor_quantize_rowcol, (x, "e5m2")),
        (ops.fp8_tensor_quantize, (x[3:],)),
        (ops.fp8_tensor_quantize_rowcol, (x[3:],)),
    ]:
        assert_cuda_matches_cpu(fn, *args)


def test_large_tensor_grid_stride(gen):
    x = torch.randn(8192, 4096, generator=gen).bfloat16()
    assert_cuda_matches_cpu(ops.mxfp8_quantize, x)
    # 2048 tiles: each CTA of the transposing passes' resident grid loops over several, loading
    # the next tile while it stores this one.
    assert_cuda_matches_cpu(ops.fp8_block_quantize_rowcol, x)
    assert_cuda_matches_cpu(ops.fp8_block_quantize_rowcol, x, True, True)
    assert_cuda_matches_cpu(ops.fp8_block_quantize_transposed, x, True)
    assert_cuda_matches_cpu(ops.fp8_tensor_quantize_rowcol, x, "e5m2")


def test_side_stream_is_followed():
    x = torch.randn(1024, 1024, device="cuda").bfloat16()
    want = ops.mxfp8_quantize(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(10_000_000)  # keep the side stream busy: a launch on another stream would race
        got = ops.mxfp8_quantize(x * 1.0)
    torch.cuda.current_stream().wait_stream(s)
    assert all(same_bits(g, w) for g, w in zip(got, want))


def test_after_linear_under_cuda_graphs():
    """Launch on the caller's stream (docs/DESIGN.md "Conventions"): an op right after an nn.Linear
    under reduce-overhead compile (CUDA graphs)."""
    lin = torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16)

    def f(x):
        return ops.mxfp8_quantize(lin(x))

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        got = compiled(x)
    want = f(x)
    assert all(same_bits(g, w) for g, w in zip(got, want))


def test_mixed_devices_are_rejected():
    x = torch.randn(4, 64, device="cuda")
    d, s = ops.mxfp8_quantize(x)
    with pytest.raises(RuntimeError, match="'scale' must be on cuda:0 like 'data'|'scale' must be on a CUDA device"):
        ops.mxfp8_dequantize(d, s.cpu())


def test_numerics_vectors_on_the_gpu():
    """docs/NUMERICS.md's MXFP8 table, on the device (the CPU side is checked against it in test_mxfp8)."""
    from test_mxfp8 import F32_VECTORS

    for value, rceil, floor in F32_VECTORS:
        x = torch.full((2, 32), value, dtype=torch.float32, device="cuda")
        for mode, (want_scale, want_elem) in (("rceil", rceil), ("floor", floor)):
            data, scale = ops.mxfp8_quantize(x, -1, mode)
            assert set(scale.view(torch.uint8).flatten().tolist()) == {want_scale}, (value, mode)
            assert set(data.view(torch.uint8).flatten().tolist()) == {want_elem}, (value, mode)
