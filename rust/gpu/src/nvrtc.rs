//! NVRTC, loaded from the path Python hands over (torch's wheel ships `nvidia/cu13/lib/libnvrtc.so.13`),
//! never from a system CUDA: one NVRTC per process. Compiles a kernel (`KernelId`) to a cubin for one arch.
//! Needs no GPU, so CI compiles every kernel for every arch.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use crate::error::{GpuError, Result};
use crate::kernels::KernelId;
use crate::sources::Header;

type Prog = *mut c_void;

/// NVRTC's C API (nvrtc.h), resolved with dlsym.
#[allow(non_snake_case)]
struct Api {
    nvrtcVersion: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    nvrtcGetErrorString: unsafe extern "C" fn(c_int) -> *const c_char,
    nvrtcCreateProgram: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    nvrtcAddNameExpression: unsafe extern "C" fn(Prog, *const c_char) -> c_int,
    nvrtcCompileProgram: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int,
    nvrtcGetProgramLogSize: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    nvrtcGetProgramLog: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    nvrtcGetCUBINSize: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    nvrtcGetCUBIN: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    nvrtcGetLoweredName: unsafe extern "C" fn(Prog, *const c_char, *mut *const c_char) -> c_int,
    nvrtcDestroyProgram: unsafe extern "C" fn(*mut Prog) -> c_int,
}

/// Options every kernel is compiled with. `--fmad=false`: no a*b+c contraction, so every fp32
/// operation rounds exactly as in the Rust reference (the kernels are memory-bound; FMA buys
/// nothing). The default `-ftz=false -prec-div=true -prec-sqrt=true` keep IEEE semantics.
pub const OPTIONS: [&str; 3] = ["-std=c++17", "--fmad=false", "-lineinfo"];

pub struct Nvrtc {
    api: Api,
    path: String,
}

static NVRTC: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();

/// Loads NVRTC from `path` once per process (later calls return the first result).
pub fn load(path: &str) -> Result<&'static Nvrtc> {
    NVRTC.get_or_init(|| Nvrtc::open(path)).as_ref().map_err(|e| GpuError::Nvrtc(e.clone()))
}

/// The NVRTC loaded earlier, if any.
pub fn loaded() -> Option<&'static Nvrtc> {
    NVRTC.get().and_then(|r| r.as_ref().ok())
}

/// dlsym with a typed result.
///
/// # Safety
/// `F` must be the fn-pointer type of the symbol's C declaration.
unsafe fn sym<F: Copy>(handle: *mut c_void, name: &str) -> std::result::Result<F, String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: handle from dlopen, never closed; c is a C string.
    let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
    if p.is_null() {
        return Err(format!("symbol {name} missing"));
    }
    // SAFETY: guaranteed by the caller.
    Ok(unsafe { std::mem::transmute_copy(&p) })
}

impl Nvrtc {
    fn open(path: &str) -> std::result::Result<Nvrtc, String> {
        let c = CString::new(path).map_err(|e| e.to_string())?;
        // SAFETY: a valid C string; NVRTC has no problematic initialisers.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err(format!("cannot load NVRTC from {path}"));
        }
        // SAFETY: each field's type matches its declaration in nvrtc.h.
        let api = unsafe {
            Api {
                nvrtcVersion: sym(h, "nvrtcVersion")?,
                nvrtcGetErrorString: sym(h, "nvrtcGetErrorString")?,
                nvrtcCreateProgram: sym(h, "nvrtcCreateProgram")?,
                nvrtcAddNameExpression: sym(h, "nvrtcAddNameExpression")?,
                nvrtcCompileProgram: sym(h, "nvrtcCompileProgram")?,
                nvrtcGetProgramLogSize: sym(h, "nvrtcGetProgramLogSize")?,
                nvrtcGetProgramLog: sym(h, "nvrtcGetProgramLog")?,
                nvrtcGetCUBINSize: sym(h, "nvrtcGetCUBINSize")?,
                nvrtcGetCUBIN: sym(h, "nvrtcGetCUBIN")?,
                nvrtcGetLoweredName: sym(h, "nvrtcGetLoweredName")?,
                nvrtcDestroyProgram: sym(h, "nvrtcDestroyProgram")?,
            }
        };
        Ok(Nvrtc { api, path: path.to_owned() })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// "13.2" — part of the cache key.
    pub fn version(&self) -> String {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out pointers.
        unsafe { (self.api.nvrtcVersion)(&mut major, &mut minor) };
        format!("{major}.{minor}")
    }

    fn check(&self, what: &str, code: c_int) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static string for any code.
        let s = unsafe { CStr::from_ptr((self.api.nvrtcGetErrorString)(code)) };
        Err(GpuError::Nvrtc(format!("{what}: {}", s.to_string_lossy())))
    }

    /// Compiles `kernel` for `arch` (e.g. "sm_90a"); returns (cubin, lowered symbol name).
    pub fn compile(&self, kernel: KernelId, arch: &str) -> Result<(Vec<u8>, String)> {
        let owned = |s: &str| CString::new(s).map_err(|e| GpuError::Nvrtc(e.to_string()));
        let src = owned(&kernel.translation_unit())?;
        let headers: Vec<CString> = Header::ALL.iter().map(|h| owned(h.source())).collect::<Result<_>>()?;
        let names: Vec<CString> = Header::ALL.iter().map(|h| owned(h.file_name())).collect::<Result<_>>()?;
        let header_ptrs: Vec<*const c_char> = headers.iter().map(|c| c.as_ptr()).collect();
        let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
        let expr = owned(&kernel.name_expression())?;
        let mut opts: Vec<CString> = vec![owned(&format!("--gpu-architecture={arch}"))?];
        for o in OPTIONS {
            opts.push(owned(o)?);
        }
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();

        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: all pointers reference live CStrings of this frame; counts match.
        self.check("nvrtcCreateProgram", unsafe {
            (self.api.nvrtcCreateProgram)(
                &mut prog,
                src.as_ptr(),
                c"deepwell_kernel.cu".as_ptr(),
                header_ptrs.len() as c_int,
                header_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        })?;
        let result = self.compile_program(prog, &expr, arch, &opt_ptrs);
        // SAFETY: prog was created above and is destroyed once.
        unsafe { (self.api.nvrtcDestroyProgram)(&mut prog) };
        result
    }

    fn compile_program(
        &self,
        prog: Prog,
        expr: &CStr,
        arch: &str,
        opts: &[*const c_char],
    ) -> Result<(Vec<u8>, String)> {
        // SAFETY: prog is live; expr and opts point to live C strings.
        unsafe {
            self.check("nvrtcAddNameExpression", (self.api.nvrtcAddNameExpression)(prog, expr.as_ptr()))?;
            let code = (self.api.nvrtcCompileProgram)(prog, opts.len() as c_int, opts.as_ptr());
            if code != 0 {
                return Err(GpuError::Compile {
                    kernel: expr.to_string_lossy().into_owned(),
                    arch: arch.to_owned(),
                    log: self.log(prog),
                });
            }
            let mut size = 0usize;
            self.check("nvrtcGetCUBINSize", (self.api.nvrtcGetCUBINSize)(prog, &mut size))?;
            let mut cubin = vec![0u8; size];
            self.check("nvrtcGetCUBIN", (self.api.nvrtcGetCUBIN)(prog, cubin.as_mut_ptr().cast()))?;
            let mut lowered: *const c_char = std::ptr::null();
            self.check("nvrtcGetLoweredName", (self.api.nvrtcGetLoweredName)(prog, expr.as_ptr(), &mut lowered))?;
            let lowered = CStr::from_ptr(lowered).to_string_lossy().into_owned();
            Ok((cubin, lowered))
        }
    }

    fn log(&self, prog: Prog) -> String {
        let mut size = 0usize;
        // SAFETY: prog is live; the buffer has the size NVRTC reported.
        unsafe {
            (self.api.nvrtcGetProgramLogSize)(prog, &mut size);
            let mut buf = vec![0u8; size.max(1)];
            (self.api.nvrtcGetProgramLog)(prog, buf.as_mut_ptr().cast());
            String::from_utf8_lossy(&buf).trim_end_matches('\0').to_owned()
        }
    }
}
