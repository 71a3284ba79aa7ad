//! A Llama-family decoder's forward step on one GPU: bf16 weights, an f32 residual stream, the
//! paged bf16 KV cache of a [`DeviceKvCache`], Tandem's kernels (`cuda/decoder.cu`) for
//! embedding, RMSNorm, RoPE with the cache write, paged attention and SiLU·mul, and cuBLAS
//! ([`Blas`]) for the four products of each layer and the output layer. The attention-output and
//! down products accumulate straight into the f32 residual (cuBLAS's `beta = 1`).
//!
//! A step ([`StepInput`], checked by `crate::step`) is the engine's flattened batch: any mix of
//! prefill chunks and decode tokens; each row attends causally to keys `0..=ctx_idx[row]` of its
//! sequence. Everything a step needs travels to the device in one copy; the kernels then run on
//! the device's stream with no host sync until the logits are read.
//!
//! Invariants: a step's rows, tables and slots are validated against the cache before anything is
//! queued, so no kernel reads or writes outside its buffers; the scratch buffers hold
//! `max_tokens` rows and a step with more is refused; steps are serialised by `scratch`'s lock.

use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::{result, CudaFunction, CudaSlice};

use super::blas::{Blas, Output};
use super::{address, Device, DeviceKvCache};
use crate::step::{
    bf16_bits, check_step, prefers_tiled_attention, DecoderShape, StepInput, MAX_LOGITS_ROWS,
    TILED_ROWS,
};
use crate::KernelError;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decoder.ptx"));

/// Threads of an attention thread block (4 warps, as `decoder.cu` assumes).
const ATTENTION_THREADS: u32 = 128;
/// u32s of step metadata the decoder holds without growing its buffer (a captured step's
/// metadata must fit it).
const META_CAPACITY: usize = 1 << 20;
/// Keys per split of a long context: rows with more keys are split over thread blocks and merged.
const KEYS_PER_SPLIT: usize = 512;
/// Splits a row's keys take at most.
const MAX_SPLITS: usize = 64;

/// One of the model's weights, in the fused layout the GPU decoder keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tensor {
    /// `[vocab, hidden]`.
    Embedding,
    /// `[vocab, hidden]` (absent when tied to the embedding).
    Output,
    /// `[hidden]`.
    FinalNorm,
    /// `[hidden]` of layer `l`.
    AttnNorm(usize),
    FfnNorm(usize),
    /// `[(heads + 2 kv_heads) * head_dim, hidden]`: Q rows, then K, then V (HF order).
    Qkv(usize),
    /// `[hidden, heads * head_dim]`.
    AttnOutput(usize),
    /// `[2 * intermediate, hidden]`: gate rows, then up.
    GateUp(usize),
    /// `[hidden, intermediate]`.
    Down(usize),
}

/// Where the weights come from.
pub enum Weights<'a> {
    /// Row-major f32 values of each tensor, converted to bf16 on the way.
    Host(&'a mut dyn FnMut(Tensor) -> Result<Vec<f32>, String>),
    /// Uniform in `±sqrt(3 / cols)`, generated on the device from `seed` (norms are 1).
    Random { seed: u64 },
}

struct Layer {
    attn_norm: u64,
    ffn_norm: u64,
    qkv: u64,
    o: u64,
    gate_up: u64,
    down: u64,
}

/// Device buffers of a step, sized for `max_tokens` rows (`logits` for [`MAX_LOGITS_ROWS`]),
/// with their addresses (taken once: nothing of cudarc's runs while a step is captured).
struct Scratch {
    meta: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    part_len: usize,
    addr: ScratchAddresses,
    _buffers: Vec<CudaSlice<u8>>,
}

#[derive(Debug, Clone, Copy)]
struct ScratchAddresses {
    meta: u64,
    x: u64,
    xn: u64,
    qkv: u64,
    attn: u64,
    gate_up: u64,
    act: u64,
    part: u64,
    logits: u64,
}

/// What a step's kernels are launched with: its sizes and where its metadata lies in `meta`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StepPlan {
    tokens: usize,
    logits_rows: usize,
    splits: usize,
    /// Whether attention runs the tensor-core prefill kernel (a step of long runs of rows of
    /// one sequence, see [`prefers_tiled_attention`]) instead of the per-row kernel.
    tiled: bool,
    /// Offsets (in u32s) of ids, positions, slots, ctx_idx, table_off, logits_rows, tables.
    offsets: [u64; 7],
}

/// A step's kernels captured as a CUDA graph, replayed for later steps of the same sizes (one
/// launch instead of ~10 per layer).
pub struct StepGraph {
    graph: cudarc::driver::CudaGraph,
    plan: StepPlan,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraph")
            .field("plan", &self.plan)
            .finish()
    }
}

struct Kernels {
    embed: CudaFunction,
    rms_norm: CudaFunction,
    rope_write: CudaFunction,
    silu_mul: CudaFunction,
    fill: CudaFunction,
    attention: CudaFunction,
    combine: CudaFunction,
    prefill_attention: CudaFunction,
}

/// A kernel argument.
#[derive(Debug, Clone, Copy)]
enum Arg {
    U64(u64),
    U32(u32),
    F32(f32),
}

/// A Llama-family decoder in device memory with its KV cache.
pub struct GpuDecoder {
    device: Device,
    blas: Blas,
    shape: DecoderShape,
    cache: DeviceKvCache,
    kernels: Kernels,
    embed: u64,
    output: u64,
    final_norm: u64,
    rope: u64,
    layers: Vec<Layer>,
    max_tokens: usize,
    scratch: Mutex<Scratch>,
    /// Every weight buffer, kept alive for the addresses above.
    _memory: Vec<CudaSlice<u8>>,
}

impl std::fmt::Debug for GpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDecoder")
            .field("shape", &self.shape)
            .field("max_tokens", &self.max_tokens)
            .finish_non_exhaustive()
    }
}

impl GpuDecoder {
    /// Loads a decoder of `shape` on `device` over `cache` (bf16, one layer per model layer),
    /// with RoPE inverse frequencies `inv_freq` (`head_dim / 2` of them) and scratch for steps of
    /// up to `max_tokens` rows.
    pub fn new(
        device: &Device,
        shape: DecoderShape,
        inv_freq: &[f32],
        cache: DeviceKvCache,
        max_tokens: usize,
        weights: Weights<'_>,
    ) -> Result<Self, KernelError> {
        shape.validate()?;
        let layout = *cache.layout();
        if layout.dtype != tandem_kv_cache::CacheDtype::Bf16
            || layout.order != tandem_kv_cache::LayoutOrder::TokenMajor
            || layout.kernel_block_size != layout.block_size
            || layout.num_kv_heads != shape.kv_heads
            || layout.head_dim != shape.head_dim
            || cache.layers().len() != shape.layers
        {
            return Err(KernelError::Shape(format!(
                "the GPU decoder needs a bf16 token-major cache of {} layers, {} KV heads of {}: \
                 got {layout:?} with {} layers",
                shape.layers,
                shape.kv_heads,
                shape.head_dim,
                cache.layers().len()
            )));
        }
        if inv_freq.len() != shape.head_dim / 2 || max_tokens == 0 {
            return Err(KernelError::Shape(format!(
                "{} RoPE frequencies for head_dim {}, max_tokens {max_tokens}",
                inv_freq.len(),
                shape.head_dim
            )));
        }
        device.context().bind_to_thread()?;
        let module = device.load(PTX)?;
        let f = |name: &str| module.load_function(name);
        let kernels = Kernels {
            embed: f("tandem_embed")?,
            rms_norm: f("tandem_rms_norm")?,
            rope_write: f("tandem_rope_write")?,
            silu_mul: f("tandem_silu_mul")?,
            fill: f("tandem_fill_uniform_bf16")?,
            attention: f(if shape.head_dim == 64 {
                "tandem_attention_d64"
            } else {
                "tandem_attention_d128"
            })?,
            combine: f("tandem_attention_combine")?,
            prefill_attention: f(if shape.head_dim == 64 {
                "tandem_prefill_attention_d64"
            } else {
                "tandem_prefill_attention_d128"
            })?,
        };
        let blas = Blas::new(device)?;
        let scratch = Scratch::new(device, &shape, max_tokens)?;
        let mut loader = Loader {
            device,
            kernels: &kernels,
            weights,
            memory: Vec::new(),
            seed_counter: 0,
        };
        let (h, i) = (shape.hidden, shape.intermediate);
        let qd = shape.heads * shape.head_dim;
        let embed = loader.matrix(Tensor::Embedding, shape.vocab, h)?;
        let output = if shape.tie_embeddings {
            embed
        } else {
            loader.matrix(Tensor::Output, shape.vocab, h)?
        };
        let final_norm = loader.vector(Tensor::FinalNorm, h)?;
        let mut layers = Vec::with_capacity(shape.layers);
        for l in 0..shape.layers {
            layers.push(Layer {
                attn_norm: loader.vector(Tensor::AttnNorm(l), h)?,
                ffn_norm: loader.vector(Tensor::FfnNorm(l), h)?,
                qkv: loader.matrix(Tensor::Qkv(l), shape.qkv_width(), h)?,
                o: loader.matrix(Tensor::AttnOutput(l), h, qd)?,
                gate_up: loader.matrix(Tensor::GateUp(l), 2 * i, h)?,
                down: loader.matrix(Tensor::Down(l), h, i)?,
            });
        }
        // RoPE rows [position][cos half | sin half], computed as the CPU's table is (f32).
        let half = inv_freq.len();
        let mut table = Vec::with_capacity(shape.max_positions * 2 * half);
        for p in 0..shape.max_positions {
            let angles = inv_freq.iter().map(|&f| p as f32 * f);
            table.extend(angles.clone().map(f32::cos));
            table.extend(angles.map(f32::sin));
        }
        let rope = loader.upload_f32(&table)?;
        let memory = loader.memory;
        device.stream().synchronize()?;
        Ok(GpuDecoder {
            device: device.clone(),
            blas,
            shape,
            cache,
            kernels,
            embed,
            output,
            final_norm,
            rope,
            layers,
            max_tokens,
            scratch: Mutex::new(scratch),
            _memory: memory,
        })
    }

    pub fn shape(&self) -> &DecoderShape {
        &self.shape
    }

    pub fn cache(&self) -> &DeviceKvCache {
        &self.cache
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Queues one step on the device's stream and copies the logits of `step.logits_rows` back
    /// (`[rows, vocab]` row-major), waiting for them.
    pub fn forward(&self, step: &StepInput<'_>) -> Result<Vec<f32>, KernelError> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        self.enqueue(&mut scratch, step)?;
        self.read_logits(&scratch, step.logits_rows.len())
    }

    /// Queues one step without reading anything back (for benchmarks: time it with events).
    pub fn enqueue_step(&self, step: &StepInput<'_>) -> Result<(), KernelError> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        self.enqueue(&mut scratch, step)
    }

    fn check(&self, step: &StepInput<'_>) -> Result<(), KernelError> {
        check_step(step, &self.shape, self.cache.layout(), self.max_tokens)
    }

    fn enqueue(&self, s: &mut Scratch, step: &StepInput<'_>) -> Result<(), KernelError> {
        let plan = self.upload(s, step)?;
        self.launch_step(&s.addr, &plan)
    }

    /// Captures the kernels of `step` (whose metadata is uploaded first, outside the graph) as a
    /// graph for later steps of the same row counts and key splits; runs nothing.
    pub fn capture(&self, step: &StepInput<'_>) -> Result<StepGraph, KernelError> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let plan = self.upload(&mut scratch, step)?;
        let stream = self.device.stream();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let launched = self.launch_step(&scratch.addr, &plan);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
        launched?;
        let graph = graph.ok_or_else(|| KernelError::Shape("an empty step graph".into()))?;
        Ok(StepGraph { graph, plan })
    }

    /// Runs `step` through `graph` (captured from a step of the same sizes) and returns its
    /// logits, as [`GpuDecoder::forward`] does.
    pub fn replay(&self, graph: &StepGraph, step: &StepInput<'_>) -> Result<Vec<f32>, KernelError> {
        self.replay_queued(graph, step)?;
        let scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        self.read_logits(&scratch, step.logits_rows.len())
    }

    /// Queues `step` through `graph` without reading anything back.
    pub fn replay_queued(
        &self,
        graph: &StepGraph,
        step: &StepInput<'_>,
    ) -> Result<(), KernelError> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let plan = self.upload(&mut scratch, step)?;
        if plan != graph.plan {
            return Err(KernelError::Shape(format!(
                "a step of {} rows, {} logits rows, {} key splits (tiled prefill: {}) does not \
                 fit a graph of {} rows, {} logits rows, {} splits (tiled prefill: {})",
                plan.tokens,
                plan.logits_rows,
                plan.splits,
                plan.tiled,
                graph.plan.tokens,
                graph.plan.logits_rows,
                graph.plan.splits,
                graph.plan.tiled
            )));
        }
        graph.graph.launch()?;
        Ok(())
    }

    fn read_logits(&self, s: &Scratch, rows: usize) -> Result<Vec<f32>, KernelError> {
        let n = rows * self.shape.vocab;
        let mut out = vec![0f32; n];
        if n > 0 {
            let view = s.logits.slice(..n);
            self.device
                .stream()
                .memcpy_dtoh(&view, out.as_mut_slice())?;
        }
        self.device.stream().synchronize()?;
        Ok(out)
    }

    /// Checks `step` and copies its metadata to the device.
    fn upload(&self, s: &mut Scratch, step: &StepInput<'_>) -> Result<StepPlan, KernelError> {
        self.check(step)?;
        self.device.context().bind_to_thread()?;
        let parts = [
            step.token_ids,
            step.positions,
            step.slots,
            step.ctx_idx,
            step.table_off,
            step.logits_rows,
            step.tables,
        ];
        let meta_len: usize = parts.iter().map(|p| p.len()).sum();
        if meta_len > s.meta.len() {
            s.meta = self
                .device
                .stream()
                .alloc_zeros::<u32>(meta_len.next_power_of_two())?;
            s.addr.meta = address(&s.meta, &self.device);
        }
        let mut meta = Vec::with_capacity(meta_len);
        let mut offsets = [0u64; 7];
        for (o, p) in offsets.iter_mut().zip(parts) {
            *o = meta.len() as u64;
            meta.extend_from_slice(p);
        }
        {
            let mut view = s.meta.slice_mut(..meta_len);
            self.device
                .stream()
                .memcpy_htod(meta.as_slice(), &mut view)?;
        }
        let t = step.token_ids.len();
        let shape = &self.shape;
        let max_keys = step.ctx_idx.iter().max().map_or(1, |&c| c as usize + 1);
        let mut splits = max_keys.div_ceil(KEYS_PER_SPLIT).min(MAX_SPLITS);
        // A step with many rows fills the GPU without splits (and would overflow `part`).
        if t * shape.kv_heads >= 512 || t * shape.heads * splits * (shape.head_dim + 2) > s.part_len
        {
            splits = 1;
        }
        let tiled = prefers_tiled_attention(step.table_off);
        Ok(StepPlan {
            tokens: t,
            logits_rows: step.logits_rows.len(),
            splits: if tiled { 1 } else { splits.max(1) },
            tiled,
            offsets,
        })
    }

    /// Queues the kernels of a step whose metadata is on the device.
    fn launch_step(&self, a: &ScratchAddresses, plan: &StepPlan) -> Result<(), KernelError> {
        let shape = &self.shape;
        let (t, r, splits) = (plan.tokens, plan.logits_rows, plan.splits);
        let (h, inter) = (shape.hidden, shape.intermediate);
        let qd = shape.heads * shape.head_dim;
        let at = |i: usize| a.meta + 4 * plan.offsets[i];
        let (ids, positions, slots, ctx_idx, table_off, logits_rows, tables) =
            (at(0), at(1), at(2), at(3), at(4), at(5), at(6));
        let (x, xn, qkv, attn, gate_up, act, part, logits) =
            (a.x, a.xn, a.qkv, a.attn, a.gate_up, a.act, a.part, a.logits);
        // With one split a row's keys are all its context (the kernel stops at ctx_idx + 1).
        let chunk = if splits == 1 {
            u32::MAX
        } else {
            KEYS_PER_SPLIT as u32
        };
        let layout = self.cache.layout();
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let t32 = t as u32;
        self.launch(
            &self.kernels.embed,
            (t32, 1, 1),
            256,
            &[
                Arg::U64(ids),
                Arg::U64(self.embed),
                Arg::U64(x),
                Arg::U32(h as u32),
                Arg::F32(1.0),
            ],
        )?;
        for (l, layer) in self.layers.iter().enumerate() {
            let cl = self.cache.layers()[l];
            self.rms_norm(x, 0, layer.attn_norm, xn, t)?;
            // SAFETY (every matmul): the addresses are this decoder's weights and scratch, sized for
            // `max_tokens >= t` rows of these widths.
            unsafe {
                self.blas.matmul(
                    xn,
                    h,
                    layer.qkv,
                    qkv,
                    shape.qkv_width(),
                    (t, shape.qkv_width(), h),
                    Output::Bf16,
                )?;
            }
            self.launch(
                &self.kernels.rope_write,
                (t32, 1, 1),
                128,
                &[
                    Arg::U64(qkv),
                    Arg::U64(positions),
                    Arg::U64(slots),
                    Arg::U64(self.rope),
                    Arg::U64(cl.k),
                    Arg::U64(cl.v),
                    Arg::U64(cl.block_stride),
                    Arg::U32(layout.block_size as u32),
                    Arg::U32(shape.heads as u32),
                    Arg::U32(shape.kv_heads as u32),
                    Arg::U32(shape.head_dim as u32),
                ],
            )?;
            if plan.tiled {
                self.launch(
                    &self.kernels.prefill_attention,
                    (t32.div_ceil(TILED_ROWS), shape.heads as u32, 1),
                    ATTENTION_THREADS,
                    &[
                        Arg::U64(qkv),
                        Arg::U64(ctx_idx),
                        Arg::U64(table_off),
                        Arg::U64(tables),
                        Arg::U64(cl.k),
                        Arg::U64(cl.v),
                        Arg::U64(cl.block_stride),
                        Arg::U32(layout.block_size as u32),
                        Arg::U32(shape.heads as u32),
                        Arg::U32(shape.kv_heads as u32),
                        Arg::F32(scale),
                        Arg::U32(t32),
                        Arg::U64(attn),
                    ],
                )?;
            } else {
                self.launch(
                    &self.kernels.attention,
                    (t32, shape.kv_heads as u32, splits as u32),
                    ATTENTION_THREADS,
                    &[
                        Arg::U64(qkv),
                        Arg::U64(ctx_idx),
                        Arg::U64(table_off),
                        Arg::U64(tables),
                        Arg::U64(cl.k),
                        Arg::U64(cl.v),
                        Arg::U64(cl.block_stride),
                        Arg::U32(layout.block_size as u32),
                        Arg::U32(shape.heads as u32),
                        Arg::U32(shape.kv_heads as u32),
                        Arg::F32(scale),
                        Arg::U32(chunk),
                        Arg::U64(attn),
                        Arg::U64(part),
                    ],
                )?;
            }
            if splits > 1 {
                self.launch(
                    &self.kernels.combine,
                    (t32, shape.heads as u32, 1),
                    shape.head_dim as u32,
                    &[
                        Arg::U64(part),
                        Arg::U64(attn),
                        Arg::U32(shape.heads as u32),
                        Arg::U32(shape.head_dim as u32),
                        Arg::U32(splits as u32),
                    ],
                )?;
            }
            unsafe {
                self.blas
                    .matmul(attn, qd, layer.o, x, h, (t, h, qd), Output::AccumulateF32)?;
            }
            self.rms_norm(x, 0, layer.ffn_norm, xn, t)?;
            unsafe {
                self.blas.matmul(
                    xn,
                    h,
                    layer.gate_up,
                    gate_up,
                    2 * inter,
                    (t, 2 * inter, h),
                    Output::Bf16,
                )?;
            }
            let total = (t * inter) as u64;
            self.launch(
                &self.kernels.silu_mul,
                (total.div_ceil(256).min(65_535) as u32, 1, 1),
                256,
                &[
                    Arg::U64(gate_up),
                    Arg::U64(act),
                    Arg::U32(inter as u32),
                    Arg::U64(total),
                ],
            )?;
            unsafe {
                self.blas.matmul(
                    act,
                    inter,
                    layer.down,
                    x,
                    h,
                    (t, h, inter),
                    Output::AccumulateF32,
                )?;
            }
        }
        if r > 0 {
            self.rms_norm(x, logits_rows, self.final_norm, xn, r)?;
            unsafe {
                self.blas.matmul(
                    xn,
                    h,
                    self.output,
                    logits,
                    shape.vocab,
                    (r, shape.vocab, h),
                    Output::F32,
                )?;
            }
        }
        Ok(())
    }

    fn rms_norm(&self, x: u64, rows: u64, w: u64, out: u64, n: usize) -> Result<(), KernelError> {
        self.launch(
            &self.kernels.rms_norm,
            (n as u32, 1, 1),
            256,
            &[
                Arg::U64(x),
                Arg::U64(rows),
                Arg::U64(w),
                Arg::U64(out),
                Arg::U32(self.shape.hidden as u32),
                Arg::F32(self.shape.rms_eps),
            ],
        )
    }

    fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        threads: u32,
        args: &[Arg],
    ) -> Result<(), KernelError> {
        launch(&self.device, f, grid, threads, args)
    }
}

fn launch(
    device: &Device,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    threads: u32,
    args: &[Arg],
) -> Result<(), KernelError> {
    let mut values: Vec<Arg> = args.to_vec();
    let mut params: Vec<*mut c_void> = values
        .iter_mut()
        .map(|a| match a {
            Arg::U64(v) => v as *mut u64 as *mut c_void,
            Arg::U32(v) => v as *mut u32 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
        })
        .collect();
    // SAFETY: each kernel's parameters in `decoder.cu` are 8-byte pointers or u64s (U64) and
    // 4-byte u32s or floats, in the order the launchers pass them; the buffers they address were
    // bounds-checked by `GpuDecoder::check` and are owned by the decoder.
    unsafe {
        result::launch_kernel(
            f.cu_function(),
            grid,
            (threads, 1, 1),
            0,
            device.stream().cu_stream(),
            &mut params,
        )
    }?;
    Ok(())
}

impl Scratch {
    fn new(device: &Device, shape: &DecoderShape, max_tokens: usize) -> Result<Self, KernelError> {
        let st = device.stream();
        let t = max_tokens;
        let part_len = t.min(64) * shape.heads * MAX_SPLITS * (shape.head_dim + 2);
        let mut buffers = Vec::new();
        let mut buffer = |bytes: usize| -> Result<u64, KernelError> {
            let b = st.alloc_zeros::<u8>(bytes.max(1))?;
            let addr = address(&b, device);
            buffers.push(b);
            Ok(addr)
        };
        let x = buffer(4 * t * shape.hidden)?;
        let xn = buffer(2 * t * shape.hidden)?;
        let qkv = buffer(2 * t * shape.qkv_width())?;
        let attn = buffer(2 * t * shape.heads * shape.head_dim)?;
        let gate_up = buffer(4 * t * shape.intermediate)?;
        let act = buffer(2 * t * shape.intermediate)?;
        let part = buffer(4 * part_len)?;
        let meta = st.alloc_zeros::<u32>(META_CAPACITY)?;
        let logits = st.alloc_zeros::<f32>(t.min(MAX_LOGITS_ROWS) * shape.vocab)?;
        let addr = ScratchAddresses {
            meta: address(&meta, device),
            x,
            xn,
            qkv,
            attn,
            gate_up,
            act,
            part,
            logits: address(&logits, device),
        };
        Ok(Scratch {
            meta,
            logits,
            part_len,
            addr,
            _buffers: buffers,
        })
    }
}

/// Uploads weights as the loader's source gives them.
struct Loader<'a, 'w> {
    device: &'a Device,
    kernels: &'a Kernels,
    weights: Weights<'w>,
    memory: Vec<CudaSlice<u8>>,
    seed_counter: u64,
}

impl Loader<'_, '_> {
    fn keep(&mut self, slice: CudaSlice<u8>) -> u64 {
        let addr = address(&slice, self.device);
        self.memory.push(slice);
        addr
    }

    fn upload_f32(&mut self, values: &[f32]) -> Result<u64, KernelError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let slice = self.device.stream().clone_htod(bytes.as_slice())?;
        Ok(self.keep(slice))
    }

    fn host(&mut self, tensor: Tensor, len: usize) -> Result<Vec<f32>, KernelError> {
        let Weights::Host(source) = &mut self.weights else {
            unreachable!("host() is called for host weights only");
        };
        let values = source(tensor).map_err(KernelError::Shape)?;
        if values.len() != len {
            return Err(KernelError::Shape(format!(
                "{tensor:?} has {} values, expected {len}",
                values.len()
            )));
        }
        Ok(values)
    }

    fn vector(&mut self, tensor: Tensor, len: usize) -> Result<u64, KernelError> {
        let values = match self.weights {
            Weights::Random { .. } => vec![1.0; len],
            Weights::Host(_) => self.host(tensor, len)?,
        };
        self.upload_f32(&values)
    }

    fn matrix(&mut self, tensor: Tensor, rows: usize, cols: usize) -> Result<u64, KernelError> {
        match self.weights {
            Weights::Random { seed } => {
                self.seed_counter += 1;
                let n = rows * cols;
                let slice = self.device.stream().alloc_zeros::<u8>(2 * n)?;
                let addr = self.keep(slice);
                let mut scale = (3.0 / cols as f32).sqrt();
                if matches!(tensor, Tensor::Output) {
                    scale *= 4.0;
                }
                launch(
                    self.device,
                    &self.kernels.fill,
                    (4096, 1, 1),
                    256,
                    &[
                        Arg::U64(addr),
                        Arg::U64(n as u64),
                        Arg::U64(
                            seed.wrapping_mul(0x9E37_79B9)
                                .wrapping_add(self.seed_counter << 40),
                        ),
                        Arg::F32(scale),
                    ],
                )?;
                Ok(addr)
            }
            Weights::Host(_) => {
                let values = self.host(tensor, rows * cols)?;
                let bytes: Vec<u8> = values
                    .iter()
                    .flat_map(|&v| bf16_bits(v).to_le_bytes())
                    .collect();
                let slice = self.device.stream().clone_htod(bytes.as_slice())?;
                Ok(self.keep(slice))
            }
        }
    }
}
