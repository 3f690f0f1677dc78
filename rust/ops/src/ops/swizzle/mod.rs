//! `deepwell.swizzle_scales` / `unswizzle_scales`: Blackwell's 128x4 tiled scale layout
//! (docs/NUMERICS.md "Transposes and layouts"). Schemas: torch_ops/deepwell/ops/swizzle.py.
//!
//! The swizzled tensor is 1-D (round_up(rows,128) * round_up(cols,4) bytes, padding 0): its bytes are
//! in the order cuBLASLt and `F.scaled_mm(..., swizzle=SWIZZLE_32_4_4)` read them.

pub(crate) mod cpu;
pub(crate) mod cuda;

use deepwell_core::swizzle::swizzled_len;

use crate::check::{self, Backend};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::kernel::{cpu_and_cuda, Kernel};
use crate::ops::run_one;
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static SWIZZLE: OpSpec = OpSpec { name: "swizzle_scales", args: &[("scale", Kind::Tensor)], returns: 1 };

pub static UNSWIZZLE: OpSpec = OpSpec {
    name: "unswizzle_scales",
    args: &[("swizzled", Kind::Tensor), ("rows", Kind::Int), ("cols", Kind::Int)],
    returns: 1,
};

pub fn kernels() -> Vec<Kernel> {
    [cpu_and_cuda!(SWIZZLE, swizzle_boxed), cpu_and_cuda!(UNSWIZZLE, unswizzle_boxed)].concat()
}

// The typed API: validates, then runs on `on` (the CPU reference or the CUDA kernel).

/// `swizzle_scales`: a (rows, cols) scale tensor in the 1-D 128x4 tiled layout.
pub fn swizzle(op: Op, on: Backend, scale: Tensor) -> Result<Tensor> {
    let c = Call::swizzle(op, on, scale)?;
    run_one(op, on, c, cpu::swizzle, cuda::swizzle)
}

/// `unswizzle_scales`: the (rows, cols) scales back from the 1-D tiled layout.
pub fn unswizzle(op: Op, on: Backend, swizzled: Tensor, rows: i64, cols: i64) -> Result<Tensor> {
    let c = Call::unswizzle(op, on, swizzled, rows, cols)?;
    run_one(op, on, c, cpu::unswizzle, cuda::unswizzle)
}

fn swizzle_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    Ok(vec![swizzle(a.op(), on, a.tensor("scale")?)?])
}

fn unswizzle_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (swizzled, rows, cols) = (a.tensor("swizzled")?, a.int("rows")?, a.int("cols")?);
    Ok(vec![unswizzle(a.op(), on, swizzled, rows, cols)?])
}

pub use cuda::swizzle_on_device;

/// Scale dtypes: E8M0 (MXFP8), E4M3 (NVFP4), or raw bytes.
const SCALE_DTYPES: [DType; 3] = [DType::E8M0, DType::E4M3, DType::U8];

/// A validated call: the source tensor, its device and dtype, and the unswizzled (rows, cols).
struct Call {
    src: Tensor,
    dtype: DType,
    device: Device,
    rows: usize,
    cols: usize,
}

impl Call {
    fn swizzle(op: Op, backend: Backend, src: Tensor) -> Result<Call> {
        let dtype = check::dtype_in(op, "scale", &src, &SCALE_DTYPES)?;
        let device = check::same_device(op, backend, &[("scale", &src)])?;
        if src.dim() != 2 {
            return Err(Error::arg(op, "scale", "be 2-d (rows, scale columns)", format!("a {}-d tensor", src.dim())));
        }
        check::non_empty(op, "scale", &src, 2)?;
        let (rows, cols) = (src.sizes()[0] as usize, src.sizes()[1] as usize);
        Ok(Call { src, dtype, device, rows, cols })
    }

    fn unswizzle(op: Op, backend: Backend, src: Tensor, rows: i64, cols: i64) -> Result<Call> {
        let dtype = check::dtype_in(op, "swizzled", &src, &SCALE_DTYPES)?;
        let device = check::same_device(op, backend, &[("swizzled", &src)])?;
        if rows <= 0 || cols <= 0 {
            return Err(Error::arg(op, "rows, cols", "be positive", format!("({rows}, {cols})")));
        }
        let (rows, cols) = (rows as usize, cols as usize);
        // Huge rows/cols would wrap the padded length around (and then match a small tensor).
        let len = rows
            .checked_next_multiple_of(128)
            .and_then(|r| r.checked_mul(cols.checked_next_multiple_of(4)?))
            .filter(|&len| len <= i64::MAX as usize)
            .ok_or_else(|| {
                Error::arg(op, "rows, cols", "give a swizzled length below 2^63", format!("({rows}, {cols})"))
            })?;
        debug_assert_eq!(len, swizzled_len(rows, cols));
        check::shape_eq(op, "swizzled", &src, &[len as i64])?;
        Ok(Call { src, dtype, device, rows, cols })
    }
}
