//! The memory holding every layer's K and V cache of one worker.
//!
//! Layout: per layer, K and V arrays of shape `[num_blocks, block_size, num_kv_heads, head_dim]`
//! ([`LayoutOrder::TokenMajor`], the default) or `[num_blocks, num_kv_heads, block_size,
//! head_dim]` ([`LayoutOrder::HeadMajor`]: each head's rows of a block are contiguous, so a
//! transfer can move single heads, which heterogeneous tensor parallelism needs), 8-byte
//! aligned, allocated once and never moved, so their addresses can be registered with a transfer engine (NIXL) and read or written
//! by it while the engine runs.
//!
//! A storage may also only *describe* a cache whose arrays live elsewhere (a GPU's memory, owned by
//! the model: [`KvStorage::elsewhere`]): the same layouts and names, no host arrays; every host
//! view then fails with [`KvCacheError::NotInHostMemory`]. Given the device memory itself
//! ([`KvStorage::on_device`]), it has that memory's regions to register and copies single blocks
//! to and from it ([`KvStorage::read_block`], [`KvStorage::modify_block`]).
//!
//! Concurrency invariant: the storage is shared (`&self`) by the forward pass, checksum threads and
//! transfer engines. It does not lock; the scheduler's block ownership keeps them apart: a block is
//! written only by the request that owns it (forward or an incoming load), and read by checksums
//! or outgoing transfers only while no request writes it. Views handed out cover whole layers, and
//! callers touch only the blocks they own. Views never hold a reference to a whole array: they
//! create references over the blocks or rows asked for only ([`LayerKv`]), so a write elsewhere
//! in the array never aliases a live reference.

use std::cell::UnsafeCell;
use std::sync::Arc;

use crate::device::{Allocation, DeviceKvMemory, MemoryKind};

use crate::error::KvCacheError;
use crate::layout::{BlockLayout, LayerKv, LayoutOrder};
use crate::spec::KvCacheConfig;

/// One 8-byte aligned, fixed-address byte array.
struct RawBuf {
    words: Box<[UnsafeCell<u64>]>,
    len: usize,
}

impl RawBuf {
    fn zeroed(len: usize) -> Self {
        let words = (0..len.div_ceil(8))
            .map(|_| UnsafeCell::new(0u64))
            .collect();
        RawBuf { words, len }
    }
    fn ptr(&self) -> *mut u8 {
        // UnsafeCell<u64> is repr(transparent): the cells are contiguous u64s.
        self.words.as_ptr() as *mut u8
    }
}

/// Which of a layer's two arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvPart {
    K,
    V,
}

/// One layer's K or V array of the storage, for a transfer engine: block `b` starts at
/// `addr + b * block_stride` (`block_stride` is the block's size in a per-layer array, larger
/// where the blocks of several layers interleave), and the region spans `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    pub layer: usize,
    pub part: KvPart,
    pub addr: usize,
    pub len: usize,
    pub block_stride: usize,
}

struct LayerBuffers {
    name: String,
    group_id: usize,
    k: RawBuf,
    v: RawBuf,
    layout: BlockLayout,
}

/// Every layer's K and V cache of one worker. See the module docs for the sharing invariant.
pub struct KvStorage {
    layers: Vec<LayerBuffers>,
    /// Whether the arrays are in this process's host memory (else they are elsewhere and empty).
    host: bool,
    /// The device memory holding the arrays, when they are elsewhere and it was given.
    device: Option<Arc<dyn DeviceKvMemory>>,
}

// SAFETY: all mutation goes through raw pointers into fixed allocations, and the block-ownership
// invariant (module docs) keeps concurrent writers and readers on disjoint blocks.
unsafe impl Sync for KvStorage {}
unsafe impl Send for KvStorage {}

impl std::fmt::Debug for KvStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStorage")
            .field("layers", &self.layers.len())
            .field("bytes", &self.total_bytes())
            .finish()
    }
}

impl KvStorage {
    /// Allocates zeroed token-major K and V arrays for every layer of every group.
    pub fn new(config: &KvCacheConfig) -> Result<Self, KvCacheError> {
        Self::with_order(config, LayoutOrder::TokenMajor)
    }

    /// Allocates zeroed K and V arrays in `order` for every layer of every group.
    pub fn with_order(config: &KvCacheConfig, order: LayoutOrder) -> Result<Self, KvCacheError> {
        Self::with_group_blocks(config, order, &vec![config.num_blocks; config.groups.len()])
    }

    /// Allocates zeroed K and V arrays in `order` for every layer of every group, with
    /// `group_blocks[i]` blocks in each layer of `config.groups[i]` (a hybrid model's groups
    /// have pools of their own; `config.num_blocks` is not used).
    pub fn with_group_blocks(
        config: &KvCacheConfig,
        order: LayoutOrder,
        group_blocks: &[usize],
    ) -> Result<Self, KvCacheError> {
        Self::build(config, order, group_blocks, true)
    }

    /// The layouts of a cache whose arrays another component holds in its own memory (the GPU
    /// decoder's device cache): no host memory is allocated, and host accesses fail with
    /// [`KvCacheError::NotInHostMemory`].
    pub fn elsewhere(
        config: &KvCacheConfig,
        order: LayoutOrder,
        group_blocks: &[usize],
    ) -> Result<Self, KvCacheError> {
        Self::build(config, order, group_blocks, false)
    }

    /// The layouts of a cache held in `memory` (a GPU's): like [`KvStorage::elsewhere`], and its
    /// regions, allocations and block copies are the device memory's. Fails when the memory's
    /// regions do not cover every layer's blocks.
    pub fn on_device(
        config: &KvCacheConfig,
        order: LayoutOrder,
        group_blocks: &[usize],
        memory: Arc<dyn DeviceKvMemory>,
    ) -> Result<Self, KvCacheError> {
        let mut s = Self::build(config, order, group_blocks, false)?;
        let regions = memory.regions();
        if regions.len() != 2 * s.layers.len() {
            return Err(KvCacheError::Device(format!(
                "{} device regions for {} layers",
                regions.len(),
                s.layers.len()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for r in &regions {
            let l = s.layers.get(r.layer).ok_or(KvCacheError::LayerOutOfRange {
                layer: r.layer,
                num_layers: s.layers.len(),
            })?;
            if !seen.insert((r.layer, r.part)) {
                return Err(KvCacheError::Device(format!(
                    "layer {} {:?} has two device regions",
                    r.layer, r.part
                )));
            }
            let bb = l.layout.block_bytes();
            let need = (l.layout.num_blocks - 1)
                .checked_mul(r.block_stride)
                .and_then(|n| n.checked_add(bb));
            if r.block_stride < bb || need.is_none_or(|n| n > r.len) {
                return Err(KvCacheError::Device(format!(
                    "layer {} {:?}: a region of {} bytes at a stride of {} cannot hold {} \
                     blocks of {bb} bytes",
                    r.layer, r.part, r.len, r.block_stride, l.layout.num_blocks
                )));
            }
        }
        s.device = Some(memory);
        Ok(s)
    }

    /// Whether the arrays are in host memory (see [`KvStorage::elsewhere`]).
    pub fn in_host_memory(&self) -> bool {
        self.host
    }

    /// Where the arrays live (a storage that only describes its cache says host memory; it has
    /// no regions).
    pub fn memory_kind(&self) -> MemoryKind {
        match &self.device {
            Some(d) => MemoryKind::Device(d.device_id()),
            None => MemoryKind::Host,
        }
    }

    fn build(
        config: &KvCacheConfig,
        order: LayoutOrder,
        group_blocks: &[usize],
        host: bool,
    ) -> Result<Self, KvCacheError> {
        if group_blocks.len() != config.groups.len() || group_blocks.contains(&0) {
            return Err(KvCacheError::InvalidConfig(format!(
                "every group needs blocks: {group_blocks:?} for {} groups",
                config.groups.len()
            )));
        }
        let mut layers = Vec::new();
        for (group, &num_blocks) in config.groups.iter().zip(group_blocks) {
            let s = &group.spec;
            let layout = BlockLayout {
                order,
                ..BlockLayout::token_major(
                    num_blocks,
                    s.block_size(),
                    s.num_kv_heads(),
                    s.head_dim(),
                    s.dtype(),
                )
            };
            layout.validate()?;
            let bytes = if host { layout.total_bytes() } else { 0 };
            for name in &group.layer_names {
                layers.push(LayerBuffers {
                    name: name.clone(),
                    group_id: group.group_id,
                    k: RawBuf::zeroed(bytes),
                    v: RawBuf::zeroed(bytes),
                    layout,
                });
            }
        }
        Ok(KvStorage {
            layers,
            host,
            device: None,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    pub fn total_bytes(&self) -> usize {
        self.layers.iter().map(|l| 2 * l.layout.total_bytes()).sum()
    }
    pub fn layer_name(&self, layer: usize) -> &str {
        &self.layers[layer].name
    }
    pub fn layer_group(&self, layer: usize) -> usize {
        self.layers[layer].group_id
    }
    pub fn layout(&self, layer: usize) -> BlockLayout {
        self.layers[layer].layout
    }

    fn layer_buffers(&self, layer: usize) -> Result<&LayerBuffers, KvCacheError> {
        if !self.host {
            return Err(KvCacheError::NotInHostMemory);
        }
        self.layers.get(layer).ok_or(KvCacheError::LayerOutOfRange {
            layer,
            num_layers: self.layers.len(),
        })
    }

    /// A read view of one layer's K and V (it hands out single blocks and rows; see [`LayerKv`]).
    pub fn layer(&self, layer: usize) -> Result<LayerKv<'_>, KvCacheError> {
        let l = self.layer_buffers(layer)?;
        // SAFETY: both buffers hold `len` initialized bytes, 8-byte aligned, fixed for the life
        // of `self`, and `len == layout.total_bytes()`.
        Ok(unsafe { LayerKv::from_raw(l.k.ptr(), l.v.ptr(), l.k.len, l.layout) })
    }

    /// Writes the K and V of tokens into slots (`slot = block * block_size + offset`).
    /// `k` and `v` hold `slots.len() * num_kv_heads * head_dim` values, token by token.
    pub fn write_slots(
        &self,
        layer: usize,
        slots: &[usize],
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvCacheError> {
        let l = self.layer_buffers(layer)?;
        let layout = l.layout;
        let per_token = layout.num_kv_heads * layout.head_dim;
        let expected = slots.len() * per_token;
        for got in [k.len(), v.len()] {
            if got != expected {
                return Err(KvCacheError::LengthMismatch { expected, got });
            }
        }
        let num_slots = layout.num_blocks * layout.block_size;
        // A token's heads are one run in token-major blocks, one run per head otherwise.
        let (runs, run_len) = match layout.order {
            LayoutOrder::TokenMajor => (1, per_token),
            LayoutOrder::HeadMajor => (layout.num_kv_heads, layout.head_dim),
        };
        let run_bytes = run_len * layout.dtype.size();
        for (i, &slot) in slots.iter().enumerate() {
            if slot >= num_slots {
                return Err(KvCacheError::SlotOutOfRange { slot, num_slots });
            }
            let (block, token) = (slot / layout.block_size, slot % layout.block_size);
            for run in 0..runs {
                let off = layout.row_offset(block, token, run);
                let from = i * per_token + run * run_len;
                for (buf, src) in [(&l.k, k), (&l.v, v)] {
                    // SAFETY: off + run_bytes <= total_bytes; the slot's block is owned by the
                    // caller.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(buf.ptr().add(off), run_bytes) };
                    layout.dtype.encode(&src[from..from + run_len], dst);
                }
            }
        }
        Ok(())
    }

    /// Copies all layers of block `src` into block `dst` (recompute-free block moves and tests).
    pub fn copy_block(&self, src: usize, dst: usize) -> Result<(), KvCacheError> {
        if !self.host {
            return Err(KvCacheError::NotInHostMemory);
        }
        for l in &self.layers {
            let bb = l.layout.block_bytes();
            for b in [src, dst] {
                if b >= l.layout.num_blocks {
                    return Err(KvCacheError::BlockOutOfRange {
                        block: b,
                        num_blocks: l.layout.num_blocks,
                    });
                }
            }
            if src == dst {
                continue;
            }
            for buf in [&l.k, &l.v] {
                // SAFETY: both ranges lie inside the allocation and do not overlap (src != dst).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        buf.ptr().add(src * bb),
                        buf.ptr().add(dst * bb),
                        bb,
                    )
                };
            }
        }
        Ok(())
    }

    /// Mutable bytes of one block of one layer's K or V, for loads and fault injection.
    ///
    /// # Safety
    /// The caller must own `block` (no forward, checksum or transfer touches it meanwhile)
    /// and must not keep two returned slices of one block alive at once.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn block_bytes_mut(
        &self,
        layer: usize,
        part: KvPart,
        block: usize,
    ) -> Result<&mut [u8], KvCacheError> {
        let l = self.layer_buffers(layer)?;
        if block >= l.layout.num_blocks {
            return Err(KvCacheError::BlockOutOfRange {
                block,
                num_blocks: l.layout.num_blocks,
            });
        }
        let bb = l.layout.block_bytes();
        let buf = match part {
            KvPart::K => &l.k,
            KvPart::V => &l.v,
        };
        // SAFETY: in bounds; exclusivity is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(buf.ptr().add(block * bb), bb) })
    }

    /// Copies one block of one layer's K or V out, wherever it lives.
    ///
    /// # Safety
    /// As [`KvStorage::block_bytes_mut`]: no one writes the block meanwhile.
    pub unsafe fn read_block(
        &self,
        layer: usize,
        part: KvPart,
        block: usize,
    ) -> Result<Vec<u8>, KvCacheError> {
        match &self.device {
            Some(d) => {
                self.check_block(layer, block)?;
                d.read_block(layer, part, block)
                    .map_err(KvCacheError::Device)
            }
            // SAFETY: forwarded to the caller.
            None => Ok(unsafe { self.block_bytes_mut(layer, part, block) }?.to_vec()),
        }
    }

    /// Overwrites one block of one layer's K or V with `bytes`, wherever it lives.
    ///
    /// # Safety
    /// As [`KvStorage::block_bytes_mut`]: the caller owns the block.
    pub unsafe fn write_block(
        &self,
        layer: usize,
        part: KvPart,
        block: usize,
        bytes: &[u8],
    ) -> Result<(), KvCacheError> {
        let expected = self.check_block(layer, block)?;
        if bytes.len() != expected {
            return Err(KvCacheError::LengthMismatch {
                expected,
                got: bytes.len(),
            });
        }
        match &self.device {
            Some(d) => d
                .write_block(layer, part, block, bytes)
                .map_err(KvCacheError::Device),
            None => {
                // SAFETY: forwarded to the caller.
                unsafe { self.block_bytes_mut(layer, part, block) }?.copy_from_slice(bytes);
                Ok(())
            }
        }
    }

    /// Runs `f` over one block's bytes, wherever they live: in place in host memory, through a
    /// copy out and back in device memory. Returns `f`'s result.
    ///
    /// # Safety
    /// As [`KvStorage::block_bytes_mut`]: the caller owns the block.
    pub unsafe fn modify_block<R>(
        &self,
        layer: usize,
        part: KvPart,
        block: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, KvCacheError> {
        if self.device.is_none() {
            // SAFETY: forwarded to the caller.
            return Ok(f(unsafe { self.block_bytes_mut(layer, part, block) }?));
        }
        // SAFETY: forwarded to the caller.
        let mut bytes = unsafe { self.read_block(layer, part, block) }?;
        let out = f(&mut bytes);
        // SAFETY: forwarded to the caller.
        unsafe { self.write_block(layer, part, block, &bytes) }?;
        Ok(out)
    }

    /// Checks a (layer, block) pair and returns the block's size.
    fn check_block(&self, layer: usize, block: usize) -> Result<usize, KvCacheError> {
        let l = self
            .layers
            .get(layer)
            .ok_or(KvCacheError::LayerOutOfRange {
                layer,
                num_layers: self.layers.len(),
            })?;
        if block >= l.layout.num_blocks {
            return Err(KvCacheError::BlockOutOfRange {
                block,
                num_blocks: l.layout.num_blocks,
            });
        }
        Ok(l.layout.block_bytes())
    }

    /// The allocations holding the regions, for registration with a transfer engine (each host
    /// array is one).
    pub fn allocations(&self) -> Vec<Allocation> {
        match &self.device {
            Some(d) => d.allocations(),
            None => self
                .regions()
                .iter()
                .map(|r| Allocation {
                    addr: r.addr,
                    len: r.len,
                })
                .collect(),
        }
    }

    /// Every array as a memory region, for registration with a transfer engine.
    pub fn regions(&self) -> Vec<MemoryRegion> {
        if let Some(d) = &self.device {
            return d.regions();
        }
        if !self.host {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(2 * self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            for (part, buf) in [(KvPart::K, &l.k), (KvPart::V, &l.v)] {
                out.push(MemoryRegion {
                    layer: i,
                    part,
                    addr: buf.ptr() as usize,
                    len: buf.len,
                    block_stride: l.layout.block_bytes(),
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::CacheDtype;
    use crate::spec::{KvCacheGroup, KvCacheSpec};

    fn config(dtype: CacheDtype) -> KvCacheConfig {
        KvCacheConfig {
            num_blocks: 4,
            groups: vec![KvCacheGroup {
                group_id: 0,
                spec: KvCacheSpec::FullAttention {
                    block_size: 4,
                    num_kv_heads: 2,
                    head_dim: 8,
                    dtype,
                },
                layer_names: vec!["layers.0".into(), "layers.1".into()],
            }],
        }
    }

    #[test]
    fn written_rows_are_read_back_at_their_slot() {
        let s = KvStorage::new(&config(CacheDtype::F32)).unwrap();
        let k: Vec<f32> = (0..16).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..16).map(|x| -(x as f32)).collect();
        s.write_slots(1, &[5], &k, &v).unwrap();
        let view = s.layer(1).unwrap();
        let (kr, vr) = view.rows(1, 1, 1);
        let mut back = [0f32; 8];
        CacheDtype::F32.decode(kr, &mut back);
        assert_eq!(&back[..], &k[8..16]);
        CacheDtype::F32.decode(vr, &mut back);
        assert_eq!(&back[..], &v[8..16]);
        // layer 0 untouched
        assert!(s.layer(0).unwrap().to_vecs().0.iter().all(|&b| b == 0));
    }

    #[test]
    fn head_major_storage_keeps_each_heads_rows_together() {
        let s = KvStorage::with_order(&config(CacheDtype::F32), LayoutOrder::HeadMajor).unwrap();
        assert_eq!(s.layout(0).order, LayoutOrder::HeadMajor);
        // tokens 0..4 of block 1 (slots 4..8), head h of token t holds 100 t + 10 h + d/8
        let row = |t: usize, h: usize| -> Vec<f32> {
            (0..8)
                .map(|d| (100 * t + 10 * h) as f32 + d as f32 / 8.0)
                .collect()
        };
        let k: Vec<f32> = (0..4)
            .flat_map(|t| [row(t, 0), row(t, 1)].concat())
            .collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        s.write_slots(0, &[4, 5, 6, 7], &k, &v).unwrap();
        let view = s.layer(0).unwrap();
        let (kb, vb) = view.block(1).unwrap();
        let mut back = vec![0f32; kb.len() / 4];
        CacheDtype::F32.decode(kb, &mut back);
        // head 0's four rows, then head 1's
        let want: Vec<f32> = (0..2)
            .flat_map(|h| (0..4).flat_map(move |t| row(t, h)))
            .collect();
        assert_eq!(back, want);
        CacheDtype::F32.decode(vb, &mut back);
        assert_eq!(back, want.iter().map(|x| -x).collect::<Vec<_>>());
        let (kr, _) = view.rows(1, 2, 1);
        let mut one = [0f32; 8];
        CacheDtype::F32.decode(kr, &mut one);
        assert_eq!(one.to_vec(), row(2, 1));
    }

    #[test]
    fn copy_block_moves_every_layer() {
        let s = KvStorage::new(&config(CacheDtype::Bf16)).unwrap();
        s.write_slots(0, &[0, 1, 2, 3], &vec![1.5; 64], &vec![2.0; 64])
            .unwrap();
        s.copy_block(0, 3).unwrap();
        let view = s.layer(0).unwrap();
        assert_eq!(view.block(0).unwrap(), view.block(3).unwrap());
        assert!(s.write_slots(0, &[16], &[0.0; 16], &[0.0; 16]).is_err());
    }

    #[test]
    fn a_storage_of_device_memory_describes_layouts_and_refuses_host_access() {
        let s =
            KvStorage::elsewhere(&config(CacheDtype::Bf16), LayoutOrder::TokenMajor, &[4]).unwrap();
        assert!(!s.in_host_memory());
        assert_eq!(s.num_layers(), 2);
        assert_eq!(s.layout(1).num_blocks, 4);
        assert_eq!(s.layer_name(1), "layers.1");
        assert!(matches!(s.layer(0), Err(KvCacheError::NotInHostMemory)));
        assert!(matches!(
            s.write_slots(0, &[0], &[0.0; 16], &[0.0; 16]),
            Err(KvCacheError::NotInHostMemory)
        ));
        assert!(matches!(
            s.copy_block(0, 1),
            Err(KvCacheError::NotInHostMemory)
        ));
        // SAFETY: nothing is returned.
        assert!(unsafe { s.block_bytes_mut(0, KvPart::K, 0) }.is_err());
        assert!(s.regions().is_empty());
        assert!(KvStorage::new(&config(CacheDtype::Bf16))
            .unwrap()
            .in_host_memory());
    }

    #[test]
    fn regions_cover_all_arrays_without_overlap() {
        let s = KvStorage::new(&config(CacheDtype::F16)).unwrap();
        let r = s.regions();
        assert_eq!(r.len(), 4);
        assert_eq!(r.iter().map(|r| r.len).sum::<usize>(), s.total_bytes());
        assert!(r.iter().all(|r| r.addr % 8 == 0));
    }

    /// Interleaved device-like memory held in a host vector: `[block][layer][K, V][bytes]`.
    #[derive(Debug)]
    struct Interleaved {
        bytes: std::sync::Mutex<Vec<u8>>,
        block_bytes: usize,
        layers: usize,
    }

    impl Interleaved {
        fn offset(&self, layer: usize, part: KvPart, block: usize) -> usize {
            let p = usize::from(part == KvPart::V);
            (block * self.layers * 2 + layer * 2 + p) * self.block_bytes
        }
    }

    impl DeviceKvMemory for Interleaved {
        fn device_id(&self) -> u64 {
            3
        }
        fn regions(&self) -> Vec<MemoryRegion> {
            let base = 1 << 20;
            let len = self.bytes.lock().unwrap().len();
            (0..self.layers)
                .flat_map(|l| [(l, KvPart::K), (l, KvPart::V)])
                .map(|(layer, part)| {
                    let off = self.offset(layer, part, 0);
                    MemoryRegion {
                        layer,
                        part,
                        addr: base + off,
                        len: len - off,
                        block_stride: 2 * self.layers * self.block_bytes,
                    }
                })
                .collect()
        }
        fn allocations(&self) -> Vec<Allocation> {
            vec![Allocation {
                addr: 1 << 20,
                len: self.bytes.lock().unwrap().len(),
            }]
        }
        fn read_block(&self, layer: usize, part: KvPart, block: usize) -> Result<Vec<u8>, String> {
            let o = self.offset(layer, part, block);
            Ok(self.bytes.lock().unwrap()[o..o + self.block_bytes].to_vec())
        }
        fn write_block(
            &self,
            layer: usize,
            part: KvPart,
            block: usize,
            bytes: &[u8],
        ) -> Result<(), String> {
            let o = self.offset(layer, part, block);
            self.bytes.lock().unwrap()[o..o + self.block_bytes].copy_from_slice(bytes);
            Ok(())
        }
    }

    #[test]
    fn a_storage_on_device_memory_reaches_blocks_through_it() {
        let cfg = config(CacheDtype::F32);
        let bb = 4 * 2 * 8 * 4;
        let mem = Arc::new(Interleaved {
            bytes: std::sync::Mutex::new(vec![0; 4 * 2 * 2 * bb]),
            block_bytes: bb,
            layers: 2,
        });
        let s = KvStorage::on_device(&cfg, LayoutOrder::TokenMajor, &[4], mem.clone()).unwrap();
        assert_eq!(s.memory_kind(), MemoryKind::Device(3));
        assert_eq!(s.allocations().len(), 1);
        let regions = s.regions();
        assert_eq!(regions.len(), 4);
        assert!(regions.iter().all(|r| r.block_stride == 4 * bb));
        // Host views still refuse; block copies go through the device memory.
        assert_eq!(s.layer(0).err(), Some(KvCacheError::NotInHostMemory));
        unsafe { s.modify_block(1, KvPart::V, 2, |b| b[5] = 7) }.unwrap();
        assert_eq!(
            mem.bytes.lock().unwrap()[mem.offset(1, KvPart::V, 2) + 5],
            7
        );
        assert_eq!(unsafe { s.read_block(1, KvPart::V, 2) }.unwrap()[5], 7);
        assert_eq!(
            unsafe { s.write_block(0, KvPart::K, 4, &vec![0; bb]) },
            Err(KvCacheError::BlockOutOfRange {
                block: 4,
                num_blocks: 4
            })
        );
        assert_eq!(
            unsafe { s.write_block(0, KvPart::K, 0, &[1, 2]) },
            Err(KvCacheError::LengthMismatch {
                expected: bb,
                got: 2
            })
        );
        // Memory too small for the layouts is refused.
        let small = Arc::new(Interleaved {
            bytes: std::sync::Mutex::new(vec![0; 3 * 2 * 2 * bb]),
            block_bytes: bb,
            layers: 2,
        });
        let e = KvStorage::on_device(&cfg, LayoutOrder::TokenMajor, &[4], small).unwrap_err();
        assert!(matches!(e, KvCacheError::Device(_)), "{e}");
        // Two regions for one array (and none for another) are refused.
        let twice = Arc::new(TwiceK(Interleaved {
            bytes: std::sync::Mutex::new(vec![0; 4 * 2 * 2 * bb]),
            block_bytes: bb,
            layers: 2,
        }));
        let e = KvStorage::on_device(&cfg, LayoutOrder::TokenMajor, &[4], twice).unwrap_err();
        assert!(e.to_string().contains("two device regions"), "{e}");
    }

    /// Memory that names layer 0's K region in place of its V region.
    #[derive(Debug)]
    struct TwiceK(Interleaved);

    impl DeviceKvMemory for TwiceK {
        fn device_id(&self) -> u64 {
            self.0.device_id()
        }
        fn regions(&self) -> Vec<MemoryRegion> {
            let mut r = self.0.regions();
            r[1] = r[0];
            r
        }
        fn allocations(&self) -> Vec<Allocation> {
            self.0.allocations()
        }
        fn read_block(&self, layer: usize, part: KvPart, block: usize) -> Result<Vec<u8>, String> {
            self.0.read_block(layer, part, block)
        }
        fn write_block(
            &self,
            layer: usize,
            part: KvPart,
            block: usize,
            bytes: &[u8],
        ) -> Result<(), String> {
            self.0.write_block(layer, part, block, bytes)
        }
    }

    #[test]
    fn host_storage_allocations_are_its_arrays() {
        let s = KvStorage::new(&config(CacheDtype::F32)).unwrap();
        assert_eq!(s.memory_kind(), MemoryKind::Host);
        let a = s.allocations();
        assert_eq!(a.len(), 4);
        assert!(s
            .regions()
            .iter()
            .zip(&a)
            .all(|(r, a)| r.addr == a.addr && r.len == a.len && r.block_stride == 4 * 2 * 8 * 4));
    }
}
