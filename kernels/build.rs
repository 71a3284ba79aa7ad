//! Compiles Tandem's CUDA kernels to PTX when the `cuda` feature is on (nvcc from `CUDA_ROOT`,
//! see `scripts/cuda_toolchain.sh`). The CPU build runs nothing here.

use std::path::PathBuf;
use std::process::Command;

/// Kernel sources under `cuda/`, each compiled to `$OUT_DIR/<name>.ptx`.
const SOURCES: &[&str] = &["kv_checksum", "testing", "decoder"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CUDA_ROOT");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = match std::env::var_os("CUDA_ROOT") {
        Some(root) => PathBuf::from(root).join("bin").join("nvcc"),
        None => PathBuf::from("nvcc"),
    };
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for name in SOURCES {
        let src = format!("cuda/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        let ptx = out.join(format!("{name}.ptx"));
        // PTX for compute capability 9.0 (Hopper): the driver compiles it for the GPU at load
        // time, and later GPUs run it too.
        let status = Command::new(&nvcc)
            .args(["-ptx", "-arch=compute_90", "-O3", "-std=c++17", "-o"])
            .arg(&ptx)
            .arg(&src)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("nvcc failed on {src} ({s})"),
            Err(e) => panic!(
                "the `cuda` feature needs nvcc 13.0 ({} : {e}); run scripts/cuda_toolchain.sh \
                 and set CUDA_ROOT to the directory it prints",
                nvcc.display()
            ),
        }
    }
}
