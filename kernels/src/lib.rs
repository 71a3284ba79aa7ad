//! Tandem's GPU side: CUDA kernels (in `cuda/*.cu`, compiled to PTX by `build.rs`) and the host
//! code that launches them through cudarc, built only with the `cuda` feature. The CPU build
//! compiles only the host-side step checks ([`step`]) and the error type, so their tests run
//! everywhere.
//!
//! - [`cuda::Device`]: one GPU, opened with a clear error where there is no driver or device.
//! - [`cuda::DeviceKvCache`]: a paged KV cache in device memory, per-layer arrays or block-major
//!   across layers (a request's KV leaves in few large regions).
//! - [`cuda::CudaChecksums`]: the fused KV checksum kernel, launched on a side stream after an
//!   event, results collected from pinned host memory without blocking the launching thread.

#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod step;

pub use error::KernelError;
