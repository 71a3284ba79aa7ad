//! Workers: execute a [`SchedulerOutput`] and return a [`WorkerOutput`].
//!
//! The scheduler sees workers only through [`Worker`], so a tensor- or pipeline-parallel group of
//! workers can stand where one worker stands now. [`FlatBatch`] lays a step's tokens out for a
//! forward pass: every scheduled request's tokens one after another, each with its cache slot.

use tandem_kv_connector::base::Waker;

use crate::error::EngineError;
use crate::scheduler_output::{SchedulerOutput, WorkerOutput};

/// Executes scheduled steps.
pub trait Worker: Send {
    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError>;
    /// Called once before the first step: `waker` runs the engine's next step at once when the
    /// worker's connector has news (a load finished, or part of one landed) instead of at the
    /// next poll. Workers without a connector ignore it.
    fn set_waker(&mut self, _waker: Waker) {}
}

/// The flattened inputs of one forward pass.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FlatBatch {
    pub token_ids: Vec<u32>,
    pub positions: Vec<usize>,
    /// Per block table of the step (every request has the same number: one per KV cache group,
    /// or one all groups share), the cache slot of each token.
    pub slot_mappings: Vec<Vec<usize>>,
    /// (query_start, query_len, context_len) per scheduled request.
    pub seqs: Vec<(usize, usize, usize)>,
    /// Rows whose logits are returned: the sampled rows, then the prompt-logprob rows.
    pub logits_indices: Vec<usize>,
    /// The request of each sampled row, in order.
    pub sampled_requests: Vec<u64>,
    /// Per request with prompt logprobs this step, in the order of their rows after the sampled
    /// ones: (request id, prompt position of the first target, the target tokens).
    pub prompt_rows: Vec<(u64, usize, Vec<u32>)>,
}

impl FlatBatch {
    /// Lays out every scheduled request's tokens one after another.
    pub fn build(step: &SchedulerOutput, block_size: usize) -> FlatBatch {
        let mut b = FlatBatch::default();
        let num_tables = step.scheduled.first().map_or(1, |s| s.block_tables.len());
        b.slot_mappings = vec![Vec::new(); num_tables];
        for s in &step.scheduled {
            let start = b.token_ids.len();
            for (i, &t) in s.token_ids.iter().enumerate() {
                let pos = s.start_position + i;
                b.token_ids.push(t);
                b.positions.push(pos);
                for (slots, table) in b.slot_mappings.iter_mut().zip(&s.block_tables) {
                    let block = table[pos / block_size] as usize;
                    slots.push(block * block_size + pos % block_size);
                }
            }
            let n = s.token_ids.len();
            b.seqs.push((start, n, s.start_position + n));
            if s.sample {
                b.logits_indices.push(start + n - 1);
                b.sampled_requests.push(s.request_id);
            }
        }
        let mut start = 0;
        for s in &step.scheduled {
            let targets = &s.prompt_logprob_targets;
            if !targets.is_empty() {
                b.logits_indices.extend(start..start + targets.len());
                b.prompt_rows
                    .push((s.request_id, s.start_position + 1, targets.clone()));
            }
            start += s.token_ids.len();
        }
        b
    }
}
