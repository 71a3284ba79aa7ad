//! The CUDA host side: opening a device, its KV cache, and the kernels' launchers.
//!
//! Invariant: nothing here calls into cudarc before [`Device::open`] has checked that the driver
//! library loads (cudarc panics on a missing library; Tandem returns [`KernelError::NoDriver`]).

mod blas;
mod checksum;
mod decoder;
mod kv_cache;
pub mod testing;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream, DevicePtr};
use cudarc::nvrtc::Ptx;

pub use crate::step::{bf16_bits, bf16_to_f32, DecoderShape, OwnedStep, StepInput, MAX_GROUP};
pub use blas::{Blas, Output};
pub use checksum::{
    CudaBackend, CudaChecksums, DeviceChecksums, PendingChecksums, MAX_BLOCKS_PER_LAUNCH,
};
pub use cudarc::driver::CudaEvent;
pub use decoder::{GpuDecoder, Tensor, Weights};
pub use kv_cache::{DeviceKvCache, DeviceLayer, KvArrangement};

use crate::KernelError;

/// One GPU: its context and the stream the engine's forward runs on.
#[derive(Debug, Clone)]
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
}

impl Device {
    /// Opens GPU `ordinal`, with a clear error where the driver or the device is missing.
    pub fn open(ordinal: usize) -> Result<Self, KernelError> {
        // SAFETY: only tries to load the library, calls nothing in it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(KernelError::NoDriver);
        }
        cudarc::driver::result::init()?;
        let count = CudaContext::device_count()?;
        if ordinal >= count.max(0) as usize {
            return Err(KernelError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.new_stream()?;
        Ok(Device {
            ctx,
            stream,
            ordinal,
        })
    }

    /// The GPU's ordinal on this host.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream the engine's work (forward, cache writes) runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String, KernelError> {
        Ok(self.ctx.name()?)
    }

    /// Loads one of the crate's PTX modules.
    pub(crate) fn load(&self, ptx: &'static str) -> Result<Arc<CudaModule>, KernelError> {
        Ok(self.ctx.load_module(Ptx::from_src(ptx))?)
    }
}

/// The device address of a slice allocated on `device`'s stream.
pub(crate) fn address<T>(slice: &CudaSlice<T>, device: &Device) -> u64 {
    let (ptr, _sync) = slice.device_ptr(device.stream());
    ptr
}
