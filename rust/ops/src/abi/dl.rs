//! dlopen/dlsym of libraries that the Python process has already loaded.
//!
//! torch loads `libtorch_cpu.so` with RTLD_LOCAL, so its symbols are not visible to a library loaded
//! later; `dlopen(path, RTLD_NOW | RTLD_NOLOAD)` returns a handle to the copy already in the process
//! without loading a second one (docs/DESIGN.md "How Rust reaches PyTorch").

use std::ffi::{c_void, CStr, CString};

use crate::error::{Error, Result};

/// A library handle from `dlopen`. Never closed: the function pointers taken from it live in a
/// process-wide table for as long as the process runs.
#[derive(Clone, Copy)]
pub struct Library {
    handle: *mut c_void,
    path: &'static str,
}

// SAFETY: a dlopen handle is a process-global token; dlsym is thread-safe.
unsafe impl Send for Library {}
unsafe impl Sync for Library {}

fn last_dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc (thread-local).
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown dlopen error".to_owned()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

impl Library {
    /// Returns the already-loaded library at `path`; fails (without loading it) when the process has
    /// not loaded it, which means torch was not imported first.
    pub fn already_loaded(path: &str) -> Result<Library> {
        let c = CString::new(path).map_err(|_| Error::Load(format!("library path {path:?} contains NUL")))?;
        // SAFETY: `c` is a valid C string; RTLD_NOLOAD never runs a library's initialisers.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            return Err(Error::Load(format!(
                "{path} is not loaded in this process ({}); import torch before deepwell",
                last_dl_error()
            )));
        }
        Ok(Library { handle, path: Box::leak(path.to_owned().into_boxed_str()) })
    }

    /// The address of `name`, or None when the library does not export it (a newer shim).
    pub fn optional(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: `handle` came from dlopen and is never closed; `c` is a valid C string.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    /// The address of `name`, or an error naming the symbol and the library.
    pub fn required(&self, name: &str) -> Result<*mut c_void> {
        self.optional(name).ok_or_else(|| {
            Error::Load(format!("symbol {name} not found in {}: deepwell needs torch >= 2.10", self.path))
        })
    }
}

/// Casts a symbol address to the function-pointer type `F`.
///
/// # Safety
/// `F` must be an `extern` fn-pointer type whose signature matches the C declaration of the symbol.
pub unsafe fn cast<F: Copy>(p: *mut c_void) -> F {
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: guaranteed by the caller; fn pointers and data pointers have the same size on the
    // platforms torch supports (POSIX requires it for dlsym).
    unsafe { std::mem::transmute_copy(&p) }
}
