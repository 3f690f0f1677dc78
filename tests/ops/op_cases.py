"""Sample calls of every torch.ops.deepwell op, used by the opcheck, compile and registry tests.
Adding an op without adding its cases here fails tests/ops/test_registry.py."""

from __future__ import annotations

import torch

from deepwell.ops.fp8_tensor import amax_of


def _x(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _mx(x, **kw):
    return torch.ops.deepwell.mxfp8_quantize(x, **kw)


def _nv(x, **kw):
    return torch.ops.deepwell.nvfp4_quantize(x, **kw)


def _fb(x, *block):
    return torch.ops.deepwell.fp8_block_quantize(x, *block)


def _fbc(x):
    """x's fp8_block rowcol codes with M-major scales, as fp8_block_linear takes them (both copies)."""
    return torch.ops.deepwell.fp8_block_quantize_rowcol(x, True, True)


def _fbr(x):
    """x's fp8_block row codes alone, M-major scales, as fp8_block_linear takes them (rows only)."""
    return torch.ops.deepwell.fp8_block_quantize_rowcol(x, True, True, "rows")[:2]


def _ftc(x, amax=None):
    """x's fp8_tensor codes, scale and transposed codes, as fp8_tensor_linear takes them."""
    rows, cols, scale = torch.ops.deepwell.fp8_tensor_quantize_rowcol(x, "e4m3", amax)
    return rows, scale, cols


def _ftr(x, amax=None):
    """x's fp8_tensor row codes alone and the scale, as fp8_tensor_linear takes them (rows only)."""
    rows, _, scale = torch.ops.deepwell.fp8_tensor_quantize_rowcol(x, "e4m3", amax, "rows")
    return rows, scale


def _mlp_saved(x, recipe):
    """What fp8_block_swiglu_mlp saves for its backward, x (..., k) through w_gate / w_up (384, k) and
    w_down (128, 384): x's column codes, gate_up, h's column codes, and the three weights."""
    k = x.shape[-1]
    codes = _fbc(x.reshape(-1, k))
    weights = (_x(384, k, seed=1), _x(384, k, seed=2), _x(128, 384, seed=3))
    _, gate_up, h_t, h_s = torch.ops.deepwell.fp8_block_swiglu_mlp(x, *codes, *weights, recipe)
    return (*codes[2:], gate_up, h_t, h_s, *weights)


def _p(*shape, dtype=torch.bfloat16, seed=0):
    """A leaf tensor that requires grad (opcheck then checks the autograd formula too)."""
    return _x(*shape, dtype=dtype, seed=seed).requires_grad_()


def cases() -> dict[str, list[tuple[tuple, dict]]]:
    """op name -> [(args, kwargs), ...]."""
    mx = _mx(_x(4, 64))
    mx_dim0 = _mx(_x(64, 3), dim=0)
    nv = _nv(_x(16, 32))
    fb = _fb(_x(128, 256), 1, 128)
    fb2 = _fb(_x(128, 256), 128, 128)
    scale = torch.randint(0, 255, (130, 6), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    routed = torch.ops.deepwell.moe_route(_x(7, 8, dtype=torch.float32), None, 2, "softmax", 0, 0, 0.0)
    w_fb, w_mx, w_nv = _x(128, 256, seed=4), _x(32, 64, seed=5), _x(32, 32, seed=6)
    routed_drop = torch.ops.deepwell.moe_route(_x(9, 8, dtype=torch.float32), None, 2, "softmax", 0, 0, 0.5)
    perm = torch.ops.deepwell.moe_permute_index(routed[0], routed[1], 8, 1)
    perm_drop = torch.ops.deepwell.moe_permute_index(routed_drop[0], routed_drop[1], 8, 4)
    w7, w9 = torch.rand(7, 2), torch.rand(9, 2, generator=torch.Generator().manual_seed(1))
    ga = _fb(_x(200, 256, seed=7), 1, 128)
    gb = _fb(_x(3, 128, 256, seed=8), 128, 128)
    gt = _fb(_x(64, 256, seed=9), 1, 128)  # wgrad operands: (rows, tokens) along the tokens
    return {
        "mxfp8_quantize": [
            ((_x(4, 64),), {}),
            ((_x(64, 3, dtype=torch.float32),), {"dim": 0, "scale_mode": "floor", "elem": "e5m2"}),
            ((_x(8, 64, dtype=torch.float16).t(),), {"dim": 0}),
        ],
        "mxfp8_quantize_rowcol": [
            ((_x(64, 96),), {}),
            ((_x(32, 64, dtype=torch.float32),), {"scale_mode": "floor", "col_transposed": True, "swizzle": True}),
        ],
        "mxfp8_dequantize": [(mx, {}), (mx_dim0, {"dim": 0, "out_dtype": torch.float32})],
        "nvfp4_quantize": [
            ((_x(4, 32),), {}),
            ((_x(32, 32, dtype=torch.float32),), {"block_2d": True, "global_amax": torch.tensor([4.0])}),
            ((_x(4, 32),), {"stochastic": True, "seed": 3, "hadamard": True}),
        ],
        "nvfp4_dequantize": [(nv, {}), (nv, {"out_dtype": torch.float16})],
        "fp8_block_quantize": [
            ((_x(4, 256),), {}),
            ((_x(128, 256, dtype=torch.float32), 128, 128, False), {}),
            ((_x(256, 8), 128, 1), {}),
        ],
        "fp8_block_quantize_rowcol": [
            ((_x(128, 256),), {}),
            ((_x(256, 128, dtype=torch.float16),), {"pow2": False}),
            ((_x(256, 384),), {"m_major_scales": True}),
            ((_x(256, 384),), {"m_major_scales": True, "copies": "rows"}),
            ((_x(128, 256, dtype=torch.float32),), {"copies": "cols"}),
            ((_x(256, 128),), {"m_major_scales": True, "copies": "cols"}),
        ],
        "fp8_block_dequantize": [(fb, {}), ((*fb2, 128, 128), {"out_dtype": torch.float32})],
        "fp8_attention": [
            ((_p(1, 2, 16, 64), _p(1, 2, 16, 64, seed=1), _p(1, 2, 16, 64, seed=2)), {"is_causal": True}),
            ((_x(2, 1, 5, 32, dtype=torch.float32), _x(2, 1, 9, 32, dtype=torch.float32, seed=1),
              _x(2, 1, 9, 32, dtype=torch.float32, seed=2)), {"scale": 0.3}),
        ],
        "fp8_attention_backward": [
            ((_x(1, 2, 16, 64, seed=3), _x(1, 2, 16, 64), _x(1, 2, 16, 64, seed=1), _x(1, 2, 16, 64, seed=2)),
             {"is_causal": True}),
        ],
        "swiglu": [((_p(8, 64),), {}), ((_x(3, 10, dtype=torch.float32),), {}), ((_p(5, 6, dtype=torch.float16),), {})],
        "swiglu_backward": [
            ((_x(8, 64), _x(8, 32, seed=1)), {}),
            ((_x(3, 10, dtype=torch.float16), _x(3, 5, dtype=torch.float16, seed=1)), {}),
        ],
        "fp8_block_swiglu_quantize_rowcol": [
            ((_x(128, 256),), {}),
            ((_x(256, 512, dtype=torch.float32),), {"pow2": False}),
        ],
        "fp8_block_swiglu_backward_quantize_rowcol": [
            ((_x(128, 256), _x(128, 128, seed=1)), {}),
            ((_x(256, 512, dtype=torch.float16), _x(256, 256, dtype=torch.float16, seed=1)), {"pow2": False}),
        ],
        "fp8_block_quantize_transposed": [((_x(128, 256),), {}), ((_x(256, 128, dtype=torch.float32),), {"pow2": False})],
        "fp8_block_expert_weight": [((_x(2, 128, 256), "fprop"), {}), ((_x(3, 256, 128, dtype=torch.float32), "dgrad"), {})],
        "mxfp8_expert_weight": [((_x(2, 128, 256), "fprop"), {}), ((_x(3, 256, 128, dtype=torch.float32), "dgrad"), {})],
        "fp8_block_gemm": [
            ((*fb, *fb2), {}),
            ((*fb, *_fb(_x(72, 256, seed=3), 1, 128)), {"bias": _x(72), "out_dtype": torch.float32}),
        ],
        "fp8_block_grouped_gemm": [
            ((*ga, *gb, torch.tensor([0, 50, 50, 200], dtype=torch.int32)), {}),
            ((*ga, *torch.ops.deepwell.fp8_block_quantize_transposed(_x(3 * 256, 128, seed=10)),
              torch.tensor([0, 64, 64, 200], dtype=torch.int32)), {"out_dtype": torch.float32}),
        ],
        "fp8_block_grouped_wgrad": [
            ((*gt, *fb, torch.tensor([0, 128, 128, 256], dtype=torch.int32)), {"out_dtype": torch.float32}),
        ],
        "fp8_tensor_quantize": [
            ((_x(4, 33),), {}),
            ((_x(3, 5, 7, dtype=torch.float32),), {"elem": "e5m2"}),
            ((_x(8, 64, dtype=torch.float16).t(),), {}),
        ],
        "fp8_tensor_quantize_rowcol": [
            ((_x(70, 130),), {}),
            ((_x(64, 16, dtype=torch.float32),), {"elem": "e5m2"}),
            ((_x(70, 130),), {"copies": "rows"}),
            ((_x(64, 16, dtype=torch.float16), "e4m3", amax_of(_x(64, 16, dtype=torch.float16))), {"copies": "cols"}),
        ],
        "fp8_tensor_dequantize": [
            (torch.ops.deepwell.fp8_tensor_quantize(_x(4, 33)), {}),
            (torch.ops.deepwell.fp8_tensor_quantize(_x(9, 5), "e5m2"), {"out_dtype": torch.float32}),
        ],
        "swizzle_scales": [((scale,), {})],
        "scaled_linear": [
            ((_p(2, 3, 64), _p(32, 64, seed=1), _p(32, seed=2), "mxfp8"), {}),
            ((_p(4, 128, dtype=torch.float32), _p(128, 128, seed=1, dtype=torch.float32), None, "fp8_block"), {}),
            ((_p(32, 32), _p(16, 32, seed=1), _p(16, seed=2), "nvfp4"), {"seed": 7}),
            ((_p(5, 48, dtype=torch.float16), _p(24, 48, seed=1, dtype=torch.float16), None, "bf16"), {}),
            ((_x(3, 64), _x(32, 64, seed=1), None, "mxfp8"), {}),
            ((_p(2, 40, 48), _p(32, 48, seed=1), _p(32, seed=2), "fp8_tensor"), {}),
        ],
        # Every combination of given operands: none (the op quantizes x), both copies, the row copy
        # alone; with and without W's and x's amax.
        "fp8_tensor_linear": [
            ((_p(2, 40, 48), _p(32, 48, seed=1), _p(32, seed=2)), {}),
            ((_p(64, 64, dtype=torch.float32), _p(32, 64, seed=1, dtype=torch.float32), None, "fp8_tensor@sm_90"), {}),
            ((_p(64, 64, dtype=torch.float32), _p(32, 64, seed=1, dtype=torch.float32), None, "fp8_tensor@sm_90"),
             {"weight_amax": amax_of(_x(32, 64, seed=1, dtype=torch.float32)),
              "x_amax": amax_of(_x(64, 64, dtype=torch.float32))}),
            ((_p(2, 40, 48), _p(32, 48, seed=1), _p(32, seed=2), "fp8_tensor", *_ftc(_x(80, 48))), {}),
            ((_p(64, 64, dtype=torch.float32), _p(32, 64, seed=1, dtype=torch.float32), None, "fp8_tensor@sm_90",
              *_ftc(_x(64, 64, dtype=torch.float32)), amax_of(_x(32, 64, seed=1, dtype=torch.float32))), {}),
            ((_p(2, 40, 48), _p(32, 48, seed=1), _p(32, seed=2), "fp8_tensor", *_ftr(_x(80, 48))), {}),
            ((_p(64, 64, dtype=torch.float32), _p(32, 64, seed=1, dtype=torch.float32), None, "fp8_tensor@sm_90",
              *_ftr(_x(64, 64, dtype=torch.float32), amax_of(_x(64, 64, dtype=torch.float32)))),
             {"weight_amax": amax_of(_x(32, 64, seed=1, dtype=torch.float32)),
              "x_amax": amax_of(_x(64, 64, dtype=torch.float32))}),
        ],
        "fp8_tensor_linear_backward": [
            ((_x(2, 40, 32), *torch.ops.deepwell.fp8_tensor_linear(_x(2, 40, 48), _x(32, 48, seed=1), None)[1:],
              _x(32, 48, seed=1), "fp8_tensor", True, True), {}),
            ((_x(64, 32), *torch.ops.deepwell.fp8_tensor_linear(_x(64, 48), _x(32, 48, seed=2), None)[1:],
              _x(32, 48, seed=2), "fp8_tensor@sm_90", False, True), {}),
            ((_x(64, 32), *torch.ops.deepwell.fp8_tensor_linear(_x(64, 48), _x(32, 48, seed=2), None)[1:],
              _x(32, 48, seed=2), "fp8_tensor@sm_90", True, True, amax_of(_x(64, 32)), amax_of(_x(32, 48, seed=2))), {}),
        ],
        # Every combination of given operands: none (the op quantizes x), both copies, the row copy alone.
        "fp8_block_linear": [
            ((_p(2, 128, 256), _p(128, 256, seed=1), _p(128, seed=2)), {}),
            ((_p(128, 128, dtype=torch.float32), _p(256, 128, seed=1, dtype=torch.float32), None, "fp8_block@sm_90"), {}),
            ((_p(2, 128, 256), _p(128, 256, seed=1), _p(128, seed=2), "fp8_block", *_fbc(_x(256, 256))), {}),
            ((_p(128, 128, dtype=torch.float32), _p(256, 128, seed=1, dtype=torch.float32), None, "fp8_block@sm_90",
              *_fbc(_x(128, 128, dtype=torch.float32))), {}),
            ((_p(2, 128, 256), _p(128, 256, seed=1), _p(128, seed=2), "fp8_block", *_fbr(_x(256, 256))), {}),
            ((_p(128, 128, dtype=torch.float32), _p(256, 128, seed=1, dtype=torch.float32), None, "fp8_block@sm_90"),
             dict(zip(("x_codes", "x_scale_inv"), _fbr(_x(128, 128, dtype=torch.float32))))),
        ],
        "fp8_block_linear_backward": [
            ((_x(2, 128, 128), *_fbc(_x(256, 256))[2:], _x(128, 256, seed=1), "fp8_block", True, True), {}),
            ((_x(128, 256), *_fbc(_x(128, 128))[2:], _x(256, 128, seed=1), "fp8_block@sm_90", False, True), {}),
            ((_x(128, 256), *_fbc(_x(128, 128))[2:], _x(256, 128, seed=1), "fp8_block@sm_90", True, False), {}),
        ],
        "fp8_block_swiglu_mlp": [
            ((_p(2, 128, 256), *_fbc(_x(256, 256)), _p(128, 256, seed=1), _p(128, 256, seed=2), _p(256, 128, seed=3)), {}),
            ((_p(128, 128, dtype=torch.float32), *_fbc(_x(128, 128, dtype=torch.float32)),
              _p(256, 128, seed=1, dtype=torch.float32), _p(256, 128, seed=2, dtype=torch.float32),
              _p(128, 256, seed=3, dtype=torch.float32), "fp8_block@sm_90"), {}),
        ],
        "fp8_block_swiglu_mlp_backward": [
            ((_x(2, 128, 128), *_mlp_saved(_x(2, 128, 256), "fp8_block"), "fp8_block", True, True), {}),
            ((_x(128, 128), *_mlp_saved(_x(128, 256), "fp8_block@sm_90"), "fp8_block@sm_90", False, True), {}),
            ((_x(128, 128), *_mlp_saved(_x(128, 256), "fp8_block@sm_90"), "fp8_block@sm_90", True, False), {}),
        ],
        "mxfp8_linear": [
            ((_p(2, 3, 64), _p(32, 64, seed=1)), {}),
            ((_p(64, 64, dtype=torch.float32), _p(32, 64, seed=1, dtype=torch.float32), _p(32, seed=2)), {}),
        ],
        "scaled_linear_backward": [
            ((_x(2, 32, 32), _x(2, 32, 64, seed=1), _x(32, 64, seed=2), "mxfp8", None, True, True), {}),
            ((_x(32, 16), _x(32, 32, seed=1), _x(16, 32, seed=2), "nvfp4", 3, True, False), {}),
            ((_x(128, 128), _x(128, 128, seed=1), _x(128, 128, seed=2), "fp8_block", None, False, True), {}),
            ((_x(48, 32), _x(48, 64, seed=1), _x(32, 64, seed=2), "fp8_tensor", None, True, True), {}),
            ((_x(50, 32), _x(50, 64, seed=1), _x(32, 64, seed=2), "fp8_tensor", None, True, True), {}),
        ],
        "quantized_linear": [
            ((_x(4, 256), *_fb(w_fb, 128, 128), None, None, "fp8_block"), {}),
            ((_x(2, 3, 64, dtype=torch.float32), *_mx(w_mx), None, _x(32, seed=2), "mxfp8"), {}),
            ((_x(5, 32), *torch.ops.deepwell.nvfp4_quantize(w_nv, None, True), _x(32, seed=3), "nvfp4@sm_100"), {}),
        ],
        "quantized_linear_backward": [
            ((_x(4, 256), _x(4, 256, seed=1), *_fb(_x(256, 256, seed=4), 128, 128), "fp8_block", torch.float32, True, True), {}),
            ((_x(2, 4, 512, dtype=torch.float32), _x(2, 4, 256, seed=1, dtype=torch.float32), *_fb(_x(512, 256, seed=5), 128, 128),
              "fp8_block@sm_90", torch.bfloat16, True, False), {}),
            ((_x(128, 128), _x(128, 256, seed=1), *_fb(w_fb, 128, 128), "fp8_block", torch.float16, False, True), {}),
        ],
        "unswizzle_scales": [((torch.ops.deepwell.swizzle_scales(scale), 130, 6), {})],
        "moe_route": [
            ((_x(6, 8, dtype=torch.float32), None, 2, "softmax", 0, 0, 0.0), {}),
            ((_x(5, 8), _x(8, dtype=torch.float32, seed=1), 3, "sigmoid", 4, 2, 1.25), {}),
        ],
        "moe_permute_index": [
            ((routed[0], routed[1], 8, 1), {}),
            ((routed_drop[0], routed_drop[1], 8, 16), {}),
        ],
        "moe_gather_rows": [
            ((_x(7, 16), perm[1], None, 2), {}),
            ((_x(9, 12, dtype=torch.float32), perm_drop[1], w9, 2), {}),
        ],
        "moe_sum_slots": [
            ((_x(perm[1].shape[0], 16), perm[0], w7), {}),
            ((_x(perm_drop[1].shape[0], 5, dtype=torch.float16), perm_drop[0], None), {}),
        ],
        "moe_slot_dots": [
            ((_x(perm[1].shape[0], 16), perm[0], _x(7, 16, seed=1)), {}),
            ((_x(perm_drop[1].shape[0], 300, dtype=torch.float32), perm_drop[0], _x(9, 300, seed=1, dtype=torch.float32)), {}),
        ],
    }
