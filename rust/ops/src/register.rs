//! Loading: the C API entries (`capi.rs`) that register the kernels with torch (once, after `import
//! torch` and after Python defined the op schemas), compile every kernel ahead of time, and
//! describe the library.

use std::sync::OnceLock;

use serde_json::{json, Value};

use crate::abi::{self, EXTENSION_BUILD_VERSION};
use crate::dtype;
use crate::entry::{fields, Answer, Entries};
use crate::error::{Error, Result};
use crate::ops::all_kernels;
use crate::stack::c_message;

static REGISTERED: OnceLock<()> = OnceLock::new();

/// Every kernel is registered twice, under the same schema: `deepwell::<op>`, the ops users call,
/// whose autograd formulas are Python (torch_ops/deepwell/ops), and `deepwell_graph::<op>`, which
/// has none. The deepwell backend retargets the ops of its compiled graphs to the second
/// (torch_ops/deepwell/compiler/graph_ops.py): autograd is already done there, and the Python autograd
/// kernel cost host time on every call (~8.5 us on the H200's host), only to redispatch below it.
const NAMESPACES: [&str; 2] = ["deepwell", "deepwell_graph"];

/// `register`: resolves the ABI table from the already-loaded `libtorch_cpu` (and `libtorch_cuda`,
/// absent for a CPU-only torch), configures the GPU runtime (NVRTC path and JIT cache directory,
/// either may be absent; `print_compile` logs every kernel load) and registers every kernel under
/// `torch.ops.deepwell` and `torch.ops.deepwell_graph` (`NAMESPACES`). Idempotent. Torch must be
/// imported in this process.
pub fn register_entry(req: &Value) -> Answer {
    let cpu = fields::text(req, "libtorch_cpu")?;
    let cuda = fields::opt_text(req, "libtorch_cuda")?;
    let gpu = deepwell_gpu::Config {
        nvrtc_path: fields::opt_text(req, "nvrtc")?,
        cache_dir: fields::opt_text(req, "cache_dir")?,
        print_compile: fields::flag(req, "print_compile")?,
    };
    register(&cpu, cuda.as_deref(), gpu)?;
    Ok(Value::Null)
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
    for (ns, key) in NAMESPACES.iter().flat_map(|ns| keys.iter().map(move |key| (*ns, *key))) {
        let mut lib = std::ptr::null_mut();
        let (ns_c, key_c) = (c_message(ns), c_message(key));
        // SAFETY: valid C strings; `lib` receives a heap torch::Library that we never free (freeing
        // it would deregister the kernels).
        let code = unsafe {
            (api.aoti_torch_library_init_impl)(
                ns_c.as_ptr(),
                key_c.as_ptr(),
                c"rust/ops/src/register.rs".as_ptr(),
                line!(),
                &mut lib,
            )
        };
        if code != 0 {
            return Err(Error::Load(format!("aoti_torch_library_init_impl({ns}, {key}) failed")));
        }
        for k in all_kernels().into_iter().filter(|k| k.dispatch_key == key) {
            let name = c_message(k.spec.name);
            // SAFETY: `lib` is a live library handle; the kernel is a `C-unwind` fn with the boxed
            // signature; the version is the encoding our stack decoder implements.
            let code = unsafe { (api.torch_library_impl)(lib, name.as_ptr(), k.boxed, EXTENSION_BUILD_VERSION) };
            if code != 0 {
                return Err(Error::Load(format!("registering {ns}::{} for {key} failed", k.spec.name)));
            }
        }
    }
    let _ = REGISTERED.set(());
    Ok(())
}

/// `compile_all`: compiles every CUDA kernel the ops can launch for each arch in `archs` (e.g.
/// ["sm_90a", "sm_100a", "sm_120a"]) with the NVRTC at `nvrtc`. Needs no GPU. Answers a report, one
/// line per arch; the first failure fails the call.
pub fn compile_all_entry(req: &Value) -> Answer {
    let nvrtc = fields::text(req, "nvrtc")?;
    let archs = fields::get(req, "archs")?.as_array().ok_or("field 'archs' must be a list of strings")?;
    let archs: Vec<String> = archs
        .iter()
        .map(|a| a.as_str().ok_or("field 'archs' must be a list of strings".to_owned()))
        .map(|a| a.and_then(|a| deepwell_gpu::arch::parse_arch(a.trim())))
        .collect::<std::result::Result<_, String>>()?;
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
    Ok(json!(report.join("\n")))
}

/// `version`: the crate version, e.g. "0.1.0".
pub fn version_entry(_: &Value) -> Answer {
    Ok(json!(env!("CARGO_PKG_VERSION")))
}

/// `kernel_table`: every registered kernel as `{"op", "key", "args": [[name, type], ...],
/// "returns"}`, so the tests can check the Rust specs against the Python schemas.
pub fn kernel_table_entry(_: &Value) -> Answer {
    let rows: Vec<Value> = all_kernels()
        .iter()
        .map(|k| {
            let args: Vec<Value> = k.spec.args.iter().map(|(n, kind)| json!([n, kind.schema_type()])).collect();
            json!({"op": k.spec.name, "key": k.dispatch_key, "args": args, "returns": k.spec.returns})
        })
        .collect();
    Ok(Value::Array(rows))
}

/// This module's entries of the C API (`capi.rs`): name, handler, request -> answer.
pub const ENTRIES: Entries = &[
    ("register", register_entry, "{libtorch_cpu, libtorch_cuda?, nvrtc?, cache_dir?, print_compile} -> null"),
    ("compile_all", compile_all_entry, "{nvrtc, archs: [\"sm_90a\", ...]} -> report text"),
    ("version", version_entry, "{} -> \"0.1.0\""),
    ("kernel_table", kernel_table_entry, "{} -> [{op, key, args, returns}]"),
];
