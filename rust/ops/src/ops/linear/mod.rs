//! `deepwell.scaled_linear` and `deepwell.scaled_linear_backward`: a linear layer `y = x W^T + b`
//! whose three GEMMs run in a recipe's precision. Schemas, fake kernels and the autograd formula:
//! torch_ops/deepwell/ops/linear.py. The kernel (which GEMM runs each pass on which device) is
//! chosen by deepwell_core::policy::gemm_backend, the table documented there and in docs/OPS.md "Linear layers".
//!
//! The operands and GEMMs come from the shared quantized-GEMM layer (rust/ops/src/gemm/); this
//! module validates the layer's arguments, runs its three passes, and owns `weight_cache.rs` (when
//! a weight's quantized operands may be reused).
//!
//! Every pass is `out = A @ B^T` with A (rows, K) and B (cols, K) quantized along the shared K:
//!
//! | pass | A | B | K |
//! |---|---|---|---|
//! | fprop | x (M, in) | W (out, in) | in |
//! | dgrad | dy (M, out) | W^T (in, out) | out |
//! | wgrad | dy^T (out, M) | x^T (in, M) | M (tokens) |

pub mod expert_weight;
pub mod fp8_block_linear;
pub mod fp8_block_mlp;
pub mod fp8_tensor_linear;
pub mod quantized_linear;
pub mod weight_cache;

use std::sync::atomic::{AtomicU64, Ordering};

use deepwell_core::policy::{gemm_backend, Arch, GemmChoice, GemmShape, Pass, Recipe, ScalingType};
use serde_json::Value;

use crate::aten;
use crate::check;
use crate::dtype::{DType, Device};
use crate::entry::{fields, Answer, Entries};
use crate::error::{Error, Op, Result};
use crate::gemm::{self, quantize, Form, Role};
use crate::kernel::{one_body, Kernel};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;
use weight_cache::{Want, WeightOperands};

pub static FORWARD: OpSpec = OpSpec {
    name: "scaled_linear",
    args: &[
        ("x", Kind::Tensor),
        ("weight", Kind::Tensor),
        ("bias", Kind::OptTensor),
        ("recipe", Kind::Str),
        ("seed", Kind::OptInt),
    ],
    returns: 1,
};

/// The MXFP8 case of `scaled_linear`, as its own op (the name users call directly).
pub static MXFP8_FORWARD: OpSpec = OpSpec {
    name: "mxfp8_linear",
    args: &[("x", Kind::Tensor), ("weight", Kind::Tensor), ("bias", Kind::OptTensor)],
    returns: 1,
};

pub static BACKWARD: OpSpec = OpSpec {
    name: "scaled_linear_backward",
    args: &[
        ("grad_out", Kind::Tensor),
        ("x", Kind::Tensor),
        ("weight", Kind::Tensor),
        ("recipe", Kind::Str),
        ("seed", Kind::OptInt),
        ("need_input", Kind::Bool),
        ("need_weight", Kind::Bool),
    ],
    returns: 2,
};

/// One body for both devices: the device-specific work happens in the quantizers and GEMMs.
pub fn kernels() -> Vec<Kernel> {
    let mut v =
        [one_body!(FORWARD, forward), one_body!(MXFP8_FORWARD, mxfp8_forward), one_body!(BACKWARD, backward)].concat();
    v.extend(quantized_linear::kernels());
    v.extend(expert_weight::kernels());
    v.extend(fp8_tensor_linear::kernels());
    v.extend(fp8_block_linear::kernels());
    v.extend(fp8_block_mlp::kernels());
    v
}

// ---------------------------------------------------------------------------------------------
// Stochastic-rounding seeds

static SEED_BASE: AtomicU64 = AtomicU64::new(0x5EED_DEE9_0000_0000);
static SEED_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh seed per backward call that was given none: `deepwell.manual_seed(s)` makes the
/// sequence reproducible. (Under CUDA-graph replay the seed captured at record time repeats.)
fn next_seed() -> u64 {
    let n = SEED_COUNTER.fetch_add(1, Ordering::Relaxed);
    SEED_BASE.load(Ordering::Relaxed) ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// `manual_seed`: `{"seed": u64}` restarts the seed sequence of stochastic rounding.
pub fn manual_seed_entry(req: &Value) -> Answer {
    let seed = fields::get(req, "seed")?.as_u64().ok_or("field 'seed' must be an integer in [0, 2^64)")?;
    SEED_BASE.store(seed, Ordering::Relaxed);
    SEED_COUNTER.store(0, Ordering::Relaxed);
    Ok(Value::Null)
}

// ---------------------------------------------------------------------------------------------
// Validation

/// What every pass of a validated call needs besides the weight: x seen as (m, k), the weight's
/// (n, k), and where it runs. `scaled_linear` holds the weight itself (`Layer`),
/// `quantized_linear_backward` its stored codes.
pub(super) struct Passes {
    /// The call's x; for `fp8_tensor_linear_backward`, x's saved transposed codes (k, m).
    pub x: Tensor,
    pub recipe: Recipe,
    pub device: Device,
    pub arch: Arch,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// x's shape with its last dim replaced by n.
    pub out_shape: Vec<i64>,
}

impl Passes {
    pub fn choice(&self, pass: Pass) -> GemmChoice {
        let _time = crate::host_time::span("gemm choice (policy)");
        gemm_backend(self.recipe, self.arch, pass, GemmShape::linear(pass, self.m, self.k, self.n))
    }

    /// x as a contiguous (m, k) tensor.
    pub fn x_2d(&self, op: Op) -> Result<Tensor> {
        aten::contiguous(op, self.x.share(op)?)?.reshape_contiguous(op, &[self.m as i64, self.k as i64])
    }

    /// x's shape: the output's with its last dim k (dx has it).
    pub fn x_shape(&self) -> Vec<i64> {
        let mut s = self.out_shape.clone();
        *s.last_mut().unwrap_or(&mut 0) = self.k as i64;
        s
    }

    /// The wgrad operand of x quantized along the tokens (`along_m`), what the backward of
    /// `scaled_linear` and `quantized_linear` reads.
    pub fn x_wgrad(&self, op: Op, form: Form, seed: u64) -> Result<gemm::Operand> {
        quantize::along_m(op, self.recipe, form, Role::Activation, self.x_2d(op)?, seed.wrapping_add(2))
    }
}

/// A validated `scaled_linear` call: its passes and the weight (n, k).
struct Layer {
    p: Passes,
    weight: Tensor,
}

/// Where a call's GEMMs dispatch: the CUDA device's own arch, the CPU's table, or, for CPU tensors
/// with a recipe like `"fp8_block@sm_90"`, the named GPU's table: its native GEMM arguments are
/// built and run through a CPU model of `_scaled_mm_v2` (`gemm/scaled_mm_model.rs`), so what a GPU
/// we do not have computes is reproduced (and tested) on any machine.
fn arch_of(op: Op, device: Device, modelled: Option<Arch>, recipe_arg: &str) -> Result<Arch> {
    match (device, modelled) {
        (Device::Cpu, Some(arch)) => Ok(arch),
        (Device::Cpu, None) => Ok(Arch::CPU),
        (_, Some(_)) => Err(Error::arg(
            op,
            "recipe",
            "name a GPU to model after '@' only for CPU tensors",
            check::quoted(recipe_arg),
        )),
        (Device::Cuda(i), None) => {
            let (major, minor) = crate::cuda::device(op, i)?.capability();
            Ok(Arch::sm(major, minor))
        }
        (other, None) => Err(Error::Unsupported { op, what: format!("no kernels for {other}") }),
    }
}

/// `"recipe"` or `"recipe@arch"` (see `arch_of`).
fn parse_recipe(op: Op, s: &str) -> Result<(Recipe, Option<Arch>)> {
    let (name, arch) = match s.split_once('@') {
        Some((name, arch)) => (name, Some(arch)),
        None => (s, None),
    };
    let recipe = check::parse(op, "recipe", name, "'mxfp8', 'nvfp4', 'fp8_block', 'fp8_tensor', 'bf16'")?;
    let arch = arch
        .map(|a| {
            a.parse::<Arch>().map_err(|_| {
                Error::arg(op, "recipe", "name a known GPU after '@' (e.g. 'fp8_block@sm_90')", check::quoted(s))
            })
        })
        .transpose()?;
    Ok((recipe, arch))
}

impl Layer {
    fn new(op: Op, x: Tensor, weight: Tensor, others: &[(&'static str, &Tensor)], recipe: &str) -> Result<Layer> {
        let _time = crate::host_time::span("validate layer");
        let recipe_arg = recipe;
        let (recipe, modelled) = parse_recipe(op, recipe_arg)?;
        check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
        check::dtype_in(op, "weight", &weight, &check::FLOAT_INPUTS)?;
        let mut tensors = vec![("x", &x), ("weight", &weight)];
        tensors.extend_from_slice(others);
        let backend = if x.device() == Device::Cpu { check::Backend::Cpu } else { check::Backend::Cuda };
        let device = check::same_device(op, backend, &tensors)?;
        check::non_empty(op, "x", &x, 1)?;
        check::ndim(op, "weight", &weight, 2, "(out_features, in_features)")?;
        check::non_empty(op, "weight", &weight, 2)?;
        let (n, k) = (weight.sizes()[0] as usize, weight.sizes()[1] as usize);
        let x_k = *x.sizes().last().unwrap_or(&0) as usize;
        if x_k != k {
            return Err(Error::Mismatch {
                op,
                msg: format!(
                    "x has {x_k} features (shape {}) but weight has in_features {k} (shape {})",
                    check::shape_str(x.sizes()),
                    check::shape_str(weight.sizes())
                ),
            });
        }
        // Both weight dims are some pass's K (in for fprop, out for dgrad); fp8_block's 128x128
        // weight tiles and NVFP4's 16x16 ones need both anyway.
        if let Some(block) = recipe.block_k() {
            let why = format!("{recipe} quantizes along in_features in blocks of {block}");
            check::divisible(op, "weight", &weight, 1, block, &why)?;
            let why = format!("{recipe} quantizes W along out_features for dgrad in blocks of {block}");
            check::divisible(op, "weight", &weight, 0, block, &why)?;
        }
        let m = x.numel() / k;
        let mut out_shape = x.sizes().to_vec();
        *out_shape.last_mut().unwrap_or(&mut 0) = n as i64;
        let arch = arch_of(op, device, modelled, recipe_arg)?;
        Ok(Layer { p: Passes { x, recipe, device, arch, m, k, n, out_shape }, weight })
    }

    /// The weight's fprop or dgrad operand: made for this call, or reused inside a reuse scope
    /// (`weight_cache.rs` says exactly when).
    fn weight_operand(&self, op: Op, want: Want) -> Result<gemm::Operand> {
        self.weight_operand_from(op, want, None)
    }

    /// `weight_operand`, given W's amax (the fp8_tensor ops' `weight_amax`: reduced once per step
    /// in the backend's graph, read by the forward and the backward). Only the tensor-wise forms
    /// (sm_89+) read it; the emulated ones reduce their own, the same value.
    fn weight_operand_from(&self, op: Op, want: Want, amax: Option<Tensor>) -> Result<gemm::Operand> {
        let fprop = Form::of(self.p.choice(Pass::Fprop).backend).1;
        let dgrad = Form::of(self.p.choice(Pass::Dgrad).backend).1;
        let tensorwise = Form::Blockwise(ScalingType::TensorWise);
        let amax = amax.filter(|_| (fprop, dgrad) == (tensorwise, tensorwise));
        let (recipe, w) = (self.p.recipe, &self.weight);
        let contiguous = || aten::contiguous(op, w.share(op)?);
        let given = || amax.as_ref().map(|a| a.share(op)).transpose();
        let make_one = || match (want, amax.is_some()) {
            (Want::Fprop, true) => quantize::fp8_tensor_weight_fprop(op, contiguous()?, given()?),
            (Want::Dgrad, true) => quantize::fp8_tensor_weight_dgrad(op, contiguous()?, given()?),
            (Want::Fprop, false) => quantize::along_k(op, recipe, fprop, Role::Weight, contiguous()?, 0),
            (Want::Dgrad, false) => quantize::weight_dgrad(op, recipe, fprop, dgrad, contiguous()?),
        };
        let make_pair = || {
            let (fprop, dgrad) = if amax.is_some() {
                quantize::fp8_tensor_weight_pair(op, contiguous()?, given()?)?
            } else {
                quantize::weight_pair(op, recipe, fprop, dgrad, contiguous()?)?
            };
            Ok(WeightOperands { fprop, dgrad })
        };
        weight_cache::operand(op, w, recipe, (fprop, dgrad), want, make_one, make_pair)
    }
}

// ---------------------------------------------------------------------------------------------
// The kernels

fn forward(a: &mut Args) -> Result<Vec<Tensor>> {
    let (x, weight, bias) = (a.tensor("x")?, a.tensor("weight")?, a.opt_tensor("bias")?);
    let recipe = a.str("recipe")?;
    let _seed = a.opt_int("seed")?; // used by the backward only
    run_forward(a.op(), x, weight, bias, &recipe)
}

fn mxfp8_forward(a: &mut Args) -> Result<Vec<Tensor>> {
    let (x, weight, bias) = (a.tensor("x")?, a.tensor("weight")?, a.opt_tensor("bias")?);
    run_forward(a.op(), x, weight, bias, "mxfp8")
}

fn run_forward(op: Op, x: Tensor, weight: Tensor, bias: Option<Tensor>, recipe: &str) -> Result<Vec<Tensor>> {
    let mut others = Vec::new();
    if let Some(b) = &bias {
        others.push(("bias", b));
    }
    let layer = Layer::new(op, x, weight, &others, recipe)?;
    let p = &layer.p;
    check_bias(op, bias.as_ref(), p.n as i64)?;
    let backend = p.choice(Pass::Fprop).backend;
    let xa = quantize::along_k(op, p.recipe, Form::of(backend).0, Role::Activation, p.x_2d(op)?, 0)?;
    let wb = layer.weight_operand(op, Want::Fprop)?;
    let y = gemm::run::run(op, backend, xa, wb, bias, p.x.dtype())?;
    Ok(vec![aten::contiguous(op, y)?.reshape_contiguous(op, &p.out_shape)?])
}

/// A bias, when given, is a float vector of the layer's out_features `n`.
fn check_bias(op: Op, bias: Option<&Tensor>, n: i64) -> Result<()> {
    if let Some(b) = bias {
        check::dtype_in(op, "bias", b, &check::FLOAT_INPUTS)?;
        check::shape_eq(op, "bias", b, &[n])?;
    }
    Ok(())
}

/// `recipe_arg` names `want`, optionally '@' a GPU to model (`"fp8_block@sm_90"` on CPU tensors): the
/// ops made for one recipe (fp8_tensor_linear, fp8_block_linear) refuse the others.
fn expect_recipe(op: Op, recipe: Recipe, want: Recipe, recipe_arg: &str) -> Result<()> {
    if recipe == want {
        return Ok(());
    }
    Err(Error::arg(op, "recipe", format!("be '{want}' (optionally '@' a GPU to model)"), check::quoted(recipe_arg)))
}

/// x's FP8 operands as a `fp8_*_linear` call gives them in its optional arguments: none (the
/// forward quantizes x into both copies itself and returns the column copy for autograd to keep),
/// the row copy alone (the backward makes the column copy from x), or both (made once beforehand for
/// every layer reading x). `R` and `C`: how many tensors make each copy (codes, and scales where
/// the copy has its own).
pub(super) enum Given<const R: usize, const C: usize> {
    Nothing,
    Rows([Tensor; R]),
    Both([Tensor; R], [Tensor; C]),
}

impl<const R: usize, const C: usize> Given<R, C> {
    /// The optional arguments named `rows` (the row copy's) and `cols` (the column copy's): each copy
    /// whole or absent, the column copy only with the row copy.
    pub fn parse(a: &mut Args, rows: [&'static str; R], cols: [&'static str; C]) -> Result<Self> {
        match (copy(a, rows)?, copy(a, cols)?) {
            (None, None) => Ok(Given::Nothing),
            (Some(r), None) => Ok(Given::Rows(r)),
            (Some(r), Some(c)) => Ok(Given::Both(r, c)),
            (None, Some(_)) => {
                let why = format!("be given with '{}' (x's column copy comes with its row copy)", cols[0]);
                Err(Error::arg(a.op(), rows[0], why, "None"))
            }
        }
    }

    /// The given tensors by argument name (for the device check).
    pub fn named(&self, rows: [&'static str; R], cols: [&'static str; C]) -> Vec<(&'static str, &Tensor)> {
        let (r, c): (&[Tensor], &[Tensor]) = match self {
            Given::Nothing => (&[], &[]),
            Given::Rows(r) => (r, &[]),
            Given::Both(r, c) => (r, c),
        };
        rows.into_iter().zip(r).chain(cols.into_iter().zip(c)).collect()
    }
}

/// A `fp8_*_linear` forward's arguments x, weight, bias, recipe and x's copies (`rows`, `cols`, as
/// `Given::parse` reads them), checked: the recipe names `want`, x fits the weight and the bias,
/// and every tensor is on one device (each op checks its copies' dtypes and shapes). Returns the
/// layer, the bias and the copies.
fn given_layer<const R: usize, const C: usize>(
    a: &mut Args,
    want: Recipe,
    rows: [&'static str; R],
    cols: [&'static str; C],
) -> Result<(Layer, Option<Tensor>, Given<R, C>)> {
    let op = a.op();
    let (x, weight, bias) = (a.tensor("x")?, a.tensor("weight")?, a.opt_tensor("bias")?);
    let recipe_arg = a.str("recipe")?;
    let given = Given::parse(a, rows, cols)?;
    expect_recipe(op, parse_recipe(op, &recipe_arg)?.0, want, &recipe_arg)?;
    let mut others = given.named(rows, cols);
    others.extend(bias.iter().map(|b| ("bias", b)));
    let layer = Layer::new(op, x, weight, &others, &recipe_arg)?;
    check_bias(op, bias.as_ref(), layer.p.n as i64)?;
    Ok((layer, bias, given))
}

/// A `fp8_*_linear` forward's outputs: y (m, n) shaped like x with n features, then x's column
/// copy made here as uint8 codes and fp32 scales (`made`), or two empty tensors of those dtypes
/// where x's copies were given.
fn forward_outputs(op: Op, p: &Passes, y: Tensor, made: Option<[Tensor; 2]>) -> Result<Vec<Tensor>> {
    let [codes_t, scale_t] = match made {
        Some(made) => made,
        None => [unused(op, DType::U8, p.device)?, unused(op, DType::F32, p.device)?],
    };
    Ok(vec![aten::contiguous(op, y)?.reshape_contiguous(op, &p.out_shape)?, codes_t, scale_t])
}

/// A `fp8_*_linear_backward`'s arguments, read and checked by `saved_layer`: grad_out, x's saved
/// transposed codes `x_codes_t`, their scales (the argument `scale_arg`, of shape
/// `scale_shape(m, k)`), the weight, the recipe (naming `want`), need_input and need_weight.
struct Saved {
    layer: Layer,
    dy: Tensor,
    scale: Tensor,
    /// (need_input, need_weight).
    grads: (bool, bool),
}

impl Saved {
    fn parse(
        a: &mut Args,
        scale_arg: &'static str,
        want: Recipe,
        scale_shape: impl Fn(i64, i64) -> Vec<i64>,
    ) -> Result<Saved> {
        let op = a.op();
        let (dy, codes, scale, weight) =
            (a.tensor("grad_out")?, a.tensor("x_codes_t")?, a.tensor(scale_arg)?, a.tensor("weight")?);
        let recipe_arg = a.str("recipe")?;
        let grads = (a.bool("need_input")?, a.bool("need_weight")?);
        let layer = saved_layer(
            op,
            &dy,
            ("x_codes_t", codes),
            (scale_arg, &scale),
            ("weight", weight),
            (&recipe_arg, want),
            scale_shape,
        )?;
        Ok(Saved { layer, dy, scale, grads })
    }
}

/// One copy of x's operands from the optional arguments `names`: all given, or none.
fn copy<const N: usize>(a: &mut Args, names: [&'static str; N]) -> Result<Option<[Tensor; N]>> {
    let mut got = Vec::with_capacity(N);
    for name in names {
        got.push(a.opt_tensor(name)?);
    }
    if got.iter().all(Option::is_none) {
        return Ok(None);
    }
    if let Some(missing) = names.iter().zip(&got).find_map(|(n, t)| t.is_none().then_some(*n)) {
        let given: Vec<_> =
            names.iter().zip(&got).filter(|(_, t)| t.is_some()).map(|(n, _)| format!("'{n}'")).collect();
        let why = format!("be given with {} (a copy of x comes whole: its codes and their scales)", given.join(", "));
        return Err(Error::arg(a.op(), missing, why, "None"));
    }
    let tensors: Vec<Tensor> = got.into_iter().flatten().collect();
    Ok(tensors.try_into().ok())
}

/// A backward's layer from x's saved transposed codes (the argument's name and tensor: (k, m), E4M3
/// or its bytes as uint8) and their fp32 scales (`scale`: the argument's name and tensor, of shape
/// `scale_shape(m, k)`), checked against the weight (name and tensor, (n, k)) and grad_out (..., n): the layer's passes
/// with the codes standing for x. `recipe`: the argument and the recipe it must name.
fn saved_layer(
    op: Op,
    dy: &Tensor,
    (codes_arg, codes): (&'static str, Tensor),
    (scale_arg, scale): (&'static str, &Tensor),
    (weight_arg, weight): (&'static str, Tensor),
    (recipe_arg, want): (&str, Recipe),
    scale_shape: impl Fn(i64, i64) -> Vec<i64>,
) -> Result<Layer> {
    let (recipe, modelled) = parse_recipe(op, recipe_arg)?;
    expect_recipe(op, recipe, want, recipe_arg)?;
    check::dtype_in(op, "grad_out", dy, &check::FLOAT_INPUTS)?;
    check::dtype_in(op, weight_arg, &weight, &check::FLOAT_INPUTS)?;
    check::dtype_in(op, codes_arg, &codes, &[DType::U8, DType::E4M3])?;
    check::dtype_in(op, scale_arg, scale, &[DType::F32])?;
    let tensors = [("grad_out", dy), (codes_arg, &codes), (scale_arg, scale), (weight_arg, &weight)];
    let device = check::same_device(op, check::Backend::of(op, dy.device())?, &tensors)?;
    if weight.dim() != 2 || codes.dim() != 2 {
        let (arg, t) = if weight.dim() != 2 { (weight_arg, &weight) } else { (codes_arg, &codes) };
        return Err(Error::arg(op, arg, "be 2-d", format!("a {}-d tensor", t.dim())));
    }
    check::non_empty(op, weight_arg, &weight, 2)?;
    check::non_empty(op, "grad_out", dy, 1)?;
    let (n, k) = (weight.sizes()[0], weight.sizes()[1]);
    if dy.sizes().last() != Some(&n) {
        return Err(Error::Mismatch {
            op,
            msg: format!(
                "grad_out has {} features (shape {}) but {weight_arg} has out_features {n}",
                dy.sizes().last().unwrap_or(&0),
                check::shape_str(dy.sizes())
            ),
        });
    }
    let m = dy.numel() as i64 / n.max(1);
    check::shape_eq(op, codes_arg, &codes, &[k, m])?;
    check::shape_eq(op, scale_arg, scale, &scale_shape(m, k))?;
    let arch = arch_of(op, device, modelled, recipe_arg)?;
    let (m, k, n) = (m as usize, k as usize, n as usize);
    let out_shape = dy.sizes().to_vec();
    Ok(Layer { p: Passes { x: codes, recipe, device, arch, m, k, n, out_shape }, weight })
}

/// An empty tensor standing for a gradient nobody asked for (the autograd formula drops it).
fn unused(op: Op, dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::empty(op, &[0], dtype, device)
}

fn backward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (dy, x, weight) = (a.tensor("grad_out")?, a.tensor("x")?, a.tensor("weight")?);
    let recipe = a.str("recipe")?;
    let seed = a.opt_int("seed")?.map_or_else(next_seed, |s| s as u64);
    let (need_x, need_w) = (a.bool("need_input")?, a.bool("need_weight")?);
    let layer = Layer::new(op, x, weight, &[("grad_out", &dy)], &recipe)?;
    let (p, w_dtype) = (&layer.p, layer.weight.dtype());
    let grads = (need_x, need_w);
    let dgrad_weight = || layer.weight_operand(op, Want::Dgrad);
    run_backward(op, p, (dy, None), seed, grads, (p.x.dtype(), w_dtype), dgrad_weight, |form| p.x_wgrad(op, form, seed))
}

/// The backward passes of a validated call: dy (checked against the call; with its amax where its
/// producer computed it) quantized once for both GEMMs (`gradient_pair`), dgrad `dx = dy W`
/// against `dgrad_weight()` (the weight's dgrad operand, made only when dx is wanted) in
/// `x_dtype`, wgrad `dW = dy^T x` from dy and `x_wgrad(form)` (x's operand in the wgrad's form,
/// made only when dW is wanted) in `w_dtype`.
/// `scaled_linear_backward`, `quantized_linear_backward` and `fp8_tensor_linear_backward` all run
/// it, so for the same operands they run the same passes bit for bit.
#[allow(clippy::too_many_arguments)] // the passes' inputs, each made lazily by its caller
pub(super) fn run_backward(
    op: Op,
    p: &Passes,
    (dy, dy_amax): (Tensor, Option<Tensor>),
    seed: u64,
    (need_x, need_w): (bool, bool),
    (x_dtype, w_dtype): (DType, DType),
    dgrad_weight: impl FnOnce() -> Result<gemm::Operand>,
    x_wgrad: impl FnOnce(Form) -> Result<gemm::Operand>,
) -> Result<Vec<Tensor>> {
    check::dtype_in(op, "grad_out", &dy, &check::FLOAT_INPUTS)?;
    check::shape_eq(op, "grad_out", &dy, &p.out_shape)?;
    let dy2 = aten::contiguous(op, dy)?.reshape_contiguous(op, &[p.m as i64, p.n as i64])?;
    let dy_operands = |dgrad, wgrad| quantize::gradient_pair(op, p.recipe, dgrad, wgrad, dy2, dy_amax, seed);
    backward_passes(op, p, dy_operands, (need_x, need_w), (x_dtype, w_dtype), dgrad_weight, x_wgrad)
}

/// `run_backward`'s two GEMMs from dy's operands in the forms each GEMM reads,
/// `dy_operands(dgrad form, wgrad form) -> (rows, cols)` (a form given only where its gradient is
/// wanted): dgrad `dx = dy W` in `x_dtype` (shaped like x), wgrad `dW = dy^T x` in `w_dtype`.
/// `fp8_block_swiglu_mlp_backward` runs it on dy's operands made by its fused SwiGLU pass.
#[allow(clippy::too_many_arguments)] // the passes' inputs, each made lazily by its caller
pub(super) fn backward_passes(
    op: Op,
    p: &Passes,
    dy_operands: impl FnOnce(Option<Form>, Option<Form>) -> Result<(Option<gemm::Operand>, Option<gemm::Operand>)>,
    (need_x, need_w): (bool, bool),
    (x_dtype, w_dtype): (DType, DType),
    dgrad_weight: impl FnOnce() -> Result<gemm::Operand>,
    x_wgrad: impl FnOnce(Form) -> Result<gemm::Operand>,
) -> Result<Vec<Tensor>> {
    let (dgrad_backend, wgrad_backend) = (p.choice(Pass::Dgrad).backend, p.choice(Pass::Wgrad).backend);
    let dgrad = need_x.then(|| Form::of(dgrad_backend).0);
    let wgrad = need_w.then(|| Form::of(wgrad_backend));
    let (dy_rows, dy_cols) = dy_operands(dgrad, wgrad.map(|f| f.0))?;

    let dx = match dy_rows {
        Some(da) => {
            let dx = gemm::run::run(op, dgrad_backend, da, dgrad_weight()?, None, x_dtype)?;
            aten::contiguous(op, dx)?.reshape_contiguous(op, &p.x_shape())?
        }
        None => unused(op, x_dtype, p.device)?,
    };
    let dw = match (dy_cols, wgrad) {
        (Some(da), Some((_, x_form))) => {
            aten::contiguous(op, gemm::run::run(op, wgrad_backend, da, x_wgrad(x_form)?, None, w_dtype)?)?
        }
        _ => unused(op, w_dtype, p.device)?,
    };
    Ok(vec![dx, dw])
}

/// This module's entries of the C API (`capi.rs`): name, handler, request -> answer.
pub const ENTRIES: Entries = &[("manual_seed", manual_seed_entry, "{seed: u64} -> null")];
