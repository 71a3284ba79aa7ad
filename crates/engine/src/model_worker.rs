//! The model worker: runs the model (or one rank's shard of it) over its paged KV cache.
//!
//! The sampling rank (the whole model, or TP rank 0 of the last pipeline stage) owns each
//! request's sampler (created when the request is first scheduled, dropped when the scheduler
//! reports it finished); other ranks return no tokens. Every rank drives its connector's worker
//! side around the forward pass: transfers start before the forward, finished ones are collected
//! after it. Its [`ChecksumWorker`] (its layers and KV heads) learns the step's loads before the
//! connector starts them, checksums sends on its side thread after the forward, and checksums
//! the loads the connector reports finished before the step returns.

use std::collections::HashMap;
use std::sync::Arc;

use tandem_kv_cache::KvStorage;
use tandem_kv_connector::base::KvConnectorWorker;
use tandem_models::{CausalLm, ForwardBatch, SeqBatch};

use crate::error::EngineError;
use crate::kv_checksum::ChecksumWorker;
use crate::sampling::Sampler;
use crate::scheduler_output::{SampledToken, SchedulerOutput, WorkerOutput};
use crate::worker::{FlatBatch, Worker};

/// Runs the model on this process.
pub struct ModelWorker {
    model: Arc<dyn CausalLm>,
    kv: Arc<KvStorage>,
    block_size: usize,
    samplers: HashMap<u64, Sampler>,
    connector: Box<dyn KvConnectorWorker>,
    checksums: ChecksumWorker,
    /// Whether this rank samples the step's tokens.
    samples: bool,
}

impl ModelWorker {
    pub fn new(
        model: Arc<dyn CausalLm>,
        kv: Arc<KvStorage>,
        block_size: usize,
        mut connector: Box<dyn KvConnectorWorker>,
    ) -> Result<Self, EngineError> {
        connector
            .register_kv_caches(kv.clone())
            .map_err(|e| EngineError::Execution(format!("registering KV caches: {e}")))?;
        // The storage was allocated from these groups; they name each layer's group and spec.
        let groups = if kv.num_layers() == 0 {
            Vec::new()
        } else {
            model.kv_cache_groups(block_size, kv.layout(0).dtype)
        };
        let (parallel, rank) = model.parallel_rank();
        let checksums = if parallel.is_single() {
            ChecksumWorker::single(kv.clone(), &groups)
        } else {
            let kv_heads = model.info().num_kv_heads;
            ChecksumWorker::for_rank(kv.clone(), &groups, parallel, rank, kv_heads)?
        };
        Ok(ModelWorker {
            model,
            kv,
            block_size,
            samplers: HashMap::new(),
            connector,
            checksums,
            samples: rank == parallel.driver(),
        })
    }
}

impl ModelWorker {
    /// Starts the step's transfers and runs the forward; returns the sampled tokens.
    fn run_step(&mut self, step: &SchedulerOutput) -> Result<Vec<SampledToken>, EngineError> {
        self.connector
            .start_load_kv(&step.connector_metadata)
            .map_err(|e| EngineError::Execution(format!("starting KV transfers: {e}")))?;
        let mut sampled = Vec::new();
        if !step.has_model_work() {
            return Ok(sampled);
        }
        for s in step.scheduled.iter().filter(|_| self.samples) {
            if let Some(p) = &s.sampling {
                let context = s.penalty_context.as_deref().unwrap_or_default();
                self.samplers
                    .insert(s.request_id, Sampler::new(p.clone(), context));
            }
        }
        let flat = FlatBatch::build(step, self.block_size);
        let tables: Vec<&[u32]> = step
            .scheduled
            .iter()
            .map(|s| s.block_table.as_slice())
            .collect();
        let seqs: Vec<SeqBatch<'_>> = flat
            .seqs
            .iter()
            .zip(&tables)
            .map(|(&(query_start, query_len, context_len), table)| SeqBatch {
                query_start,
                query_len,
                context_len,
                block_table: table,
            })
            .collect();
        let batch = ForwardBatch {
            token_ids: &flat.token_ids,
            positions: &flat.positions,
            slot_mapping: &flat.slot_mapping,
            seqs: &seqs,
            logits_indices: &flat.logits_indices,
        };
        let logits = self
            .model
            .forward(&batch, &self.kv)
            .map_err(|e| EngineError::Execution(e.to_string()))?;
        if !self.samples {
            return Ok(sampled);
        }
        let vocab = self.model.info().vocab_size;
        for (row, &id) in flat.sampled_requests.iter().enumerate() {
            let sampler = self
                .samplers
                .get_mut(&id)
                .ok_or_else(|| EngineError::Execution(format!("no sampler for request {id}")))?;
            let (token_id, logprob) = sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
            sampled.push(SampledToken {
                request_id: id,
                token_id,
                logprob,
            });
        }
        Ok(sampled)
    }
}

impl Worker for ModelWorker {
    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError> {
        for id in &step.finished_request_ids {
            self.samplers.remove(id);
        }
        self.checksums
            .begin_step(&step.checksum_work, &step.finished_request_ids);
        let sampled = self.run_step(step);
        // The forward wrote this step's KV: the prompts it completed can be checksummed. Queued
        // even after a failed step, so that every send job is answered and its blocks released.
        self.checksums.start_sends(&step.checksum_work);
        let mut out = WorkerOutput {
            sampled: sampled?,
            ..Default::default()
        };
        out.connector_output = self.connector.get_finished();
        out.checksum_records = self.checksums.end_step(&out.connector_output);
        Ok(out)
    }
}
