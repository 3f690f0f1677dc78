//! How each recipe quantizes each operand of each pass (docs/DESIGN.md "Recipes and hardware", formats
//! in docs/NUMERICS.md), producing the operand form the pass's backend reads (`operand.rs`).
//!
//! | recipe | x (activations) | W (weights) | dy (gradients) |
//! |---|---|---|---|
//! | mxfp8 | E4M3, E8M0 scale per 1x32, rceil | same | same |
//! | fp8_block | E4M3, pow2 fp32 scale per 1x128 | per 128x128 | per 1x128 |
//! | fp8_tensor | E4M3, one pow2 fp32 scale per tensor | same | E5M2, one scale |
//! | nvfp4 | E2M1, 1x16, round to nearest | 16x16 blocks | 1x16, stochastic rounding |
//! | bf16 | bf16 | bf16 | bf16 |
//!
//! NVFP4 follows NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149): 2-D 16x16 weight blocks (so
//! W and W^T quantize identically), stochastic rounding on gradients, and the 16x16 random
//! Hadamard transform on both wgrad operands (x^T and dy^T along the tokens). Every operand is
//! quantized along its GEMM's K; the wgrad operands along the token dim M (`along_m`). A column-wise
//! copy is re-quantized from the high-precision tensor, never transposed from the row-wise one
//! (docs/NUMERICS.md "Transposes"), except for 2-D blocks and fp8_tensor's single scale, where the
//! two are identical: fp8_tensor's transposed operands are its codes transposed, written by the
//! same pass that writes the row codes when both are needed (W, dy).

use deepwell_core::policy::{Recipe, ScalingType};

use super::operand::{dense_dtype, Form, Operand};
use super::quantizers::{self as k, Copies, Fp8Elem, Nvfp4Options};
use crate::aten;
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

/// What a tensor is to the layer: it decides NVFP4's block shape and rounding, and fp8_block's tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Activation,
    Weight,
    Gradient,
}

/// Values rounded to bf16 (what a bf16 GEMM reads); widened exactly to fp32 on the CPU.
fn dense(op: Op, t: Tensor) -> Result<Tensor> {
    let device = t.device();
    let b = aten::to_dtype(op, t, DType::BF16)?;
    aten::to_dtype(op, b, dense_dtype(device))
}

/// fp8_tensor's element format: E5M2 for gradients (range), E4M3 for activations and weights.
pub(crate) fn fp8_tensor_elem(role: Role) -> Fp8Elem {
    if role == Role::Gradient {
        Fp8Elem::E5M2
    } else {
        Fp8Elem::E4M3
    }
}

/// fp8_tensor's values, dequantized exactly (a power-of-two scale times an FP8 code is a bf16).
fn fp8_tensor_emulated(op: Op, t: Tensor, role: Role) -> Result<Tensor> {
    let device = t.device();
    let (data, scale) = k::fp8_tensor_quantize(op, t, fp8_tensor_elem(role), None)?;
    k::fp8_tensor_dequantize(op, data, scale, dense_dtype(device))
}

/// fp8_tensor's operand of x (m, k) transposed, (k, m): the codes transposed (one pass); `amax`:
/// x's, where the caller has it (else reduced here).
fn fp8_tensor_cols(op: Op, t: Tensor, role: Role, amax: Option<Tensor>) -> Result<Operand> {
    let [_, data, scale] = k::fp8_tensor_quantize_rowcol(op, t, fp8_tensor_elem(role), Copies::Cols, amax)?;
    Ok(Operand::Blockwise { data, scale, scaling: ScalingType::TensorWise })
}

// fp8_tensor's weight operands in the tensor-wise forms (cuBLASLt, sm_89+), from W's amax where the
// caller has it: the deepwell backend reduces it once per step in the graph, and the forward and
// the backward both read it, so neither makes a pass over W for it. Bit for bit what `along_k`,
// `weight_dgrad` and `weight_pair` make for these forms (they call these with None).

/// W (N, K) along K: the fprop operand, codes in W's layout.
pub fn fp8_tensor_weight_fprop(op: Op, w: Tensor, amax: Option<Tensor>) -> Result<Operand> {
    let (data, scale) = k::fp8_tensor_quantize(op, w, fp8_tensor_elem(Role::Weight), amax)?;
    Ok(Operand::Blockwise { data, scale, scaling: ScalingType::TensorWise })
}

/// W^T (K, N): the dgrad operand, W's codes transposed.
pub fn fp8_tensor_weight_dgrad(op: Op, w: Tensor, amax: Option<Tensor>) -> Result<Operand> {
    fp8_tensor_cols(op, w, Role::Weight, amax)
}

/// Both, from one pass over W.
pub fn fp8_tensor_weight_pair(op: Op, w: Tensor, amax: Option<Tensor>) -> Result<(Operand, Operand)> {
    let [rows, cols, scale] = k::fp8_tensor_quantize_rowcol(op, w, fp8_tensor_elem(Role::Weight), Copies::Both, amax)?;
    let scaling = ScalingType::TensorWise;
    let d = Operand::Blockwise { data: cols, scale: scale.share(op)?, scaling };
    Ok((Operand::Blockwise { data: rows, scale, scaling }, d))
}

fn nvfp4_options(role: Role, seed: u64, hadamard: bool) -> Nvfp4Options {
    Nvfp4Options { block_2d: role == Role::Weight, stochastic_seed: (role == Role::Gradient).then_some(seed), hadamard }
}

/// NVFP4 dequantized without the global decode scale (exact in bf16: E2M1 x E4M3 has at most six
/// significant bits), the scale kept for after the GEMM.
fn nvfp4_emulated(op: Op, t: Tensor, o: Nvfp4Options) -> Result<Operand> {
    let device = t.device();
    let [data, scale, global] = k::nvfp4_quantize(op, t, o)?;
    let unit = aten::ones_like(op, &global)?;
    let values = k::nvfp4_dequantize(op, data, scale, unit, dense_dtype(device))?;
    Ok(Operand::DenseScaled { values, global })
}

/// `t` (rows, K), contiguous, quantized along its last dim K.
fn along_last(op: Op, recipe: Recipe, form: Form, role: Role, t: Tensor, seed: u64, hadamard: bool) -> Result<Operand> {
    check_form(op, recipe, form)?;
    let device = t.device();
    match (form, recipe) {
        (Form::Dense, _) | (_, Recipe::Bf16) => Ok(Operand::Dense(dense(op, t)?)),
        (Form::Emulated, Recipe::Mxfp8) => {
            let (data, scale) = k::mxfp8_quantize(op, t, -1)?;
            Ok(Operand::Dense(k::mxfp8_dequantize(op, data, scale, -1, dense_dtype(device))?))
        }
        (Form::Emulated, Recipe::Fp8Block) => {
            let block = if role == Role::Weight { (128, 128) } else { (1, 128) };
            let (data, scale) = k::fp8_block_quantize(op, t, block, k::ScaleLayout::RowMajor)?;
            Ok(Operand::Dense(k::fp8_block_dequantize(op, data, scale, block, dense_dtype(device))?))
        }
        (Form::Emulated, Recipe::Nvfp4) => nvfp4_emulated(op, t, nvfp4_options(role, seed, hadamard)),
        (Form::Emulated, Recipe::Fp8Tensor) => Ok(Operand::Dense(fp8_tensor_emulated(op, t, role)?)),
        (Form::Blockwise(scaling @ ScalingType::TensorWise), _) => {
            let (data, scale) = k::fp8_tensor_quantize(op, t, fp8_tensor_elem(role), None)?;
            Ok(Operand::Blockwise { data, scale, scaling })
        }
        (Form::Blockwise(ScalingType::BlockWise128x128), _) => {
            let (data, scale) = k::fp8_block_quantize(op, t, (128, 128), k::ScaleLayout::RowMajor)?;
            let scale = scale.t(op)?;
            Ok(Operand::Blockwise { data, scale, scaling: ScalingType::BlockWise128x128 })
        }
        (Form::Blockwise(scaling), _) => {
            let (data, scale) = k::fp8_block_quantize(op, t, (1, 128), k::ScaleLayout::MMajor)?;
            Ok(Operand::Blockwise { data, scale: scale.t(op)?, scaling }) // stored M-major
        }
        (Form::Mx(scaling @ ScalingType::BlockWise1x16), _) => {
            let [data, scale, global] = k::nvfp4_quantize(op, t, nvfp4_options(role, seed, hadamard))?;
            let data = aten::view_dtype(op, data, DType::F4x2)?;
            Ok(Operand::Mx { data, scale: k::swizzle_scales(op, scale)?, global: Some(global), scaling })
        }
        (Form::Mx(scaling), _) => {
            let (data, scale) = k::mxfp8_quantize(op, t, -1)?;
            Ok(Operand::Mx { data, scale: k::swizzle_scales(op, scale)?, global: None, scaling })
        }
    }
}

/// The operand of an fprop or dgrad GEMM: `t` (rows, K), contiguous, quantized along K.
pub fn along_k(op: Op, recipe: Recipe, form: Form, role: Role, t: Tensor, seed: u64) -> Result<Operand> {
    let _time = crate::host_time::span("quantize along K");
    along_last(op, recipe, form, role, t, seed, false)
}

/// A wgrad operand: `t` (M, cols), contiguous, quantized along the token dim M and returned as the
/// (cols, M) operand (a transposed view where the backend accepts one).
pub fn along_m(op: Op, recipe: Recipe, form: Form, role: Role, t: Tensor, seed: u64) -> Result<Operand> {
    check_form(op, recipe, form)?;
    let device = t.device();
    match (form, recipe) {
        (Form::Dense, _) | (_, Recipe::Bf16) => Ok(Operand::Dense(dense(op, t)?.t(op)?)),
        (Form::Emulated, Recipe::Mxfp8) => {
            let (data, scale) = k::mxfp8_quantize(op, t, 0)?;
            Ok(Operand::Dense(k::mxfp8_dequantize(op, data, scale, 0, dense_dtype(device))?.t(op)?))
        }
        (Form::Emulated, Recipe::Fp8Block) => {
            let (data, scale) = k::fp8_block_quantize(op, t, (128, 1), k::ScaleLayout::RowMajor)?;
            Ok(Operand::Dense(k::fp8_block_dequantize(op, data, scale, (128, 1), dense_dtype(device))?.t(op)?))
        }
        (Form::Emulated, Recipe::Fp8Tensor) => Ok(Operand::Dense(fp8_tensor_emulated(op, t, role)?.t(op)?)),
        (Form::Blockwise(ScalingType::TensorWise), _) => fp8_tensor_cols(op, t, role, None),
        (Form::Blockwise(scaling), _) => {
            let (data, scale) = k::fp8_block_quantize_transposed(op, t, k::Transposed::Cols)?;
            Ok(Operand::Blockwise { data, scale: scale.t(op)?, scaling }) // stored M-major
        }
        // NVFP4's Hadamard transform runs along the quantized dim, so the operand is transposed first.
        (Form::Emulated, Recipe::Nvfp4) | (Form::Mx(_), _) => {
            let tt = aten::transpose_copy(op, &t)?;
            along_last(op, recipe, form, role, tt, seed, recipe == Recipe::Nvfp4)
        }
    }
}

/// The fprop operand `along_k(recipe, form, Role::Weight, W)` rebuilt from W's stored codes (what
/// that call quantizes W to, before the form's layout: fp8_block (N, K) E4M3 + (N/128, K/128) fp32
/// tile scales; MXFP8 (N, K) E4M3 + (N, K/32) E8M0; NVFP4 (N, K/2) packed E2M1 + (N, K/16) E4M3 +
/// the fp32 per-tensor decode scale), so a pre-quantized weight feeds the GEMM exactly the operand
/// its forward built (ops/linear/quantized_linear.rs). `data` and `scale` contiguous.
pub fn weight_from_codes(
    op: Op,
    recipe: Recipe,
    form: Form,
    data: Tensor,
    scale: Tensor,
    global: Option<Tensor>,
) -> Result<Operand> {
    check_form(op, recipe, form)?;
    let device = data.device();
    let missing = || Error::Internal { op, msg: "NVFP4 codes without their per-tensor scale".into() };
    match (form, recipe) {
        (Form::Dense, _) | (_, Recipe::Bf16) => {
            Err(Error::Internal { op, msg: format!("no stored codes for a {form:?} {recipe} operand") })
        }
        (Form::Emulated, Recipe::Mxfp8) => {
            Ok(Operand::Dense(k::mxfp8_dequantize(op, data, scale, -1, dense_dtype(device))?))
        }
        (Form::Emulated, Recipe::Fp8Block) => {
            Ok(Operand::Dense(k::fp8_block_dequantize(op, data, scale, (128, 128), dense_dtype(device))?))
        }
        (Form::Emulated, Recipe::Fp8Tensor) => {
            Ok(Operand::Dense(k::fp8_tensor_dequantize(op, data, scale, dense_dtype(device))?))
        }
        (Form::Emulated, Recipe::Nvfp4) => {
            let global = global.ok_or_else(missing)?;
            let unit = aten::ones_like(op, &global)?;
            let values = k::nvfp4_dequantize(op, data, scale, unit, dense_dtype(device))?;
            Ok(Operand::DenseScaled { values, global })
        }
        (Form::Blockwise(scaling), _) => Ok(Operand::Blockwise { data, scale: scale.t(op)?, scaling }),
        (Form::Mx(scaling @ ScalingType::BlockWise1x16), _) => {
            let data = aten::view_dtype(op, data, DType::F4x2)?;
            Ok(Operand::Mx {
                data,
                scale: k::swizzle_scales(op, scale)?,
                global: Some(global.ok_or_else(missing)?),
                scaling,
            })
        }
        (Form::Mx(scaling), _) => Ok(Operand::Mx { data, scale: k::swizzle_scales(op, scale)?, global: None, scaling }),
    }
}

/// fp8_tensor's operand of x (m, k) along K from x's codes `data` (m, k) and 0-d `scale`: exactly
/// what `along_k(Fp8Tensor, form, Role::Activation, x)` makes from x (`fp8_tensor_linear`).
pub fn fp8_tensor_from_codes(op: Op, form: Form, data: Tensor, scale: Tensor) -> Result<Operand> {
    match form {
        Form::Blockwise(scaling @ ScalingType::TensorWise) => Ok(Operand::Blockwise { data, scale, scaling }),
        Form::Emulated => {
            let device = data.device();
            Ok(Operand::Dense(k::fp8_tensor_dequantize(op, data, scale, dense_dtype(device))?))
        }
        _ => Err(Error::Internal { op, msg: format!("no {form:?} fp8_tensor operand from codes") }),
    }
}

/// fp8_tensor's wgrad operand of x from x's transposed codes `codes_t` (k, m) and 0-d `scale`:
/// exactly what `along_m(Fp8Tensor, form, Role::Activation, x)` makes from x, in its layout (the
/// emulated operand is the dequantized (m, k) seen transposed, as `along_m` lays it out, so dense
/// GEMMs accumulate in the same order).
pub fn fp8_tensor_cols_from_codes(op: Op, form: Form, codes_t: Tensor, scale: Tensor) -> Result<Operand> {
    match form {
        Form::Blockwise(ScalingType::TensorWise) => fp8_tensor_from_codes(op, form, codes_t, scale),
        Form::Emulated => {
            let device = codes_t.device();
            let bytes = aten::transpose_copy(op, &aten::view_dtype(op, codes_t, DType::U8)?)?;
            let codes = aten::view_dtype(op, bytes, DType::E4M3)?;
            Ok(Operand::Dense(k::fp8_tensor_dequantize(op, codes, scale, dense_dtype(device))?.t(op)?))
        }
        _ => Err(Error::Internal { op, msg: format!("no {form:?} fp8_tensor wgrad operand from codes") }),
    }
}

/// fp8_block's operand of x (m, k) along K from `fp8_block_quantize_rowcol(x, m_major_scales=True)`'s
/// row codes `data` (m, k) and their scales stored M-major, (k/128, m): exactly what
/// `along_k(Fp8Block, form, Role::Activation, x)` makes from x (`fp8_block_linear` given them).
pub fn fp8_block_rows_from_codes(op: Op, form: Form, data: Tensor, scale: Tensor) -> Result<Operand> {
    match form {
        Form::Blockwise(scaling @ ScalingType::BlockWise1x128) => {
            Ok(Operand::Blockwise { data, scale: scale.t(op)?, scaling })
        }
        Form::Emulated => {
            let device = data.device();
            let rows = aten::transpose_copy(op, &scale)?; // (m, k/128), row-major
            Ok(Operand::Dense(k::fp8_block_dequantize(op, data, rows, (1, 128), dense_dtype(device))?))
        }
        _ => Err(Error::Internal { op, msg: format!("no {form:?} fp8_block operand from codes") }),
    }
}

/// fp8_block's wgrad operand of x from rowcol's column codes `codes_t` (k, m) (x^T in 1x128 blocks
/// along m) and their scales stored M-major, (m/128, k): exactly what `along_m(Fp8Block, form,
/// Role::Activation, x)` makes from x, in its layout (the emulated operand is x's (128, 1)-block
/// dequantization (m, k) seen transposed, whose scales are the M-major storage itself).
pub fn fp8_block_cols_from_codes(op: Op, form: Form, codes_t: Tensor, scale: Tensor) -> Result<Operand> {
    match form {
        Form::Blockwise(scaling @ ScalingType::BlockWise1x128) => {
            Ok(Operand::Blockwise { data: codes_t, scale: scale.t(op)?, scaling })
        }
        Form::Emulated => {
            let device = codes_t.device();
            let bytes = aten::transpose_copy(op, &aten::view_dtype(op, codes_t, DType::U8)?)?;
            let codes = aten::view_dtype(op, bytes, DType::E4M3)?;
            let values = k::fp8_block_dequantize(op, codes, scale, (128, 1), dense_dtype(device))?;
            Ok(Operand::Dense(values.t(op)?))
        }
        _ => Err(Error::Internal { op, msg: format!("no {form:?} fp8_block wgrad operand from codes") }),
    }
}

/// The weight's two operands: W (N, K) along K for fprop, and W^T (K, N) along N for dgrad. Dense
/// GEMMs read W^T's operand as a transposed view of W's where they coincide (dense values and 2-D
/// blocks: fp8_block 128x128, NVFP4 16x16; docs/NUMERICS.md "Transposes"); cuBLASLt's 128x128 FP8
/// operand is made by one transposing pass over W (the same bytes and scales as transposing W's
/// FP8 copy, at a fraction of the cost of a strided 1-byte transpose); MXFP8's 1x32 blocks quantize
/// W along N (dim 0) instead, read through a transposed view.
pub fn weight_pair(op: Op, recipe: Recipe, fprop: Form, dgrad: Form, w: Tensor) -> Result<(Operand, Operand)> {
    let tensorwise = Form::Blockwise(ScalingType::TensorWise);
    if (fprop, dgrad) == (tensorwise, tensorwise) {
        // fp8_tensor: W's codes and W^T's (its codes transposed) from one pass.
        return fp8_tensor_weight_pair(op, w, None);
    }
    let f = along_k(op, recipe, fprop, Role::Weight, w.share(op)?, 0)?;
    let d = match dgrad_from_fprop(op, recipe, &f, fprop, dgrad)? {
        Some(d) => d,
        None => dgrad_alone(op, recipe, dgrad, w)?,
    };
    Ok((f, d))
}

/// The dgrad operand alone (what a backward needs): `weight_pair`'s second operand, made the same
/// way, so it is bit-identical to the pair's.
pub fn weight_dgrad(op: Op, recipe: Recipe, fprop: Form, dgrad: Form, w: Tensor) -> Result<Operand> {
    if derives_from_fprop(recipe, fprop, dgrad) {
        return Ok(weight_pair(op, recipe, fprop, dgrad, w)?.1);
    }
    dgrad_alone(op, recipe, dgrad, w)
}

/// `weight_dgrad(recipe, fprop, dgrad, W)` rebuilt from W's stored fp8_block codes (`data` (N, K)
/// E4M3, `scale` (N/128, K/128) fp32, contiguous: what `weight_from_codes` reads). A 128x128 tile's
/// codes and scale do not depend on its orientation (docs/NUMERICS.md "Transposes and layouts"), so
/// W^T's operand is the codes transposed, laid out as `weight_dgrad` lays it out (dense GEMMs'
/// accumulation may depend on the layout): a transposed view of the dequantized W where
/// `derives_from_fprop`, else the dequantized W^T (`dgrad_alone`'s emulated pass), or cuBLASLt's
/// 128x128 operand, data (K, N) and its (K/128, N/128) scales, as `dgrad_alone`'s `TileT` pass makes
/// it. fp8_block only: MXFP8's 1x32 blocks along K are not W^T's blocks along N, and NVFP4's tiles
/// carry a per-tensor scale of the whole weight.
pub fn weight_dgrad_from_codes(
    op: Op,
    recipe: Recipe,
    fprop: Form,
    dgrad: Form,
    data: Tensor,
    scale: Tensor,
) -> Result<Operand> {
    check_form(op, recipe, dgrad)?;
    let device = data.device();
    let unsupported = || Error::Internal { op, msg: format!("no {dgrad:?} {recipe} dgrad operand from stored codes") };
    if recipe != Recipe::Fp8Block {
        return Err(unsupported());
    }
    if derives_from_fprop(recipe, fprop, dgrad) {
        let f = weight_from_codes(op, recipe, fprop, data, scale, None)?;
        return f.transposed_view(op)?.ok_or_else(unsupported);
    }
    // W^T's tiles: the bytes transposed (as uint8: a plain byte copy on every device) and the
    // tile scales transposed.
    let data_t = aten::view_dtype(op, aten::transpose_copy(op, &aten::view_dtype(op, data, DType::U8)?)?, DType::E4M3)?;
    let scale_t = aten::transpose_copy(op, &scale)?;
    match dgrad {
        Form::Emulated => {
            Ok(Operand::Dense(k::fp8_block_dequantize(op, data_t, scale_t, (128, 128), dense_dtype(device))?))
        }
        Form::Blockwise(scaling @ ScalingType::BlockWise128x128) => {
            Ok(Operand::Blockwise { data: data_t, scale: scale_t.t(op)?, scaling })
        }
        _ => Err(unsupported()),
    }
}

/// Whether W^T's dense operand is a transposed view of W's (then one quantization makes both).
fn derives_from_fprop(recipe: Recipe, fprop: Form, dgrad: Form) -> bool {
    let symmetric = matches!(recipe, Recipe::Fp8Block | Recipe::Fp8Tensor | Recipe::Nvfp4 | Recipe::Bf16);
    match (fprop, dgrad) {
        (Form::Dense | Form::Emulated, Form::Dense | Form::Emulated) => symmetric || fprop == Form::Dense,
        _ => false,
    }
}

/// W^T's operand as a transposed view of W's, where `derives_from_fprop`.
fn dgrad_from_fprop(op: Op, recipe: Recipe, f: &Operand, fprop: Form, dgrad: Form) -> Result<Option<Operand>> {
    if !derives_from_fprop(recipe, fprop, dgrad) {
        return Ok(None);
    }
    f.transposed_view(op)
}

/// W^T's operand made from W on its own: along N (1x32 MXFP8 blocks, native MX/NV layouts), or
/// cuBLASLt's 128x128 FP8 blocks of W^T from one transposing pass (data (K, N); its (K/128, N/128)
/// scales, read as the (N/128, K/128) view the GEMM's B operand takes).
fn dgrad_alone(op: Op, recipe: Recipe, dgrad: Form, w: Tensor) -> Result<Operand> {
    if recipe == Recipe::Mxfp8 && dgrad == Form::Emulated {
        return along_m(op, recipe, dgrad, Role::Weight, w, 0);
    }
    if dgrad == Form::Blockwise(ScalingType::TensorWise) {
        return fp8_tensor_weight_dgrad(op, w, None);
    }
    if let Form::Blockwise(scaling @ ScalingType::BlockWise128x128) = dgrad {
        let (data, scale) = k::fp8_block_quantize_transposed(op, w, k::Transposed::TileT)?;
        return Ok(Operand::Blockwise { data, scale: scale.t(op)?, scaling });
    }
    along_k(op, recipe, dgrad, Role::Weight, aten::transpose_copy(op, &w)?, 0)
}

/// The output gradient dy (M, N) as the dgrad operand (along N) and the wgrad operand (along M),
/// each when its form is given. One pass over dy makes both where a kernel does both (MXFP8 rowcol,
/// FP8 block rowcol, FP8 tensor rowcol); stochastic rounding uses `seed` for dgrad and `seed + 1`
/// for wgrad. `dy_amax`: dy's amax where its producer computed it (fp8_tensor's rowcol pass reads
/// it instead of reducing dy; every other pass ignores it: it is only ever dy's own amax).
pub fn gradient_pair(
    op: Op,
    recipe: Recipe,
    dgrad: Option<Form>,
    wgrad: Option<Form>,
    dy: Tensor,
    dy_amax: Option<Tensor>,
    seed: u64,
) -> Result<(Option<Operand>, Option<Operand>)> {
    let _time = crate::host_time::span("quantize dy (both operands)");
    let device = dy.device();
    let seed_w = seed.wrapping_add(1);
    match (recipe, dgrad, wgrad) {
        (Recipe::Mxfp8, Some(Form::Emulated), Some(Form::Emulated)) => {
            let [rd, rs, cd, cs] = k::mxfp8_quantize_rowcol(op, dy)?;
            let rows = k::mxfp8_dequantize(op, rd, rs, -1, dense_dtype(device))?;
            let cols = k::mxfp8_dequantize(op, cd, cs, 0, dense_dtype(device))?.t(op)?;
            Ok((Some(Operand::Dense(rows)), Some(Operand::Dense(cols))))
        }
        (Recipe::Fp8Block, Some(Form::Emulated), Some(Form::Emulated)) => {
            let [rd, rs, cd, cs] = k::fp8_block_quantize_rowcol(op, dy, k::ScaleLayout::RowMajor)?;
            let rows = k::fp8_block_dequantize(op, rd, rs, (1, 128), dense_dtype(device))?;
            let cols = k::fp8_block_dequantize(op, cd, cs, (1, 128), dense_dtype(device))?;
            Ok((Some(Operand::Dense(rows)), Some(Operand::Dense(cols))))
        }
        (Recipe::Fp8Tensor, Some(Form::Blockwise(sd)), Some(Form::Blockwise(sw))) => {
            // dy's codes for dgrad and the same codes transposed for wgrad, from one pass.
            let [rd, cd, scale] =
                k::fp8_tensor_quantize_rowcol(op, dy, fp8_tensor_elem(Role::Gradient), Copies::Both, dy_amax)?;
            let rows = Operand::Blockwise { data: rd, scale: scale.share(op)?, scaling: sd };
            Ok((Some(rows), Some(Operand::Blockwise { data: cd, scale, scaling: sw })))
        }
        (Recipe::Fp8Block, Some(Form::Blockwise(sd)), Some(Form::Blockwise(sw))) => {
            // Scales stored M-major by the kernel: their .t() views are what cuBLASLt reads.
            let [rd, rs, cd, cs] = k::fp8_block_quantize_rowcol(op, dy, k::ScaleLayout::MMajor)?;
            let rows = Operand::Blockwise { data: rd, scale: rs.t(op)?, scaling: sd };
            let cols = Operand::Blockwise { data: cd, scale: cs.t(op)?, scaling: sw };
            Ok((Some(rows), Some(cols)))
        }
        _ => {
            let rows = match dgrad {
                Some(form) => Some(along_k(op, recipe, form, Role::Gradient, dy.share(op)?, seed)?),
                None => None,
            };
            let cols = match wgrad {
                Some(form) => Some(along_m(op, recipe, form, Role::Gradient, dy, seed_w)?),
                None => None,
            };
            Ok((rows, cols))
        }
    }
}

/// Refuses a form the recipe has no quantizer for (unreachable through the dispatch table).
fn check_form(op: Op, recipe: Recipe, form: Form) -> Result<()> {
    let ok = match form {
        Form::Dense | Form::Emulated => true,
        Form::Blockwise(ScalingType::TensorWise) => recipe == Recipe::Fp8Tensor,
        Form::Blockwise(_) => recipe == Recipe::Fp8Block,
        Form::Mx(s) => matches!(
            (recipe, s),
            (Recipe::Mxfp8, ScalingType::BlockWise1x32) | (Recipe::Nvfp4, ScalingType::BlockWise1x16)
        ),
    };
    if ok {
        Ok(())
    } else {
        Err(Error::Internal { op, msg: format!("no {form:?} operands for recipe {recipe}") })
    }
}
