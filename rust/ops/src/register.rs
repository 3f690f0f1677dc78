//! The library's exported C functions, called once by `torch_ops/deepwell/_native.py` through ctypes
//! after `import torch` and after Python defined the op schemas.

use std::ffi::{c_char, CStr, CString};
use std::panic::catch_unwind;
use std::sync::{Mutex, OnceLock};

use crate::abi::{self, EXTENSION_BUILD_VERSION};
use crate::dtype;
use crate::error::{Error, Result};
use crate::ops::all_kernels;
use crate::stack::c_message;

static LAST_ERROR: Mutex<Option<CString>> = Mutex::new(None);
static REGISTERED: OnceLock<()> = OnceLock::new();

fn set_last_error(msg: &str) {
    if let Ok(mut slot) = LAST_ERROR.lock() {
        *slot = Some(c_message(msg));
    }
}

/// Resolves the ABI table from `libtorch_cpu` (a path or soname of the copy torch loaded) and
/// registers every kernel under `torch.ops.deepwell`. Idempotent. Returns 0, or 1 with the reason
/// in `deepwell_last_error()`.
///
/// # Safety
/// `libtorch_cpu` must be a NUL-terminated string; torch must be imported in this process.
#[no_mangle]
pub unsafe extern "C" fn deepwell_register(libtorch_cpu: *const c_char) -> i32 {
    if libtorch_cpu.is_null() {
        set_last_error("deepwell_register: libtorch_cpu path is NULL");
        return 1;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let path = unsafe { CStr::from_ptr(libtorch_cpu) }.to_string_lossy().into_owned();
    match catch_unwind(|| register(&path)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            1
        }
        Err(_) => {
            set_last_error("deepwell_register panicked (a bug in deepwell)");
            1
        }
    }
}

fn register(libtorch_cpu: &str) -> Result<()> {
    if REGISTERED.get().is_some() {
        return Ok(());
    }
    let api = abi::init(libtorch_cpu)?;
    dtype::init(api);
    for key in ["CPU"] {
        let mut lib = std::ptr::null_mut();
        let key_c = c_message(key);
        // SAFETY: valid C strings; `lib` receives a heap torch::Library that we never free (freeing
        // it would deregister the kernels).
        let code = unsafe {
            (api.aoti_torch_library_init_impl)(c"deepwell".as_ptr(), key_c.as_ptr(), c"rust/ops/src/register.rs".as_ptr(), line!(), &mut lib)
        };
        if code != 0 {
            return Err(Error::Load(format!("aoti_torch_library_init_impl(deepwell, {key}) failed")));
        }
        for k in all_kernels().into_iter().filter(|k| k.dispatch_key == key) {
            let name = c_message(k.spec.name);
            // SAFETY: `lib` is a live library handle; the kernel is a `C-unwind` fn with the boxed
            // signature; the version is the encoding our stack decoder implements.
            let code = unsafe { (api.torch_library_impl)(lib, name.as_ptr(), k.boxed, EXTENSION_BUILD_VERSION) };
            if code != 0 {
                return Err(Error::Load(format!("registering deepwell::{} for {key} failed", k.spec.name)));
            }
        }
    }
    let _ = REGISTERED.set(());
    Ok(())
}

/// The message of the last failed `deepwell_register` (empty if none). Borrowed; valid until the
/// next failure.
#[no_mangle]
pub extern "C" fn deepwell_last_error() -> *const c_char {
    match LAST_ERROR.lock() {
        Ok(slot) => slot.as_ref().map_or(c"".as_ptr(), |s| s.as_ptr()),
        Err(_) => c"deepwell: error slot poisoned".as_ptr(),
    }
}

/// The crate version, e.g. "0.1.0".
#[no_mangle]
pub extern "C" fn deepwell_version() -> *const c_char {
    static V: OnceLock<CString> = OnceLock::new();
    V.get_or_init(|| c_message(env!("CARGO_PKG_VERSION"))).as_ptr()
}

/// Every registered kernel as JSON lines `{"op": ..., "key": ..., "args": [[name, type], ...],
/// "returns": n}`, so the tests can check the Rust specs against the Python schemas.
#[no_mangle]
pub extern "C" fn deepwell_kernel_table() -> *const c_char {
    static T: OnceLock<CString> = OnceLock::new();
    T.get_or_init(|| {
        let lines: Vec<String> = all_kernels()
            .iter()
            .map(|k| {
                let args: Vec<String> =
                    k.spec.args.iter().map(|(n, kind)| format!("[\"{n}\", \"{}\"]", kind.schema_type())).collect();
                format!(
                    "{{\"op\": \"{}\", \"key\": \"{}\", \"args\": [{}], \"returns\": {}}}",
                    k.spec.name,
                    k.dispatch_key,
                    args.join(", "),
                    k.spec.returns
                )
            })
            .collect();
        c_message(&lines.join("\n"))
    })
    .as_ptr()
}
