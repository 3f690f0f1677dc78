//! The LibTorch stable C ABI, as a table of function pointers resolved once at registration.
//!
//! This module and `kernel.rs` are the whole FFI seam (docs/DESIGN.md "Conventions"). Signatures mirror
//! `torch/csrc/inductor/aoti_torch/c/shim.h` and `torch/csrc/stable/c/shim.h` (torch 2.10+). The
//! 2.10 set is mandatory; newer shims are `Option`s probed with dlsym.

pub mod cublaslt;
pub mod dl;

use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

use crate::error::{Error, Result};
use dl::{cast, Library};

pub type AtenTensorHandle = *mut c_void;
pub type TorchLibraryHandle = *mut c_void;
pub type StringHandle = *mut c_void;
pub type StableListHandle = *mut c_void;
pub type StableIValue = u64;
/// 0 = success, 1 = failure (the message went to stderr: torch < 2.13 cannot return it).
pub type AotiError = i32;

/// A boxed kernel: `stack[0..num_args)` holds the arguments in schema order; the kernel writes its
/// returns to `stack[0..num_outputs)`.
pub type BoxedKernel = unsafe extern "C-unwind" fn(*mut StableIValue, u64, u64);

/// The torch version whose StableIValue encodings this crate implements (2.10.0), passed to
/// `torch_library_impl` so newer libtorch keeps presenting arguments the 2.10 way.
pub const EXTENSION_BUILD_VERSION: u64 = (2 << 56) | (10 << 48);

macro_rules! abi_table {
    (
        required { $( $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ; )* }
        optional { $( $oname:ident : fn($($oarg:ty),*) $(-> $oret:ty)? ; )* }
    ) => {
        /// Function pointers into libtorch_cpu.so (names are the C symbols).
        #[allow(non_snake_case)]
        pub struct Api {
            $( pub $name: unsafe extern "C-unwind" fn($($arg),*) $(-> $ret)?, )*
            $( pub $oname: Option<unsafe extern "C-unwind" fn($($oarg),*) $(-> $oret)?>, )*
            /// `operator delete(void*)` from libstdc++: frees the boxes of `T?` arguments on torch
            /// < 2.13, where libtorch allocates them with `new StableIValue`.
            pub operator_delete: Option<unsafe extern "C" fn(*mut c_void)>,
            /// `operator new(size_t)` from libstdc++: allocates the boxes of `T?` arguments deepwell
            /// passes to `torch_call_dispatcher` on torch < 2.13 (libtorch frees them with delete).
            pub operator_new: Option<unsafe extern "C" fn(usize) -> *mut c_void>,
        }

        impl Api {
            fn resolve(lib: &Library, libstdcxx: Option<&Library>) -> Result<Api> {
                // SAFETY: each field's type is the C signature of the symbol of the same name.
                unsafe {
                    Ok(Api {
                        $( $name: cast(lib.required(stringify!($name))?), )*
                        $( $oname: lib.optional(stringify!($oname)).map(|p| cast(p)), )*
                        operator_delete: libstdcxx.and_then(|l| l.optional("_ZdlPv")).map(|p| cast(p)),
                        operator_new: libstdcxx.and_then(|l| l.optional("_Znwm")).map(|p| cast(p)),
                    })
                }
            }
        }
    };
}

abi_table! {
    required {
        aoti_torch_abi_version: fn() -> u64;
        aoti_torch_library_init_impl: fn(*const c_char, *const c_char, *const c_char, u32, *mut TorchLibraryHandle) -> AotiError;
        torch_library_impl: fn(TorchLibraryHandle, *const c_char, BoxedKernel, u64) -> AotiError;
        aoti_torch_check: fn(bool, *const c_char, *const c_char, u32, *const c_char);
        aoti_torch_delete_tensor_object: fn(AtenTensorHandle) -> AotiError;
        aoti_torch_get_data_ptr: fn(AtenTensorHandle, *mut *mut c_void) -> AotiError;
        aoti_torch_get_dim: fn(AtenTensorHandle, *mut i64) -> AotiError;
        aoti_torch_get_sizes: fn(AtenTensorHandle, *mut *mut i64) -> AotiError;
        aoti_torch_get_strides: fn(AtenTensorHandle, *mut *mut i64) -> AotiError;
        aoti_torch_get_dtype: fn(AtenTensorHandle, *mut i32) -> AotiError;
        aoti_torch_get_device_type: fn(AtenTensorHandle, *mut i32) -> AotiError;
        aoti_torch_get_device_index: fn(AtenTensorHandle, *mut i32) -> AotiError;
        aoti_torch_empty_strided: fn(i64, *const i64, *const i64, i32, i32, i32, *mut AtenTensorHandle) -> AotiError;
        torch_string_length: fn(StringHandle, *mut usize) -> AotiError;
        torch_string_c_str: fn(StringHandle, *mut *const c_char) -> AotiError;
        torch_delete_string: fn(StringHandle) -> AotiError;
        torch_call_dispatcher: fn(*const c_char, *const c_char, *mut StableIValue, u64) -> AotiError;
        torch_new_list_reserve_size: fn(usize, *mut StableListHandle) -> AotiError;
        torch_list_push_back: fn(StableListHandle, StableIValue) -> AotiError;
        torch_delete_list: fn(StableListHandle) -> AotiError;
        aoti_torch_new_tensor_handle: fn(AtenTensorHandle, *mut AtenTensorHandle) -> AotiError;
        aoti_torch__reinterpret_tensor: fn(AtenTensorHandle, i64, *const i64, *const i64, i64, *mut AtenTensorHandle) -> AotiError;
        aoti_torch_memory_format_contiguous_format: fn() -> i32;
        aoti_torch_device_type_cpu: fn() -> i32;
        aoti_torch_device_type_cuda: fn() -> i32;
        aoti_torch_dtype_float32: fn() -> i32;
        aoti_torch_dtype_float16: fn() -> i32;
        aoti_torch_dtype_bfloat16: fn() -> i32;
        aoti_torch_dtype_float64: fn() -> i32;
        aoti_torch_dtype_uint8: fn() -> i32;
        aoti_torch_dtype_int8: fn() -> i32;
        aoti_torch_dtype_int16: fn() -> i32;
        aoti_torch_dtype_int32: fn() -> i32;
        aoti_torch_dtype_int64: fn() -> i32;
        aoti_torch_dtype_bool: fn() -> i32;
        aoti_torch_dtype_float8_e4m3fn: fn() -> i32;
        aoti_torch_dtype_float8_e5m2: fn() -> i32;
    }
    optional {
        // In every torch with the stable ABI, but not needed to register: probed.
        aoti_torch_get_storage_size: fn(AtenTensorHandle, *mut i64) -> AotiError;
        aoti_torch_get_storage_offset: fn(AtenTensorHandle, *mut i64) -> AotiError;
        // 2.11+
        torch_dtype_float8_e8m0fnu: fn() -> i32;
        torch_dtype_float4_e2m1fn_x2: fn() -> i32;
        // 2.13+
        torch_delete_stable_ivalue: fn(*mut StableIValue) -> AotiError;
        torch_new_stable_ivalue: fn(*mut *mut StableIValue) -> AotiError;
    }
}

/// The one function deepwell needs from libtorch_cuda.so: torch's current stream of a device.
pub struct CudaApi {
    pub aoti_torch_get_current_cuda_stream: unsafe extern "C-unwind" fn(i32, *mut *mut c_void) -> AotiError,
}

static API: OnceLock<Api> = OnceLock::new();
static CUDA_API: OnceLock<CudaApi> = OnceLock::new();

/// Resolves the CUDA table from the already-loaded `libtorch_cuda` (a CUDA build of torch).
pub fn init_cuda(libtorch_cuda: &str) -> Result<&'static CudaApi> {
    if let Some(api) = CUDA_API.get() {
        return Ok(api);
    }
    let lib = Library::already_loaded(libtorch_cuda)?;
    // SAFETY: the declared signature of aoti_torch_get_current_cuda_stream in shim.h.
    let api = CudaApi {
        aoti_torch_get_current_cuda_stream: unsafe { cast(lib.required("aoti_torch_get_current_cuda_stream")?) },
    };
    Ok(CUDA_API.get_or_init(|| api))
}

/// The CUDA table, when torch has CUDA (None on CPU-only torch builds).
pub fn cuda_api() -> Option<&'static CudaApi> {
    CUDA_API.get()
}

/// Resolves the table from the already-loaded `libtorch_cpu` (idempotent).
pub fn init(libtorch_cpu: &str) -> Result<&'static Api> {
    if let Some(api) = API.get() {
        return Ok(api);
    }
    let lib = Library::already_loaded(libtorch_cpu)?;
    let libstdcxx = Library::already_loaded("libstdc++.so.6").ok();
    let api = Api::resolve(&lib, libstdcxx.as_ref())?;
    // SAFETY: resolved above with the documented signature.
    let version = unsafe { (api.aoti_torch_abi_version)() };
    if version < EXTENSION_BUILD_VERSION {
        return Err(Error::Load(format!(
            "libtorch ABI version {}.{} is too old: deepwell needs torch >= 2.10",
            version >> 56,
            (version >> 48) & 0xff
        )));
    }
    if api.torch_delete_stable_ivalue.is_none() && api.operator_delete.is_none() {
        return Err(Error::Load("cannot free optional-argument boxes: libstdc++ not found".into()));
    }
    if api.torch_new_stable_ivalue.is_none() && api.operator_new.is_none() {
        return Err(Error::Load("cannot allocate optional-argument boxes: libstdc++ not found".into()));
    }
    Ok(API.get_or_init(|| api))
}

/// The resolved table. Kernels only run after `init` succeeded (they are registered by it).
pub fn api() -> &'static Api {
    API.get().expect("deepwell: ABI table used before the library registered its kernels")
}
