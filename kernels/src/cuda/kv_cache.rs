//! A paged KV cache in device memory: every layer's K and V, each a pool of cache blocks laid
//! out as a [`BlockLayout`] says within a block.
//!
//! Two arrangements of the blocks (see [`KvArrangement`]): per-layer arrays, as the CPU's
//! `KvStorage`, or block-major across layers, where cache block `b` of every layer's K and V is
//! one contiguous region: a request's KV then leaves in one region per block (fewer still where
//! its blocks are consecutive) whatever the model's depth, which NIXL over CUDA IPC wants (each
//! descriptor costs about 10 us on the H200). Attention reads a layer's block at a stride of
//! `layers * 2 * block_bytes` instead of `block_bytes`: the same bytes per block, farther apart.
//!
//! The arrays are `cuMemAlloc` allocations, not the stream-ordered pool's that other device
//! buffers use: CUDA IPC (how NIXL's UCX backend moves KV between processes on one host) exports
//! only the former.
//!
//! Invariants: the memory lives as long as any clone of the cache's [`Arc`] (pending kernels hold
//! one); [`DeviceLayer`] addresses stay inside it for every block id `< num_blocks`.

use std::sync::Arc;

use cudarc::driver::{result, CudaContext};
use tandem_kv_cache::{Allocation, BlockLayout, DeviceKvMemory, KvPart, MemoryRegion};

use super::Device;
use crate::KernelError;

/// How the cache blocks of the layers are placed in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvArrangement {
    /// Each layer's K and V are arrays of their own; block `b` at `b * block_bytes` of each.
    PerLayer,
    /// One array `[block][layer][K, V][block_bytes]`: a block of every layer is contiguous.
    BlockMajor,
}

/// Where one layer's K and V blocks are: block `b` of K starts at `k + b * block_stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLayer {
    pub k: u64,
    pub v: u64,
    pub block_stride: u64,
    pub layout: BlockLayout,
}

/// Every layer's K and V in device memory.
#[derive(Debug, Clone)]
pub struct DeviceKvCache {
    device: Device,
    layout: BlockLayout,
    arrangement: KvArrangement,
    layers: Vec<DeviceLayer>,
    memory: Arc<Vec<DeviceArray>>,
}

/// One `cuMemAlloc` allocation, freed on drop (after the device's work on it: its owners keep it
/// alive until then).
#[derive(Debug)]
pub(crate) struct DeviceArray {
    addr: u64,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceArray {
    /// `len` zeroed bytes.
    fn zeroed(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, KernelError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation of `len` bytes, then a memset of exactly those bytes.
        let addr = unsafe { result::malloc_sync(len.max(1)) }?;
        let array = DeviceArray {
            addr,
            len,
            ctx: ctx.clone(),
        };
        // SAFETY: `addr .. addr + len` is the allocation just made.
        unsafe { result::memset_d8_sync(addr, 0, len) }?;
        Ok(array)
    }
}

impl Drop for DeviceArray {
    fn drop(&mut self) {
        // Every user of the memory holds the Arc that owns this array, so none is left.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync, freed once.
            let _ = unsafe { result::free_sync(self.addr) };
        }
    }
}

impl DeviceKvCache {
    /// Allocates a zeroed cache of `num_layers` layers, each laid out as `layout`.
    pub fn new(
        device: &Device,
        layout: BlockLayout,
        num_layers: usize,
        arrangement: KvArrangement,
    ) -> Result<Self, KernelError> {
        layout
            .validate()
            .map_err(|e| KernelError::Cache(e.to_string()))?;
        if num_layers == 0 {
            return Err(KernelError::Cache(
                "a cache needs at least one layer".into(),
            ));
        }
        let bb = layout.block_bytes() as u64;
        let stream = device.stream();
        let alloc = |bytes: u64| -> Result<DeviceArray, KernelError> {
            let bytes = usize::try_from(bytes)
                .map_err(|_| KernelError::Cache("cache size overflows".into()))?;
            DeviceArray::zeroed(device.context(), bytes)
        };
        let arrays = (layout.num_blocks as u64)
            .checked_mul(bb)
            .ok_or_else(|| KernelError::Cache("cache size overflows".into()))?;
        let (memory, layers) = match arrangement {
            KvArrangement::PerLayer => {
                let mut memory = Vec::with_capacity(2 * num_layers);
                let mut layers = Vec::with_capacity(num_layers);
                for _ in 0..num_layers {
                    let k = alloc(arrays)?;
                    let v = alloc(arrays)?;
                    layers.push(DeviceLayer {
                        k: k.addr,
                        v: v.addr,
                        block_stride: bb,
                        layout,
                    });
                    memory.push(k);
                    memory.push(v);
                }
                (memory, layers)
            }
            KvArrangement::BlockMajor => {
                let total = arrays
                    .checked_mul(2 * num_layers as u64)
                    .ok_or_else(|| KernelError::Cache("cache size overflows".into()))?;
                let all = alloc(total)?;
                let base = all.addr;
                let block_stride = 2 * num_layers as u64 * bb;
                let layers = (0..num_layers as u64)
                    .map(|l| DeviceLayer {
                        k: base + 2 * l * bb,
                        v: base + (2 * l + 1) * bb,
                        block_stride,
                        layout,
                    })
                    .collect();
                (vec![all], layers)
            }
        };
        stream.synchronize()?;
        Ok(DeviceKvCache {
            device: device.clone(),
            layout,
            arrangement,
            layers,
            memory: Arc::new(memory),
        })
    }

    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }

    pub fn arrangement(&self) -> KvArrangement {
        self.arrangement
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Where each layer's blocks are, by layer index.
    pub fn layers(&self) -> &[DeviceLayer] {
        &self.layers
    }

    /// Keeps the memory alive (for work queued on a stream that reads it).
    pub(crate) fn keep_alive(&self) -> Arc<Vec<DeviceArray>> {
        self.memory.clone()
    }

    /// Device address of block `block` of layer `layer`'s K (`v = false`) or V array.
    fn block_address(&self, layer: usize, block: usize, v: bool) -> Result<u64, KernelError> {
        let l = self
            .layers
            .get(layer)
            .ok_or_else(|| KernelError::Cache(format!("no layer {layer}")))?;
        if block >= self.layout.num_blocks {
            return Err(KernelError::Cache(format!(
                "block {block} is outside a pool of {}",
                self.layout.num_blocks
            )));
        }
        Ok(if v { l.v } else { l.k } + block as u64 * l.block_stride)
    }

    /// Writes one block of one layer's K and V from host bytes (`block_bytes` each), waiting for
    /// the copy. For tests and tools; the engine writes the cache with its kernels.
    pub fn write_block(
        &self,
        layer: usize,
        block: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), KernelError> {
        let bb = self.layout.block_bytes();
        if k.len() != bb || v.len() != bb {
            return Err(KernelError::Cache(format!(
                "a block is {bb} bytes of K and of V, got {} and {}",
                k.len(),
                v.len()
            )));
        }
        self.device.context().bind_to_thread()?;
        self.device.stream().synchronize()?;
        for (bytes, is_v) in [(k, false), (v, true)] {
            let dst = self.block_address(layer, block, is_v)?;
            // SAFETY: `dst .. dst + bb` lies inside this cache's memory (block_address checked
            // the layer and block), which lives as long as `self`.
            unsafe { result::memcpy_htod_sync(dst, bytes) }?;
        }
        Ok(())
    }

    /// Reads one block of one layer's K and V into host bytes, waiting for the device.
    pub fn read_block(
        &self,
        layer: usize,
        block: usize,
    ) -> Result<(Vec<u8>, Vec<u8>), KernelError> {
        let bb = self.layout.block_bytes();
        self.device.context().bind_to_thread()?;
        self.device.stream().synchronize()?;
        let mut out = [vec![0u8; bb], vec![0u8; bb]];
        for (bytes, is_v) in out.iter_mut().zip([false, true]) {
            let src = self.block_address(layer, block, is_v)?;
            // SAFETY: as in write_block.
            unsafe { result::memcpy_dtoh_sync(bytes.as_mut_slice(), src) }?;
        }
        let [k, v] = out;
        Ok((k, v))
    }

    /// Fills every byte of the cache with a reproducible pattern from `seed` (on the device).
    pub fn fill_pattern(&self, seed: u64) -> Result<(), KernelError> {
        let fill = super::testing::Testing::load(&self.device)?;
        for array in self.memory.iter() {
            fill.fill_hash(array.addr, array.len / 8, seed ^ array.addr)?;
        }
        self.device.stream().synchronize()?;
        Ok(())
    }
}

/// The engine's storage reaches the device cache through this: its regions and allocations (what
/// NIXL registers as VRAM) and single-block copies (fault injection).
impl DeviceKvMemory for DeviceKvCache {
    fn device_id(&self) -> u64 {
        self.device.ordinal() as u64
    }

    fn regions(&self) -> Vec<MemoryRegion> {
        let allocations = self.allocations();
        // A region runs from its first block to the end of the allocation holding it.
        let end_of = |addr: usize| {
            allocations
                .iter()
                .find(|a| (a.addr..a.addr + a.len).contains(&addr))
                .map_or(addr, |a| a.addr + a.len)
        };
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(layer, l)| [(layer, KvPart::K, l.k, l), (layer, KvPart::V, l.v, l)])
            .map(|(layer, part, addr, l)| MemoryRegion {
                layer,
                part,
                addr: addr as usize,
                len: end_of(addr as usize) - addr as usize,
                block_stride: l.block_stride as usize,
            })
            .collect()
    }

    fn allocations(&self) -> Vec<Allocation> {
        self.memory
            .iter()
            .map(|array| Allocation {
                addr: array.addr as usize,
                len: array.len,
            })
            .collect()
    }

    fn read_block(&self, layer: usize, part: KvPart, block: usize) -> Result<Vec<u8>, String> {
        let (k, v) = DeviceKvCache::read_block(self, layer, block).map_err(|e| e.to_string())?;
        Ok(if part == KvPart::K { k } else { v })
    }

    fn write_block(
        &self,
        layer: usize,
        part: KvPart,
        block: usize,
        bytes: &[u8],
    ) -> Result<(), String> {
        let (mut k, mut v) =
            DeviceKvCache::read_block(self, layer, block).map_err(|e| e.to_string())?;
        match part {
            KvPart::K => k = bytes.to_vec(),
            KvPart::V => v = bytes.to_vec(),
        }
        DeviceKvCache::write_block(self, layer, block, &k, &v).map_err(|e| e.to_string())
    }
}
