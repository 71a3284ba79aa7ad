//! KV memory that another component owns on an accelerator (a GPU's cache, written by its
//! kernels), as a [`crate::KvStorage`] reaches it: where each layer's K and V blocks are in device
//! addresses, which allocations hold them (what a transfer engine registers), and block copies to
//! and from the host (fault injection, tools).
//!
//! Invariants an implementation keeps: the regions cover every layer of the storage in storage
//! order, K then V, each inside one of the allocations; block `b` of a region starts at
//! `addr + b * block_stride`; the memory stays allocated while the implementation lives.

use crate::storage::{KvPart, MemoryRegion};

/// Where a storage's arrays live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// This process's host memory.
    Host,
    /// The memory of accelerator `device` (its ordinal on this host).
    Device(u64),
}

impl MemoryKind {
    /// `dram` or `vram`, as a transfer engine names the memory.
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Host => "dram",
            MemoryKind::Device(_) => "vram",
        }
    }
}

/// One allocation regions lie in: what a transfer engine registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub addr: usize,
    pub len: usize,
}

/// A device cache seen from the host. See the module docs.
pub trait DeviceKvMemory: Send + Sync + std::fmt::Debug {
    /// The accelerator's ordinal.
    fn device_id(&self) -> u64;
    /// Every layer's K and V region, in storage order, in device addresses.
    fn regions(&self) -> Vec<MemoryRegion>;
    /// The allocations that hold the regions.
    fn allocations(&self) -> Vec<Allocation>;
    /// Copies block `block` of layer `layer`'s `part` to the host (after the device's queued work).
    fn read_block(&self, layer: usize, part: KvPart, block: usize) -> Result<Vec<u8>, String>;
    /// Overwrites block `block` of layer `layer`'s `part` with `bytes` (one block's size).
    fn write_block(
        &self,
        layer: usize,
        part: KvPart,
        block: usize,
        bytes: &[u8],
    ) -> Result<(), String>;
}
