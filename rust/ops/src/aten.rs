//! Calling ATen ops from Rust through `torch_call_dispatcher` (docs/DESIGN.md "Calling ATen ops"):
//! GEMMs (`mm`, `linear`, `_scaled_mm_v2`), dtype casts, copies and the version counter.
//!
//! Rules of the call: the stack holds every schema argument in order, defaulted ones included; every
//! argument is consumed (tensor handles, optional boxes and lists are freed by libtorch, even on
//! failure); returns come back as new owning values in `stack[0..]`. Schemas with a `Scalar`
//! argument cannot be called (the stable ABI has no Scalar encoding), which is why bias and alpha
//! epilogues are deepwell kernels (`gemm/epilogue.rs`) and not `aten::add`.

use std::ffi::CStr;

use crate::abi::{api, StableIValue, StableListHandle, EXTENSION_BUILD_VERSION};
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

/// One argument of an ATen call.
pub enum Arg {
    Tensor(Tensor),
    OptTensor(Option<Tensor>),
    Int(i64),
    Bool(bool),
    ScalarType(DType),
    OptScalarType(Option<DType>),
    /// `MemoryFormat?` / `Layout?` / `Device?` / `bool?` ... given as None.
    None,
    IntList(Vec<i64>),
    TensorList(Vec<Tensor>),
}

/// A heap box holding `v`, allocated the way libtorch frees `T?` boxes (2.13+:
/// `torch_new_stable_ivalue`; before: C++ `operator new`).
fn new_box(v: StableIValue) -> *mut StableIValue {
    let a = api();
    let mut p: *mut StableIValue = std::ptr::null_mut();
    // SAFETY: both allocators return 8 bytes suitably aligned for a u64 (or null on failure);
    // registration refused to proceed when neither exists.
    unsafe {
        if let Some(alloc) = a.torch_new_stable_ivalue {
            alloc(&mut p);
        } else if let Some(new) = a.operator_new {
            p = new(std::mem::size_of::<StableIValue>()).cast();
        }
        if !p.is_null() {
            *p = v;
        }
    }
    p
}

fn new_list(items: impl ExactSizeIterator<Item = StableIValue>) -> StableListHandle {
    let mut list: StableListHandle = std::ptr::null_mut();
    // SAFETY: valid out pointer; each push hands the element's ownership to the list.
    unsafe {
        (api().torch_new_list_reserve_size)(items.len(), &mut list);
        for v in items {
            (api().torch_list_push_back)(list, v);
        }
    }
    list
}

impl Arg {
    /// The StableIValue of this argument; ownership moves into it.
    fn encode(self) -> StableIValue {
        match self {
            Arg::Tensor(t) => t.into_raw() as StableIValue,
            Arg::OptTensor(None) | Arg::OptScalarType(None) | Arg::None => 0,
            Arg::OptTensor(Some(t)) => new_box(t.into_raw() as StableIValue) as StableIValue,
            Arg::Int(v) => v as StableIValue,
            Arg::Bool(b) => b as StableIValue,
            Arg::ScalarType(d) => d.code() as u32 as StableIValue,
            Arg::OptScalarType(Some(d)) => new_box(d.code() as u32 as StableIValue) as StableIValue,
            Arg::IntList(v) => new_list(v.into_iter().map(|i| i as StableIValue)) as StableIValue,
            Arg::TensorList(v) => new_list(v.into_iter().map(|t| t.into_raw() as StableIValue)) as StableIValue,
        }
    }
}

/// Calls `name.overload` with `args`; returns the raw return values (`returns` of them).
fn call_raw(op: Op, name: &'static CStr, overload: &CStr, args: Vec<Arg>, returns: usize) -> Result<Vec<StableIValue>> {
    let _time = crate::host_time::span_c(name);
    let mut stack: Vec<StableIValue> = args.into_iter().map(Arg::encode).collect();
    if stack.len() < returns {
        stack.resize(returns, 0);
    }
    // SAFETY: the stack holds the schema's arguments encoded for ABI 2.10, with room for the returns.
    let code = unsafe {
        (api().torch_call_dispatcher)(name.as_ptr(), overload.as_ptr(), stack.as_mut_ptr(), EXTENSION_BUILD_VERSION)
    };
    if code != 0 {
        let call = name.to_str().unwrap_or("aten op");
        return Err(Error::Torch { op, call });
    }
    stack.truncate(returns);
    Ok(stack)
}

/// Calls an op returning one tensor.
fn call(op: Op, name: &'static CStr, overload: &CStr, args: Vec<Arg>) -> Result<Tensor> {
    let out = call_raw(op, name, overload, args, 1)?;
    // SAFETY: the op's schema returns one Tensor: a new owning handle.
    unsafe { Tensor::from_raw(out[0] as _) }.ok_or(Error::Torch { op, call: name.to_str().unwrap_or("aten op") })
}

/// `aten::contiguous(t)` (t itself when already contiguous).
pub fn contiguous(op: Op, t: Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t);
    }
    // SAFETY: constant getter.
    let format = unsafe { (api().aoti_torch_memory_format_contiguous_format)() };
    call(op, c"aten::contiguous", c"", vec![Arg::Tensor(t), Arg::Int(format as i64)])
}

/// A contiguous copy of the transpose of a 2-D tensor.
pub fn transpose_copy(op: Op, t: &Tensor) -> Result<Tensor> {
    contiguous(op, t.t(op)?)
}

/// `t` converted to `dtype` (t itself when it already has it).
pub fn to_dtype(op: Op, t: Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t);
    }
    // aten::to.dtype(Tensor self, ScalarType dtype, bool non_blocking=False, bool copy=False,
    //                MemoryFormat? memory_format=None)
    let args = vec![Arg::Tensor(t), Arg::ScalarType(dtype), Arg::Bool(false), Arg::Bool(false), Arg::None];
    call(op, c"aten::to", c"dtype", args)
}

/// `a @ b` (2-D), in the operands' dtype.
pub fn mm(op: Op, a: Tensor, b: Tensor) -> Result<Tensor> {
    call(op, c"aten::mm", c"", vec![Arg::Tensor(a), Arg::Tensor(b)])
}

/// `a @ b` with an fp32 result from bf16/fp16 operands (CUDA; fp32 accumulation).
pub fn mm_dtype(op: Op, a: Tensor, b: Tensor, out: DType) -> Result<Tensor> {
    call(op, c"aten::mm", c"dtype", vec![Arg::Tensor(a), Arg::Tensor(b), Arg::ScalarType(out)])
}

/// `x @ w^T + bias` (cuBLAS fuses the bias into the GEMM's epilogue).
pub fn linear(op: Op, x: Tensor, w: Tensor, bias: Option<Tensor>) -> Result<Tensor> {
    call(op, c"aten::linear", c"", vec![Arg::Tensor(x), Arg::Tensor(w), Arg::OptTensor(bias)])
}

/// `t.narrow(dim, start, length)`: a view of `length` indices of `dim` from `start`.
pub fn narrow(op: Op, t: &Tensor, dim: i64, start: i64, length: i64) -> Result<Tensor> {
    let args = vec![Arg::Tensor(t.share(op)?), Arg::Int(dim), Arg::Int(start), Arg::Int(length)];
    call(op, c"aten::narrow", c"", args)
}

/// `torch.cat(tensors, dim)`.
pub fn cat(op: Op, tensors: Vec<Tensor>, dim: i64) -> Result<Tensor> {
    call(op, c"aten::cat", c"", vec![Arg::TensorList(tensors), Arg::Int(dim)])
}

/// `torch.stack(tensors, dim)`.
pub fn stack(op: Op, tensors: Vec<Tensor>, dim: i64) -> Result<Tensor> {
    call(op, c"aten::stack", c"", vec![Arg::TensorList(tensors), Arg::Int(dim)])
}

/// `ones_like(t)`: a tensor of ones with t's shape, dtype and device.
pub fn ones_like(op: Op, t: &Tensor) -> Result<Tensor> {
    // aten::ones_like(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None,
    //                 bool? pin_memory=None, MemoryFormat? memory_format=None)
    let args = vec![Arg::Tensor(t.share(op)?), Arg::None, Arg::None, Arg::None, Arg::None, Arg::None];
    call(op, c"aten::ones_like", c"", args)
}

/// One operand's scales for `_scaled_mm_v2`: the tensors, their `ScalingType` codes and their
/// `SwizzleType` codes (0 = none, 1 = SWIZZLE_32_4_4).
pub struct Scales {
    pub tensors: Vec<Tensor>,
    pub recipes: Vec<i64>,
    pub swizzles: Vec<i64>,
}

/// `aten::_scaled_mm_v2(a, b, ...)`: cuBLASLt's scaled GEMM (a row-major, b column-major).
pub fn scaled_mm_v2(
    op: Op,
    a: Tensor,
    b: Tensor,
    sa: Scales,
    sb: Scales,
    bias: Option<Tensor>,
    out: DType,
) -> Result<Tensor> {
    // aten::_scaled_mm_v2(Tensor self, Tensor mat2, Tensor[] scale_a, int[] recipe_a, int[] swizzle_a,
    //   Tensor[] scale_b, int[] recipe_b, int[] swizzle_b, Tensor? bias, ScalarType? out_dtype,
    //   int[] contraction_dim=[], bool use_fast_accum=False)
    let args = vec![
        Arg::Tensor(a),
        Arg::Tensor(b),
        Arg::TensorList(sa.tensors),
        Arg::IntList(sa.recipes),
        Arg::IntList(sa.swizzles),
        Arg::TensorList(sb.tensors),
        Arg::IntList(sb.recipes),
        Arg::IntList(sb.swizzles),
        Arg::OptTensor(bias),
        Arg::OptScalarType(Some(out)),
        Arg::IntList(Vec::new()),
        Arg::Bool(false),
    ];
    call(op, c"aten::_scaled_mm_v2", c"", args)
}

/// The tensor's version counter (bumped by every in-place write), or None when it has none
/// (inference tensors).
pub fn version(op: Op, t: &Tensor) -> Option<i64> {
    let handle = t.share(op).ok()?;
    call_raw(op, c"aten::_version", c"", vec![Arg::Tensor(handle)], 1).ok().map(|v| v[0] as i64)
}

/// `aten::alias(t)`: a new tensor (its own TensorImpl) on t's storage, sharing t's version counter.
/// Unlike another handle to `t`, it keeps the storage even when `t.data = ...` swaps t's.
pub fn alias(op: Op, t: &Tensor) -> Result<Tensor> {
    call(op, c"aten::alias", c"", vec![Arg::Tensor(t.share(op)?)])
}

/// The same bytes seen as another dtype of the same element size (`Tensor.view(dtype)`).
pub fn view_dtype(op: Op, t: Tensor, dtype: DType) -> Result<Tensor> {
    call(op, c"aten::view", c"dtype", vec![Arg::Tensor(t), Arg::ScalarType(dtype)])
}
