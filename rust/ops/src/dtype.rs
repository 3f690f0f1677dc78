//! torch dtypes and device types as deepwell uses them.
//!
//! The shim's numeric codes "are NOT part of the ABI contract", so they are read from the
//! `aoti_torch_dtype_*()` getters once, at registration. float8_e8m0fnu has a getter only from torch
//! 2.11 (`torch_dtype_float8_e8m0fnu`); on 2.10 its c10 value (44) is used.

use std::fmt;
use std::sync::OnceLock;

use deepwell_core::Fp8Elem;

use crate::abi::Api;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    U8,
    E4M3,
    E5M2,
    E8M0,
    /// float4_e2m1fn_x2: two E2M1 codes per byte (the dtype `_scaled_mm_v2` wants for NVFP4 data).
    F4x2,
    // Dtypes no kernel accepts, named so error messages can say what was given.
    I8,
    I16,
    I32,
    I64,
    Bool,
    Other(i32),
}

/// c10::ScalarType::Float8_e8m0fnu and Float4_e2m1fn_x2, for torch 2.10 which has no getters.
const E8M0_C10_CODE: i32 = 44;
const F4X2_C10_CODE: i32 = 45;

struct Codes {
    table: [(DType, i32); 14],
}

static CODES: OnceLock<Codes> = OnceLock::new();

pub fn init(api: &Api) {
    // SAFETY: the getters take no arguments and return a constant.
    let table = unsafe {
        [
            (DType::F32, (api.aoti_torch_dtype_float32)()),
            (DType::F16, (api.aoti_torch_dtype_float16)()),
            (DType::BF16, (api.aoti_torch_dtype_bfloat16)()),
            (DType::F64, (api.aoti_torch_dtype_float64)()),
            (DType::U8, (api.aoti_torch_dtype_uint8)()),
            (DType::E4M3, (api.aoti_torch_dtype_float8_e4m3fn)()),
            (DType::E5M2, (api.aoti_torch_dtype_float8_e5m2)()),
            (DType::E8M0, api.torch_dtype_float8_e8m0fnu.map_or(E8M0_C10_CODE, |f| f())),
            (DType::F4x2, api.torch_dtype_float4_e2m1fn_x2.map_or(F4X2_C10_CODE, |f| f())),
            (DType::I8, (api.aoti_torch_dtype_int8)()),
            (DType::I16, (api.aoti_torch_dtype_int16)()),
            (DType::I32, (api.aoti_torch_dtype_int32)()),
            (DType::I64, (api.aoti_torch_dtype_int64)()),
            (DType::Bool, (api.aoti_torch_dtype_bool)()),
        ]
    };
    let _ = CODES.set(Codes { table });
}

fn codes() -> &'static Codes {
    CODES.get().expect("deepwell: dtype codes used before the library registered its kernels")
}

impl DType {
    pub fn from_code(code: i32) -> DType {
        codes().table.iter().find(|(_, c)| *c == code).map_or(DType::Other(code), |(d, _)| *d)
    }

    /// Bytes per element (None for a dtype deepwell does not know).
    pub fn size(self) -> Option<usize> {
        Some(match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::U8 | DType::E4M3 | DType::E5M2 | DType::E8M0 | DType::F4x2 | DType::I8 | DType::Bool => 1,
            DType::Other(_) => return None,
        })
    }

    pub fn code(self) -> i32 {
        match self {
            DType::Other(c) => c,
            d => codes().table.iter().find(|(x, _)| *x == d).map(|(_, c)| *c).unwrap_or(-1),
        }
    }

    /// The dtype of an FP8 element format's codes (fp8_tensor's and MXFP8's).
    pub fn of_fp8(elem: Fp8Elem) -> DType {
        match elem {
            Fp8Elem::E4M3 => DType::E4M3,
            Fp8Elem::E5M2 => DType::E5M2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            DType::F32 => "torch.float32",
            DType::F16 => "torch.float16",
            DType::BF16 => "torch.bfloat16",
            DType::F64 => "torch.float64",
            DType::U8 => "torch.uint8",
            DType::E4M3 => "torch.float8_e4m3fn",
            DType::E5M2 => "torch.float8_e5m2",
            DType::E8M0 => "torch.float8_e8m0fnu",
            DType::F4x2 => "torch.float4_e2m1fn_x2",
            DType::I8 => "torch.int8",
            DType::I16 => "torch.int16",
            DType::I32 => "torch.int32",
            DType::I64 => "torch.int64",
            DType::Bool => "torch.bool",
            DType::Other(c) => return write!(f, "dtype code {c}"),
        };
        f.write_str(name)
    }
}

/// Where a tensor lives. Only CPU kernels exist so far; CUDA tensors are recognised so the error
/// can say what is missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(i32),
    Other(i32, i32),
}

impl Device {
    pub fn from_codes(api: &Api, device_type: i32, index: i32) -> Device {
        // SAFETY: constant getters.
        let (cpu, cuda) = unsafe { ((api.aoti_torch_device_type_cpu)(), (api.aoti_torch_device_type_cuda)()) };
        if device_type == cpu {
            Device::Cpu
        } else if device_type == cuda {
            Device::Cuda(index)
        } else {
            Device::Other(device_type, index)
        }
    }

    pub fn codes(self, api: &Api) -> (i32, i32) {
        // SAFETY: constant getters.
        unsafe {
            match self {
                Device::Cpu => ((api.aoti_torch_device_type_cpu)(), -1),
                Device::Cuda(i) => ((api.aoti_torch_device_type_cuda)(), i),
                Device::Other(t, i) => (t, i),
            }
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Other(t, i) => write!(f, "device type {t} index {i}"),
        }
    }
}
