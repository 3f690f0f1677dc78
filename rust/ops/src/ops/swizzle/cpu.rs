//! CPU reference kernels of the swizzle ops (deepwell_core::swizzle).

use deepwell_core::swizzle;

use super::Call;
use crate::dtype::Device;
use crate::error::{Op, Result};
use crate::host;
use crate::tensor::Tensor;

pub(super) fn swizzle(op: Op, c: Call) -> Result<Vec<Tensor>> {
    let out = Tensor::empty(op, &[swizzle::swizzled_len(c.rows, c.cols) as i64], c.dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU input; `out` is fresh with swizzled_len bytes.
    unsafe { swizzle::swizzle_scales(&host::row_major::<u8>(op, &c.src)?, c.rows, c.cols, out.as_mut_slice::<u8>()) };
    Ok(vec![out])
}

pub(super) fn unswizzle(op: Op, c: Call) -> Result<Vec<Tensor>> {
    let out = Tensor::empty(op, &[c.rows as i64, c.cols as i64], c.dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU input of swizzled_len bytes; `out` is fresh with rows*cols bytes.
    unsafe { swizzle::unswizzle_scales(&host::row_major::<u8>(op, &c.src)?, c.rows, c.cols, out.as_mut_slice::<u8>()) };
    Ok(vec![out])
}
