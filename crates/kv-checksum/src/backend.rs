//! Where checksums are computed: the [`ChecksumBackend`] trait, the jobs it runs, and the CPU
//! backend.
//!
//! A [`GroupJob`] is plain data (which layers, which head factors, which blocks and token ranges,
//! which output column), so a backend that owns other memory — a CUDA kernel over device
//! buffers — can run the same jobs without its callers changing. The CPU backend reads the KV
//! through a [`KvSource`] (the worker's [`KvStorage`], or byte views in tests and the CLI).
//!
//! Invariants: a backend validates every job against the memory before reading it and returns
//! an error instead of panicking; output `out[column * blocks + b]` receives the wrapping sum,
//! over the job's layers of that column and their heads, of `m * s` for block `b`, added to what
//! `out` held.

use tandem_kv_cache::{BlockLayout, KvStorage, LayerKv};

use crate::definition::{head_factor, pieces_per_token};
use crate::error::KvChecksumError;
use crate::kernel::{block_slice_sums, Scratch};

/// One layer of a [`GroupJob`]: where its KV is and how its heads are numbered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerJob {
    /// The layer's index in the backend's KV memory (e.g. [`KvStorage::layer`]).
    pub source_index: usize,
    /// The layout the job expects; the backend refuses memory laid out otherwise.
    pub layout: BlockLayout,
    /// The layer number (from the layer's name) in the head factor.
    pub layer_number: u32,
    /// Global index of local head 0; local head `h` is global head `head_base + h`.
    pub head_base: u32,
    /// Output column (one per replica key) this layer adds to.
    pub column: usize,
}

/// One block position of a [`GroupJob`]: which cache block and which of the request's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockJob {
    /// Cache block id.
    pub block_id: usize,
    /// Slot in the cache block of the token at `token_begin`.
    pub first_slot: usize,
    /// First token position (in the request) covered.
    pub token_begin: usize,
    /// One past the last token position covered.
    pub token_end: usize,
}

/// The checksums of one KV cache group over some blocks: for each column and block,
/// `Σ_{layers of the column, heads} m * s`.
#[derive(Debug, Clone, Copy)]
pub struct GroupJob<'j> {
    pub layers: &'j [LayerJob],
    pub blocks: &'j [BlockJob],
    pub columns: usize,
}

/// Computes the checksums of group jobs. Implementations: [`CpuBackend`]; a CUDA backend can run
/// the same jobs over device memory.
pub trait ChecksumBackend {
    /// Adds the job's checksums to `out` (`columns * blocks.len()` values, column-major:
    /// `out[column * blocks.len() + block]`).
    fn checksum(&self, job: &GroupJob<'_>, out: &mut [u64]) -> Result<(), KvChecksumError>;
}

/// A backend threads share: how a worker whose KV lives on an accelerator hands the checksum
/// worker its device kernel.
pub type SharedBackend = std::sync::Arc<dyn ChecksumBackend + Send + Sync>;

/// Byte views of a worker's layers, by index.
pub trait KvSource {
    /// The K and V of layer `index`, or `None` when there is no such layer.
    fn layer(&self, index: usize) -> Option<LayerKv<'_>>;
}

impl KvSource for KvStorage {
    fn layer(&self, index: usize) -> Option<LayerKv<'_>> {
        KvStorage::layer(self, index).ok()
    }
}

impl KvSource for [LayerKv<'_>] {
    fn layer(&self, index: usize) -> Option<LayerKv<'_>> {
        self.get(index).copied()
    }
}

impl KvSource for Vec<LayerKv<'_>> {
    fn layer(&self, index: usize) -> Option<LayerKv<'_>> {
        self.get(index).copied()
    }
}

/// The CPU backend: one thread, reading the KV in place.
pub struct CpuBackend<'s, S: KvSource + ?Sized> {
    source: &'s S,
}

impl<S: KvSource + ?Sized> std::fmt::Debug for CpuBackend<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CpuBackend")
    }
}

impl<'s, S: KvSource + ?Sized> CpuBackend<'s, S> {
    pub fn new(source: &'s S) -> Self {
        CpuBackend { source }
    }
}

impl<S: KvSource + ?Sized> ChecksumBackend for CpuBackend<'_, S> {
    fn checksum(&self, job: &GroupJob<'_>, out: &mut [u64]) -> Result<(), KvChecksumError> {
        let nb = job.blocks.len();
        if out.len() != job.columns * nb {
            return Err(KvChecksumError::InvalidJob(format!(
                "output holds {} values, expected {} columns x {nb} blocks",
                out.len(),
                job.columns
            )));
        }
        let mut scratch = Scratch::default();
        let mut head_sums = Vec::new();
        let mut factors = Vec::new();
        for layer in job.layers {
            if layer.column >= job.columns {
                return Err(KvChecksumError::InvalidJob(format!(
                    "layer {} writes column {} of {}",
                    layer.source_index, layer.column, job.columns
                )));
            }
            let kv = self
                .source
                .layer(layer.source_index)
                .ok_or(KvChecksumError::MissingLayer(layer.source_index))?;
            check_layer(&kv, layer)?;
            for b in job.blocks {
                check_block(&kv.layout, b)?;
            }
            let heads = kv.layout.num_kv_heads;
            factors.clear();
            factors.extend((0..heads).map(|h| {
                // check_layer bounds head_base + heads by 2^16.
                head_factor(layer.layer_number, layer.head_base + h as u32)
            }));
            head_sums.clear();
            head_sums.resize(heads, 0u64);
            let col = &mut out[layer.column * nb..(layer.column + 1) * nb];
            for (b, acc) in job.blocks.iter().zip(col.iter_mut()) {
                let n = b.token_end - b.token_begin;
                if n == 0 {
                    continue;
                }
                block_slice_sums(
                    &kv,
                    b.block_id,
                    b.first_slot,
                    n,
                    b.token_begin as u64,
                    &mut scratch,
                    &mut head_sums,
                );
                let c = head_sums
                    .iter()
                    .zip(&factors)
                    .fold(0u64, |c, (&s, &m)| c.wrapping_add(m.wrapping_mul(s)));
                *acc = acc.wrapping_add(c);
            }
        }
        Ok(())
    }
}

/// Checks that the memory of a layer is what the job expects and that the kernel may index it.
fn check_layer(kv: &LayerKv<'_>, layer: &LayerJob) -> Result<(), KvChecksumError> {
    check_layer_shape(&kv.layout, layer)?;
    let lay = &kv.layout;
    let total = lay
        .num_blocks
        .checked_mul(lay.block_bytes())
        .ok_or_else(|| KvChecksumError::InvalidJob("layer size overflows".into()))?;
    if kv.array_len() < total {
        return Err(KvChecksumError::InvalidJob(format!(
            "layer {} holds {} bytes of K and of V, its layout needs {total}",
            layer.source_index,
            kv.array_len(),
        )));
    }
    Ok(())
}

/// Checks what every backend needs of a layer whatever memory holds it: laid out as the job
/// expects, a valid layout, rows of whole 8-byte pieces per token, heads within the per-layer
/// bound. Backends check their memory's extent themselves.
pub fn check_layer_shape(lay: &BlockLayout, layer: &LayerJob) -> Result<(), KvChecksumError> {
    if *lay != layer.layout {
        return Err(KvChecksumError::InvalidJob(format!(
            "layer {} is laid out as {:?}, the job expects {:?}",
            layer.source_index, lay, layer.layout
        )));
    }
    lay.validate()
        .map_err(|e| KvChecksumError::InvalidJob(format!("layer {}: {e}", layer.source_index)))?;
    if pieces_per_token(lay.head_dim, lay.dtype).is_none() {
        return Err(KvChecksumError::InvalidJob(format!(
            "layer {}: a token's K and V rows ({} bytes) are not whole 8-byte pieces",
            layer.source_index,
            2 * lay.row_bytes()
        )));
    }
    if layer.head_base as u64 + lay.num_kv_heads as u64 > crate::MAX_KV_HEADS_PER_LAYER {
        return Err(KvChecksumError::InvalidJob(format!(
            "layer {}: heads {}..{} exceed the bound of 2^16 per layer",
            layer.source_index,
            layer.head_base,
            layer.head_base as u64 + lay.num_kv_heads as u64
        )));
    }
    Ok(())
}

/// Checks that a block job lies within a pool laid out as `lay`.
pub fn check_block(lay: &BlockLayout, b: &BlockJob) -> Result<(), KvChecksumError> {
    let ok = b.block_id < lay.num_blocks
        && b.token_begin <= b.token_end
        && b.first_slot
            .checked_add(b.token_end - b.token_begin.min(b.token_end))
            .is_some_and(|end| end <= lay.block_size);
    if ok {
        Ok(())
    } else {
        Err(KvChecksumError::InvalidJob(format!(
            "{b:?} does not fit a pool of {} blocks of {} tokens",
            lay.num_blocks, lay.block_size
        )))
    }
}
