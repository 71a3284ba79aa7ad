//! The fused KV checksum kernel's host side: a [`GroupJob`] (the same plain-data jobs the CPU
//! backend runs) checksummed straight from a [`DeviceKvCache`], on a side stream.
//!
//! [`CudaChecksums::launch`] queues, on its own stream: a wait for the event the caller names (the
//! forward's), a zeroed output, the kernel launches (the job tables travel as a kernel parameter,
//! so nothing is staged on the host), an async copy of the results into pinned host memory, and an
//! event. It returns at once with a [`PendingChecksums`]; only [`PendingChecksums::wait`] blocks,
//! and only on that event. The engine's stream never waits for the checksums.
//!
//! Invariants: every job is validated against the cache before anything is queued (the same
//! checks as the CPU backend: layout, pieces, head bound, block and slot ranges), so the kernel
//! never reads outside the cache; a pending result keeps the cache memory, its device output and
//! its pinned buffer alive until its work is done, and a pinned buffer returns to the pool only
//! after its copy finished.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result, CudaEvent, CudaFunction, CudaSlice, CudaStream, PinnedHostSlice};
use tandem_kv_cache::LayoutOrder;
use tandem_kv_checksum::{
    check_block, check_layer_shape, ChecksumBackend, GroupJob, KvChecksumError,
};

use super::{Device, DeviceKvCache, DeviceLayer};
use crate::KernelError;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kv_checksum.ptx"));

/// Layers per kernel launch (the kernel parameter's table size); bigger jobs take more launches.
pub const MAX_LAYERS_PER_LAUNCH: usize = 32;
/// Block positions per kernel launch.
pub const MAX_BLOCKS_PER_LAUNCH: usize = 256;
/// Tokens per cache block the kernel takes (its table of row offsets in shared memory).
pub const MAX_TOKENS_PER_BLOCK: usize = 8192;
const THREADS: u32 = 256;

/// `LayerDesc` of `kv_checksum.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct LayerDesc {
    k: u64,
    v: u64,
    layer_number: u32,
    head_base: u32,
    column: u32,
    pad: u32,
}

/// `BlockDesc` of `kv_checksum.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct BlockDesc {
    t0: u64,
    block_id: u32,
    first_slot: u32,
    n: u32,
    index: u32,
}

/// `Launch` of `kv_checksum.cu`: one kernel launch's tables and strides.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Launch {
    layers: [LayerDesc; MAX_LAYERS_PER_LAUNCH],
    blocks: [BlockDesc; MAX_BLOCKS_PER_LAUNCH],
    block_stride: u64,
    kernel_block_stride: u64,
    token_stride: u64,
    head_stride: u64,
    kernel_block_size: u32,
    num_heads: u32,
    row_bytes: u32,
    num_layers: u32,
    num_blocks: u32,
    out_blocks: u32,
}

// The kernel's struct has exactly this size (checked there too).
const _: () = assert!(std::mem::size_of::<Launch>() == 7224);

/// Which kernel reads a layout, by the widest load its rows and strides allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reader {
    /// Rows of whole pieces, 16-byte loads.
    Rows16,
    /// Rows of whole pieces, 8-byte loads.
    Rows8,
    /// Rows of 4 mod 8 bytes: a token's K and V rows joined, 4-byte loads.
    Joined,
}

/// The strides of a layer's rows within its blocks, and the reader for them.
fn strides(layer: &DeviceLayer) -> (Reader, [u64; 3]) {
    let lay = &layer.layout;
    let rb = lay.row_bytes() as u64;
    let heads = lay.num_kv_heads as u64;
    let kbs = lay.kernel_block_size as u64;
    let (token_stride, head_stride) = match lay.order {
        LayoutOrder::TokenMajor => (heads * rb, rb),
        LayoutOrder::HeadMajor => (rb, kbs * rb),
    };
    let kernel_block_stride = kbs * heads * rb;
    let all = [
        rb,
        token_stride,
        head_stride,
        kernel_block_stride,
        layer.block_stride,
        layer.k,
        layer.v,
    ];
    let reader = if all.iter().all(|x| x % 16 == 0) {
        Reader::Rows16
    } else if all.iter().all(|x| x % 8 == 0) {
        Reader::Rows8
    } else {
        Reader::Joined
    };
    (reader, [kernel_block_stride, token_stride, head_stride])
}

/// The checksum kernel, its side stream and a pool of pinned result buffers.
#[derive(Debug)]
pub struct CudaChecksums {
    device: Device,
    stream: Arc<CudaStream>,
    rows16: CudaFunction,
    rows8: CudaFunction,
    joined: CudaFunction,
    pinned: Arc<Mutex<Vec<PinnedHostSlice<u64>>>>,
}

impl CudaChecksums {
    /// Loads the kernel and creates its side stream on `device`.
    pub fn new(device: &Device) -> Result<Self, KernelError> {
        let module = device.load(PTX)?;
        Ok(CudaChecksums {
            device: device.clone(),
            stream: device.context().new_stream()?,
            rows16: module.load_function("kv_checksum_rows16")?,
            rows8: module.load_function("kv_checksum_rows8")?,
            joined: module.load_function("kv_checksum_joined")?,
            pinned: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// The side stream the checksums run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Queues `job` over `cache` after `after` (the event that marks the forward that wrote the
    /// blocks; `None`: after the device stream's work queued so far) and returns at once. The
    /// result is `columns * blocks` values, column-major, as [`ChecksumBackend`] defines.
    pub fn launch(
        &self,
        cache: &DeviceKvCache,
        job: &GroupJob<'_>,
        after: Option<&CudaEvent>,
    ) -> Result<PendingChecksums, KernelError> {
        let launches = plan(cache, job)?;
        let out_len = job.columns * job.blocks.len();
        let ctx = self.device.context();
        ctx.bind_to_thread()?;
        match after {
            Some(event) => self.stream.wait(event)?,
            None => self.stream.join(self.device.stream())?,
        }
        let out: CudaSlice<u64> = self.stream.alloc_zeros(out_len.max(1))?;
        let out_addr = {
            use cudarc::driver::DevicePtr;
            let (ptr, _sync) = out.device_ptr(&self.stream);
            ptr
        };
        for (reader, launch) in &launches {
            let function = match reader {
                Reader::Rows16 => &self.rows16,
                Reader::Rows8 => &self.rows8,
                Reader::Joined => &self.joined,
            };
            let max_n = launch.blocks[..launch.num_blocks as usize]
                .iter()
                .map(|b| b.n)
                .max()
                .unwrap_or(1)
                .max(1);
            let mut table = *launch;
            let mut out_ptr = out_addr;
            let mut params: [*mut c_void; 2] = [
                (&mut table) as *mut Launch as *mut c_void,
                (&mut out_ptr) as *mut u64 as *mut c_void,
            ];
            // SAFETY: the kernel takes (Launch, u64*) and `params` points at exactly those; plan()
            // validated every address the tables lead to against the cache, and `out` holds
            // `columns * out_blocks` values. The launch copies the parameters before returning.
            unsafe {
                result::launch_kernel(
                    function.cu_function(),
                    (launch.num_blocks, layer_groups(launch), 1),
                    (THREADS, 1, 1),
                    4 * max_n,
                    self.stream.cu_stream(),
                    &mut params,
                )
            }?;
        }
        let mut host = self.take_pinned(out_len.max(1))?;
        // SAFETY: the pinned buffer holds at least out_len values and nothing else uses it until
        // the event below completes (PendingChecksums owns it); `out` lives in the pending value.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(host.as_mut_ptr()?, out_len.max(1));
            result::memcpy_dtoh_async(dst, out_addr, self.stream.cu_stream())?;
        }
        let done = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        Ok(PendingChecksums {
            len: out_len,
            host: Some(host),
            done,
            _out: out,
            _memory: cache.keep_alive(),
            pool: self.pinned.clone(),
        })
    }

    fn take_pinned(&self, len: usize) -> Result<PinnedHostSlice<u64>, KernelError> {
        let mut pool = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = pool.iter().position(|p| p.len() >= len) {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        let len = len.next_power_of_two().max(4096);
        // SAFETY: the memory is only read after the copy into it completes. Flags 0: cached
        // memory that the host reads back (write-combined memory reads slowly).
        Ok(unsafe { self.device.context().alloc_pinned_with_flags::<u64>(len, 0) }?)
    }
}

/// Checksums queued on the side stream; [`PendingChecksums::wait`] collects them.
#[derive(Debug)]
pub struct PendingChecksums {
    len: usize,
    host: Option<PinnedHostSlice<u64>>,
    done: CudaEvent,
    _out: CudaSlice<u64>,
    _memory: Arc<Vec<super::kv_cache::DeviceArray>>,
    pool: Arc<Mutex<Vec<PinnedHostSlice<u64>>>>,
}

impl PendingChecksums {
    /// Whether the results have reached host memory (never blocks).
    pub fn is_ready(&self) -> Result<bool, KernelError> {
        Ok(self.done.try_is_complete()?)
    }

    /// Waits for the results (only for this job's event) and returns them.
    pub fn wait(self) -> Result<Vec<u64>, KernelError> {
        self.done.synchronize()?;
        let host = self.host.as_ref().expect("taken only here and in drop");
        let values = host.as_slice()?[..self.len].to_vec();
        Ok(values)
    }
}

impl Drop for PendingChecksums {
    fn drop(&mut self) {
        if let Some(host) = self.host.take() {
            // The copy into the buffer must be over before another job may reuse it.
            if self.done.synchronize().is_ok() {
                self.pool
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(host);
            }
        }
    }
}

/// Validates `job` against `cache` and cuts it into kernel launches.
fn plan(cache: &DeviceKvCache, job: &GroupJob<'_>) -> Result<Vec<(Reader, Launch)>, KernelError> {
    let nb = job.blocks.len();
    let out_blocks = u32::try_from(nb).map_err(|_| invalid("too many blocks in one job"))?;
    let mut layers = Vec::with_capacity(job.layers.len());
    for layer in job.layers {
        let dl = *cache
            .layers()
            .get(layer.source_index)
            .ok_or(KvChecksumError::MissingLayer(layer.source_index))?;
        check_layer_shape(&dl.layout, layer)?;
        if layer.column >= job.columns {
            return Err(invalid(&format!(
                "layer {} writes column {} of {}",
                layer.source_index, layer.column, job.columns
            )));
        }
        if dl.layout.block_bytes() > u32::MAX as usize {
            // The kernel keeps row offsets within a block as u32.
            return Err(invalid(&format!(
                "blocks of {} bytes exceed the kernel's 4 GiB",
                dl.layout.block_bytes()
            )));
        }
        if dl.layout.block_size > MAX_TOKENS_PER_BLOCK {
            return Err(invalid(&format!(
                "blocks of {} tokens exceed the kernel's {MAX_TOKENS_PER_BLOCK}",
                dl.layout.block_size
            )));
        }
        for b in job.blocks {
            check_block(&dl.layout, b)?;
        }
        layers.push((dl, layer));
    }
    let blocks: Vec<BlockDesc> = job
        .blocks
        .iter()
        .enumerate()
        .map(|(i, b)| BlockDesc {
            t0: b.token_begin as u64,
            // check_block bounds block_id by the pool and the slots by the block size.
            block_id: b.block_id as u32,
            first_slot: b.first_slot as u32,
            n: (b.token_end - b.token_begin) as u32,
            index: i as u32,
        })
        .filter(|b| b.n > 0)
        .collect();
    if cache.layout().num_blocks > u32::MAX as usize {
        return Err(invalid("pools of more than 2^32 blocks"));
    }

    let mut launches = Vec::new();
    let mut start = 0;
    while start < layers.len() {
        // A run of layers that share a layout and block stride, at most a launch's worth.
        let first = layers[start].0;
        let mut end = start + 1;
        while end < layers.len()
            && end - start < MAX_LAYERS_PER_LAUNCH
            && layers[end].0.layout == first.layout
            && layers[end].0.block_stride == first.block_stride
        {
            end += 1;
        }
        let (mut reader, [kernel_block_stride, token_stride, head_stride]) = strides(&first);
        for (dl, _) in &layers[start..end] {
            // Per-layer arrays may differ in alignment: the run reads as its least aligned one.
            let (r, _) = strides(dl);
            reader = reader.max_of(r);
        }
        let mut descs = [LayerDesc::default(); MAX_LAYERS_PER_LAUNCH];
        for (d, (dl, job_layer)) in descs.iter_mut().zip(&layers[start..end]) {
            *d = LayerDesc {
                k: dl.k,
                v: dl.v,
                layer_number: job_layer.layer_number,
                head_base: job_layer.head_base,
                column: job_layer.column as u32,
                pad: 0,
            };
        }
        for chunk in blocks.chunks(MAX_BLOCKS_PER_LAUNCH) {
            let mut table = [BlockDesc::default(); MAX_BLOCKS_PER_LAUNCH];
            table[..chunk.len()].copy_from_slice(chunk);
            launches.push((
                reader,
                Launch {
                    layers: descs,
                    blocks: table,
                    block_stride: first.block_stride,
                    kernel_block_stride,
                    token_stride,
                    head_stride,
                    kernel_block_size: first.layout.kernel_block_size as u32,
                    num_heads: first.layout.num_kv_heads as u32,
                    row_bytes: first.layout.row_bytes() as u32,
                    num_layers: (end - start) as u32,
                    num_blocks: chunk.len() as u32,
                    out_blocks,
                },
            ));
        }
        start = end;
    }
    Ok(launches)
}

impl Reader {
    /// The reader that serves both: the narrower load.
    fn max_of(self, other: Reader) -> Reader {
        let rank = |r: Reader| match r {
            Reader::Rows16 => 0,
            Reader::Rows8 => 1,
            Reader::Joined => 2,
        };
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}

/// Thread blocks per block desc along the layers: each sums `num_layers / groups` layers, so big
/// launches amortize a thread block's set-up and reduction over several layers while small ones
/// keep every layer its own thread block (enough of them to fill the GPU).
fn layer_groups(launch: &Launch) -> u32 {
    const LAYERS_PER_THREAD_BLOCK: u32 = 4;
    if launch.num_blocks * launch.num_layers >= 4096 {
        launch.num_layers.div_ceil(LAYERS_PER_THREAD_BLOCK)
    } else {
        launch.num_layers
    }
}

fn invalid(what: &str) -> KernelError {
    KernelError::Checksum(KvChecksumError::InvalidJob(what.to_string()))
}

/// The checksum kernel over one device cache, owned: what the engine's checksum worker is given
/// for a GPU instance (its side thread and its step share it). Each job launches on the side
/// stream after the engine stream's queued work and waits for its own result.
#[derive(Debug)]
pub struct DeviceChecksums {
    checksums: CudaChecksums,
    cache: DeviceKvCache,
}

impl DeviceChecksums {
    /// Loads the kernel for `cache`'s device.
    pub fn new(cache: DeviceKvCache) -> Result<Self, KernelError> {
        Ok(DeviceChecksums {
            checksums: CudaChecksums::new(cache.device())?,
            cache,
        })
    }
}

impl ChecksumBackend for DeviceChecksums {
    fn checksum(&self, job: &GroupJob<'_>, out: &mut [u64]) -> Result<(), KvChecksumError> {
        CudaBackend {
            checksums: &self.checksums,
            cache: &self.cache,
        }
        .checksum(job, out)
    }
}

/// [`ChecksumBackend`] over a device cache: launches and waits (for callers that want the values
/// now, like the CPU backend's).
#[derive(Debug)]
pub struct CudaBackend<'a> {
    pub checksums: &'a CudaChecksums,
    pub cache: &'a DeviceKvCache,
}

impl ChecksumBackend for CudaBackend<'_> {
    fn checksum(&self, job: &GroupJob<'_>, out: &mut [u64]) -> Result<(), KvChecksumError> {
        if out.len() != job.columns * job.blocks.len() {
            return Err(KvChecksumError::InvalidJob(format!(
                "output holds {} values, expected {} columns x {} blocks",
                out.len(),
                job.columns,
                job.blocks.len()
            )));
        }
        let values = self
            .checksums
            .launch(self.cache, job, None)
            .and_then(PendingChecksums::wait)
            .map_err(|e| match e {
                KernelError::Checksum(e) => e,
                other => KvChecksumError::Backend(other.to_string()),
            })?;
        for (o, v) in out.iter_mut().zip(values) {
            *o = o.wrapping_add(v);
        }
        Ok(())
    }
}
