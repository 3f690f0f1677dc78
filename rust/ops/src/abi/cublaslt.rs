//! torch's cuBLASLt, bound at run time: the entry points deepwell's direct FP8 GEMM calls
//! (gemm/cublaslt.rs), with the cublasLt.h / library_types.h values it passes. The library is the
//! copy torch's CUDA build already loaded (dlopen(RTLD_NOLOAD), as for libtorch: dl.rs), so
//! deepwell still links nothing, and a process without it simply has no `api()`.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use super::dl::{cast, Library};

pub type Handle = *mut c_void;
pub type Desc = *mut c_void;
pub type Layout = *mut c_void;
pub type Pref = *mut c_void;

/// cublasLtMatmulHeuristicResult_t (cublasLt.h): the algorithm (8 x u64), its workspace bytes,
/// its status, waves and reserved words.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Heuristic {
    pub algo: [u64; 8],
    pub workspace: usize,
    pub state: c_int,
    pub waves: f32,
    pub reserved: [c_int; 4],
}

// cublasLt.h / library_types.h values (CUDA 12.9+; torch 2.11's cu130 wheels ship cuBLAS 13).
pub const COMPUTE_32F: c_int = 68; // cublasComputeType_t CUBLAS_COMPUTE_32F
pub const R_32F: c_int = 0; // cudaDataType_t
pub const R_16F: c_int = 2;
pub const R_16BF: c_int = 14;
pub const R_8F_E4M3: c_int = 28;
pub const R_8F_E5M2: c_int = 29;
pub const OP_N: c_int = 0; // cublasOperation_t
pub const OP_T: c_int = 1;
pub const DESC_TRANSA: c_int = 3; // cublasLtMatmulDescAttributes_t
pub const DESC_TRANSB: c_int = 4;
pub const DESC_EPILOGUE: c_int = 7;
pub const DESC_BIAS_POINTER: c_int = 8;
pub const DESC_SM_COUNT_TARGET: c_int = 15;
pub const DESC_A_SCALE_POINTER: c_int = 17;
pub const DESC_B_SCALE_POINTER: c_int = 18;
pub const DESC_FAST_ACCUM: c_int = 25;
pub const DESC_BIAS_DATA_TYPE: c_int = 26;
pub const DESC_A_SCALE_MODE: c_int = 31;
pub const DESC_B_SCALE_MODE: c_int = 32;
pub const EPILOGUE_BIAS: c_int = 4; // cublasLtEpilogue_t
pub const PREF_MAX_WORKSPACE_BYTES: c_int = 1; // cublasLtMatmulPreferenceAttributes_t
pub const SCALE_SCALAR_32F: c_int = 0; // cublasLtMatmulMatrixScale_t
pub const SCALE_VEC128_32F: c_int = 4;
pub const SCALE_BLK128X128_32F: c_int = 5;

/// The cuBLASLt entry points deepwell calls, resolved with dlsym from torch's copy.
#[allow(non_snake_case)]
pub struct Api {
    pub cublasLtCreate: unsafe extern "C" fn(*mut Handle) -> c_int,
    pub cublasLtMatmulDescCreate: unsafe extern "C" fn(*mut Desc, c_int, c_int) -> c_int,
    pub cublasLtMatmulDescSetAttribute: unsafe extern "C" fn(Desc, c_int, *const c_void, usize) -> c_int,
    pub cublasLtMatrixLayoutCreate: unsafe extern "C" fn(*mut Layout, c_int, u64, u64, i64) -> c_int,
    pub cublasLtMatmulPreferenceCreate: unsafe extern "C" fn(*mut Pref) -> c_int,
    pub cublasLtMatmulPreferenceSetAttribute: unsafe extern "C" fn(Pref, c_int, *const c_void, usize) -> c_int,
    pub cublasLtMatmulPreferenceDestroy: unsafe extern "C" fn(Pref) -> c_int,
    #[allow(clippy::type_complexity)]
    pub cublasLtMatmulAlgoGetHeuristic: unsafe extern "C" fn(
        Handle,
        Desc,
        Layout,
        Layout,
        Layout,
        Layout,
        Pref,
        c_int,
        *mut Heuristic,
        *mut c_int,
    ) -> c_int,
    #[allow(clippy::type_complexity)]
    pub cublasLtMatmul: unsafe extern "C" fn(
        Handle,
        Desc,
        *const c_void,
        *const c_void,
        Layout,
        *const c_void,
        Layout,
        *const c_void,
        *const c_void,
        Layout,
        *mut c_void,
        Layout,
        *const [u64; 8],
        *mut c_void,
        usize,
        *mut c_void,
    ) -> c_int,
    /// One handle for the process: a cuBLASLt handle holds no stream or workspace, and its calls
    /// are thread-safe (cuBLAS docs, "Thread Safety").
    pub handle: Handle,
    /// The heuristic's workspace limit, torch's (`workspace_limit`).
    pub workspace_limit: usize,
}

// SAFETY: function pointers and a thread-safe library handle.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

static API: OnceLock<Option<Api>> = OnceLock::new();

/// torch's cuBLASLt, when this process has loaded it (torch's CUDA build does at import).
pub fn api() -> Option<&'static Api> {
    API.get_or_init(load).as_ref()
}

fn load() -> Option<Api> {
    let lib = ["libcublasLt.so.13", "libcublasLt.so.12"].iter().find_map(|p| Library::already_loaded(p).ok())?;
    let f = |name: &str| lib.optional(name);
    // SAFETY: each pointer is the named cublasLt.h function, transmuted to its declared type.
    let api = unsafe {
        Api {
            cublasLtCreate: cast(f("cublasLtCreate")?),
            cublasLtMatmulDescCreate: cast(f("cublasLtMatmulDescCreate")?),
            cublasLtMatmulDescSetAttribute: cast(f("cublasLtMatmulDescSetAttribute")?),
            cublasLtMatrixLayoutCreate: cast(f("cublasLtMatrixLayoutCreate")?),
            cublasLtMatmulPreferenceCreate: cast(f("cublasLtMatmulPreferenceCreate")?),
            cublasLtMatmulPreferenceSetAttribute: cast(f("cublasLtMatmulPreferenceSetAttribute")?),
            cublasLtMatmulPreferenceDestroy: cast(f("cublasLtMatmulPreferenceDestroy")?),
            cublasLtMatmulAlgoGetHeuristic: cast(f("cublasLtMatmulAlgoGetHeuristic")?),
            cublasLtMatmul: cast(f("cublasLtMatmul")?),
            handle: std::ptr::null_mut(),
            workspace_limit: workspace_limit(std::env::var("CUBLASLT_WORKSPACE_SIZE").ok().as_deref()),
        }
    };
    let mut handle: Handle = std::ptr::null_mut();
    // SAFETY: valid out pointer.
    if unsafe { (api.cublasLtCreate)(&mut handle) } != 0 || handle.is_null() {
        return None;
    }
    Some(Api { handle, ..api })
}

/// torch's cuBLASLt workspace: `CUBLASLT_WORKSPACE_SIZE` KiB, 1024 when unset or unreadable
/// (torch warns and keeps its default then too).
pub fn workspace_limit(env: Option<&str>) -> usize {
    env.and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(1024) * 1024
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heuristic_result_has_cublaslt_h_size() {
        // 64 bytes of algorithm, size_t, status, float, int[4].
        assert_eq!(size_of::<Heuristic>(), 96);
    }

    #[test]
    fn workspace_limit_follows_torch() {
        assert_eq!(workspace_limit(None), 1 << 20);
        assert_eq!(workspace_limit(Some("4096")), 4 << 20);
        assert_eq!(workspace_limit(Some("lots")), 1 << 20);
    }
}
