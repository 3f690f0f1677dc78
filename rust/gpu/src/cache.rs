//! The on-disk JIT cache (STYLE.md item 4). Content-addressed: the key hashes every header's
//! source, the name expression, the arch, the NVRTC version and the options, so a change to any of
//! them compiles anew and stale entries are never used. Entries are written into a temporary
//! directory and renamed into place (atomic on one filesystem, safe with many processes); a
//! corrupt entry (checksum mismatch) is deleted and rebuilt.
//!
//! Layout: `<root>/<key>/kernel.cubin` and `<root>/<key>/meta` ("<sha256 of cubin> <lowered name>").

use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{GpuError, Result};
use crate::nvrtc::OPTIONS;
use crate::sources::{Header, KernelSpec};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The cache key of one compiled kernel.
pub fn key(spec: &KernelSpec, arch: &str, nvrtc_version: &str) -> String {
    let mut h = Sha256::new();
    for header in Header::ALL {
        h.update(header.file_name());
        h.update([0]);
        h.update(header.source());
        h.update([0]);
    }
    for part in [spec.translation_unit().as_str(), spec.name.as_str(), arch, nvrtc_version] {
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

impl DiskCache {
    pub fn new(root: impl Into<PathBuf>) -> DiskCache {
        DiskCache { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cached (cubin, lowered name) for `key`, or None when absent. A corrupt entry is removed
    /// (and so rebuilt by the caller).
    pub fn get(&self, key: &str) -> Option<(Vec<u8>, String)> {
        let dir = self.root.join(key);
        let meta = fs::read_to_string(dir.join("meta")).ok()?;
        let cubin = fs::read(dir.join("kernel.cubin")).ok()?;
        let (sum, lowered) = meta.trim_end().split_once(' ')?;
        if sum == hex(&Sha256::digest(&cubin)) && !lowered.is_empty() {
            return Some((cubin, lowered.to_owned()));
        }
        let _ = fs::remove_dir_all(&dir);
        None
    }

    /// Stores an entry atomically. If another process stored the same key first, theirs is kept.
    pub fn put(&self, key: &str, cubin: &[u8], lowered: &str) -> Result<()> {
        fs::create_dir_all(&self.root).map_err(|e| cache_err(&self.root, e))?;
        let tmp = self.root.join(format!(".tmp-{key}-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).map_err(|e| cache_err(&self.root, e))?;
        let write = || -> std::io::Result<()> {
            fs::write(tmp.join("kernel.cubin"), cubin)?;
            fs::write(tmp.join("meta"), format!("{} {lowered}\n", hex(&Sha256::digest(cubin))))?;
            Ok(())
        };
        if let Err(e) = write() {
            let _ = fs::remove_dir_all(&tmp);
            return Err(cache_err(&self.root, e));
        }
        let dest = self.root.join(key);
        if fs::rename(&tmp, &dest).is_err() {
            // Lost a race with another writer (the destination exists and is complete): keep theirs.
            let _ = fs::remove_dir_all(&tmp);
            if !dest.join("meta").exists() {
                return Err(cache_err(&self.root, format!("could not move an entry into {}", dest.display())));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_root(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("deepwell-cache-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        p
    }

    #[test]
    fn round_trip_and_corruption_is_rebuilt() {
        let cache = DiskCache::new(temp_root("rt"));
        assert!(cache.get("k").is_none());
        cache.put("k", b"\x7fELF cubin bytes", "_Z6kernelv").unwrap();
        assert_eq!(cache.get("k").unwrap(), (b"\x7fELF cubin bytes".to_vec(), "_Z6kernelv".to_owned()));
        // A second writer of the same key keeps the first entry.
        cache.put("k", b"other", "_Z6otherv").unwrap();
        assert_eq!(cache.get("k").unwrap().1, "_Z6kernelv");
        // Truncate the cubin: the entry is detected, removed, and reported absent.
        fs::write(cache.root().join("k").join("kernel.cubin"), b"\x7fELF").unwrap();
        assert!(cache.get("k").is_none());
        assert!(!cache.root().join("k").exists());
        let _ = fs::remove_dir_all(cache.root());
    }

    #[test]
    fn keys_depend_on_every_input() {
        let spec = KernelSpec::new(Header::Mxfp8, "deepwell::mxfp8_quantize_rows<deepwell::BF16, 0, 0>");
        let k = key(&spec, "sm_90a", "13.0");
        assert_eq!(k.len(), 64);
        assert_ne!(k, key(&spec, "sm_100a", "13.0"));
        assert_ne!(k, key(&spec, "sm_90a", "13.2"));
        assert_ne!(
            k,
            key(
                &KernelSpec::new(Header::Mxfp8, "deepwell::mxfp8_quantize_rows<deepwell::F32, 0, 0>"),
                "sm_90a",
                "13.0"
            )
        );
    }

    #[test]
    fn unwritable_root_names_the_directory() {
        let cache = DiskCache::new("/proc/deepwell-cannot-write-here");
        let err = cache.put("k", b"x", "y").unwrap_err().to_string();
        assert!(err.contains("/proc/deepwell-cannot-write-here"), "{err}");
    }
}
