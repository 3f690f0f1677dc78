//! Per-device state: torch's primary context, the arch to compile for, and the table of loaded
//! kernels. Kernels are compiled on first use (disk cache first) and launched on the stream the
//! caller passes (torch's current stream). Device memory is never allocated here: buffers come
//! from torch's allocator through the ops layer.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{OnceLock, RwLock};

use cudarc::driver::{result, sys};

use crate::arch::{nvrtc_arch, persistent_sms};
use crate::cache::{self, DiskCache};
use crate::error::{driver, GpuError, Result};
use crate::kernels::{Geometry, KernelId, Wave, THREADS};
use crate::nvrtc;
use crate::tma::TensorMap;

/// Where NVRTC and the disk cache are; set once by the ops layer at registration.
pub struct Config {
    pub nvrtc_path: Option<String>,
    pub cache_dir: Option<String>,
    /// Print one line per kernel load to stderr: name, arch, disk-cache hit or compile time.
    pub print_compile: bool,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

pub fn configure(config: Config) {
    let _ = CONFIG.set(config);
}

fn config() -> Option<&'static Config> {
    CONFIG.get()
}

/// SMs deepwell's persistent kernels leave free on every device, for the collectives that run
/// beside them: the FSDP plan's `sm_carveout`, set with torch's own carveout (which cuBLASLt's GEMMs
/// follow) by torch_ops/deepwell/distributed/shard.py through the `sm_carveout` C API entry. Process-wide,
/// as torch's setting is; 0 (every SM) until set.
static SMS_FOR_COLLECTIVES: AtomicU32 = AtomicU32::new(0);

pub fn leave_sms_to_collectives(sms: u32) {
    SMS_FOR_COLLECTIVES.store(sms, Ordering::Relaxed);
}

pub fn sms_left_to_collectives() -> u32 {
    SMS_FOR_COLLECTIVES.load(Ordering::Relaxed)
}

/// A loaded kernel. The module stays loaded for the life of the process.
#[derive(Clone, Copy)]
struct Function(sys::CUfunction);
// SAFETY: CUfunction handles are process-global and usable from any thread with the context current.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

pub struct Device {
    ordinal: i32,
    ctx: sys::CUcontext,
    arch: String,
    capability: (u32, u32),
    sms: u32,
    max_threads_per_sm: u32,
    /// Dynamic shared memory one block may opt into (227 KiB on sm_90).
    max_smem_optin: u32,
    name: String,
    functions: RwLock<HashMap<KernelId, Function>>,
    /// Clusters of a clustered kernel that can be resident at once (cuOccupancyMaxActiveClusters;
    /// the kernel fixes its cluster size and shared memory): the cap of its persistent grid.
    resident_clusters: Occupancy,
    /// CTAs of a `Geometry::resident` kernel that fit on one SM at once
    /// (cuOccupancyMaxActiveBlocksPerMultiprocessor at its block size and shared memory).
    resident_blocks: Occupancy,
}

/// A driver's occupancy answer per kernel, asked once: a kernel always launches with the same
/// block size, shared memory and cluster size, and its registers are fixed at load, so the answer
/// cannot change for the life of the process.
#[derive(Default)]
struct Occupancy(RwLock<HashMap<KernelId, u32>>);

impl Occupancy {
    /// The cached answer for `kernel`, else `ask()`'s, kept (and printed under `print_compile` as
    /// "deepwell: <kernel> fits <n> <what()>"; `what` is a closure so that a launch, which finds
    /// the answer cached, formats nothing).
    fn get_or_ask(
        &self,
        kernel: KernelId,
        ask: impl FnOnce() -> Result<u32>,
        what: impl FnOnce() -> String,
    ) -> Result<u32> {
        if let Some(n) = self.0.read().ok().and_then(|t| t.get(&kernel).copied()) {
            return Ok(n);
        }
        let n = ask()?;
        if let Ok(mut t) = self.0.write() {
            t.insert(kernel, n);
        }
        if self::config().is_some_and(|c| c.print_compile) {
            eprintln!("deepwell: {} fits {n} {}", kernel.name_expression(), what());
        }
        Ok(n)
    }
}

// SAFETY: the primary context handle is process-global; the table is behind an RwLock.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

const MAX_DEVICES: usize = 64;
static DEVICES: [OnceLock<std::result::Result<Device, String>>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];

/// The state of CUDA device `ordinal`, opened on first use (no lock on later calls).
pub fn device(ordinal: i32) -> Result<&'static Device> {
    let slot = DEVICES
        .get(ordinal as usize)
        .ok_or_else(|| GpuError::Unsupported(format!("CUDA device index {ordinal} is out of range")))?;
    slot.get_or_init(|| Device::open(ordinal).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| GpuError::Unsupported(e.clone()))
}

/// Kernel arguments: each scalar is stored in 8 bytes (little-endian, so a 4-byte `int` parameter
/// reads the low half), a tensor map in its 16 words; cuLaunchKernel receives a pointer to each
/// parameter's first word and copies as many bytes as the kernel's parameter has.
#[derive(Default)]
pub struct Params {
    words: Vec<u64>,
    /// Index in `words` of each parameter's first word.
    starts: Vec<usize>,
}

impl Params {
    pub fn new() -> Params {
        Params::default()
    }
    fn push(mut self, words: &[u64]) -> Params {
        self.starts.push(self.words.len());
        self.words.extend_from_slice(words);
        self
    }
    pub fn ptr(self, p: *const c_void) -> Params {
        self.push(&[p as u64])
    }
    pub fn i64(self, v: i64) -> Params {
        self.push(&[v as u64])
    }
    pub fn u64(self, v: u64) -> Params {
        self.push(&[v])
    }
    pub fn i32(self, v: i32) -> Params {
        self.push(&[v as u32 as u64])
    }
    /// A `__grid_constant__ TmaDesc` parameter (cuda/sm90.cuh).
    pub fn tensor_map(self, map: &TensorMap) -> Params {
        self.push(map)
    }
}

impl Device {
    fn open(ordinal: i32) -> Result<Device> {
        driver("cuInit", result::init())?;
        let dev = driver("cuDeviceGet", result::device::get(ordinal))?;
        // SAFETY: `dev` is a valid device; retaining the primary context is what the CUDA runtime
        // (and so torch) does too, so both share one context.
        let ctx = driver("cuDevicePrimaryCtxRetain", unsafe { result::primary_ctx::retain(dev) })?;
        let attr = |a| driver("cuDeviceGetAttribute", unsafe { result::device::get_attribute(dev, a) });
        use sys::CUdevice_attribute::*;
        let (major, minor) =
            (attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
        let sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_threads_per_sm = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)? as u32;
        let max_smem_optin = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;
        let arch = nvrtc_arch(major, minor).map_err(GpuError::Unsupported)?;
        let name = driver("cuDeviceGetName", result::device::get_name(dev))?;
        let capability = (major as u32, minor as u32);
        let functions = RwLock::new(HashMap::new());
        Ok(Device {
            ordinal,
            ctx,
            arch,
            capability,
            sms,
            max_threads_per_sm,
            max_smem_optin,
            name,
            functions,
            resident_clusters: Occupancy::default(),
            resident_blocks: Occupancy::default(),
        })
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }
    pub fn arch(&self) -> &str {
        &self.arch
    }
    /// The compute capability `(major, minor)`.
    pub fn capability(&self) -> (u32, u32) {
        self.capability
    }
    pub fn sms(&self) -> u32 {
        self.sms
    }
    /// Blocks of `threads` threads that fit on one SM at once (by thread count: 8 of 256 on
    /// sm_90/sm_100, 6 on sm_120).
    pub fn resident_blocks_per_sm(&self, threads: u32) -> u32 {
        (self.max_threads_per_sm / threads.max(1)).max(1)
    }
    /// One wave of resident CTAs of THREADS threads, the cap of every grid-stride launch.
    pub fn wave(&self) -> Wave {
        Wave { sms: self.sms, per_sm: self.resident_blocks_per_sm(THREADS) }
    }
    /// The SMs a persistent kernel may hold: all but those left to collectives.
    pub fn persistent_sms(&self) -> u32 {
        persistent_sms(self.sms, sms_left_to_collectives())
    }
    /// `wave()` over the SMs a persistent kernel may hold (its grid: one CTA on each).
    pub fn persistent_wave(&self) -> Wave {
        Wave { sms: self.persistent_sms(), ..self.wave() }
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The most dynamic shared memory one block may use (kernels with `dynamic_smem` opt in).
    pub fn max_smem_optin(&self) -> u32 {
        self.max_smem_optin
    }

    /// Makes this device's primary context current on the calling thread (as every launch does).
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: a retained primary context; making it current on this thread is always valid.
        driver("cuCtxSetCurrent", unsafe { result::ctx::set_current(self.ctx) })
    }

    /// Compiles (or reads from the disk cache) and loads `kernel`.
    fn load(&self, kernel: KernelId) -> Result<Function> {
        let cfg = config().ok_or_else(|| GpuError::Unsupported("deepwell's GPU runtime is not configured".into()))?;
        let path = cfg.nvrtc_path.as_deref().ok_or_else(|| {
            GpuError::Unsupported(
                "NVRTC was not found (torch's nvidia/cu13/lib/libnvrtc.so.13); deepwell cannot build its kernels"
                    .into(),
            )
        })?;
        let nvrtc = nvrtc::load(path)?;
        let disk = cfg.cache_dir.as_ref().map(DiskCache::new);
        let start = std::time::Instant::now();
        let (cubin, lowered, how, key) = cached_compile(nvrtc, disk.as_ref(), kernel, &self.arch)?;
        if cfg.print_compile {
            let ms = start.elapsed().as_secs_f64() * 1e3;
            eprintln!(
                "deepwell: {} for {} ({how}, {ms:.0} ms, {} bytes, key {})",
                kernel.name_expression(),
                self.arch,
                cubin.len(),
                &key[..12]
            );
        }
        self.make_current()?;
        // SAFETY: `cubin` is a complete cubin image for this device's arch; the module is never
        // unloaded, so the function handle stays valid.
        unsafe {
            let module = driver("cuModuleLoadData", result::module::load_data(cubin.as_ptr().cast()))?;
            let name = CString::new(lowered).map_err(|e| GpuError::Nvrtc(e.to_string()))?;
            let f = driver("cuModuleGetFunction", result::module::get_function(module, name))?;
            if kernel.dynamic_smem() {
                // Opt in once to the device's whole per-block shared memory less the kernel's static
                // arrays (the driver refuses more); each launch asks for what it needs (above 48 KiB
                // in all a launch fails without this).
                use sys::CUfunction_attribute_enum::{
                    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC,
                    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES as STATIC,
                };
                let fixed = driver("cuFuncGetAttribute", result::function::get_function_attribute(f, STATIC))?;
                let bytes = self.max_smem_optin as i32 - fixed;
                driver("cuFuncSetAttribute", result::function::set_function_attribute(f, MAX_DYNAMIC, bytes))?;
            }
            Ok(Function(f))
        }
    }

    fn function(&self, kernel: KernelId) -> Result<Function> {
        if let Some(f) = self.functions.read().ok().and_then(|t| t.get(&kernel).copied()) {
            return Ok(f);
        }
        let f = self.load(kernel)?;
        if let Ok(mut t) = self.functions.write() {
            t.entry(kernel).or_insert(f);
        }
        Ok(f)
    }

    /// Launches `kernel` with the 1-D geometry `g` on `stream` (torch's current stream of this
    /// device).
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list, and every pointer in it must be valid
    /// device memory of the sizes the kernel accesses for the given sizes.
    pub unsafe fn launch(&self, kernel: KernelId, g: Geometry, stream: *mut c_void, params: Params) -> Result<()> {
        let f = self.function(kernel)?;
        if g.smem > self.max_smem_optin {
            return Err(GpuError::Unsupported(format!(
                "{} needs {} bytes of shared memory; {} has {} per block",
                kernel.name_expression(),
                g.smem,
                self.name,
                self.max_smem_optin
            )));
        }
        self.make_current()?;
        let Params { mut words, starts } = params;
        let base = words.as_mut_ptr();
        // SAFETY: every start indexes `words`.
        let mut ptrs: Vec<*mut c_void> = starts.iter().map(|&i| unsafe { base.add(i) } as *mut c_void).collect();
        if g.cluster > 1 {
            // SAFETY: as below; the launch configuration lives through the call.
            return unsafe { self.launch_clustered(kernel, f, g, stream, &mut ptrs) };
        }
        let grid = if g.resident { g.grid.min(self.resident_blocks(kernel, f, g)? * self.sms) } else { g.grid };
        // SAFETY: guaranteed by the caller; `words` outlives the call (cuLaunchKernel copies the
        // parameters before returning).
        driver("cuLaunchKernel", unsafe {
            result::launch_kernel(f.0, (grid, 1, 1), (g.block, 1, 1), g.smem, stream as sys::CUstream, &mut ptrs)
        })
    }

    /// CTAs of `kernel` (loaded as `f`, launched as `g`) that fit on one SM at once, at least one;
    /// asked of the driver once per kernel (its registers and shared memory fix the answer).
    fn resident_blocks(&self, kernel: KernelId, f: Function, g: Geometry) -> Result<u32> {
        let ask = || {
            let mut n: i32 = 0;
            // SAFETY: `f` is a loaded function of this context.
            let code = unsafe {
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f.0, g.block as i32, g.smem as usize)
            };
            driver("cuOccupancyMaxActiveBlocksPerMultiprocessor", code.result())?;
            Ok(n.max(1) as u32)
        };
        self.resident_blocks.get_or_ask(kernel, ask, || format!("CTAs of {} threads per SM", g.block))
    }

    /// A launch in clusters of `g.cluster` CTAs (cuLaunchKernelEx). A persistent kernel's grid is
    /// cut to the clusters that fit at once: an SM pair split across two GPCs cannot host one, so
    /// one CTA per SM can overshoot, and a cluster that waits for a whole earlier one to finish
    /// would double the kernel's time.
    ///
    /// # Safety
    /// As `launch`; `ptrs` point at the kernel's parameters.
    unsafe fn launch_clustered(
        &self,
        kernel: KernelId,
        f: Function,
        g: Geometry,
        stream: *mut c_void,
        ptrs: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: an all-zero launch attribute is a valid value of the C struct.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attr.value.clusterDim.x = g.cluster;
        attr.value.clusterDim.y = 1;
        attr.value.clusterDim.z = 1;
        let mut config = sys::CUlaunchConfig {
            gridDimX: g.grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: g.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: g.smem,
            hStream: stream as sys::CUstream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        let ask = || {
            let mut n: i32 = 0;
            // SAFETY: `f` is a loaded function of this context; `config` is a complete
            // configuration (its grid is ignored by the query).
            let code = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.0, &config) };
            driver("cuOccupancyMaxActiveClusters", code.result())?;
            Ok(n.max(0) as u32)
        };
        let resident =
            self.resident_clusters.get_or_ask(kernel, ask, || format!("clusters of {} at once", g.cluster))?;
        if resident == 0 {
            return Err(GpuError::Unsupported(format!(
                "{} cannot run in clusters of {} on {} ({} bytes of shared memory per CTA)",
                kernel.name_expression(),
                g.cluster,
                self.name,
                g.smem
            )));
        }
        config.gridDimX = g.grid.min(resident * g.cluster);
        // SAFETY: guaranteed by the caller; cuLaunchKernelEx copies the parameters before returning.
        let code = unsafe { sys::cuLaunchKernelEx(&config, f.0, ptrs.as_mut_ptr(), std::ptr::null_mut()) };
        driver("cuLaunchKernelEx", code.result())
    }

    /// True while `stream` (torch's current stream of this device) is capturing a CUDA graph.
    pub fn is_capturing(&self, stream: *mut c_void) -> Result<bool> {
        self.make_current()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `stream` is a live stream of this device's context; valid out pointer.
        let code = unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status) };
        driver("cuStreamIsCapturing", code.result())?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Fills `bytes` bytes at `ptr` with zero on `stream`.
    ///
    /// # Safety
    /// `ptr` must be device memory of at least `bytes` bytes on this device.
    pub unsafe fn memset_zero(&self, ptr: *mut c_void, bytes: usize, stream: *mut c_void) -> Result<()> {
        self.make_current()?;
        // SAFETY: guaranteed by the caller.
        driver("cuMemsetD8Async", unsafe {
            result::memset_d8_async(ptr as sys::CUdeviceptr, 0, bytes, stream as sys::CUstream)
        })
    }
}

/// `kernel`'s cubin for `arch`: from the disk cache, or compiled and written there (a failed write
/// costs only the cache: `DiskCache::put` warns and carries on). Returns the cubin, its lowered
/// name, how it was found, and its cache key.
fn cached_compile(
    nvrtc: &nvrtc::Nvrtc,
    disk: Option<&DiskCache>,
    kernel: KernelId,
    arch: &str,
) -> Result<(Vec<u8>, String, &'static str, String)> {
    let key = cache::key(kernel, arch, &nvrtc.version());
    if let Some((cubin, lowered)) = disk.and_then(|d| d.get(&key)) {
        return Ok((cubin, lowered, "disk cache hit", key));
    }
    let (cubin, lowered) = nvrtc.compile(kernel, arch)?;
    if let Some(d) = disk {
        d.put(&key, &cubin, &lowered);
    }
    Ok((cubin, lowered, "compiled", key))
}

/// Compiles `kernels` for every arch with no GPU (the `--compile-all` check), through the configured
/// disk cache when there is one (so a later run on a GPU of that arch loads them from it). Returns
/// (kernel, arch, cubin bytes) per success and stops at the first failure.
pub fn compile_all(nvrtc_path: &str, kernels: &[KernelId], archs: &[String]) -> Result<Vec<(String, String, usize)>> {
    let nvrtc = nvrtc::load(nvrtc_path)?;
    let disk = config().and_then(|c| c.cache_dir.as_ref()).map(DiskCache::new);
    let mut out = Vec::new();
    for arch in archs {
        for &kernel in kernels {
            let (cubin, ..) = cached_compile(nvrtc, disk.as_ref(), kernel, arch)?;
            out.push((kernel.name_expression(), arch.clone(), cubin.len()));
        }
    }
    Ok(out)
}
