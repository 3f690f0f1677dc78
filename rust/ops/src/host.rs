//! Host (CPU) views of tensor memory for the reference kernels: typed contiguous slices of inputs
//! (gathered into a buffer when the input is strided) and of freshly allocated outputs.

use std::borrow::Cow;

use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

/// A float input as a contiguous, row-major slice of its own element type.
pub enum FloatSlice<'a> {
    F32(Cow<'a, [f32]>),
    BF16(Cow<'a, [bf16]>),
    F16(Cow<'a, [f16]>),
}

/// Runs `$body` with `$s: &[T]` bound to the slice, for whichever float type it holds.
macro_rules! with_floats {
    ($view:expr, $s:ident => $body:expr) => {
        match $view {
            $crate::host::FloatSlice::F32(c) => {
                let $s: &[f32] = &c;
                $body
            }
            $crate::host::FloatSlice::BF16(c) => {
                let $s: &[half::bf16] = &c;
                $body
            }
            $crate::host::FloatSlice::F16(c) => {
                let $s: &[half::f16] = &c;
                $body
            }
        }
    };
}
pub(crate) use with_floats;

/// A mutable output slice of a float dtype.
pub enum FloatSliceMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

macro_rules! with_floats_mut {
    ($view:expr, $s:ident => $body:expr) => {
        match $view {
            $crate::host::FloatSliceMut::F32($s) => $body,
            $crate::host::FloatSliceMut::BF16($s) => $body,
            $crate::host::FloatSliceMut::F16($s) => $body,
        }
    };
}
pub(crate) use with_floats_mut;

/// An empty buffer with room for `n` elements, or an error instead of the abort of `with_capacity`
/// (a broadcast view such as `randn(1, 32).expand(2**28, 32)` is small but gathers to 32 GiB).
pub fn buffer<T>(op: Op, n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::Alloc {
        op,
        what: format!("a host buffer for {what}"),
        bytes: n as u128 * std::mem::size_of::<T>() as u128,
    })?;
    Ok(v)
}

/// `n` copies of `value` in a buffer from [`buffer`]: an error, not an abort, when the host cannot
/// hold them.
pub fn filled<T: Clone>(op: Op, n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = buffer(op, n, what)?;
    v.resize(n, value); // within the reserved capacity: no reallocation
    Ok(v)
}

/// Copies a strided tensor into a row-major buffer.
///
/// # Safety
/// `base` must address element 0 of a tensor with these sizes/strides whose elements are `T`.
unsafe fn gather<T: Copy>(op: Op, base: *const T, sizes: &[i64], strides: &[i64]) -> Result<Vec<T>> {
    let numel: i64 = sizes.iter().product();
    let mut out = buffer(op, numel as usize, "a contiguous copy of a strided input")?;
    let mut index = vec![0i64; sizes.len()];
    let mut offset = 0i64;
    for _ in 0..numel {
        // SAFETY: `offset` is the strided offset of `index`, inside the tensor by construction.
        out.push(unsafe { *base.offset(offset as isize) });
        // Odometer increment, last dim fastest.
        for d in (0..sizes.len()).rev() {
            index[d] += 1;
            offset += strides[d];
            if index[d] < sizes[d] {
                break;
            }
            offset -= strides[d] * sizes[d];
            index[d] = 0;
        }
    }
    Ok(out)
}

/// The tensor's elements in row-major order, borrowed when contiguous.
///
/// # Safety
/// `t` must be a non-empty CPU tensor whose elements are `T`.
pub unsafe fn row_major<T: Copy>(op: Op, t: &Tensor) -> Result<Cow<'_, [T]>> {
    if t.is_contiguous() {
        // SAFETY: contiguous, non-empty, element type guaranteed by the caller.
        Ok(Cow::Borrowed(unsafe { t.as_slice::<T>() }))
    } else {
        // SAFETY: as above; gather follows the tensor's own strides.
        Ok(Cow::Owned(unsafe { gather(op, t.data_ptr() as *const T, t.sizes(), t.strides())? }))
    }
}

/// A float input tensor (dtype already validated to be f32/bf16/f16) as a row-major slice.
///
/// # Safety
/// `t` must be a non-empty CPU tensor of dtype `dtype`.
pub unsafe fn float_slice(op: Op, t: &Tensor, dtype: DType) -> Result<FloatSlice<'_>> {
    // SAFETY: the dtype names the element type.
    unsafe {
        Ok(match dtype {
            DType::F32 => FloatSlice::F32(row_major(op, t)?),
            DType::BF16 => FloatSlice::BF16(row_major(op, t)?),
            _ => FloatSlice::F16(row_major(op, t)?),
        })
    }
}

/// The mutable elements of an output deepwell just allocated with a float dtype.
///
/// # Safety
/// `t` must be a fresh, contiguous, non-empty CPU tensor of dtype `dtype` with no other users.
pub unsafe fn float_slice_mut(t: &Tensor, dtype: DType) -> FloatSliceMut<'_> {
    // SAFETY: as documented.
    unsafe {
        match dtype {
            DType::F32 => FloatSliceMut::F32(t.as_mut_slice()),
            DType::BF16 => FloatSliceMut::BF16(t.as_mut_slice()),
            _ => FloatSliceMut::F16(t.as_mut_slice()),
        }
    }
}

/// The (k, m) row-major transpose of an (m, k) row-major slice (the reference's column-wise copies).
pub fn transpose<T: Copy>(op: Op, xs: &[T], m: usize, k: usize) -> Result<Vec<T>> {
    let mut out = buffer(op, m * k, "a transposed copy")?;
    for c in 0..k {
        out.extend((0..m).map(|r| xs[r * k + c]));
    }
    Ok(out)
}
