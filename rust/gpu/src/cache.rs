//! The on-disk JIT cache (docs/DESIGN.md "Conventions"). Content-addressed: the key hashes every header's
//! source, the name expression, the arch, the NVRTC version and the options, so a change to any of
//! them compiles anew and stale entries are never used. Entries are written into a temporary
//! directory and renamed into place (atomic on one filesystem, safe with many processes); an
//! incomplete or corrupt entry (checksum mismatch) is deleted and rebuilt. The cache is an
//! optimisation only: when it cannot be written, kernels are compiled in memory (`put`).
//!
//! Layout: `<root>/<key>/kernel.cubin` and `<root>/<key>/meta` ("<sha256 of cubin> <lowered name>").

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{GpuError, Result};
use crate::kernels::KernelId;
use crate::nvrtc::OPTIONS;
use crate::sources::Header;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The cache key of one compiled kernel.
pub fn key(kernel: KernelId, arch: &str, nvrtc_version: &str) -> String {
    let mut h = Sha256::new();
    for header in Header::ALL {
        h.update(header.file_name());
        h.update([0]);
        h.update(header.source());
        h.update([0]);
    }
    for part in [kernel.translation_unit().as_str(), kernel.name_expression().as_str(), arch, nvrtc_version] {
        h.update(part);
        h.update([0]);
    }
    for o in OPTIONS {
        h.update(o);
        h.update([0]);
    }
    hex(&h.finalize())
}

pub struct DiskCache {
    root: PathBuf,
}

fn cache_err(dir: &Path, msg: impl std::fmt::Display) -> GpuError {
    GpuError::Cache { dir: dir.display().to_string(), msg: msg.to_string() }
}

/// Writes `bytes` to a new file and flushes it to disk, so that the rename that publishes the
/// entry never publishes a file whose data is still only in the page cache.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

impl DiskCache {
    pub fn new(root: impl Into<PathBuf>) -> DiskCache {
        DiskCache { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cached (cubin, lowered name) for `key`, or None when absent. An entry that is not
    /// complete and intact (no meta, no cubin, unparsable meta, checksum mismatch: a truncated or
    /// foreign file) is removed, so the caller's rebuild can store a good one in its place.
    pub fn get(&self, key: &str) -> Option<(Vec<u8>, String)> {
        let dir = self.root.join(key);
        if !dir.exists() {
            return None;
        }
        let entry = read_entry(&dir);
        if entry.is_none() {
            let _ = fs::remove_dir_all(&dir);
        }
        entry
    }

    /// Stores an entry, best effort: a cache that cannot be written (read-only directory, a file
    /// where the directory should be, a full disk) only costs a recompile next time, never the
    /// kernel load that just compiled successfully. The first failure per process is reported on
    /// stderr, naming the directory.
    pub fn put(&self, key: &str, cubin: &[u8], lowered: &str) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        if let Err(e) = self.try_put(key, cubin, lowered) {
            WARNED.call_once(|| eprintln!("deepwell: warning: kernels will not be cached on disk: {e}"));
        }
    }

    /// Stores an entry atomically: written and synced in a private temporary directory, then
    /// renamed into place, so readers (other threads, other processes) see the whole entry or none.
    /// If another writer stored a good entry for the same key first, theirs is kept; a broken
    /// entry in the way is replaced.
    pub fn try_put(&self, key: &str, cubin: &[u8], lowered: &str) -> Result<()> {
        fs::create_dir_all(&self.root).map_err(|e| cache_err(&self.root, e))?;
        let tmp = self.root.join(format!(".tmp-{key}-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).map_err(|e| cache_err(&self.root, e))?;
        let write = || -> std::io::Result<()> {
            write_synced(&tmp.join("kernel.cubin"), cubin)?;
            write_synced(&tmp.join("meta"), format!("{} {lowered}\n", hex(&Sha256::digest(cubin))).as_bytes())
        };
        if let Err(e) = write() {
            let _ = fs::remove_dir_all(&tmp);
            return Err(cache_err(&self.root, e));
        }
        let dest = self.root.join(key);
        let result = self.publish(&tmp, &dest);
        let _ = fs::remove_dir_all(&tmp); // left only when the rename did not happen
        result
    }

    fn publish(&self, tmp: &Path, dest: &Path) -> Result<()> {
        for _ in 0..2 {
            if fs::rename(tmp, dest).is_ok() {
                return Ok(());
            }
            // rename(2) does not replace a non-empty directory: another writer's entry is there.
            if read_entry(dest).is_some() {
                return Ok(()); // theirs is as good as ours
            }
            // A broken entry (a crashed writer of an older version, a truncated copy): replace it.
            let _ = fs::remove_dir_all(dest);
        }
        Err(cache_err(&self.root, format!("could not move an entry into {}", dest.display())))
    }
}

/// A complete, intact entry: meta parses and the cubin's checksum matches it.
fn read_entry(dir: &Path) -> Option<(Vec<u8>, String)> {
    let meta = fs::read_to_string(dir.join("meta")).ok()?;
    let (sum, lowered) = meta.trim_end().split_once(' ')?;
    let cubin = fs::read(dir.join("kernel.cubin")).ok()?;
    (sum == hex(&Sha256::digest(&cubin)) && !lowered.is_empty()).then(|| (cubin, lowered.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_root(name: &str) -> PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("deepwell-cache-test-{name}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        p
    }

    #[test]
    fn round_trip_and_corruption_is_rebuilt() {
        let cache = DiskCache::new(temp_root("rt"));
        assert!(cache.get("k").is_none());
        cache.try_put("k", b"\x7fELF cubin bytes", "_Z6kernelv").unwrap();
        assert_eq!(cache.get("k").unwrap(), (b"\x7fELF cubin bytes".to_vec(), "_Z6kernelv".to_owned()));
        // A second writer of the same key keeps the first entry.
        cache.try_put("k", b"other", "_Z6otherv").unwrap();
        assert_eq!(cache.get("k").unwrap().1, "_Z6kernelv");
        // Truncate the cubin: the entry is detected, removed, and reported absent.
        fs::write(cache.root().join("k").join("kernel.cubin"), b"\x7fELF").unwrap();
        assert!(cache.get("k").is_none());
        assert!(!cache.root().join("k").exists());
        let _ = fs::remove_dir_all(cache.root());
    }

    #[test]
    fn keys_depend_on_every_input() {
        use crate::kernels::{mxfp8, Float, Mxfp8};
        let rows = |input| KernelId::Mxfp8(Mxfp8::Rows { input, mode: mxfp8::Mode::Rceil, elem: mxfp8::Fp8::E4M3 });
        let spec = rows(Float::BF16);
        let k = key(spec, "sm_90a", "13.0");
        assert_eq!(k.len(), 64);
        assert_ne!(k, key(spec, "sm_100a", "13.0"));
        assert_ne!(k, key(spec, "sm_90a", "13.2"));
        assert_ne!(k, key(rows(Float::F32), "sm_90a", "13.0"));
    }

    /// Every way an entry can be broken on disk; each is detected, removed and rebuilt.
    fn corruptions() -> Vec<(&'static str, fn(&Path))> {
        vec![
            ("truncated cubin", |d| fs::write(d.join("kernel.cubin"), b"\x7fELF").unwrap()),
            ("same-length garbage cubin", |d| {
                let n = fs::read(d.join("kernel.cubin")).unwrap().len();
                fs::write(d.join("kernel.cubin"), vec![0u8; n]).unwrap()
            }),
            ("empty cubin", |d| fs::write(d.join("kernel.cubin"), b"").unwrap()),
            ("missing cubin", |d| fs::remove_file(d.join("kernel.cubin")).unwrap()),
            ("missing meta", |d| fs::remove_file(d.join("meta")).unwrap()),
            ("garbage meta", |d| fs::write(d.join("meta"), b"\xff\xfe not a checksum").unwrap()),
            ("meta without a name", |d| fs::write(d.join("meta"), b"0123\n").unwrap()),
            ("empty meta", |d| fs::write(d.join("meta"), b"").unwrap()),
        ]
    }

    const CUBIN: &[u8] = b"\x7fELF a complete cubin";

    /// A fresh cache (under `temp_root(name)`) holding the entry "k" of `CUBIN`, broken by `corrupt`.
    fn broken_cache(name: &str, corrupt: fn(&Path)) -> DiskCache {
        let cache = DiskCache::new(temp_root(name));
        cache.try_put("k", CUBIN, "_Z1kv").unwrap();
        corrupt(&cache.root().join("k"));
        cache
    }

    #[test]
    fn broken_entries_are_detected_and_rebuilt() {
        for (what, corrupt) in corruptions() {
            let cache = broken_cache("broken", corrupt);
            assert!(cache.get("k").is_none(), "{what}: a broken entry was served");
            assert!(!cache.root().join("k").exists(), "{what}: the broken entry was not removed");
            cache.try_put("k", CUBIN, "_Z1kv").unwrap();
            assert_eq!(cache.get("k").unwrap(), (CUBIN.to_vec(), "_Z1kv".to_owned()), "{what}");
            let _ = fs::remove_dir_all(cache.root());
        }
    }

    #[test]
    fn a_put_replaces_a_broken_entry_in_its_way() {
        // Without a get first (another process may have left the broken entry after our get).
        for (what, corrupt) in corruptions() {
            let cache = broken_cache("in-the-way", corrupt);
            cache.try_put("k", CUBIN, "_Z1kv").unwrap();
            assert_eq!(cache.get("k").unwrap().0, CUBIN, "{what}");
            let _ = fs::remove_dir_all(cache.root());
        }
    }

    /// try_put fails naming the directory; put (what kernel loads call) still succeeds, and get
    /// reports a miss, so the kernel is compiled in memory.
    fn assert_unwritable(cache: &DiskCache) {
        let dir = cache.root().display().to_string();
        let err = cache.try_put("k", b"x", "y").unwrap_err().to_string();
        assert!(err.contains(&dir), "{err}");
        cache.put("k", b"x", "y"); // warns, does not fail
        assert!(cache.get("k").is_none());
    }

    #[test]
    fn unwritable_roots_cost_only_a_recompile() {
        assert_unwritable(&DiskCache::new("/proc/deepwell-cannot-write-here"));
        // The configured directory is a file.
        let file = temp_root("is-a-file");
        fs::write(&file, b"not a directory").unwrap();
        assert_unwritable(&DiskCache::new(&file));
        assert_unwritable(&DiskCache::new(file.join("below-a-file")));
        let _ = fs::remove_file(&file);
    }

    #[test]
    fn read_only_root_serves_hits_and_skips_writes() {
        use std::os::unix::fs::PermissionsExt;
        let cache = DiskCache::new(temp_root("read-only"));
        cache.try_put("hit", CUBIN, "_Z1kv").unwrap();
        fs::set_permissions(cache.root(), fs::Permissions::from_mode(0o555)).unwrap();
        // root ignores permission bits: then there is nothing read-only to test here.
        if fs::write(cache.root().join("probe"), b"").is_err() {
            assert_eq!(cache.get("hit").unwrap().0, CUBIN);
            assert_unwritable(&cache);
        }
        fs::set_permissions(cache.root(), fs::Permissions::from_mode(0o755)).unwrap();
        let _ = fs::remove_dir_all(cache.root());
    }

    #[test]
    fn concurrent_writers_never_expose_a_partial_entry() {
        // 8 writers store different (each self-consistent) entries under one key while a reader
        // polls: every hit must be one writer's complete cubin with its own name.
        let cache = std::sync::Arc::new(DiskCache::new(temp_root("concurrent")));
        let payload = |w: usize| (vec![w as u8; 64 * 1024 + w * 4099], format!("_Z{w}kv"));
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (cache, done) = (cache.clone(), done.clone());
            std::thread::spawn(move || {
                let mut hits = 0;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Some((cubin, lowered)) = cache.get("k") {
                        let w = cubin[0] as usize;
                        assert_eq!((cubin, lowered), payload(w), "a partial or mixed entry was served");
                        hits += 1;
                    }
                }
                hits
            })
        };
        let writers: Vec<_> = (0..8)
            .map(|w| {
                let cache = cache.clone();
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        let (cubin, lowered) = payload(w);
                        cache.try_put("k", &cubin, &lowered).unwrap();
                        // Readers also delete what they consider broken: race that too.
                        if w % 2 == 0 {
                            let _ = cache.get("k");
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        reader.join().unwrap();
        let (cubin, lowered) = cache.get("k").expect("an entry after the writers finished");
        assert_eq!((cubin.clone(), lowered), payload(cubin[0] as usize));
        let leftovers: Vec<_> = fs::read_dir(cache.root()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers, vec![std::ffi::OsString::from("k")], "temporary directories left behind");
        let _ = fs::remove_dir_all(cache.root());
    }
}
