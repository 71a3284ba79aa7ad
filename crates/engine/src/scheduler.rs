//! The scheduler: which requests run this step, with how many tokens, in which blocks.
//!
//! Policy (vLLM v1's, in a few lines): running requests first, in arrival order, each with as many
//! tokens as it has not computed yet (1 when decoding, a chunk of the prompt when prefilling),
//! within the step's token budget; when blocks run out, the most recently admitted running request
//! is preempted (its blocks freed, recomputed later). Waiting requests are admitted only in steps
//! without preemption, in arrival order, after a prefix-cache lookup and the connector's answer
//! about remote tokens.
//!
//! KV checksums (when enabled, see [`crate::kv_checksum`]): in the step whose tokens cross a
//! producer request's prompt, its blocks go to the workers to be checksummed after the forward;
//! a request that finishes normally before every worker reported waits, finished but
//! unanswered, in `awaiting_checksums` (at most the send timeout), and its answer's
//! `kv_transfer_params` carry the checksums. A load's blocks go to the workers when it starts;
//! its verdict comes before the request is queued again, and under fail-closed a bad load takes
//! the same path as a load the connector reported failed. Policy `recompute` resumes a bad load
//! after its verified blocks when the damage is localized (see `finish_remote_load`).
//!
//! Invariants (checked by the lifecycle tests): every request is in exactly one of `waiting`,
//! `running`, `remote_waiting`, `awaiting_checksums`, or (finished, blocks held for the connector
//! or for a checksum still reading them) `delayed_free` / `checksum_holds`; a request whose
//! blocks a checksum reads is neither preempted nor freed; once all requests are finished and
//! released, no block is held.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;
use tandem_kv_cache::{CachedPrefix, KvCacheGroup, KvCacheManager};
use tandem_kv_connector::base::{
    ConnectorOutput, ConnectorRequest, FinishKind, KvChecksumCarrier, KvConnectorScheduler,
    KV_CHECKSUMS_PARAM,
};

use crate::detokenizer::Detokenize;
use crate::error::EngineError;
use crate::kv_checksum::tracker::{ChecksumTracker, ExpectedChecksums, LoadCheck};
use crate::kv_checksum::{KvChecksumConfig, WorkerGrid};
use crate::metrics as m;
use crate::output::RequestEvent;
use crate::request::{FinishReason, NewRequest, Request, RequestStatus};
use crate::scheduler_output::{ScheduledRequest, SchedulerOutput, WorkerOutput};

/// Most prompt tokens of a request with prompt logprobs computed in one step (each returns a
/// row of logits over the vocabulary).
pub const PROMPT_LOGPROBS_CHUNK: usize = 256;

/// What happens to a request whose KV load failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvLoadFailurePolicy {
    /// End the request with an error.
    Fail,
    /// Prefill the prompt locally.
    #[default]
    Recompute,
}

impl KvLoadFailurePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            KvLoadFailurePolicy::Fail => "fail",
            KvLoadFailurePolicy::Recompute => "recompute",
        }
    }
}

/// Limits of a step.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub enable_chunked_prefill: bool,
    /// Most prompt tokens of one request per step (0: no limit beyond the budget).
    pub long_prefill_token_threshold: usize,
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    /// Under [`KvLoadFailurePolicy::Recompute`]: a failed load whose damage is localized (a
    /// checksum mismatch, or blocks the connector names invalid) keeps its verified blocks and
    /// resumes from the first bad one; otherwise the whole prompt is recomputed.
    pub kv_partial_recompute: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            max_model_len: 2048,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            kv_load_failure_policy: KvLoadFailurePolicy::Recompute,
            kv_partial_recompute: true,
        }
    }
}

/// Counts of requests by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub running: usize,
    pub waiting: usize,
    pub waiting_for_remote_kv: usize,
    pub delayed_free: usize,
    /// Finished requests waiting for their KV checksums before they answer.
    pub awaiting_checksums: usize,
    pub free_blocks: usize,
    pub total_blocks: usize,
    /// Preemptions since start.
    pub preemptions: u64,
}

/// A finished request's answer, held until its KV checksums arrive.
struct AwaitingChecksums {
    reason: FinishReason,
    event: RequestEvent,
    stop_reason: Option<String>,
    deadline: Instant,
}

/// Schedules requests over one KV cache. See the module docs.
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    connector: Box<dyn KvConnectorScheduler>,
    tokenizer: Arc<dyn Detokenize>,
    eos_token_ids: Vec<u32>,
    requests: HashMap<u64, Request>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    remote_waiting: HashSet<u64>,
    delayed_free: HashSet<u64>,
    /// KV checksums, when enabled and carried by the connector.
    checksums: Option<ChecksumTracker>,
    awaiting_checksums: HashMap<u64, AwaitingChecksums>,
    /// Finished requests whose blocks a send checksum still reads.
    checksum_holds: HashSet<u64>,
    finished_since_last_step: Vec<u64>,
    step: u64,
    reported_prefix_stats: (u64, u64),
    preemptions: u64,
}

impl Scheduler {
    pub fn new(
        config: SchedulerConfig,
        kv: KvCacheManager,
        connector: Box<dyn KvConnectorScheduler>,
        tokenizer: Arc<dyn Detokenize>,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        metrics::gauge!(m::KV_CACHE_TOTAL_BLOCKS).set(kv.num_blocks() as f64);
        for g in 0..kv.num_groups() {
            metrics::gauge!(m::KV_CACHE_GROUP_TOTAL_BLOCKS, "group" => g.to_string())
                .set(kv.group_pool(g).num_blocks() as f64);
        }
        Scheduler {
            config,
            kv,
            connector,
            tokenizer,
            eos_token_ids,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            remote_waiting: HashSet::new(),
            delayed_free: HashSet::new(),
            checksums: None,
            awaiting_checksums: HashMap::new(),
            checksum_holds: HashSet::new(),
            finished_since_last_step: Vec::new(),
            step: 0,
            reported_prefix_stats: (0, 0),
            preemptions: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Turns KV checksums on (`config.enabled`) for the KV cache `groups` over a `grid` of
    /// workers; call once, before the first step. Returns whether checksums are active.
    ///
    /// A connector that carries no checksums ([`KvConnectorScheduler::carries_kv_checksums`])
    /// can verify no load: under fail-closed that refuses to start
    /// ([`EngineError::InvalidConfig`]), otherwise checksums are disabled with a warning.
    pub fn enable_kv_checksums(
        &mut self,
        config: &KvChecksumConfig,
        groups: &[KvCacheGroup],
        grid: WorkerGrid,
    ) -> Result<bool, EngineError> {
        self.checksums = None;
        if !config.enabled {
            if config.fault_injection.is_some() {
                tracing::warn!(
                    "kv_fault_injection is set but enable_kv_checksum is not: no fault is injected"
                );
            }
            return Ok(false);
        }
        if !self.connector.carries_kv_checksums() {
            if config.fail_closed {
                return Err(EngineError::InvalidConfig(
                    "enable_kv_checksum with kv_checksum_fail_closed: the KV connector carries no \
                     KV checksums, so every load would fail verification; use a connector that \
                     carries them or turn off kv_checksum_fail_closed"
                        .into(),
                ));
            }
            tracing::warn!(
                "enable_kv_checksum: the KV connector carries no KV checksums; KV checksums are \
                 disabled"
            );
            return Ok(false);
        }
        if grid.tp_size == 0 || grid.pp_size == 0 {
            return Err(EngineError::InvalidConfig(format!(
                "KV checksums over {} x {} workers",
                grid.tp_size, grid.pp_size
            )));
        }
        if let Some(g) = groups
            .iter()
            .find(|g| g.spec.block_size() != self.kv.block_size())
        {
            return Err(EngineError::InvalidConfig(format!(
                "KV cache group {} has block size {}, the scheduler's is {}",
                g.group_id,
                g.spec.block_size(),
                self.kv.block_size()
            )));
        }
        if let Some(f) = &config.fault_injection {
            tracing::warn!(
                kind = f.kind.as_str(),
                probability = f.probability,
                seed = f.seed,
                "KV FAULT INJECTION IS ON: loads are damaged on purpose before verification; \
                 never use this in production"
            );
        }
        tracing::info!(
            fail_closed = config.fail_closed,
            kv_load_failure_policy = self.config.kv_load_failure_policy.as_str(),
            tp_size = grid.tp_size,
            pp_size = grid.pp_size,
            "KV checksums enabled"
        );
        self.checksums = Some(ChecksumTracker::new(config, groups, grid));
        Ok(true)
    }

    /// Whether KV checksums are active.
    pub fn kv_checksums_enabled(&self) -> bool {
        self.checksums.is_some()
    }

    /// Whether a finished request's answer waits for its KV checksums.
    pub fn is_awaiting_checksums(&self) -> bool {
        !self.awaiting_checksums.is_empty()
    }
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            waiting_for_remote_kv: self.remote_waiting.len(),
            delayed_free: self.delayed_free.union(&self.checksum_holds).count(),
            awaiting_checksums: self.awaiting_checksums.len(),
            free_blocks: self.kv.num_free_blocks(),
            total_blocks: self.kv.num_blocks(),
            preemptions: self.preemptions,
        }
    }

    /// Requests the scheduler still tracks (unfinished, or finished with held blocks).
    pub fn num_unfinished(&self) -> usize {
        self.requests.len() + self.delayed_free.union(&self.checksum_holds).count()
    }

    /// Whether a step would have anything to do.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }
    /// Whether requests wait for something outside the step loop (remote KV, lease holders).
    pub fn has_pending_transfers(&self) -> bool {
        !self.remote_waiting.is_empty()
            || !self.delayed_free.is_empty()
            || !self.awaiting_checksums.is_empty()
            || !self.checksum_holds.is_empty()
    }

    /// Checks a new request against the model and cache limits.
    pub fn validate(&self, new: &NewRequest) -> Result<(), EngineError> {
        crate::core::check_request_limits(
            &self.config,
            self.kv.num_blocks(),
            self.kv.block_size(),
            new,
        )
    }

    /// Queues a request (validated by the caller with [`Self::validate`]).
    pub fn add_request(&mut self, request: Request) {
        let id = request.id;
        self.requests.insert(id, request);
        self.waiting.push_back(id);
    }

    /// Ends a request at the client's wish; a no-op for unknown or finished requests.
    pub fn abort_request(&mut self, id: u64) {
        if self.requests.contains_key(&id) {
            self.finish_request(id, FinishReason::Abort, None);
        }
    }

    fn connector_view(req: &Request) -> ConnectorRequest<'_> {
        ConnectorRequest {
            request_id: req.id,
            external_id: &req.external_id,
            prompt_token_ids: req.prompt_token_ids(),
            kv_transfer_params: req.kv_transfer_params.as_ref(),
        }
    }

    fn preempt(&mut self, id: u64) {
        self.kv.free(id);
        let req = self.requests.get_mut(&id).expect("running request exists");
        req.status = RequestStatus::Preempted;
        req.num_computed_tokens = 0;
        req.num_preemptions += 1;
        self.preemptions += 1;
        self.waiting.push_front(id);
        metrics::counter!(m::NUM_PREEMPTIONS_TOTAL).increment(1);
        tracing::debug!(request = id, "preempted for lack of KV blocks");
    }

    fn tokens_this_step(&self, req: &Request, budget: usize) -> usize {
        self.chunk_bound(req, req.num_tokens() - req.num_computed_tokens)
            .min(budget)
    }

    /// `n` tokens of `req` bounded to what one step may compute of it: the long-prefill
    /// threshold, and the prompt-logprob rows (each returns a vocabulary of logits).
    fn chunk_bound(&self, req: &Request, mut n: usize) -> usize {
        if self.config.long_prefill_token_threshold > 0 {
            n = n.min(self.config.long_prefill_token_threshold);
        }
        if req.wants_prompt_logprobs() {
            n = n.min(PROMPT_LOGPROBS_CHUNK);
        }
        n
    }

    fn scheduled_request(&mut self, id: u64, num_new: usize) -> ScheduledRequest {
        let block_tables = self.kv.block_tables(id);
        let req = self
            .requests
            .get_mut(&id)
            .expect("scheduled request exists");
        let start = req.num_computed_tokens;
        let sampling = (!req.sent_to_worker).then(|| req.params.clone());
        let penalty_context = sampling
            .as_ref()
            .filter(|p| p.repetition_penalty != 1.0)
            .map(|_| req.all_token_ids.clone());
        req.sent_to_worker = true;
        let prompt_logprob_targets = if req.wants_prompt_logprobs() {
            let end = (start + num_new + 1).min(req.num_prompt_tokens);
            req.all_token_ids[(start + 1).min(end)..end].to_vec()
        } else {
            Vec::new()
        };
        ScheduledRequest {
            request_id: id,
            sampling,
            penalty_context,
            token_ids: req.all_token_ids[start..start + num_new].to_vec(),
            start_position: start,
            block_tables,
            sample: start + num_new == req.num_tokens(),
            prompt_logprob_targets,
        }
    }

    /// Decides the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.step += 1;
        self.poll_checksums(Instant::now());
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled: Vec<(u64, usize)> = Vec::new();
        let mut preempted = false;

        // Running requests, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let req = &self.requests[&id];
            let num_new = self.tokens_this_step(req, budget);
            if num_new == 0 {
                i += 1;
                continue;
            }
            let computed = req.num_computed_tokens;
            let target = computed + num_new;
            // Blocks that fell out of a sliding window go back first (not while a checksum
            // reads the request's blocks).
            if !self.checksum_reads(id) {
                self.kv.remove_out_of_window(id, computed);
            }
            let mut admitted = true;
            while self.kv.allocate(id, target, computed, None).is_none() {
                // The most recent request not yet scheduled this step (this one included), unless
                // a checksum reads its blocks.
                let victim = (i..self.running.len())
                    .rev()
                    .find(|&p| !self.checksum_reads(self.running[p]));
                preempted = true;
                let Some(p) = victim else {
                    admitted = false;
                    break;
                };
                let victim = self.running.remove(p);
                self.preempt(victim);
                if victim == id {
                    admitted = false;
                    break;
                }
            }
            if !admitted {
                break;
            }
            scheduled.push((id, num_new));
            budget -= num_new;
            i += 1;
        }

        // Waiting requests, in order, unless this step had to preempt.
        while !preempted && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let req = &self.requests[&id];
            // A request holds blocks here only after its remote load completed (or failed
            // and keeps its verified blocks: it resumes after them).
            let fresh = self.kv.holds_nothing(id);
            // Prompt logprobs need every prompt position's logits: no prefix hit.
            let prefix = if fresh && req.params.prompt_logprobs.is_none() {
                self.kv.find_cached_prefix(&req.all_token_ids, &[])
            } else {
                CachedPrefix::default()
            };
            let local_computed = if fresh {
                prefix.num_tokens
            } else {
                req.num_computed_tokens
            };
            // The connector is asked once per request, before its first blocks; a preempted
            // request recomputes locally (its remote KV source is gone).
            let ask_connector = fresh && req.status == RequestStatus::Waiting;
            let matched = if !ask_connector {
                Default::default()
            } else {
                match self
                    .connector
                    .get_num_new_matched_tokens(&Self::connector_view(req), local_computed)
                {
                    Ok(m) => m,
                    Err(e) => {
                        self.waiting.pop_front();
                        let err = EngineError::InvalidTransferParams(e.to_string());
                        self.finish_request(id, FinishReason::Error, Some(err));
                        continue;
                    }
                }
            };
            if matched.load_async {
                let total = local_computed + matched.num_external_tokens;
                // A sliding-window group holds the window of the first token computed after
                // the load: the last prompt token, computed again for its logits, which
                // attends one position further back than the first output token.
                let resume = total.min(self.requests[&id].num_tokens() - 1);
                if self.kv.allocate(id, total, resume, Some(&prefix)).is_none() {
                    break;
                }
                let req = self.requests.get_mut(&id).expect("waiting request exists");
                req.num_computed_tokens = local_computed;
                req.num_cached_tokens = Some(prefix.num_tokens);
                req.num_external_tokens = matched.num_external_tokens;
                req.status = RequestStatus::WaitingForRemoteKv;
                req.first_scheduled_at.get_or_insert_with(Instant::now);
                // Connectors and checksums see every group's table (or the one all share).
                let tables = self.kv.block_tables(id);
                let view = Self::connector_view(req);
                self.connector.update_state_after_alloc(
                    &view,
                    &tables,
                    matched.num_external_tokens,
                );
                if let Some(t) = self.checksums.as_mut() {
                    if let Some(carrier) = self.connector.kv_checksum_carrier(&view, true) {
                        let expected = match carrier {
                            KvChecksumCarrier::KvTransferParams => {
                                ExpectedChecksums::Params(req.kv_transfer_params.as_ref())
                            }
                            KvChecksumCarrier::Connector => ExpectedChecksums::FromConnector,
                        };
                        t.add_load(
                            id,
                            expected,
                            local_computed,
                            local_computed + matched.num_external_tokens,
                            &tables,
                        );
                    }
                }
                self.waiting.pop_front();
                self.remote_waiting.insert(id);
                continue;
            }
            let req = &self.requests[&id];
            let remaining = req.num_tokens() - local_computed;
            if !self.config.enable_chunked_prefill && remaining > budget {
                break;
            }
            let num_new = self.chunk_bound(req, remaining.min(budget));
            if !fresh {
                self.kv.remove_out_of_window(id, local_computed);
            }
            if self
                .kv
                .allocate(id, local_computed + num_new, local_computed, Some(&prefix))
                .is_none()
            {
                break;
            }
            let req = self.requests.get_mut(&id).expect("waiting request exists");
            req.num_computed_tokens = local_computed;
            if req.num_cached_tokens.is_none() {
                req.num_cached_tokens = Some(prefix.num_tokens);
            }
            if std::mem::take(&mut req.recomputing_failed_load) {
                let prompt = req.num_tokens() as u64;
                metrics::counter!(m::KV_LOAD_RECOMPUTED_TOKENS_TOTAL)
                    .increment(prompt - local_computed as u64);
                metrics::counter!(m::KV_LOAD_RECOMPUTE_PROMPT_TOKENS_TOTAL).increment(prompt);
            }
            req.status = RequestStatus::Running;
            req.first_scheduled_at.get_or_insert_with(Instant::now);
            let tables = self.kv.block_tables(id);
            self.connector
                .update_state_after_alloc(&Self::connector_view(req), &tables, 0);
            self.waiting.pop_front();
            self.running.push(id);
            scheduled.push((id, num_new));
            budget -= num_new;
        }

        let step_tokens: usize = scheduled.iter().map(|(_, n)| n).sum();
        if step_tokens > 0 {
            metrics::histogram!(m::ITERATION_TOKENS_TOTAL).record(step_tokens as f64);
        }
        self.add_checksum_sends(&scheduled);
        let scheduled = scheduled
            .into_iter()
            .map(|(id, n)| self.scheduled_request(id, n))
            .collect();
        self.publish_gauges();
        SchedulerOutput {
            step: self.step,
            scheduled,
            finished_request_ids: std::mem::take(&mut self.finished_since_last_step),
            connector_metadata: self.connector.build_connector_meta(),
            checksum_work: self
                .checksums
                .as_mut()
                .map(|t| t.take_work())
                .unwrap_or_default(),
        }
    }

    /// Whether a send checksum still reads the request's blocks (they may not be freed).
    fn checksum_reads(&self, id: u64) -> bool {
        self.checksums
            .as_ref()
            .is_some_and(|t| t.send_in_flight(id))
    }

    /// Producer requests whose prompt this step completes: their prompt's blocks go to the
    /// workers, to be checksummed after the forward.
    fn add_checksum_sends(&mut self, scheduled: &[(u64, usize)]) {
        let Some(t) = self.checksums.as_mut() else {
            return;
        };
        for &(id, n) in scheduled {
            let req = &self.requests[&id];
            let (start, prompt) = (req.num_computed_tokens, req.num_prompt_tokens);
            if !(start < prompt && start + n >= prompt) {
                continue;
            }
            if self
                .connector
                .kv_checksum_carrier(&Self::connector_view(req), false)
                .is_some()
            {
                t.add_send(id, prompt, &self.kv.block_tables(id));
            }
        }
    }

    /// Frees blocks no checksum reads any more, and answers the finished requests whose
    /// checksums arrived (or whose wait timed out).
    fn poll_checksums(&mut self, now: Instant) {
        let Some(t) = self.checksums.as_mut() else {
            return;
        };
        for id in t.take_released() {
            if self.checksum_holds.remove(&id) && !self.delayed_free.contains(&id) {
                self.kv.free(id);
            }
        }
        let mut ready: Vec<u64> = self
            .awaiting_checksums
            .iter()
            .filter(|(id, a)| now >= a.deadline || !t.send_in_flight(**id))
            .map(|(id, _)| *id)
            .collect();
        ready.sort_unstable();
        for id in ready {
            if let Some(a) = self.awaiting_checksums.remove(&id) {
                self.finish_now(id, a.reason, None, a.event, a.stop_reason);
            }
        }
    }

    /// Applies a step's results: advance computed tokens, append sampled tokens, stop, stream.
    pub fn update_from_output(&mut self, out: &SchedulerOutput, worker: WorkerOutput) {
        let now = Instant::now();
        if let Some(t) = self.checksums.as_mut() {
            t.add_records(worker.checksum_records);
        }
        let mut sampled: HashMap<u64, _> = worker
            .sampled
            .into_iter()
            .map(|s| (s.request_id, s))
            .collect();
        for chunk in worker.prompt_logprobs {
            let Some(req) = self.requests.get_mut(&chunk.request_id) else {
                continue;
            };
            if req.prompt_logprobs.len() != req.num_prompt_tokens {
                req.prompt_logprobs = vec![None; req.num_prompt_tokens];
            }
            for (i, lp) in chunk.logprobs.into_iter().enumerate() {
                if let Some(slot) = req.prompt_logprobs.get_mut(chunk.first_position + i) {
                    *slot = Some(lp);
                }
            }
        }
        let mut prompt_tokens = 0u64;
        for s in &out.scheduled {
            let id = s.request_id;
            let Some(req) = self.requests.get_mut(&id) else {
                continue; // aborted during the step
            };
            if req.status != RequestStatus::Running {
                continue;
            }
            req.num_computed_tokens += s.token_ids.len();
            let computed = req.num_computed_tokens;
            prompt_tokens += s
                .token_ids
                .len()
                .min(req.num_prompt_tokens.saturating_sub(s.start_position))
                as u64;
            self.kv
                .cache_full_blocks(id, &req.all_token_ids, computed, &[]);
            if !s.sample {
                continue;
            }
            let Some(tok) = sampled.remove(&id) else {
                continue;
            };
            self.append_token(id, tok.token_id, tok.logprob, now);
        }
        metrics::counter!(m::PROMPT_TOKENS_TOTAL).increment(prompt_tokens);
        self.handle_connector_output(worker.connector_output);
        self.poll_checksums(Instant::now());
        self.publish_gauges();
    }

    fn append_token(
        &mut self,
        id: u64,
        token: u32,
        logprob: Option<crate::sampling::TokenLogprob>,
        now: Instant,
    ) {
        let eos = &self.eos_token_ids;
        let max_model_len = self.config.max_model_len;
        let req = self.requests.get_mut(&id).expect("request exists");
        req.all_token_ids.push(token);
        metrics::counter!(m::GENERATION_TOKENS_TOTAL).increment(1);
        match req.last_token_at {
            None => {
                metrics::histogram!(m::TIME_TO_FIRST_TOKEN_SECONDS)
                    .record((now - req.arrival).as_secs_f64());
                req.first_token_at = Some(now);
            }
            Some(t) => {
                metrics::histogram!(m::INTER_TOKEN_LATENCY_SECONDS).record((now - t).as_secs_f64())
            }
        }
        req.last_token_at = Some(now);
        let n_out = req.num_output_tokens();
        let p = &req.params;
        let mut finish = None;
        if n_out >= p.min_tokens
            && ((!p.ignore_eos && eos.contains(&token)) || p.stop_token_ids.contains(&token))
        {
            finish = Some(FinishReason::Stop);
        } else if n_out >= p.max_tokens || req.num_tokens() >= max_model_len {
            finish = Some(FinishReason::Length);
        }
        let delta = req.detokenizer.step(
            self.tokenizer.as_ref(),
            &req.all_token_ids,
            finish.is_some(),
        );
        let mut stop_reason = None;
        if delta.stopped_by.is_some() && n_out >= p.min_tokens {
            finish = Some(FinishReason::Stop);
            stop_reason = delta.stopped_by;
        }
        let prompt_logprobs = (n_out == 1 && p.prompt_logprobs.is_some()).then(|| {
            let mut all = std::mem::take(&mut req.prompt_logprobs);
            all.resize(req.num_prompt_tokens, None);
            all
        });
        let event = RequestEvent {
            token_ids: vec![token],
            text: delta.text,
            logprobs: logprob.into_iter().collect(),
            prompt_logprobs,
            ..Default::default()
        };
        match finish {
            None => {
                let _ = req.sink.send(event);
            }
            Some(reason) => {
                // The final event carries the last token too.
                self.finish_with_event(id, reason, None, event, stop_reason);
            }
        }
    }

    fn handle_connector_output(&mut self, output: ConnectorOutput) {
        self.connector.update_connector_output(&output);
        let stats = &output.stats;
        metrics::counter!(m::KV_TRANSFER_BYTES_TOTAL).increment(stats.bytes);
        metrics::counter!(m::KV_TRANSFER_DESCRIPTORS_TOTAL).increment(stats.descriptors);
        metrics::counter!(m::KV_TRANSFER_FAILURES_TOTAL).increment(stats.failures);
        metrics::counter!(m::KV_LEASE_EXPIRED_TOTAL).increment(stats.expired_leases);
        metrics::counter!(m::KV_TRANSFER_FAILED_NOTIFICATIONS_TOTAL)
            .increment(stats.failed_notifications);
        if let Some(t) = self.checksums.as_mut() {
            // Before the loads they belong to are compared below.
            for (id, payload) in &output.kv_checksums {
                t.receive_checksums(*id, payload);
            }
        }
        metrics::counter!(m::NIXL_NUM_FAILED_TRANSFERS).increment(stats.failures);
        metrics::counter!(m::NIXL_NUM_FAILED_NOTIFICATIONS).increment(stats.failed_notifications);
        metrics::counter!(m::NIXL_NUM_KV_EXPIRED_REQS).increment(stats.expired_leases);
        for t in &stats.transfers {
            metrics::histogram!(m::KV_TRANSFER_SECONDS).record(t.seconds);
            metrics::histogram!(m::NIXL_XFER_TIME_SECONDS).record(t.seconds);
            metrics::histogram!(m::NIXL_POST_TIME_SECONDS).record(t.post_seconds);
            metrics::histogram!(m::NIXL_BYTES_TRANSFERRED).record(t.bytes as f64);
            metrics::histogram!(m::NIXL_NUM_DESCRIPTORS).record(t.descriptors as f64);
        }
        for id in &output.finished_sending {
            if self.delayed_free.remove(id) && !self.checksum_holds.contains(id) {
                self.kv.free(*id);
            }
        }
        for id in output.finished_recving {
            if !self.remote_waiting.remove(&id) {
                continue;
            }
            let failure = output.failed_recving.get(&id).cloned();
            self.finish_remote_load(id, failure, &output.invalid_block_ids);
        }
    }

    /// A request's remote load ended: accept its blocks, or apply the failure policy. The
    /// connector's failures come first (such a load is not compared); then, if the load is
    /// checksummed, its verdict, which under fail-closed can fail it too.
    ///
    /// Recompute keeps what is known good when the damage is localized: blocks before the first
    /// block the connector names invalid, or before the first block whose checksum differs
    /// ([`LoadCheck::Reject::verified_tokens`]). The request resumes there; the later blocks stay
    /// its own and are overwritten by the local prefill before they are prefix-cached. A failure
    /// that names no blocks, or an unverified load, recomputes the whole prompt.
    fn finish_remote_load(
        &mut self,
        id: u64,
        mut failure: Option<String>,
        invalid_blocks: &HashSet<(usize, tandem_kv_cache::BlockId)>,
    ) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        // The first block position any group names invalid.
        let first_invalid = self
            .kv
            .block_tables(id)
            .iter()
            .enumerate()
            .filter_map(|(g, table)| table.iter().position(|&b| invalid_blocks.contains(&(g, b))))
            .min();
        let mut bad = failure.is_some() || first_invalid.is_some();
        let mut verified_tokens = match failure {
            None => first_invalid.map(|i| i * self.kv.block_size()),
            Some(_) => None,
        };
        if let Some(t) = self.checksums.as_mut() {
            if bad {
                t.forget_load(id);
            } else if let Some(LoadCheck::Reject {
                reason,
                verified_tokens: v,
            }) = t.verify_load(id, &req.external_id)
            {
                bad = true;
                failure = Some(reason);
                verified_tokens = v;
            }
        }
        if !bad {
            // A load may cover the whole prompt; its last token is computed again locally,
            // since its logits are needed to sample the first output token.
            req.num_computed_tokens =
                (req.num_computed_tokens + req.num_external_tokens).min(req.num_tokens() - 1);
            req.status = RequestStatus::Waiting;
            let computed = req.num_computed_tokens;
            self.kv
                .cache_full_blocks(id, &req.all_token_ids, computed, &[]);
            self.waiting.push_front(id);
            return;
        }
        let policy = self.config.kv_load_failure_policy;
        let reason = failure.unwrap_or_else(|| "loaded blocks are invalid".into());
        metrics::counter!(m::KV_LOAD_FAILURES_TOTAL, "policy" => policy.as_str()).increment(1);
        match policy {
            KvLoadFailurePolicy::Fail => {
                tracing::warn!(request = %req.external_id, policy = policy.as_str(), "KV load failed: {reason}");
                self.kv.uncache_blocks(&self.kv.block_tables(id));
                self.finish_request(
                    id,
                    FinishReason::Error,
                    Some(EngineError::KvLoadFailed(reason)),
                );
            }
            KvLoadFailurePolicy::Recompute => {
                // The remote source is forgotten either way; what is kept is verified.
                // A sliding-window group must hold the window before the resume point.
                let keep = verified_tokens
                    .filter(|_| self.config.kv_partial_recompute)
                    .map(|t| self.kv.resume_point(id, t.min(req.num_tokens() - 1)))
                    .filter(|&t| t > 0);
                req.num_external_tokens = 0;
                req.kv_transfer_params = None;
                req.status = RequestStatus::Waiting;
                req.recomputing_failed_load = true;
                match keep {
                    Some(t) => {
                        tracing::warn!(
                            request = %req.external_id,
                            policy = policy.as_str(),
                            "KV load failed: {reason}; keeping the {t} verified tokens, \
                             recomputing tokens [{t}, {})",
                            req.num_tokens()
                        );
                        // The next schedule sees blocks in the table and resumes at `t`.
                        req.num_computed_tokens = t;
                        self.kv.cache_full_blocks(id, &req.all_token_ids, t, &[]);
                    }
                    None => {
                        tracing::warn!(
                            request = %req.external_id,
                            policy = policy.as_str(),
                            "KV load failed: {reason}; recomputing the whole prompt"
                        );
                        // Every block is dropped: the next schedule looks the prompt up in the
                        // local prefix cache again and computes the rest.
                        req.num_computed_tokens = 0;
                        self.kv.free(id);
                    }
                }
                self.waiting.push_front(id);
            }
        }
    }

    fn finish_request(&mut self, id: u64, reason: FinishReason, error: Option<EngineError>) {
        self.finish_with_event(id, reason, error, RequestEvent::default(), None);
    }

    fn finish_with_event(
        &mut self,
        id: u64,
        reason: FinishReason,
        error: Option<EngineError>,
        event: RequestEvent,
        stop_reason: Option<String>,
    ) {
        let normal = matches!(reason, FinishReason::Stop | FinishReason::Length);
        if normal && self.checksum_reads(id) && !self.awaiting_checksums.contains_key(&id) {
            // The answer carries the prompt's checksums: wait for the workers' records.
            if let Some(req) = self.requests.get_mut(&id) {
                req.status = RequestStatus::Finished(reason);
                self.running.retain(|&r| r != id);
                self.waiting.retain(|&w| w != id);
                let timeout = self
                    .checksums
                    .as_ref()
                    .map(|t| t.send_timeout())
                    .unwrap_or_default();
                self.awaiting_checksums.insert(
                    id,
                    AwaitingChecksums {
                        reason,
                        event,
                        stop_reason,
                        deadline: Instant::now() + timeout,
                    },
                );
            }
            return;
        }
        self.finish_now(id, reason, error, event, stop_reason);
    }

    fn finish_now(
        &mut self,
        id: u64,
        reason: FinishReason,
        error: Option<EngineError>,
        mut event: RequestEvent,
        stop_reason: Option<String>,
    ) {
        let Some(mut req) = self.requests.remove(&id) else {
            return;
        };
        self.awaiting_checksums.remove(&id);
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
        self.remote_waiting.remove(&id);
        req.status = RequestStatus::Finished(reason);
        let kind = match reason {
            FinishReason::Stop | FinishReason::Length => FinishKind::Normal,
            FinishReason::Abort | FinishReason::Error => FinishKind::Aborted,
        };
        let tables = self.kv.block_tables(id);
        let holds_blocks = !self.kv.holds_nothing(id);
        let action = self
            .connector
            .request_finished(&Self::connector_view(&req), &tables, kind);
        let mut kv_transfer_params = action.kv_transfer_params;
        let mut had_load = false;
        if let Some(t) = self.checksums.as_mut() {
            had_load = t.forget_load(id);
            let normal = kind == FinishKind::Normal;
            if let Some(checksums) = t.finish_send(id, normal, &req.external_id) {
                let view = Self::connector_view(&req);
                let params = kv_transfer_params.as_mut().and_then(Value::as_object_mut);
                match (self.connector.kv_checksum_carrier(&view, false), params) {
                    (Some(KvChecksumCarrier::Connector), _) => {
                        self.connector.send_kv_checksums(&view, &checksums);
                        metrics::counter!(m::KV_CHECKSUM_SENDS_TOTAL).increment(1);
                    }
                    (_, Some(params)) => {
                        params.insert(KV_CHECKSUMS_PARAM.into(), Value::String(checksums));
                        metrics::counter!(m::KV_CHECKSUM_SENDS_TOTAL).increment(1);
                    }
                    (_, None) => tracing::warn!(
                        request = %req.external_id,
                        "the connector carries KV checksums in kv_transfer_params but answered \
                         none: no checksums sent"
                    ),
                }
            }
        }
        if let Some(params) = kv_transfer_params.as_mut().and_then(Value::as_object_mut) {
            self.connector.seal_transfer_params(params);
        }
        let delay = action.delay_free && holds_blocks;
        let hold = holds_blocks && self.checksum_reads(id);
        if delay {
            self.delayed_free.insert(id);
        }
        if hold {
            self.checksum_holds.insert(id);
        }
        if !delay && !hold {
            self.kv.free(id);
        }
        if req.sent_to_worker || had_load {
            self.finished_since_last_step.push(id);
        }
        metrics::counter!(m::REQUEST_SUCCESS_TOTAL, "finished_reason" => reason.as_str())
            .increment(1);
        metrics::histogram!(m::E2E_REQUEST_LATENCY_SECONDS)
            .record(req.arrival.elapsed().as_secs_f64());
        record_request_times(&req);
        event.finish = Some(reason);
        event.stop_reason = stop_reason;
        event.error = error;
        event.num_prompt_tokens = req.num_prompt_tokens;
        event.num_output_tokens = req.num_output_tokens();
        event.num_cached_tokens = req.num_cached_tokens.unwrap_or(0);
        event.kv_transfer_params = kv_transfer_params;
        let _ = req.sink.send(event);
    }

    /// Publishes the request and cache gauges (called after every step and before idling).
    pub fn publish_gauges(&mut self) {
        metrics::gauge!(m::NUM_REQUESTS_RUNNING).set(self.running.len() as f64);
        metrics::gauge!(m::NUM_REQUESTS_WAITING).set(self.waiting.len() as f64);
        metrics::gauge!(m::NUM_REQUESTS_WAITING_FOR_REMOTE_KV)
            .set(self.remote_waiting.len() as f64);
        metrics::gauge!(m::KV_CACHE_USAGE_PERC).set(self.kv.usage());
        metrics::gauge!(m::KV_CACHE_FREE_BLOCKS).set(self.kv.num_free_blocks() as f64);
        for g in 0..self.kv.num_groups() {
            let pool = self.kv.group_pool(g);
            let group = g.to_string();
            metrics::gauge!(m::KV_CACHE_GROUP_USAGE_PERC, "group" => group.clone())
                .set(pool.usage());
            metrics::gauge!(m::KV_CACHE_GROUP_FREE_BLOCKS, "group" => group)
                .set(pool.num_free() as f64);
        }
        let s = self.kv.prefix_cache_stats();
        let (q, h) = self.reported_prefix_stats;
        metrics::counter!(m::PREFIX_CACHE_QUERIES_TOTAL).increment(s.queries - q);
        metrics::counter!(m::PREFIX_CACHE_HITS_TOTAL).increment(s.hits - h);
        self.reported_prefix_stats = (s.queries, s.hits);
    }

    /// Ends every request with an error (the engine cannot go on).
    pub fn fail_all(&mut self, error: EngineError) {
        let ids: Vec<u64> = self.requests.keys().copied().collect();
        for id in ids {
            self.finish_request(id, FinishReason::Error, Some(error.clone()));
        }
    }

    /// Checks the bookkeeping invariants; for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = HashSet::new();
        for id in self
            .waiting
            .iter()
            .chain(&self.running)
            .chain(&self.remote_waiting)
            .chain(self.awaiting_checksums.keys())
        {
            if !seen.insert(*id) {
                return Err(format!("request {id} is in two queues"));
            }
            if !self.requests.contains_key(id) {
                return Err(format!("queued request {id} is unknown"));
            }
        }
        if seen.len() != self.requests.len() {
            return Err("a tracked request is in no queue".into());
        }
        for (id, r) in &self.requests {
            if r.num_computed_tokens > r.num_tokens() {
                return Err(format!("request {id} computed more tokens than it has"));
            }
        }
        for id in self.delayed_free.iter().chain(&self.checksum_holds) {
            if self.requests.contains_key(id) {
                return Err(format!(
                    "request {id} holds blocks after finishing but is tracked"
                ));
            }
            if self.kv.holds_nothing(*id) {
                return Err(format!("request {id} is held but holds no block"));
            }
        }
        if let Some(t) = &self.checksums {
            if let Some(id) = self
                .checksum_holds
                .iter()
                .find(|&&id| !t.send_in_flight(id))
            {
                return Err(format!(
                    "request {id} is held for a checksum that no longer reads"
                ));
            }
        }
        self.kv.check_invariants()
    }
}

/// vLLM's per-request histograms, observed once when the request finishes: the phases that it
/// reached (a request aborted while queued has no prefill or decode time).
fn record_request_times(req: &Request) {
    let now = Instant::now();
    let secs = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
    metrics::histogram!(m::REQUEST_PROMPT_TOKENS).record(req.num_prompt_tokens as f64);
    metrics::histogram!(m::REQUEST_GENERATION_TOKENS).record(req.num_output_tokens() as f64);
    let Some(scheduled) = req.first_scheduled_at else {
        return;
    };
    metrics::histogram!(m::REQUEST_QUEUE_TIME_SECONDS).record(secs(req.arrival, scheduled));
    metrics::histogram!(m::REQUEST_INFERENCE_TIME_SECONDS).record(secs(scheduled, now));
    if let Some(first) = req.first_token_at {
        metrics::histogram!(m::REQUEST_PREFILL_TIME_SECONDS).record(secs(scheduled, first));
        metrics::histogram!(m::REQUEST_DECODE_TIME_SECONDS).record(secs(first, now));
    }
}
