//! The GPU decoder's step as the host builds and checks it, before anything reaches a device:
//! the decoder's shape ([`DecoderShape`]), a step's arrays ([`StepInput`], [`OwnedStep`]), the
//! bounds check that keeps every kernel inside its buffers ([`check_step`]), which attention
//! kernel a step takes ([`prefers_tiled_attention`]) and the bf16 rounding the weights go
//! through.
//!
//! Plain Rust, compiled with or without the `cuda` feature, so its tests run in every build (no
//! GPU, no CUDA toolchain); only `cuda::GpuDecoder` calls the crate-private checks.
//!
//! Invariant: a step that [`check_step`] accepts makes no kernel read or write outside its
//! buffers.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::KernelError;

/// Query rows per thread block of the tensor-core prefill attention (16 per warp).
pub(crate) const TILED_ROWS: u32 = 64;
/// Rows per run of one sequence, on average, from which a step's attention is tiled.
const TILED_MIN_RUN: usize = 16;
/// Query heads per KV head the attention kernel holds in registers.
pub const MAX_GROUP: usize = 8;
/// Rows of logits a step computes at most.
pub const MAX_LOGITS_ROWS: usize = 512;

/// The shape of a Llama-family decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub max_positions: usize,
    pub rms_eps: f32,
    pub tie_embeddings: bool,
}

impl DecoderShape {
    /// Llama 3.1 8B's shape (for benchmarks with random weights).
    pub fn llama_8b() -> Self {
        DecoderShape {
            hidden: 4096,
            intermediate: 14336,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 128_256,
            max_positions: 131_072,
            rms_eps: 1e-5,
            tie_embeddings: false,
        }
    }

    pub(crate) fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Bytes of bf16 weights a step reads once (every matrix and the output layer).
    pub fn weight_bytes(&self) -> usize {
        let (h, i) = (self.hidden, self.intermediate);
        let per_layer = self.qkv_width() * h + h * self.heads * self.head_dim + 3 * h * i;
        2 * (self.layers * per_layer + self.vocab * h)
    }

    pub(crate) fn validate(&self) -> Result<(), KernelError> {
        let ok = self.heads > 0
            && self.kv_heads > 0
            && self.heads.is_multiple_of(self.kv_heads)
            && self.heads / self.kv_heads <= MAX_GROUP
            && matches!(self.head_dim, 64 | 128)
            && self.layers > 0
            && self.hidden > 0
            && self.vocab > 0;
        if ok {
            Ok(())
        } else {
            Err(KernelError::Shape(format!(
                "the GPU decoder takes head_dim 64 or 128 and at most {MAX_GROUP} query heads per \
                 KV head: {self:?}"
            )))
        }
    }
}

/// One step's batch, as the engine flattens it (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    pub token_ids: &'a [u32],
    /// RoPE position of each row.
    pub positions: &'a [u32],
    /// Cache slot (`block * block_size + offset`) each row's K and V are written to.
    pub slots: &'a [u32],
    /// Cache index of each row in its sequence: the row attends to keys `0..=ctx_idx`.
    pub ctx_idx: &'a [u32],
    /// Where each row's block table starts in `tables`.
    pub table_off: &'a [u32],
    /// The block tables of the step's sequences, concatenated.
    pub tables: &'a [u32],
    /// Rows whose logits are computed, in this order.
    pub logits_rows: &'a [u32],
}

/// A step's arrays, owned ([`StepInput`] is their view).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OwnedStep {
    pub token_ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub ctx_idx: Vec<u32>,
    pub table_off: Vec<u32>,
    pub tables: Vec<u32>,
    pub logits_rows: Vec<u32>,
}

impl OwnedStep {
    pub fn input(&self) -> StepInput<'_> {
        StepInput {
            token_ids: &self.token_ids,
            positions: &self.positions,
            slots: &self.slots,
            ctx_idx: &self.ctx_idx,
            table_off: &self.table_off,
            tables: &self.tables,
            logits_rows: &self.logits_rows,
        }
    }

    /// Appends one sequence's rows: tokens `ids` at cache indices (and positions) `first..`, its
    /// block table `table` of `block_size`-token blocks, and a logits row for its last row.
    pub fn push_sequence(&mut self, table: &[u32], block_size: usize, first: usize, ids: &[u32]) {
        let off = self.tables.len() as u32;
        self.tables.extend_from_slice(table);
        for (i, &id) in (first..).zip(ids) {
            self.token_ids.push(id);
            self.positions.push(i as u32);
            self.slots
                .push(table[i / block_size] * block_size as u32 + (i % block_size) as u32);
            self.ctx_idx.push(i as u32);
            self.table_off.push(off);
        }
        self.logits_rows.push(self.token_ids.len() as u32 - 1);
    }
}

/// Whether a step's attention runs the tensor-core prefill kernel: at least one thread block of
/// rows, in runs of one sequence (equal `table_off`) of [`TILED_MIN_RUN`] rows or more on
/// average. Decode steps (one row per sequence) keep the per-row kernel, which splits long
/// contexts over thread blocks; the tiled kernel stages each sequence's keys in shared memory
/// once per 64 rows and multiplies on tensor cores, so it wins where rows share keys.
pub(crate) fn prefers_tiled_attention(table_off: &[u32]) -> bool {
    let rows = table_off.len();
    let runs = 1 + table_off.windows(2).filter(|w| w[0] != w[1]).count();
    rows >= TILED_ROWS as usize && rows >= TILED_MIN_RUN * runs
}

/// f32 to bf16 bits, rounding to nearest even (NaN stays NaN).
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// bf16 bits to f32.
pub fn bf16_to_f32(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

/// Refuses a step that would make a kernel read or write outside its buffers: rows beyond the
/// scratch, token ids beyond the vocabulary, positions beyond the RoPE table, slots or blocks
/// beyond the cache, tables that do not reach a row's cache index, logits rows beyond the step.
pub(crate) fn check_step(
    step: &StepInput<'_>,
    shape: &DecoderShape,
    layout: &tandem_kv_cache::BlockLayout,
    max_tokens: usize,
) -> Result<(), KernelError> {
    let t = step.token_ids.len();
    let bad = |m: String| Err(KernelError::Shape(m));
    if t == 0 || t > max_tokens {
        return bad(format!("{t} rows: the decoder takes 1..={}", max_tokens));
    }
    if [step.positions, step.slots, step.ctx_idx, step.table_off]
        .iter()
        .any(|v| v.len() != t)
    {
        return bad("every per-row array needs one entry per row".into());
    }
    if step.logits_rows.len() > max_tokens.min(MAX_LOGITS_ROWS) {
        return bad(format!("{} logits rows", step.logits_rows.len()));
    }
    let (bs, nb) = (layout.block_size, layout.num_blocks);
    if let Some(id) = step
        .token_ids
        .iter()
        .find(|&&id| id as usize >= shape.vocab)
    {
        return bad(format!(
            "token id {id} outside a vocabulary of {}",
            shape.vocab
        ));
    }
    if let Some(p) = step
        .positions
        .iter()
        .find(|&&p| p as usize >= shape.max_positions)
    {
        return bad(format!("position {p} beyond {}", shape.max_positions));
    }
    if let Some(s) = step.slots.iter().find(|&&s| s as usize >= nb * bs) {
        return bad(format!("slot {s} outside a cache of {nb} blocks of {bs}"));
    }
    if let Some(b) = step.tables.iter().find(|&&b| b as usize >= nb) {
        return bad(format!("block {b} outside a cache of {nb} blocks"));
    }
    for row in 0..t {
        let (off, ctx) = (step.table_off[row] as usize, step.ctx_idx[row] as usize);
        if off + ctx / bs >= step.tables.len() {
            return bad(format!(
                "row {row}: its table at {off} does not cover cache index {ctx}"
            ));
        }
    }
    if let Some(r) = step.logits_rows.iter().find(|&&r| r as usize >= t) {
        return bad(format!("logits row {r} of {t} rows"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_cache::{BlockLayout, CacheDtype};

    #[test]
    fn prefill_steps_take_the_tiled_attention_and_decode_steps_do_not() {
        // one 512-row prefill chunk; two sequences of 70 and 50 rows
        assert!(prefers_tiled_attention(&[0; 512]));
        let two: Vec<u32> = [vec![0; 70], vec![5; 50]].concat();
        assert!(prefers_tiled_attention(&two));
        // 32 decode rows; a short prefill; a chunk with 60 decode rows beside it
        let decode: Vec<u32> = (0..32).map(|i| i * 4).collect();
        assert!(!prefers_tiled_attention(&decode));
        assert!(!prefers_tiled_attention(&[0; 57]));
        let mixed: Vec<u32> = [vec![0; 64], (1..61).collect()].concat();
        assert!(!prefers_tiled_attention(&mixed));
    }

    /// Two rows of one sequence in block 1 of a cache of 8 blocks of 16.
    fn good() -> OwnedStep {
        let mut s = OwnedStep::default();
        s.push_sequence(&[1], 16, 0, &[1, 2]);
        s
    }

    fn check(s: &OwnedStep) -> Result<(), KernelError> {
        let mut shape = DecoderShape::llama_8b();
        shape.vocab = 300;
        shape.max_positions = 4096;
        let layout = BlockLayout::token_major(8, 16, 8, 128, CacheDtype::Bf16);
        check_step(&s.input(), &shape, &layout, 16)
    }

    #[test]
    fn a_step_that_would_reach_outside_a_buffer_is_refused() {
        let g = good();
        assert_eq!(
            (g.slots.as_slice(), g.logits_rows.as_slice()),
            (&[16, 17][..], &[1][..])
        );
        assert!(check(&g).is_ok());
        type Breaker = fn(&mut OwnedStep);
        let cases: [(&str, Breaker); 9] = [
            ("token id", |s| s.token_ids[0] = 300),
            ("slot", |s| s.slots[1] = 8 * 16),
            ("block", |s| s.tables[0] = 8),
            ("table coverage", |s| s.ctx_idx[1] = 16),
            ("table offset", |s| s.table_off[1] = 1),
            ("logits row", |s| s.logits_rows[0] = 2),
            ("position", |s| s.positions[0] = 4096),
            ("row count", |s| s.positions.push(2)),
            ("too many rows", |s| {
                s.token_ids = vec![1; 17];
                s.positions = vec![0; 17];
                s.slots = vec![16; 17];
                s.ctx_idx = vec![0; 17];
                s.table_off = vec![0; 17];
            }),
        ];
        for (what, brk) in cases {
            let mut s = good();
            brk(&mut s);
            assert!(check(&s).is_err(), "a bad {what} was accepted");
        }
        let mut empty = good();
        empty.token_ids.clear();
        assert!(check(&empty).is_err(), "an empty step");
    }

    #[test]
    fn bf16_conversion_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        assert_eq!(
            bf16_to_f32(bf16_bits(1.0 + 1.0 / 256.0)),
            1.0,
            "a tie rounds to even"
        );
        assert_eq!(bf16_to_f32(bf16_bits(1.0 + 3.0 / 256.0)), 1.0 + 4.0 / 256.0);
        assert!(bf16_to_f32(bf16_bits(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(bf16_bits(-2.5)), -2.5);
    }

    #[test]
    fn the_8b_shape_reads_15_gb_of_weights_per_step() {
        // 7.5 billion parameters: every layer matrix and the output layer (the embedding table
        // is only gathered from).
        let gb = DecoderShape::llama_8b().weight_bytes() as f64 / 1e9;
        assert!((15.0..15.1).contains(&gb), "{gb}");
    }
}
