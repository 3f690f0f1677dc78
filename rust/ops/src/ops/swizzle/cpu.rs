//! CPU reference kernels of the swizzle ops (deepwell_core::swizzle).

use deepwell_core::swizzle;

use super::{parse_swizzle, parse_unswizzle};
use crate::check::Backend;
use crate::dtype::Device;
use crate::error::Result;
use crate::host;
use crate::stack::Args;
use crate::tensor::Tensor;

pub fn swizzle(a: &mut Args) -> Result<Vec<Tensor>> {
    let c = parse_swizzle(a, Backend::Cpu)?;
    let out = Tensor::empty(a.op(), &[swizzle::swizzled_len(c.rows, c.cols) as i64], c.dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU input; `out` is fresh with swizzled_len bytes.
    unsafe {
        swizzle::swizzle_scales(&host::row_major::<u8>(a.op(), &c.src)?, c.rows, c.cols, out.as_mut_slice::<u8>())
    };
    Ok(vec![out])
}

pub fn unswizzle(a: &mut Args) -> Result<Vec<Tensor>> {
    let c = parse_unswizzle(a, Backend::Cpu)?;
    let out = Tensor::empty(a.op(), &[c.rows as i64, c.cols as i64], c.dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU input of swizzled_len bytes; `out` is fresh with rows*cols bytes.
    unsafe {
        swizzle::unswizzle_scales(&host::row_major::<u8>(a.op(), &c.src)?, c.rows, c.cols, out.as_mut_slice::<u8>())
    };
    Ok(vec![out])
}
