//! The library's exported C functions, called once by `torch_ops/deepwell/_native.py` through ctypes
//! after `import torch` and after Python defined the op schemas.

use std::ffi::{c_char, CStr, CString};
use std::panic::catch_unwind;
use std::cell::RefCell;
use std::sync::OnceLock;

use crate::abi::{self, EXTENSION_BUILD_VERSION};
use crate::dtype;
use crate::error::{Error, Result};
use crate::ops::all_kernels;
use crate::stack::c_message;

thread_local! {
    /// The text of this thread's last failure (or compile-all report), read by Python right after
    /// the call that set it. Per thread, so the pointer `deepwell_last_message` hands out stays
    /// valid until this thread's next failing call, whatever other threads do.
    static LAST_MESSAGE: RefCell<CString> = RefCell::new(CString::default());
}
static REGISTERED: OnceLock<()> = OnceLock::new();

fn set_last_message(msg: &str) {
    LAST_MESSAGE.with(|slot| *slot.borrow_mut() = c_message(msg));
}

/// A possibly-NULL C string argument.
///
/// # Safety
/// `p` must be NULL or NUL-terminated.
unsafe fn opt_str(p: *const c_char) -> Option<String> {
    // SAFETY: guaranteed by the caller.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Runs `f` with panics caught, storing its error text; returns 0 or 1.
fn status(f: impl FnOnce() -> Result<()> + std::panic::UnwindSafe) -> i32 {
    match catch_unwind(f) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            set_last_message(&e.to_string());
            1
        }
        Err(_) => {
            set_last_message("deepwell: internal panic (a bug in deepwell)");
            1
        }
    }
}

/// Resolves the ABI table from the already-loaded `libtorch_cpu` (and `libtorch_cuda`, NULL for a
/// CPU-only torch), configures the GPU runtime (NVRTC path and JIT cache directory, either may be
/// NULL; `print_compile` non-zero logs every kernel load) and registers every kernel under
/// `torch.ops.deepwell`. Idempotent. Returns 0, or 1 with the reason in `deepwell_last_message()`.
///
/// # Safety
/// Every argument must be NULL or a NUL-terminated string (`libtorch_cpu` must not be NULL);
/// torch must be imported in this process.
#[no_mangle]
pub unsafe extern "C" fn deepwell_register(
    libtorch_cpu: *const c_char,
    libtorch_cuda: *const c_char,
    nvrtc: *const c_char,
    cache_dir: *const c_char,
    print_compile: i32,
) -> i32 {
    // SAFETY: guaranteed by the caller.
    let (cpu, cuda, nvrtc, cache) =
        unsafe { (opt_str(libtorch_cpu), opt_str(libtorch_cuda), opt_str(nvrtc), opt_str(cache_dir)) };
    status(move || {
        let cpu = cpu.ok_or_else(|| Error::Load("deepwell_register: libtorch_cpu path is NULL".into()))?;
        let gpu = deepwell_gpu::Config { nvrtc_path: nvrtc, cache_dir: cache, print_compile: print_compile != 0 };
        register(&cpu, cuda.as_deref(), gpu)
    })
}

fn register(libtorch_cpu: &str, libtorch_cuda: Option<&str>, gpu: deepwell_gpu::Config) -> Result<()> {
    if REGISTERED.get().is_some() {
        return Ok(());
    }
    let api = abi::init(libtorch_cpu)?;
    dtype::init(api);
    deepwell_gpu::configure(gpu);
    let mut keys = vec!["CPU"];
    if let Some(path) = libtorch_cuda {
        abi::init_cuda(path)?;
        keys.push("CUDA");
    }
    for key in keys {
        let mut lib = std::ptr::null_mut();
        let key_c = c_message(key);
        // SAFETY: valid C strings; `lib` receives a heap torch::Library that we never free (freeing
        // it would deregister the kernels).
        let code = unsafe {
            (api.aoti_torch_library_init_impl)(
                c"deepwell".as_ptr(),
                key_c.as_ptr(),
                c"rust/ops/src/register.rs".as_ptr(),
                line!(),
                &mut lib,
            )
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

/// Compiles every CUDA kernel the ops can launch for each arch in `archs` (comma-separated, e.g.
/// "sm_90a,sm_100a,sm_120a") with the NVRTC at `nvrtc`. Needs no GPU. Returns 0 with a report
/// (one line per arch) in `deepwell_last_message()`, or 1 with the first failure there.
///
/// # Safety
/// Both arguments must be NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn deepwell_compile_all(nvrtc: *const c_char, archs: *const c_char) -> i32 {
    // SAFETY: guaranteed by the caller.
    let (nvrtc, archs) = unsafe { (opt_str(nvrtc), opt_str(archs)) };
    status(move || {
        let nvrtc = nvrtc.ok_or_else(|| Error::Load("deepwell_compile_all: NVRTC path is NULL".into()))?;
        let archs: Vec<String> = archs
            .unwrap_or_default()
            .split(',')
            .map(|a| deepwell_gpu::arch::parse_arch(a.trim()).map_err(Error::Load))
            .collect::<Result<_>>()?;
        let kernels = deepwell_gpu::kernels::all();
        let start = std::time::Instant::now();
        let built = deepwell_gpu::compile_all(&nvrtc, &kernels, &archs).map_err(|e| Error::Load(e.to_string()))?;
        let mut report = Vec::new();
        for arch in &archs {
            let mine: Vec<_> = built.iter().filter(|(_, a, _)| a == arch).collect();
            let bytes: usize = mine.iter().map(|(_, _, b)| b).sum();
            report.push(format!("{arch}: {} kernels, {:.1} KiB of cubin", mine.len(), bytes as f64 / 1024.0));
        }
        report.push(format!("compiled {} kernels in {:.1} s", built.len(), start.elapsed().as_secs_f64()));
        set_last_message(&report.join("\n"));
        Ok(())
    })
}

/// This thread's last failure, or its last compile-all report (empty if none). Borrowed; valid
/// until this thread's next call that sets it.
#[no_mangle]
pub extern "C" fn deepwell_last_message() -> *const c_char {
    LAST_MESSAGE.with(|slot| slot.borrow().as_ptr())
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
