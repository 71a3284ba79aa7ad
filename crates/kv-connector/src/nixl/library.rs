//! Finding and loading NIXL's native library, and UCX's network-device default.
//!
//! `nixl-sys` is built with `stub-api`: its functions `dlopen("libnixl_capi.so")` on first use and
//! `abort()` the whole process when that fails. [`load_nixl`] therefore finds the library itself
//! and `dlopen`s it by absolute path with `RTLD_NOW | RTLD_GLOBAL` *before* any `nixl_sys` call;
//! the stub's later `dlopen` then matches the loaded library by its SONAME.
//!
//! Where it looks, in order (the first hit wins):
//! 1. the directory passed by the caller (a flag), else `$TANDEM_NIXL_LIB_DIR`: when either is
//!    given, it must hold the library (no silent fall-back to another copy);
//! 2. `<dir>/.nixl/.nixl_cu12.mesonpy.libs` (or `cu13`, where `scripts/setup.sh` installs it) for
//!    `<dir>` the current directory and each of its ancestors, then the executable's directory and
//!    its ancestors (so `target/release/tandem` of a checkout finds the checkout's copy);
//! 3. the dynamic linker's own search (`LD_LIBRARY_PATH`, `ldconfig`).
//!
//! Invariants: no `nixl_sys` function runs before a successful load (so `is_stub()`, which caches
//! its answer, is asked only after it); the library is never unloaded; a failed search returns
//! [`KvConnectorError::NixlLibraryNotFound`] listing every place looked at, it never aborts.
//!
//! UCX network devices: when the user has not set `UCX_NET_DEVICES`, [`load_nixl`] sets it to
//! `lo` (once, before any UCX context exists). On one host the KV bytes then move zero-copy through
//! UCX's `cma` transport (process_vm_readv), and wire-up, notifications and flushes use TCP over
//! loopback. Across hosts set `UCX_NET_DEVICES` to the interface(s) that reach the peers
//! (`eth0`, `mlx5_0:1`, or `all`). `UCX_TLS` is left to UCX's own selection: NIXL refuses a
//! `UCX_TLS` without CUDA transports on a host with GPUs, so a fixed default would break there.
//! (NIXL's per-backend `ucx_devices` parameter cannot replace the variable: it only takes
//! InfiniBand ports.) A variable the user has set is never changed.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::KvConnectorError;

/// Environment variable naming the directory that holds `libnixl_capi.so`.
pub const LIB_DIR_ENV: &str = "TANDEM_NIXL_LIB_DIR";
/// The file name of NIXL's C API library.
pub const LIB_FILE: &str = "libnixl_capi.so";
/// Where `scripts/setup.sh` installs the library, relative to the repository root.
pub const WHEEL_LIB_DIRS: [&str; 2] = [
    ".nixl/.nixl_cu12.mesonpy.libs",
    ".nixl/.nixl_cu13.mesonpy.libs",
];

/// `UCX_NET_DEVICES` when the user has not set it.
pub const DEFAULT_UCX_NET_DEVICES: &str = "lo";

/// The loaded NIXL library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlLibrary {
    /// The file that was loaded, or `libnixl_capi.so` when the dynamic linker found it.
    pub path: PathBuf,
    /// `UCX_NET_DEVICES` as UCX will see it.
    pub ucx_net_devices: String,
    /// Whether that value is [`DEFAULT_UCX_NET_DEVICES`], set by this process.
    pub ucx_net_devices_defaulted: bool,
}

static LOADED: Mutex<Option<NixlLibrary>> = Mutex::new(None);

/// Finds NIXL's library (see the module docs for where), loads it once per process, sets the
/// `UCX_NET_DEVICES` default, and returns what was loaded. Later calls return the first load, after checking
/// that an explicitly named directory (argument or `TANDEM_NIXL_LIB_DIR`) does hold the library.
pub fn load_nixl(explicit_dir: Option<&Path>) -> Result<NixlLibrary, KvConnectorError> {
    let env_dir = std::env::var_os(LIB_DIR_ENV).filter(|v| !v.is_empty());
    let found = locate(explicit_dir, env_dir.as_deref().map(Path::new))?;
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(lib) = loaded.as_ref() {
        if let Some(path) = &found {
            if *path != lib.path {
                tracing::debug!(requested = %path.display(), loaded = %lib.path.display(),
                    "NIXL already loaded from another path; keeping the first");
            }
        }
        return Ok(lib.clone());
    }
    let path = match found {
        Some(path) => {
            dlopen_global(&path)?;
            path
        }
        // Last resort: the dynamic linker's own search path.
        None => match dlopen_global(Path::new(LIB_FILE)) {
            Ok(()) => PathBuf::from(LIB_FILE),
            Err(_) => {
                return Err(KvConnectorError::NixlLibraryNotFound {
                    searched: searched_description(explicit_dir, env_dir.as_deref()),
                })
            }
        },
    };
    // Only now may nixl_sys run: its stub finds the library we loaded by SONAME.
    if nixl_sys::is_stub() {
        return Err(KvConnectorError::NixlLibraryLoad {
            path,
            reason: "loaded, but nixl-sys's stub did not pick it up (was a NIXL function \
                     called before load_nixl?)"
                .into(),
        });
    }
    let defaulted = std::env::var_os("UCX_NET_DEVICES").is_none();
    if defaulted {
        // Once, under LOADED's lock, before any UCX context reads it. Callers load NIXL at
        // startup, before other threads read the environment.
        std::env::set_var("UCX_NET_DEVICES", DEFAULT_UCX_NET_DEVICES);
    }
    let lib = NixlLibrary {
        path,
        ucx_net_devices: std::env::var("UCX_NET_DEVICES").unwrap_or_default(),
        ucx_net_devices_defaulted: defaulted,
    };
    tracing::info!(path = %lib.path.display(), ucx_net_devices = %lib.ucx_net_devices,
        defaulted, "NIXL loaded");
    *loaded = Some(lib.clone());
    Ok(lib)
}

/// Whether the library has been loaded in this process.
pub fn nixl_loaded() -> bool {
    LOADED.lock().map(|l| l.is_some()).unwrap_or(false)
}

/// The file `libnixl_capi.so` inside `dir`, accepting also the wheel's install root
/// (`.nixl`) or a repository root in place of the library directory itself.
fn lib_in(dir: &Path) -> Option<PathBuf> {
    let direct = dir.join(LIB_FILE);
    if direct.is_file() {
        return Some(direct);
    }
    for sub in WHEEL_LIB_DIRS {
        // `.nixl/...` under a repository root, or `...` under `.nixl` itself.
        for rel in [
            Path::new(sub),
            Path::new(sub)
                .strip_prefix(".nixl")
                .unwrap_or(Path::new(sub)),
        ] {
            let p = dir.join(rel).join(LIB_FILE);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// Directories searched upward for a `.nixl/` install: the current directory and the
/// executable's directory, each with all its ancestors.
fn search_roots() -> Vec<PathBuf> {
    let mut starts = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        starts.push(cwd);
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        starts.push(dir);
    }
    let mut roots: Vec<PathBuf> = Vec::new();
    for start in starts {
        for dir in start.ancestors() {
            if !roots.iter().any(|r| r == dir) {
                roots.push(dir.to_path_buf());
            }
        }
    }
    roots
}

/// Finds the library file. `Ok(None)`: not found by path (the caller may still try the dynamic
/// linker); `Err`: an explicitly named directory does not hold it.
fn locate(
    explicit_dir: Option<&Path>,
    env_dir: Option<&Path>,
) -> Result<Option<PathBuf>, KvConnectorError> {
    if let Some(dir) = explicit_dir {
        return lib_in(dir)
            .map(Some)
            .ok_or_else(|| KvConnectorError::NixlLibraryNotFound {
                searched: format!("{} (given explicitly)", dir.display()),
            });
    }
    if let Some(dir) = env_dir {
        return lib_in(dir)
            .map(Some)
            .ok_or_else(|| KvConnectorError::NixlLibraryNotFound {
                searched: format!("{} (from {LIB_DIR_ENV})", dir.display()),
            });
    }
    Ok(search_roots().iter().find_map(|root| {
        WHEEL_LIB_DIRS
            .iter()
            .map(|sub| root.join(sub).join(LIB_FILE))
            .find(|p| p.is_file())
    }))
}

fn searched_description(explicit_dir: Option<&Path>, env_dir: Option<&std::ffi::OsStr>) -> String {
    if let Some(dir) = explicit_dir {
        return format!("{} (given explicitly)", dir.display());
    }
    if let Some(dir) = env_dir {
        return format!("{} (from {LIB_DIR_ENV})", Path::new(dir).display());
    }
    let starts: Vec<String> = {
        let mut v = Vec::new();
        if let Ok(cwd) = std::env::current_dir() {
            v.push(format!(
                "{} and its parents (current directory)",
                cwd.display()
            ));
        }
        if let Ok(exe) = std::env::current_exe() {
            if let Some(d) = exe.parent() {
                v.push(format!("{} and its parents (executable)", d.display()));
            }
        }
        v
    };
    format!(
        "<dir>/{{{}}} for <dir> in: {}; then the dynamic linker's path (LD_LIBRARY_PATH)",
        WHEEL_LIB_DIRS.join(","),
        starts.join(", ")
    )
}

/// `dlopen(path, RTLD_NOW | RTLD_GLOBAL)`, keeping the handle for the life of the process.
fn dlopen_global(path: &Path) -> Result<(), KvConnectorError> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        KvConnectorError::NixlLibraryLoad {
            path: path.to_path_buf(),
            reason: "path contains a NUL byte".into(),
        }
    })?;
    // SAFETY: c_path is a valid C string. Loading runs the library's constructors, which is
    // what using it requires anyway; the handle is intentionally never closed.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or NULL.
        let reason = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown dlopen error".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(KvConnectorError::NixlLibraryLoad {
            path: path.to_path_buf(),
            reason,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_dir_without_the_library_is_an_error_that_names_it() {
        let err = locate(Some(Path::new("/nonexistent/nixl")), None).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/nixl"), "{msg}");
        assert!(msg.contains("TANDEM_NIXL_LIB_DIR"), "{msg}");
        assert!(msg.contains("scripts/setup.sh"), "{msg}");
        let err = locate(None, Some(Path::new("/nonexistent/env"))).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/env"));
    }

    #[test]
    fn the_library_is_found_from_a_repository_root_or_the_wheel_root() {
        let tmp = std::env::temp_dir().join(format!("tandem-nixl-lib-{}", std::process::id()));
        let libdir = tmp.join(".nixl/.nixl_cu12.mesonpy.libs");
        std::fs::create_dir_all(&libdir).unwrap();
        std::fs::write(libdir.join(LIB_FILE), b"").unwrap();
        let want = libdir.join(LIB_FILE);
        assert_eq!(lib_in(&tmp).as_deref(), Some(want.as_path()));
        assert_eq!(lib_in(&tmp.join(".nixl")).as_deref(), Some(want.as_path()));
        assert_eq!(lib_in(&libdir).as_deref(), Some(want.as_path()));
        assert_eq!(
            locate(Some(&tmp), None).unwrap().as_deref(),
            Some(want.as_path())
        );
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn the_search_description_lists_the_places() {
        let d = searched_description(None, None);
        assert!(
            d.contains("current directory") && d.contains("executable"),
            "{d}"
        );
        assert!(d.contains(".nixl/.nixl_cu12.mesonpy.libs"), "{d}");
    }
}
