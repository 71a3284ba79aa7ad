//! Kernels for tests and benchmarks: a reproducible fill of device memory, and a kernel that keeps
//! a stream busy for a known time (a stand-in for an engine step's forward).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, CudaFunction, CudaStream};

use super::Device;
use crate::KernelError;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/testing.ptx"));

/// The loaded testing kernels.
#[derive(Debug)]
pub struct Testing {
    device: Device,
    fill: CudaFunction,
    spin: CudaFunction,
}

impl Testing {
    pub fn load(device: &Device) -> Result<Self, KernelError> {
        let module = device.load(PTX)?;
        Ok(Testing {
            device: device.clone(),
            fill: module.load_function("tandem_fill_hash")?,
            spin: module.load_function("tandem_spin")?,
        })
    }

    /// Writes `splitmix64(seed + i)` to the `n` u64s at device address `addr`, on the device's
    /// stream. The caller guarantees `addr .. addr + 8n` is device memory it owns.
    pub fn fill_hash(&self, addr: u64, n: usize, seed: u64) -> Result<(), KernelError> {
        let mut ptr = addr;
        let mut n = n as u64;
        let mut seed = seed;
        let mut params: [*mut c_void; 3] = [
            (&mut ptr) as *mut u64 as *mut c_void,
            (&mut n) as *mut u64 as *mut c_void,
            (&mut seed) as *mut u64 as *mut c_void,
        ];
        self.device.context().bind_to_thread()?;
        // SAFETY: the kernel's parameters are (u64*, u64, u64), matching `params`; the memory is
        // the caller's.
        unsafe {
            result::launch_kernel(
                self.fill.cu_function(),
                (1024, 1, 1),
                (256, 1, 1),
                0,
                self.device.stream().cu_stream(),
                &mut params,
            )
        }?;
        Ok(())
    }

    /// Queues a kernel on `stream` that runs for `ns` nanoseconds.
    pub fn spin(&self, stream: &Arc<CudaStream>, ns: u64) -> Result<(), KernelError> {
        let mut ns = ns;
        let mut params: [*mut c_void; 1] = [(&mut ns) as *mut u64 as *mut c_void];
        self.device.context().bind_to_thread()?;
        // SAFETY: the kernel takes one u64.
        unsafe {
            result::launch_kernel(
                self.spin.cu_function(),
                (1, 1, 1),
                (1, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
        }?;
        Ok(())
    }
}
