//! `deepwell.swizzle_scales` / `unswizzle_scales`: Blackwell's 128x4 tiled scale layout
//! (NUMERICS.md "Transposes and layouts"). Schemas: torch_ops/deepwell/ops/swizzle.py.
//!
//! The swizzled tensor is 1-D (round_up(rows,128) * round_up(cols,4) bytes, padding 0): its bytes are
//! in the order cuBLASLt and `F.scaled_mm(..., swizzle=SWIZZLE_32_4_4)` read them.

use deepwell_core::swizzle;

use crate::check;
use crate::dtype::{DType, Device};
use crate::error::{Error, Result};
use crate::host;
use crate::kernel::{boxed_kernel, Kernel};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static SWIZZLE: OpSpec = OpSpec { name: "swizzle_scales", args: &[("scale", Kind::Tensor)], returns: 1 };

pub static UNSWIZZLE: OpSpec = OpSpec {
    name: "unswizzle_scales",
    args: &[("swizzled", Kind::Tensor), ("rows", Kind::Int), ("cols", Kind::Int)],
    returns: 1,
};

pub fn kernels() -> Vec<Kernel> {
    vec![
        Kernel { spec: &SWIZZLE, dispatch_key: "CPU", boxed: boxed_kernel!(SWIZZLE, swizzle_cpu) },
        Kernel { spec: &UNSWIZZLE, dispatch_key: "CPU", boxed: boxed_kernel!(UNSWIZZLE, unswizzle_cpu) },
    ]
}

/// Scale dtypes: E8M0 (MXFP8), E4M3 (NVFP4), or raw bytes.
const SCALE_DTYPES: [DType; 3] = [DType::E8M0, DType::E4M3, DType::U8];

fn swizzle_cpu(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let scale = a.tensor("scale")?;
    let dtype = check::dtype_in(op, "scale", &scale, &SCALE_DTYPES)?;
    check::on_cpu(op, "scale", &scale)?;
    if scale.dim() != 2 {
        return Err(Error::arg(op, "scale", "be 2-d (rows, scale columns)", format!("a {}-d tensor", scale.dim())));
    }
    check::non_empty(op, "scale", &scale, 2)?;
    let (rows, cols) = (scale.sizes()[0] as usize, scale.sizes()[1] as usize);
    let out = Tensor::empty(op, &[swizzle::swizzled_len(rows, cols) as i64], dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU input; `out` is fresh with swizzled_len bytes.
    unsafe {
        swizzle::swizzle_scales(&host::row_major::<u8>(&scale), rows, cols, out.as_mut_slice::<u8>());
    }
    Ok(vec![out])
}

fn unswizzle_cpu(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let src = a.tensor("swizzled")?;
    let (rows, cols) = (a.int("rows")?, a.int("cols")?);
    let dtype = check::dtype_in(op, "swizzled", &src, &SCALE_DTYPES)?;
    check::on_cpu(op, "swizzled", &src)?;
    if rows <= 0 || cols <= 0 {
        return Err(Error::arg(op, "rows, cols", "be positive", format!("({rows}, {cols})")));
    }
    let len = swizzle::swizzled_len(rows as usize, cols as usize) as i64;
    check::shape_eq(op, "swizzled", &src, &[len])?;
    let out = Tensor::empty(op, &[rows, cols], dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU input of `len` bytes; `out` is fresh with rows*cols bytes.
    unsafe {
        swizzle::unswizzle_scales(&host::row_major::<u8>(&src), rows as usize, cols as usize, out.as_mut_slice::<u8>());
    }
    Ok(vec![out])
}
