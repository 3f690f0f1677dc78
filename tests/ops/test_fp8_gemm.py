"""The FP8 GEMM ops (fp8_block_gemm, fp8_block_grouped_gemm, fp8_block_grouped_wgrad): what they
compute is the float64 product of the dequantized operands, up to fp32 accumulation and the output
rounding. On the CPU that is the reference; on an H100/H200 deepwell's own kernel
(cuda/fp8_gemm.cuh) runs and is checked against the same float64 product, on fresh random inputs,
with outputs landing in NaN-poisoned memory (an element the kernel forgets stays NaN)."""

from __future__ import annotations

import pytest
import torch

import deepwell
from deepwell import _native

# ||out - ref|| / ||ref||: fp32 accumulation lands far below 1e-5 on the CPU; the GPU's FP8 tensor
# cores keep fewer bits inside each 128-wide block (measured 2.5e-4 on the H100 with an fp32
# output: the reason the kernel promotes to fp32 per block), and a bf16 / fp16 output adds its
# rounding (2^-9 relative per element).
TOL = {torch.float32: 1e-3, torch.bfloat16: 4e-3, torch.float16: 2e-3}
CPU_TOL = 1e-6


def _quant(x, block):
    return deepwell.fp8_block_quantize(x, *block)


def _deq64(codes, scale, block):
    return deepwell.fp8_block_dequantize(codes, scale, *block, torch.float32).double()


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _operands(m, n, k, device, gen, b_block=(128, 128), spread=True):
    """A (m, k) and B (n, k) quantized; `spread` scales rows over many binades (the scales matter)."""
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    if spread:
        x = x * torch.exp2(torch.randint(-8, 8, (m, 1), generator=gen).float())
        w = w * torch.exp2(torch.randint(-8, 8, (1, k), generator=gen).float())
    a = _quant(x.to(device), (1, 128))
    b = _quant(w.to(device), b_block)
    return a, b


def _poison(device):
    """Fills the caching allocator's free blocks with NaN, so a fresh output that the kernel does
    not fully write shows NaN."""
    if device == "cuda":
        junk = torch.full((64 << 20,), float("nan"), device=device)
        del junk


# ---------------------------------------------------------------------------------------------
# What the ops compute (CPU: the reference)


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dense_is_the_dequantized_product(gen, b_block, out_dtype):
    (a, sa), (b, sb) = _operands(96, 256, 384, "cpu", gen, b_block)
    bias = torch.randn(256, generator=gen)
    y = deepwell.fp8_block_gemm(a, sa, b, sb, bias, out_dtype)
    ref = _deq64(a, sa, (1, 128)) @ _deq64(b, sb, b_block).T + bias.double()
    assert y.dtype == out_dtype and y.shape == (96, 256)
    assert _rel(y, ref) < (CPU_TOL if out_dtype == torch.float32 else TOL[out_dtype])


def test_grouped_rows_are_per_group_products(gen):
    (a, sa), _ = _operands(300, 128, 256, "cpu", gen)
    w = torch.randn(4, 256, 256, generator=gen)
    b, sb = _quant(w, (128, 128))
    offsets = torch.tensor([0, 0, 37, 299, 300], dtype=torch.int32)  # an empty group, a 1-row one
    y = deepwell.fp8_block_grouped_gemm(a, sa, b, sb, offsets, torch.float32)
    for g in range(4):
        lo, hi = offsets[g].item(), offsets[g + 1].item()
        if hi > lo:
            ref = deepwell.fp8_block_gemm(a[lo:hi], sa[lo:hi], b[g], sb[g], None, torch.float32)
            torch.testing.assert_close(y[lo:hi], ref, rtol=0, atol=0)


def test_grouped_wgrad_sums_each_groups_k_range(gen):
    dy, x = torch.randn(384, 128, generator=gen), torch.randn(384, 256, generator=gen)
    a, sa = _quant(dy.t().contiguous(), (1, 128))  # dy^T along the tokens
    b, sb = _quant(x.t().contiguous(), (1, 128))
    offsets = torch.tensor([0, 256, 256, 384], dtype=torch.int32)
    y = deepwell.fp8_block_grouped_wgrad(a, sa, b, sb, offsets, torch.float32)
    assert y.shape == (3, 128, 256)
    assert torch.equal(y[1], torch.zeros(128, 256))  # the empty group
    for g, (lo, hi) in [(0, (0, 256)), (2, (256, 384))]:
        ref = _deq64(a, sa, (1, 128))[:, lo:hi] @ _deq64(b, sb, (1, 128))[:, lo:hi].T
        assert _rel(y[g], ref) < CPU_TOL


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda a, sa, b, sb: deepwell.fp8_block_gemm(a.float(), sa, b, sb), "argument 'a' must have dtype"),
        (lambda a, sa, b, sb: deepwell.fp8_block_gemm(a[:, :200], sa, b, sb), "argument 'a' must"),
        (lambda a, sa, b, sb: deepwell.fp8_block_gemm(a, sa[:, :1], b, sb), "argument 'a_scale' must have shape"),
        (lambda a, sa, b, sb: deepwell.fp8_block_gemm(a, sa, b[:, :128], sb), "a has K = 256"),
        (lambda a, sa, b, sb: deepwell.fp8_block_gemm(a, sa, b, sb[:, :1]), "argument 'b_scale' must have shape"),
        (lambda a, sa, b, sb: deepwell.fp8_block_gemm(a, sa, b, sb, torch.ones(3)), "argument 'bias' must have shape"),
        (
            lambda a, sa, b, sb: deepwell.fp8_block_grouped_gemm(a, sa, b[None], sb[None], torch.tensor([0, 64])),
            "argument 'offsets' must have dtype",
        ),
        (
            lambda a, sa, b, sb: deepwell.fp8_block_grouped_gemm(
                a, sa, b[None], sb[None], torch.tensor([0, 8, 64], dtype=torch.int32)
            ),
            "b has 1 groups but offsets has 3 entries",
        ),
        (
            lambda a, sa, b, sb: deepwell.fp8_block_grouped_gemm(
                a, sa, b[None], sb[None], torch.tensor([0, 63], dtype=torch.int32)
            ),
            "argument 'offsets' must run from 0 to the rows of a",
        ),
    ],
)
def test_bad_arguments_name_the_op_and_argument(gen, call, match):
    (a, sa), (b, sb) = _operands(64, 128, 256, "cpu", gen)
    with pytest.raises(RuntimeError, match=match):
        call(a, sa, b, sb)


def test_not_differentiable():
    (a, sa), (b, sb) = _operands(4, 128, 128, "cpu", torch.Generator().manual_seed(0), spread=False)
    sa.requires_grad_()
    y = deepwell.fp8_block_gemm(a, sa, b, sb, None, torch.float32)
    with pytest.raises(RuntimeError, match="fp8_block_gemm is not differentiable"):
        y.sum().backward()


# ---------------------------------------------------------------------------------------------
# deepwell's kernel on the GPU (sm_90); elsewhere the same checks exercise the CUDA fallback

#: Every tile shape the `fp8_gemm_tile` entry can force (rust/ops/src/gemm/fp8_gemm.rs `SHAPES`); a
#: shape that cannot serve a launch (the 128 x 192 and 192-row tiles on grouped GEMMs or 1x128 B
#: scales) leaves Rust's choice in place there.
TILE_SHAPES = ["128", "256", "2x128", "128x192", "128x192h", "192"]

DENSE_SHAPES = [
    (128, 128, 128),  # one tile, one K-block
    (260, 384, 640),  # partial row tile, 5 K-blocks
    (4096, 4096, 1024),  # 256-row tiles (two waves)
    (1000, 2816, 256),  # rows % 8 != 0, K = 2 blocks
    (8, 1024, 4096),  # a handful of tokens
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", DENSE_SHAPES)
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gpu_dense_matches_the_float64_product(gen, m, n, k, b_block, out_dtype):
    (a, sa), (b, sb) = _operands(m, n, k, "cuda", gen, b_block, spread=out_dtype != torch.float16)
    bias = torch.randn(n, generator=gen).cuda() if m % 2 == 0 else None
    _poison("cuda")
    y = deepwell.fp8_block_gemm(a, sa, b, sb, bias, out_dtype)
    ref = _deq64(a, sa, (1, 128)) @ _deq64(b, sb, b_block).T
    if bias is not None:
        ref = ref + bias.double()
    assert not y.isnan().any(), "unwritten outputs"
    assert _rel(y, ref) < TOL[out_dtype]


@pytest.mark.gpu
def test_gpu_scales_stored_m_major_are_read_in_place(gen):
    """The linear layers hand the kernel scales stored M-major (the quantizers' layout for
    cuBLASLt); the op takes any strides."""
    (a, sa), (b, sb) = _operands(512, 256, 512, "cuda", gen)
    y1 = deepwell.fp8_block_gemm(a, sa, b, sb, None, torch.float32)
    y2 = deepwell.fp8_block_gemm(a, sa.t().contiguous().t(), b, sb, None, torch.float32)
    assert torch.equal(y1, y2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sizes",
    [
        [0, 700, 5, 0, 300, 1, 0, 18],  # empty groups, a 1-row group, sizes off the tile
        [1024],  # one group holds every row
        [128, 256, 384, 256],  # tile-aligned
    ],
)
def test_gpu_grouped_rows_match_the_float64_product(gen, sizes):
    groups, n, k = len(sizes), 256, 512
    rows = sum(sizes)
    (a, sa), _ = _operands(rows, n, k, "cuda", gen)
    b, sb = _quant(torch.randn(groups, n, k, generator=gen).cuda(), (128, 128))
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    _poison("cuda")
    y = deepwell.fp8_block_grouped_gemm(a, sa, b, sb, offsets, torch.float32)
    db = _deq64(b, sb, (128, 128))
    _check_row_groups(y, _deq64(a, sa, (1, 128)), offsets, lambda g: db[g])


def _check_row_groups(y, da, offsets, b_of):
    """Every row group of y (fully written) against its float64 product with B = b_of(g)."""
    assert not y.isnan().any()
    for g in range(offsets.numel() - 1):
        lo, hi = offsets[g].item(), offsets[g + 1].item()
        if hi > lo:
            assert _rel(y[lo:hi], da[lo:hi] @ b_of(g).T) < TOL[torch.float32], g


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,n,tokens",
    [
        (384, 512, [256, 0, 384, 128]),  # 32 tiles of 256 rows: 128-row tiles
        (1160, 1024, [512, 0, 384, 256, 128, 640, 128, 256]),  # 320 tiles: 256-row tiles, a partial last one
    ],
)
def test_gpu_grouped_wgrad_matches_the_float64_product(gen, m, n, tokens):
    r = sum(tokens)
    dy, x = torch.randn(r, m, generator=gen).cuda(), torch.randn(r, n, generator=gen).cuda()
    a, sa = _quant(dy.t().contiguous(), (1, 128))
    b, sb = _quant(x.t().contiguous(), (1, 128))
    offsets = torch.tensor([0, *torch.tensor(tokens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    _poison("cuda")
    y = deepwell.fp8_block_grouped_wgrad(a, sa, b, sb, offsets, torch.float32)
    da, db = _deq64(a, sa, (1, 128)), _deq64(b, sb, (1, 128))
    for g in range(len(tokens)):
        lo, hi = offsets[g].item(), offsets[g + 1].item()
        if hi == lo:
            assert torch.equal(y[g], torch.zeros_like(y[g])), "an empty group is zeros"
        else:
            assert _rel(y[g], da[:, lo:hi] @ db[:, lo:hi].T) < TOL[torch.float32], g


@pytest.mark.gpu
@pytest.mark.parametrize("left", [8, 120, 1024])
def test_gpu_sms_left_to_collectives_change_the_grid_not_the_bits(gen, left):
    """Under FSDP the persistent kernel leaves the plan's SMs to the collectives (distributed/shard.py
    sets them with torch's carveout): fewer CTAs, each looping over more tiles; every output is the
    same bits (one CTA computes a tile whole, in the same order), dense, row-grouped and K-grouped.
    A carveout of the whole GPU still launches one CTA."""
    (a, sa), (b, sb) = _operands(1000, 640, 512, "cuda", gen)
    w, sw = _quant(torch.randn(3, 256, 512, generator=gen).cuda(), (128, 128))
    offsets = torch.tensor([0, 300, 300, 1000], dtype=torch.int32, device="cuda")
    dy, dys = _quant(torch.randn(384, 1024, generator=gen).cuda(), (1, 128))
    x, xs = _quant(torch.randn(256, 1024, generator=gen).cuda(), (1, 128))
    k_offsets = torch.tensor([0, 512, 512, 1024], dtype=torch.int32, device="cuda")

    def run():
        return (deepwell.fp8_block_gemm(a, sa, b, sb, None, torch.bfloat16),
                deepwell.fp8_block_grouped_gemm(a, sa, w, sw, offsets, torch.float32),
                deepwell.fp8_block_grouped_wgrad(dy, dys, x, xs, k_offsets, torch.float32))

    whole = run()
    try:
        assert _native.call("sm_carveout", {"sms": left}) == left
        _poison("cuda")
        carved = run()
    finally:
        _native.call("sm_carveout", {"sms": 0})
    for y, z in zip(whole, carved):
        assert torch.equal(y, z)


@pytest.mark.gpu
@pytest.mark.parametrize("left", [0, 1])
def test_gpu_every_tile_shape_gives_the_same_bits(gen, left):
    """Rust gives each launch 128-row tiles, 256-row tiles or 256-row tiles split over a cluster of
    two CTAs that share B through TMA multicast (`Fp8Gemm::shape_for`). Every shape sums each
    output's K-blocks in the same order, so all give the same bits: forced in turn here (the
    `fp8_gemm_tile` entry) on shapes where each is not Rust's choice, so clusters whose second CTA
    lies wholly or partly past the rows or a row group, 1 to 5 K-blocks (the pipelined batches of
    4, 2 and 1) and an odd SM count (left = 1: the cluster grid drops an SM) are covered; outputs
    land in NaN-poisoned memory. The 192-row tile (three math warpgroups of 64 rows): row counts
    that leave one, two or all three warpgroups of the last tile wholly or partly past the rows
    (4, 128, 196, 260, 320, 1000 rows), fp16 / bf16 / fp32 outputs."""
    (a, sa), (b, sb) = _operands(260, 384, 640, "cuda", gen)
    (c, sc), (d, sd) = _operands(1000, 2816, 256, "cuda", gen, (1, 128))
    # 128 x 192 tiles: 640 columns end in a partial tile that starts mid scale tile; 3 K-blocks.
    (e, se), (f, sf) = _operands(1000, 640, 384, "cuda", gen)
    w, sw = _quant(torch.randn(8, 256, 512, generator=gen).cuda(), (128, 128))
    (x, sx), _ = _operands(1024, 256, 512, "cuda", gen)
    sizes = [0, 700, 5, 0, 300, 1, 0, 18]
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    dy, dys = _quant(torch.randn(1160, 1408, generator=gen).cuda(), (1, 128))
    xt, xts = _quant(torch.randn(384, 1408, generator=gen).cuda(), (1, 128))
    k_offsets = torch.tensor([0, 512, 512, 896, 1024, 1408], dtype=torch.int32, device="cuda")
    # Row tails of the 192-row tile (unscaled, so that fp16 outputs stay finite).
    tail_sizes = [(4, 256, 256), (128, 128, 128), (196, 384, 640), (320, 256, 1024)]
    tails = [_operands(m, n, k, "cuda", gen, spread=False) for m, n, k in tail_sizes]
    tail_dtypes = [torch.float16, torch.float32, torch.float16, torch.bfloat16]

    def run():
        return (*(deepwell.fp8_block_gemm(p, sp, q, sq, torch.randn(q.shape[0], generator=gen).cuda(), dt)
                  for ((p, sp), (q, sq)), dt in zip(tails, tail_dtypes)),
                deepwell.fp8_block_gemm(a, sa, b, sb, torch.randn(384, generator=gen).cuda(), torch.bfloat16),
                deepwell.fp8_block_gemm(c, sc, d, sd, None, torch.float32),
                deepwell.fp8_block_gemm(e, se, f, sf, None, torch.float32),
                deepwell.fp8_block_grouped_gemm(x, sx, w, sw, offsets, torch.float32),
                deepwell.fp8_block_grouped_wgrad(dy, dys, xt, xts, k_offsets, torch.float32))

    outs = {}
    try:
        _native.call("sm_carveout", {"sms": left})
        for tile in TILE_SHAPES:
            assert _native.call("fp8_gemm_tile", {"tile": tile}) == tile
            gen.manual_seed(7)  # the same bias each time
            _poison("cuda")
            outs[tile] = run()
    finally:
        _native.call("fp8_gemm_tile", {"tile": None})
        _native.call("sm_carveout", {"sms": 0})
    assert _native.call("fp8_gemm_tile", {}) is None
    for tile in TILE_SHAPES[1:]:
        for y, z in zip(outs["128"], outs[tile]):
            assert not z.isnan().any(), tile
            assert torch.equal(y, z), tile
    # Rust's choice for big dense GEMMs and the 192-row tile, compared directly.
    assert all(torch.equal(y, z) for y, z in zip(outs["256"], outs["192"]))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", TILE_SHAPES)
@pytest.mark.parametrize("m,n,k", DENSE_SHAPES + [(1000, 640, 384), (520, 4096, 1024), (196, 384, 512),
                                                  (320, 256, 768)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_each_tile_shape_matches_the_float64_product(gen, tile, m, n, k, out_dtype):
    """Each tile shape forced on a weight-scaled dense GEMM (fprop / dgrad): partial row and column
    tiles (640 and 384 columns against 192-wide tiles; 196 and 320 rows against 192-row tiles), 1 to
    32 K-blocks, a bias, NaN-poisoned outputs."""
    (a, sa), (b, sb) = _operands(m, n, k, "cuda", gen)
    bias = torch.randn(n, generator=gen).cuda()
    try:
        assert _native.call("fp8_gemm_tile", {"tile": tile}) == tile
        _poison("cuda")
        y = deepwell.fp8_block_gemm(a, sa, b, sb, bias, out_dtype)
    finally:
        _native.call("fp8_gemm_tile", {"tile": None})
    ref = _deq64(a, sa, (1, 128)) @ _deq64(b, sb, (128, 128)).T + bias.double()
    assert not y.isnan().any(), "unwritten outputs"
    assert _rel(y, ref) < TOL[out_dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", TILE_SHAPES)
def test_gpu_zeros_saturation_and_non_finite_match_the_cpu_reference(gen, tile):
    """Zero rows and zero weight tiles, codes at E4M3's largest magnitude (448) on both operands,
    and NaN / Inf in the input (the quantizer makes NaN codes of them): every tile shape gives the
    CPU reference's NaN pattern and, elsewhere, its values within the GEMM tolerance."""
    m, n, k = 384, 640, 512
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    x[5] = 0.0
    w[128:256, 128:256] = 0.0
    x[7] = 448.0 * torch.sign(torch.randn(k, generator=gen))
    w[3] = 448.0
    x[9, 17], x[200, 300], x[301, 5] = float("nan"), float("inf"), float("-inf")
    (a, sa), (b, sb) = _quant(x, (1, 128)), _quant(w, (128, 128))
    want = deepwell.fp8_block_gemm(a, sa, b, sb, None, torch.float32)
    try:
        assert _native.call("fp8_gemm_tile", {"tile": tile}) == tile
        _poison("cuda")
        got = deepwell.fp8_block_gemm(a.cuda(), sa.cuda(), b.cuda(), sb.cuda(), None, torch.float32).cpu()
    finally:
        _native.call("fp8_gemm_tile", {"tile": None})
    assert want.isnan().any(), "the NaN input reaches the output"
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[5], want[5]) and not got[5].any(), "a zero row is zeros"
    assert _rel(got[finite], want[finite].double()) < TOL[torch.float32]


def test_config_entry_reports_rusts_tile_and_the_forced_one():
    """What bench_gemm prints per shape: Rust's heuristic tile for a dense fprop / dgrad, and the
    tile a launch takes now (a forced one overrides it)."""
    big = {"rows": 16384, "cols": 4096, "k": 4096, "sms": 132}
    assert _native.call("fp8_gemm_config", big) == {"heuristic": "256", "runs": "256"}
    assert _native.call("fp8_gemm_config", {**big, "rows": 1024})["heuristic"] == "128"
    try:
        _native.call("fp8_gemm_tile", {"tile": "128x192"})
        assert _native.call("fp8_gemm_config", big) == {"heuristic": "256", "runs": "128x192"}
        _native.call("fp8_gemm_tile", {"tile": "192"})
        assert _native.call("fp8_gemm_config", big) == {"heuristic": "256", "runs": "192"}
    finally:
        _native.call("fp8_gemm_tile", {"tile": None})
    with pytest.raises(ValueError, match=r"fp8_gemm_config: 'k' must be a positive integer"):
        _native.call("fp8_gemm_config", {**big, "k": 0})


def test_forcing_an_unknown_tile_shape_is_refused():
    with pytest.raises(ValueError, match=r"fp8_gemm_tile: 'tile' must be one of .* got \"64\""):
        _native.call("fp8_gemm_tile", {"tile": "64"})
    assert _native.call("fp8_gemm_tile", {}) is None


@pytest.mark.gpu
def test_gpu_misaligned_wgrad_offsets_come_out_nan_not_wrong(gen):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("deepwell's kernel runs on sm_90 only (the fallback needs CPU offsets)")
    a, sa = _quant(torch.randn(128, 256, generator=gen).cuda(), (1, 128))
    b, sb = _quant(torch.randn(128, 256, generator=gen).cuda(), (1, 128))
    offsets = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    y = deepwell.fp8_block_grouped_wgrad(a, sa, b, sb, offsets, torch.float32)
    assert y[0].isnan().all() and y[1].isnan().all()


def test_side_by_side_groups_are_the_transposed_stacked_weights(gen):
    """The dgrad's B: W^T of every group from one transposing quantization of the stacked weights,
    the groups side by side along K, gives what each group's own W^T tiles give."""
    groups, n, k = 3, 256, 128  # the forward's W: (groups, n, k); the dgrad multiplies by W^T (k, n)
    (a, sa), _ = _operands(200, 128, n, "cpu", gen)  # dy (rows, n)
    w = torch.randn(groups, n, k, generator=gen)
    wt, wt_s = deepwell.fp8_block_quantize_transposed(w.reshape(groups * n, k))
    assert wt.shape == (k, groups * n) and wt_s.shape == (k // 128, groups * n // 128)
    offsets = torch.tensor([0, 64, 64, 200], dtype=torch.int32)
    y = deepwell.fp8_block_grouped_gemm(a, sa, wt, wt_s, offsets, torch.float32)
    stacked = _quant(w.transpose(-2, -1).contiguous(), (128, 128))  # each W_g^T quantized on its own
    assert torch.equal(stacked[0].view(torch.uint8), wt.view(torch.uint8).reshape(k, groups, n).permute(1, 0, 2))
    torch.testing.assert_close(y, deepwell.fp8_block_grouped_gemm(a, sa, *stacked, offsets, torch.float32), rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_side_by_side_groups_match_the_float64_product(gen):
    groups, n, k = 4, 512, 384
    sizes = [300, 0, 129, 595]
    (a, sa), _ = _operands(sum(sizes), 128, n, "cuda", gen)
    w = torch.randn(groups * n, k, generator=gen).cuda()
    wt, wt_s = deepwell.fp8_block_quantize_transposed(w)
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    _poison("cuda")
    y = deepwell.fp8_block_grouped_gemm(a, sa, wt, wt_s, offsets, torch.float32)
    dw = _deq64(wt, wt_s, (128, 128))
    _check_row_groups(y, _deq64(a, sa, (1, 128)), offsets, lambda g: dw[:, g * n:(g + 1) * n])
