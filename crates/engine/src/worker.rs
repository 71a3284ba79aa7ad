//! Workers: execute a [`SchedulerOutput`] and return a [`WorkerOutput`].
//!
//! The scheduler sees workers only through [`Worker`], so a tensor- or pipeline-parallel group of
//! workers can stand where one worker stands now. [`FlatBatch`] lays a step's tokens out for a
//! forward pass: every scheduled request's tokens one after another, each with its cache slot.

use crate::error::EngineError;
use crate::scheduler_output::{SchedulerOutput, WorkerOutput};

/// Executes scheduled steps.
pub trait Worker: Send {
    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError>;
}

/// The flattened inputs of one forward pass.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FlatBatch {
    pub token_ids: Vec<u32>,
    pub positions: Vec<usize>,
    pub slot_mapping: Vec<usize>,
    /// (query_start, query_len, context_len) per scheduled request.
    pub seqs: Vec<(usize, usize, usize)>,
    /// Rows whose logits are sampled, and for which request.
    pub logits_indices: Vec<usize>,
    pub sampled_requests: Vec<u64>,
}

impl FlatBatch {
    /// Lays out every scheduled request's tokens one after another.
    pub fn build(step: &SchedulerOutput, block_size: usize) -> FlatBatch {
        let mut b = FlatBatch::default();
        for s in &step.scheduled {
            let start = b.token_ids.len();
            for (i, &t) in s.token_ids.iter().enumerate() {
                let pos = s.start_position + i;
                b.token_ids.push(t);
                b.positions.push(pos);
                let block = s.block_table[pos / block_size] as usize;
                b.slot_mapping.push(block * block_size + pos % block_size);
            }
            let n = s.token_ids.len();
            b.seqs.push((start, n, s.start_position + n));
            if s.sample {
                b.logits_indices.push(start + n - 1);
                b.sampled_requests.push(s.request_id);
            }
        }
        b
    }
}
