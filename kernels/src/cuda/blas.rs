//! Matrix products of the forward pass through cuBLAS: bf16 inputs, f32 accumulation, bf16 or f32
//! outputs, on the device's stream.
//!
//! Every matrix is row-major, as the rest of Tandem keeps them: `y[m, n] = x[m, k] · w[n, k]ᵀ`,
//! with `w` a weight in HF layout (`[out, in]`). In cuBLAS's column-major terms that is
//! `yᵀ (n×m) = wᵀ (n×k) · xᵀ (k×m)`, i.e. `gemm(T, N, n, m, k, w, k, x, k, y, n)`.
//!
//! Invariant: the handle is bound to the device's stream and used only from it, with a fixed
//! workspace, so products can be captured into a CUDA graph.

use std::ffi::c_void;

use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaSlice;

use super::Device;
use crate::KernelError;

/// Bytes of cuBLAS workspace (what NVIDIA recommends on Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// What a product writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// `y = x · wᵀ` as bf16.
    Bf16,
    /// `y = x · wᵀ` as f32.
    F32,
    /// `y += x · wᵀ` into f32 (a residual add for free).
    AccumulateF32,
}

/// A cuBLAS handle on a device's stream.
#[derive(Debug)]
pub struct Blas {
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
}

impl Blas {
    pub fn new(device: &Device) -> Result<Self, KernelError> {
        device.context().bind_to_thread()?;
        let blas = CudaBlas::new(device.stream().clone()).map_err(KernelError::blas)?;
        let workspace = device.stream().alloc_zeros::<u8>(WORKSPACE_BYTES)?;
        let addr = super::address(&workspace, device);
        // SAFETY: the workspace lives as long as the handle (both in `self`).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                addr as *mut c_void,
                WORKSPACE_BYTES,
            )
        }
        .result()
        .map_err(KernelError::blas)?;
        Ok(Blas {
            blas,
            _workspace: workspace,
        })
    }

    /// `y[m, n] (op) x[m, k] · w[n, k]ᵀ`, with `x` and `w` bf16 at device addresses and rows of
    /// `ldx`, `ldy` elements.
    ///
    /// # Safety
    /// The addresses must be device memory holding the shapes given, alive until the stream has run
    /// the product.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        x: u64,
        ldx: usize,
        w: u64,
        y: u64,
        ldy: usize,
        (m, n, k): (usize, usize, usize),
        out: Output,
    ) -> Result<(), KernelError> {
        let (alpha, beta) = (
            1.0f32,
            if out == Output::AccumulateF32 {
                1.0f32
            } else {
                0.0
            },
        );
        let y_type = match out {
            Output::Bf16 => cudaDataType::CUDA_R_16BF,
            Output::F32 | Output::AccumulateF32 => cudaDataType::CUDA_R_32F,
        };
        let dim = |v: usize| i32::try_from(v).map_err(|_| KernelError::Shape(format!("{v} > i32")));
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                dim(n)?,
                dim(m)?,
                dim(k)?,
                (&alpha) as *const f32 as *const c_void,
                w as *const c_void,
                cudaDataType::CUDA_R_16BF,
                dim(k)?,
                x as *const c_void,
                cudaDataType::CUDA_R_16BF,
                dim(ldx)?,
                (&beta) as *const f32 as *const c_void,
                y as *mut c_void,
                y_type,
                dim(ldy)?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(KernelError::blas)
    }
}
