//! Tensor maps for Hopper's bulk tensor copies (TMA): `cuTensorMapEncodeTiled` describes a 2-D
//! row-major tensor in device memory and the box one copy moves into shared memory. The 128-byte
//! map travels to the kernel by value (cuda/sm90.cuh `TmaDesc`, a `__grid_constant__` parameter).

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::error::{GpuError, Result};

/// An encoded `CUtensorMap`: 16 opaque words, passed to a kernel as one 128-byte parameter.
pub type TensorMap = [u64; 16];

/// Element type of a mapped tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// FP8 codes (E4M3 / E5M2), moved as bytes.
    U8,
    F32,
}

impl Elem {
    fn bytes(self) -> u64 {
        match self {
            Elem::U8 => 1,
            Elem::F32 => 4,
        }
    }
}

/// A 2-D row-major tensor at `ptr`: `rows` rows of `cols` elements, `row_stride` elements apart,
/// copied in boxes of `box_cols` x `box_rows` elements; `swizzle_128b` lays each box's 128-byte
/// rows out with the 128-byte swizzle that wgmma's descriptors read (cuda/sm90.cuh
/// `smem_desc_sw128`). Elements of a box outside the tensor arrive as zeros.
#[derive(Clone, Copy, Debug)]
pub struct Map2d {
    pub ptr: *const c_void,
    pub elem: Elem,
    pub rows: u64,
    pub cols: u64,
    pub row_stride: u64,
    pub box_rows: u32,
    pub box_cols: u32,
    pub swizzle_128b: bool,
}

impl Map2d {
    /// The driver's own rules, checked first so that a violation is a clear error rather than
    /// CUDA_ERROR_INVALID_VALUE: a 16-byte aligned base and row stride, boxes of at most 256
    /// elements per side whose rows are a multiple of 16 bytes (exactly 128 with the swizzle).
    fn check(&self) -> Result<()> {
        let row_bytes = self.row_stride * self.elem.bytes();
        let box_row_bytes = u64::from(self.box_cols) * self.elem.bytes();
        let problem = if self.ptr as usize % 16 != 0 {
            Some("the base address is not 16-byte aligned")
        } else if self.rows > 1 && row_bytes % 16 != 0 {
            Some("the row stride is not a multiple of 16 bytes")
        } else if self.box_rows == 0 || self.box_rows > 256 || self.box_cols == 0 || self.box_cols > 256 {
            Some("a box side is not in 1..=256")
        } else if box_row_bytes % 16 != 0 || (self.swizzle_128b && box_row_bytes != 128) {
            Some("a box row is not a multiple of 16 bytes (exactly 128 with the 128-byte swizzle)")
        } else if self.rows == 0 || self.cols == 0 || self.rows >= 1 << 31 || self.cols >= 1 << 31 {
            Some("a dimension is empty or not below 2^31")
        } else {
            None
        };
        match problem {
            Some(why) => Err(GpuError::Unsupported(format!("cannot describe {self:?} for TMA: {why}"))),
            None => Ok(()),
        }
    }

    /// Encodes the map (a host-only driver call of about a microsecond; needs no context).
    pub fn encode(&self) -> Result<TensorMap> {
        self.check()?;
        use sys::CUtensorMapDataType_enum as D;
        let dtype = match self.elem {
            Elem::U8 => D::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            Elem::F32 => D::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        };
        let dims: [u64; 2] = [self.cols, self.rows];
        let strides: [u64; 1] = [self.row_stride * self.elem.bytes()];
        let boxes: [u32; 2] = [self.box_cols, self.box_rows];
        let element_strides: [u32; 2] = [1, 1];
        let swizzle = if self.swizzle_128b {
            sys::CUtensorMapSwizzle_enum::CU_TENSOR_MAP_SWIZZLE_128B
        } else {
            sys::CUtensorMapSwizzle_enum::CU_TENSOR_MAP_SWIZZLE_NONE
        };
        let mut map = sys::CUtensorMap_st { opaque: [0; 16] };
        // SAFETY: every pointer refers to a live local array of the rank the call is given; the
        // driver only reads them and writes the 128-byte map.
        let code = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                dtype,
                2,
                self.ptr as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave_enum::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion_enum::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill_enum::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        code.result()
            .map_err(|e| GpuError::Driver { call: "cuTensorMapEncodeTiled", msg: format!("{e} for {self:?}") })?;
        Ok(map.opaque)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp8(rows: u64, cols: u64) -> Map2d {
        let ptr = 4096usize as *const c_void;
        Map2d { ptr, elem: Elem::U8, rows, cols, row_stride: cols, box_rows: 128, box_cols: 128, swizzle_128b: true }
    }

    #[test]
    fn the_driver_rules_are_checked_before_the_driver() {
        assert!(fp8(256, 4096).check().is_ok());
        let misaligned = Map2d { ptr: 4097usize as *const c_void, ..fp8(256, 4096) };
        assert!(misaligned.check().unwrap_err().to_string().contains("16-byte aligned"));
        let odd_stride = Map2d { row_stride: 4100, ..fp8(256, 4100) };
        assert!(odd_stride.check().unwrap_err().to_string().contains("row stride"));
        let wide = Map2d { box_cols: 256, ..fp8(256, 4096) };
        assert!(wide.check().unwrap_err().to_string().contains("exactly 128"));
        let scales = Map2d { elem: Elem::F32, box_cols: 256, box_rows: 1, swizzle_128b: false, ..fp8(32, 4096) };
        assert!(scales.check().is_ok());
        let tall = Map2d { box_rows: 512, ..fp8(256, 4096) };
        assert!(tall.check().unwrap_err().to_string().contains("1..=256"));
    }
}
