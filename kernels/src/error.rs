//! The crate's one error type (its driver variant only with the `cuda` feature).

#[cfg(feature = "cuda")]
use cudarc::driver::DriverError;
use tandem_kv_checksum::KvChecksumError;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// No NVIDIA driver library (libcuda.so.1) could be loaded.
    #[error("no NVIDIA driver: libcuda.so.1 could not be loaded")]
    NoDriver,
    /// The driver loaded but has no such device.
    #[error("no CUDA device {ordinal} (the driver sees {count})")]
    NoDevice { ordinal: usize, count: i32 },
    /// A CUDA driver call failed.
    #[cfg(feature = "cuda")]
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    /// A checksum job does not fit the device memory or the kernel's limits.
    #[error(transparent)]
    Checksum(#[from] KvChecksumError),
    /// A model shape, weight or step the GPU decoder cannot run.
    #[error("GPU decoder: {0}")]
    Shape(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// A device KV cache shape or access that cannot be served.
    #[error("device KV cache: {0}")]
    Cache(String),
}

#[cfg(feature = "cuda")]
impl KernelError {
    pub(crate) fn blas(e: cudarc::cublas::result::CublasError) -> Self {
        KernelError::Blas(format!("{e:?}"))
    }
}
