//! The model worker: runs the model (or one rank's shard of it) over its paged KV cache.
//!
//! [`RankWorker`] is one rank: its model shard, its KV storage, its [`ChecksumWorker`] (its layers
//! and KV heads), and, on the sampling rank (the whole model, or TP rank 0 of the last pipeline
//! stage), each request's sampler (created when the request is first scheduled, dropped when the
//! scheduler reports it finished); other ranks return no tokens. [`ModelWorker`] is the only rank
//! of an instance with its connector; a TP x PP group drives its ranks and one connector over
//! all of their caches in [`crate::parallel_worker::ParallelWorker`].
//!
//! Order of a step, for the connector and the checksums: the checksum worker learns the step's
//! loads before the connector starts them; the connector starts transfers before the forward;
//! sends are checksummed on the side thread after the forward wrote their KV (queued even when
//! the step failed, so that every send job is answered); the loads the connector reports
//! finished are checksummed before the step returns.

use std::collections::HashMap;
use std::sync::Arc;

use tandem_kv_cache::KvStorage;
use tandem_kv_connector::base::{ConnectorOutput, KvConnectorWorker, RankKvCaches};
use tandem_models::{CausalLm, ForwardBatch, SeqBatch};
use tandem_parallel::{KvHeadSlice, RankId};

use crate::error::EngineError;
use crate::kv_checksum::ChecksumWorker;
use crate::sampling::{logprobs_of, Sampler};
use crate::scheduler_output::{
    ChecksumRecord, ForwardOutput, PromptLogprobs, SampledToken, SchedulerOutput, WorkerOutput,
};
use crate::worker::{FlatBatch, Worker};

/// One rank of an instance (the only one for TP 1, PP 1). See the module docs.
pub struct RankWorker {
    model: Arc<dyn CausalLm>,
    kv: Arc<KvStorage>,
    block_size: usize,
    samplers: HashMap<u64, Sampler>,
    checksums: ChecksumWorker,
    /// Whether this rank samples the step's tokens.
    samples: bool,
    rank: RankId,
    /// The model KV heads this rank's storage holds (the model's own split, which the checksum
    /// placement and the connector's registration both follow).
    heads: KvHeadSlice,
}

impl RankWorker {
    pub fn new(
        model: Arc<dyn CausalLm>,
        kv: Arc<KvStorage>,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        // The storage was allocated from these groups; they name each layer's group and spec.
        let groups = if kv.num_layers() == 0 {
            Vec::new()
        } else {
            model.kv_cache_groups(block_size, kv.layout(0).dtype)
        };
        let (parallel, rank) = model.parallel_rank();
        let kv_heads = model.info().num_kv_heads;
        let heads = parallel
            .kv_heads(kv_heads, rank.tp_rank)
            .map_err(|e| EngineError::Execution(e.to_string()))?;
        let checksums = if parallel.is_single() {
            ChecksumWorker::single(kv.clone(), &groups)
        } else {
            ChecksumWorker::for_rank(kv.clone(), &groups, rank, heads, kv_heads)
        };
        Ok(RankWorker {
            model,
            kv,
            block_size,
            samplers: HashMap::new(),
            checksums,
            samples: rank == parallel.driver(),
            rank,
            heads,
        })
    }

    /// This rank's caches as the connector registers them: its storage and the model heads it
    /// holds.
    pub fn kv_caches(&self) -> RankKvCaches {
        let h = self.heads;
        RankKvCaches {
            tp_rank: self.rank.tp_rank,
            pp_rank: self.rank.pp_rank,
            kv_heads: (h.first..h.first + h.count).map(|x| x as u32).collect(),
            kv_replica: h.replica_index as u32,
            storage: self.kv.clone(),
        }
    }

    /// Before the connector starts this step's loads.
    pub fn begin_step(&mut self, step: &SchedulerOutput) {
        for id in &step.finished_request_ids {
            self.samplers.remove(id);
        }
        self.checksums
            .begin_step(&step.checksum_work, &step.finished_request_ids);
    }

    /// Runs the forward; returns the sampled tokens (none on ranks that do not sample).
    pub fn forward(&mut self, step: &SchedulerOutput) -> Result<ForwardOutput, EngineError> {
        let mut out = ForwardOutput::default();
        if !step.has_model_work() {
            return Ok(out);
        }
        for s in step.scheduled.iter().filter(|_| self.samples) {
            if let Some(p) = &s.sampling {
                let context = s.penalty_context.as_deref().unwrap_or_default();
                self.samplers
                    .insert(s.request_id, Sampler::new(p.clone(), context));
            }
        }
        let flat = FlatBatch::build(step, self.block_size);
        let seqs: Vec<SeqBatch<'_>> = flat
            .seqs
            .iter()
            .zip(&step.scheduled)
            .map(|(&(query_start, query_len, context_len), s)| SeqBatch {
                query_start,
                query_len,
                context_len,
                block_tables: &s.block_tables,
            })
            .collect();
        let batch = ForwardBatch {
            token_ids: &flat.token_ids,
            positions: &flat.positions,
            slot_mappings: &flat.slot_mappings,
            seqs: &seqs,
            logits_indices: &flat.logits_indices,
        };
        let logits = self
            .model
            .forward(&batch, &self.kv)
            .map_err(|e| EngineError::Execution(e.to_string()))?;
        if !self.samples {
            return Ok(out);
        }
        let vocab = self.model.info().vocab_size;
        for (row, &id) in flat.sampled_requests.iter().enumerate() {
            let sampler = self
                .samplers
                .get_mut(&id)
                .ok_or_else(|| EngineError::Execution(format!("no sampler for request {id}")))?;
            let (token_id, logprob) = sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
            out.sampled.push(SampledToken {
                request_id: id,
                token_id,
                logprob,
            });
        }
        let mut row = flat.sampled_requests.len();
        for (id, first_position, targets) in &flat.prompt_rows {
            let top = self
                .samplers
                .get(id)
                .and_then(|s| s.params().prompt_logprobs)
                .unwrap_or(0);
            let logprobs = targets
                .iter()
                .map(|&t| {
                    let lp = logprobs_of(&logits[row * vocab..(row + 1) * vocab], t, top);
                    row += 1;
                    lp
                })
                .collect();
            out.prompt_logprobs.push(PromptLogprobs {
                request_id: *id,
                first_position: *first_position,
                logprobs,
            });
        }
        Ok(out)
    }

    /// After the forward (failed or not): the step's sends can be checksummed.
    pub fn start_sends(&mut self, step: &SchedulerOutput) {
        self.checksums.start_sends(&step.checksum_work);
    }

    /// After the connector reported finished transfers: checksums this rank's part of them.
    pub fn end_step(&mut self, connector_output: &ConnectorOutput) -> Vec<ChecksumRecord> {
        self.checksums.end_step(connector_output)
    }
}

/// The only rank of an instance, with its connector.
pub struct ModelWorker {
    rank: RankWorker,
    connector: Box<dyn KvConnectorWorker>,
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
        Ok(ModelWorker {
            rank: RankWorker::new(model, kv, block_size)?,
            connector,
        })
    }
}

impl ModelWorker {
    /// Computes the KV checksums with `backend` (the GPU's kernel over its device cache).
    pub fn with_checksum_backend(mut self, backend: tandem_kv_checksum::SharedBackend) -> Self {
        self.rank.checksums.set_backend(backend);
        self
    }
}

impl Worker for ModelWorker {
    fn set_waker(&mut self, waker: tandem_kv_connector::base::Waker) {
        self.connector.set_waker(waker);
    }

    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError> {
        self.rank.begin_step(step);
        let sampled = self
            .connector
            .start_load_kv(&step.connector_metadata)
            .map_err(|e| EngineError::Execution(format!("starting KV transfers: {e}")))
            .and_then(|()| self.rank.forward(step));
        self.rank.start_sends(step);
        let forward = sampled?;
        let mut out = WorkerOutput {
            sampled: forward.sampled,
            prompt_logprobs: forward.prompt_logprobs,
            ..Default::default()
        };
        out.connector_output = self.connector.get_finished();
        out.checksum_records = self.rank.end_step(&out.connector_output);
        Ok(out)
    }
}
