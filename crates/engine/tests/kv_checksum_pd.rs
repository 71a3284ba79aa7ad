//! KV checksums end to end at the scheduler level: a producer and a consumer instance, each a
//! real `Scheduler` with real checksum workers over real `KvStorage`, exchanging KV by copying
//! the producer's blocks into the consumer's through a test connector that declares the
//! `kv_transfer_params` carrier.
//!
//! The model is tiny and deterministic: a token's K and V depend only on (token, position,
//! layer, head, dim), and the next token is a hash of every K and V byte of the context, read
//! back through the block table. So a consumer that decodes from correctly loaded KV answers
//! exactly what a single instance answers, and any damaged byte changes what it reads.
//!
//! (1,1) instances run the engine's `ModelWorker`; TP x PP instances run `GridWorker`, which
//! splits the same KV over several `KvStorage`s (layers by PP stage, heads by TP rank), each with
//! its own `ChecksumWorker`, as the engine's TP/PP workers will. Every test ends with no request
//! left and every block free on both sides.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::PrometheusBuilder;
use serde_json::{json, Value};
use tandem_engine::detokenizer::Detokenize;
use tandem_engine::model_worker::ModelWorker;
use tandem_engine::request::NewRequest;
use tandem_engine::scheduler_output::{
    ChecksumRecord, ChecksumSide, SampledToken, SchedulerOutput, WorkerOutput,
};
use tandem_engine::worker::FlatBatch;
use tandem_engine::{
    ChecksumWorker, EngineError, FaultInjection, FaultKind, FinishReason, KvChecksumConfig,
    KvLoadFailurePolicy, RequestEvent, Scheduler, SchedulerConfig, Worker, WorkerGrid,
};
use tandem_kv_cache::{
    BlockId, CacheDtype, KvCacheConfig, KvCacheGroup, KvCacheManager, KvCacheSpec, KvPart,
    KvStorage,
};
use tandem_kv_checksum::{HeadPlacement, WorkerChecksums, WorkerId};
use tandem_kv_connector::base::{
    ConnectorMetadata, ConnectorOutput, ConnectorRequest, FinishKind, FinishedAction,
    KvChecksumCarrier, KvConnectorScheduler, KvConnectorWorker, MatchedTokens, KV_CHECKSUMS_PARAM,
};
use tandem_kv_connector::KvConnectorError;
use tandem_models::{CausalLm, ForwardBatch, ModelError, ModelInfo, WeightMode};
use tokio::sync::mpsc::UnboundedReceiver;

const LAYERS: usize = 4;
const HEADS: usize = 4;
const HEAD_DIM: usize = 8;
const DTYPE: CacheDtype = CacheDtype::Bf16;
const VOCAB: usize = 64;
const EOS: u32 = VOCAB as u32 - 1;

// ---- the tiny model ----

fn layer_name(l: usize) -> String {
    format!("model.layers.{l}.self_attn")
}

fn group(block_size: usize, heads: usize, layers: std::ops::Range<usize>) -> KvCacheGroup {
    KvCacheGroup {
        group_id: 0,
        spec: KvCacheSpec::FullAttention {
            block_size,
            num_kv_heads: heads,
            head_dim: HEAD_DIM,
            dtype: DTYPE,
        },
        layer_names: layers.map(layer_name).collect(),
    }
}

/// K and V of one token in one layer, all heads: exact in bf16.
fn token_kv(token: u32, pos: usize, layer: usize) -> (Vec<f32>, Vec<f32>) {
    let val = |e: usize, which: usize| {
        ((token as usize * 7 + pos * 13 + layer * 17 + e * 3 + which * 5) % 61) as f32 * 0.25 - 7.0
    };
    let n = HEADS * HEAD_DIM;
    (
        (0..n).map(|e| val(e, 0)).collect(),
        (0..n).map(|e| val(e, 1)).collect(),
    )
}

/// Where an instance's KV lives, addressed by (layer, global head, slot).
trait KvView {
    fn block_size(&self) -> usize;
    fn write_token(&self, layer: usize, slot: usize, k: &[f32], v: &[f32]);
    fn read_row(&self, layer: usize, head: usize, slot: usize) -> (Vec<u8>, Vec<u8>);
}

fn read_row_in(s: &KvStorage, layer: usize, head: usize, slot: usize) -> (Vec<u8>, Vec<u8>) {
    let view = s.layer(layer).unwrap();
    let bs = view.layout.block_size;
    let (k, v) = view.rows(slot / bs, slot % bs, head);
    (k.to_vec(), v.to_vec())
}

fn write_row_in(s: &KvStorage, layer: usize, head: usize, slot: usize, k: &[u8], v: &[u8]) {
    let lay = s.layout(layer);
    let (block, off) = (slot / lay.block_size, slot % lay.block_size);
    let o = lay.row_offset(block, off, head) - block * lay.block_bytes();
    for (part, src) in [(KvPart::K, k), (KvPart::V, v)] {
        // SAFETY: the test's loads own their destination blocks while they are written.
        let dst = unsafe { s.block_bytes_mut(layer, part, block).unwrap() };
        dst[o..o + src.len()].copy_from_slice(src);
    }
}

/// One rank's storage: global layers `layers`, global heads `[head_offset, head_offset + heads)`.
struct Rank {
    id: WorkerId,
    storage: Arc<KvStorage>,
    config: KvCacheConfig,
    layers: std::ops::Range<usize>,
    head_offset: usize,
    heads: usize,
}

/// An instance's KV over a TP x PP grid of storages.
struct Shards {
    tp: u32,
    block_size: usize,
    ranks: Vec<Rank>,
}

impl Shards {
    fn new(tp: u32, pp: u32, block_size: usize, num_blocks: usize) -> Shards {
        let mut ranks = Vec::new();
        for pp_rank in 0..pp as usize {
            let layers = LAYERS * pp_rank / pp as usize..LAYERS * (pp_rank + 1) / pp as usize;
            for tp_rank in 0..tp as usize {
                let heads = HEADS / tp as usize;
                let config = KvCacheConfig {
                    num_blocks,
                    groups: vec![group(block_size, heads, layers.clone())],
                };
                ranks.push(Rank {
                    id: WorkerId {
                        tp_rank: tp_rank as u32,
                        pp_rank: pp_rank as u32,
                    },
                    storage: Arc::new(KvStorage::new(&config).unwrap()),
                    config,
                    layers: layers.clone(),
                    head_offset: tp_rank * heads,
                    heads,
                });
            }
        }
        Shards {
            tp,
            block_size,
            ranks,
        }
    }

    fn locate(&self, layer: usize, head: usize) -> (&Rank, usize, usize) {
        let r = self
            .ranks
            .iter()
            .find(|r| {
                r.layers.contains(&layer)
                    && (r.head_offset..r.head_offset + r.heads).contains(&head)
            })
            .expect("every (layer, head) lives on one rank");
        (r, layer - r.layers.start, head - r.head_offset)
    }

    fn write_row(&self, layer: usize, head: usize, slot: usize, k: &[u8], v: &[u8]) {
        let (r, l, h) = self.locate(layer, head);
        write_row_in(&r.storage, l, h, slot, k, v);
    }

    /// One `ChecksumWorker` per rank; heads numbered globally across TP ranks.
    fn checksum_workers(&self) -> Vec<ChecksumWorker> {
        self.ranks
            .iter()
            .map(|r| {
                let setup = WorkerChecksums::from_storage(r.id, &r.storage, &r.config, |_| {
                    HeadPlacement::tp_sharded(r.id.tp_rank, self.tp, HEADS as u32).unwrap()
                });
                ChecksumWorker::new(setup, r.storage.clone())
            })
            .collect()
    }
}

impl KvView for Shards {
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn write_token(&self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        for r in self.ranks.iter().filter(|r| r.layers.contains(&layer)) {
            let heads = r.head_offset * HEAD_DIM..(r.head_offset + r.heads) * HEAD_DIM;
            r.storage
                .write_slots(
                    layer - r.layers.start,
                    &[slot],
                    &k[heads.clone()],
                    &v[heads],
                )
                .unwrap();
        }
    }
    fn read_row(&self, layer: usize, head: usize, slot: usize) -> (Vec<u8>, Vec<u8>) {
        let (r, l, h) = self.locate(layer, head);
        read_row_in(&r.storage, l, h, slot)
    }
}

/// A whole model's storage, as the `ModelWorker` hands it to the model.
struct Single<'a>(&'a KvStorage);

impl KvView for Single<'_> {
    fn block_size(&self) -> usize {
        self.0.layout(0).block_size
    }
    fn write_token(&self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        self.0.write_slots(layer, &[slot], k, v).unwrap();
    }
    fn read_row(&self, layer: usize, head: usize, slot: usize) -> (Vec<u8>, Vec<u8>) {
        read_row_in(self.0, layer, head, slot)
    }
}

/// The next token: a hash of every K and V byte of the first `n` tokens, never EOS.
fn next_token(kv: &dyn KvView, table: &[BlockId], n: usize) -> u32 {
    let bs = kv.block_size();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in 0..n {
        let slot = table[t / bs] as usize * bs + t % bs;
        for l in 0..LAYERS {
            for head in 0..HEADS {
                let (k, v) = kv.read_row(l, head, slot);
                for b in k.iter().chain(&v) {
                    h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
    }
    (h % (VOCAB as u64 - 1)) as u32
}

/// Writes the step's K and V, then picks each sampled row's next token.
fn tiny_forward(
    kv: &dyn KvView,
    token_ids: &[u32],
    positions: &[usize],
    slots: &[usize],
    seqs: &[(usize, usize, usize, &[BlockId])],
    rows: &[usize],
) -> Vec<u32> {
    for i in 0..token_ids.len() {
        for l in 0..LAYERS {
            let (k, v) = token_kv(token_ids[i], positions[i], l);
            kv.write_token(l, slots[i], &k, &v);
        }
    }
    rows.iter()
        .map(|&row| {
            let &(qs, ql, ctx, table) = seqs
                .iter()
                .find(|(qs, ql, _, _)| (*qs..qs + ql).contains(&row))
                .expect("a sampled row belongs to a sequence");
            next_token(kv, table, ctx - ql + (row - qs) + 1)
        })
        .collect()
}

struct TinyLm {
    info: ModelInfo,
}

impl TinyLm {
    fn new() -> TinyLm {
        TinyLm {
            info: ModelInfo {
                architecture: "tiny".into(),
                num_layers: LAYERS,
                hidden_size: HEADS * HEAD_DIM,
                intermediate_size: HEADS * HEAD_DIM,
                num_heads: HEADS,
                num_kv_heads: HEADS,
                head_dim: HEAD_DIM,
                vocab_size: VOCAB,
                max_position_embeddings: 4096,
                rope_theta: 10_000.0,
                rms_norm_eps: 1e-5,
                tie_word_embeddings: false,
                weight_mode: WeightMode::F32,
                weight_bytes: 0,
            },
        }
    }
}

impl CausalLm for TinyLm {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn kv_cache_groups(&self, block_size: usize, dtype: CacheDtype) -> Vec<KvCacheGroup> {
        assert_eq!(dtype, DTYPE);
        vec![group(block_size, HEADS, 0..LAYERS)]
    }
    fn forward(&self, batch: &ForwardBatch, kv: &KvStorage) -> Result<Vec<f32>, ModelError> {
        let seqs: Vec<_> = batch
            .seqs
            .iter()
            .map(|s| (s.query_start, s.query_len, s.context_len, s.table(0)))
            .collect();
        let next = tiny_forward(
            &Single(kv),
            batch.token_ids,
            batch.positions,
            batch.slots(0),
            &seqs,
            batch.logits_indices,
        );
        let mut logits = vec![0f32; next.len() * VOCAB];
        for (i, t) in next.into_iter().enumerate() {
            logits[i * VOCAB + t as usize] = 1.0;
        }
        Ok(logits)
    }
}

// ---- the connector: kv_transfer_params carrier, loads by copying bytes ----

fn flag(req: &ConnectorRequest<'_>, key: &str) -> bool {
    req.kv_transfer_params
        .and_then(|p| p.get(key))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

#[derive(Debug, Clone)]
struct PendingLoad {
    request_id: u64,
    remote_engine: String,
    remote_request_id: u64,
    remote_blocks: Vec<BlockId>,
    remote_block_size: usize,
    local_blocks: Vec<BlockId>,
    first_token: usize,
    num_tokens: usize,
}

/// Instances by engine id, and producer requests each consumer has finished reading.
#[derive(Default)]
struct Fabric {
    instances: HashMap<String, Arc<Shards>>,
    released: HashMap<String, Vec<u64>>,
}

type SharedFabric = Arc<Mutex<Fabric>>;

/// Scheduler side: `do_remote_decode` requests hold their blocks and answer where they are;
/// `do_remote_prefill` requests load every prompt token past the local prefix hit.
struct PdConnector {
    engine_id: String,
    block_size: usize,
    carries: bool,
    pending: Vec<PendingLoad>,
}

impl KvConnectorScheduler for PdConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &ConnectorRequest<'_>,
        computed: usize,
    ) -> Result<MatchedTokens, KvConnectorError> {
        if !flag(req, "do_remote_prefill") || !computed.is_multiple_of(self.block_size) {
            return Ok(MatchedTokens::default());
        }
        let n = req.prompt_token_ids.len() - computed;
        Ok(MatchedTokens {
            num_external_tokens: n,
            load_async: n > 0,
        })
    }
    fn update_state_after_alloc(
        &mut self,
        req: &ConnectorRequest<'_>,
        tables: &[Vec<BlockId>],
        n: usize,
    ) {
        if n == 0 || !flag(req, "do_remote_prefill") {
            return;
        }
        let p = req.kv_transfer_params.unwrap();
        let prompt = req.prompt_token_ids.len();
        self.pending.push(PendingLoad {
            request_id: req.request_id,
            remote_engine: p["remote_engine_id"].as_str().unwrap().to_string(),
            remote_request_id: p["remote_request_id"].as_u64().unwrap(),
            remote_blocks: serde_json::from_value(p["remote_block_ids"].clone()).unwrap(),
            remote_block_size: p["remote_block_size"].as_u64().unwrap() as usize,
            // One table: every group shares it here.
            local_blocks: tables[0].clone(),
            first_token: prompt - n,
            num_tokens: prompt,
        });
    }
    fn build_connector_meta(&mut self) -> ConnectorMetadata {
        if self.pending.is_empty() {
            return ConnectorMetadata(None);
        }
        ConnectorMetadata(Some(Box::new(std::mem::take(&mut self.pending))))
    }
    fn request_finished(
        &mut self,
        req: &ConnectorRequest<'_>,
        tables: &[Vec<BlockId>],
        finish: FinishKind,
    ) -> FinishedAction {
        if !flag(req, "do_remote_decode") || finish != FinishKind::Normal {
            return FinishedAction::default();
        }
        let n = req.prompt_token_ids.len().div_ceil(self.block_size);
        FinishedAction {
            delay_free: true,
            kv_transfer_params: Some(json!({
                "do_remote_prefill": true,
                "remote_engine_id": self.engine_id,
                "remote_request_id": req.request_id,
                "remote_block_ids": tables[0][..n],
                "remote_block_size": self.block_size,
            })),
        }
    }
    fn carries_kv_checksums(&self) -> bool {
        self.carries
    }
    fn kv_checksum_carrier(
        &self,
        req: &ConnectorRequest<'_>,
        receiving: bool,
    ) -> Option<KvChecksumCarrier> {
        let carried = if receiving {
            // A load of an instance's own KV (do_remote_decode set too) has no checksummed source.
            flag(req, "do_remote_prefill") && !flag(req, "do_remote_decode")
        } else {
            flag(req, "do_remote_decode")
        };
        (self.carries && carried).then_some(KvChecksumCarrier::KvTransferParams)
    }
}

/// Worker side: a load copies the producer's rows into this instance's blocks, token by token
/// (so block sizes may differ), and finishes in the step that starts it.
struct PdConnectorWorker {
    engine_id: String,
    fabric: SharedFabric,
    local: Arc<Shards>,
    done: Vec<u64>,
}

impl KvConnectorWorker for PdConnectorWorker {
    fn register_kv_caches(&mut self, _storage: Arc<KvStorage>) -> Result<(), KvConnectorError> {
        Ok(())
    }
    fn start_load_kv(&mut self, meta: &ConnectorMetadata) -> Result<(), KvConnectorError> {
        let Some(loads) = meta
            .0
            .as_ref()
            .and_then(|b| b.downcast_ref::<Vec<PendingLoad>>())
        else {
            return Ok(());
        };
        let mut fabric = self.fabric.lock().unwrap();
        for l in loads {
            let remote = fabric.instances[&l.remote_engine].clone();
            let (rbs, lbs) = (l.remote_block_size, self.local.block_size);
            for t in l.first_token..l.num_tokens {
                let src = l.remote_blocks[t / rbs] as usize * rbs + t % rbs;
                let dst = l.local_blocks[t / lbs] as usize * lbs + t % lbs;
                for layer in 0..LAYERS {
                    for head in 0..HEADS {
                        let (k, v) = remote.read_row(layer, head, src);
                        self.local.write_row(layer, head, dst, &k, &v);
                    }
                }
            }
            fabric
                .released
                .entry(l.remote_engine.clone())
                .or_default()
                .push(l.remote_request_id);
            self.done.push(l.request_id);
        }
        Ok(())
    }
    fn get_finished(&mut self) -> ConnectorOutput {
        let mut out = ConnectorOutput::default();
        out.finished_recving.extend(self.done.drain(..));
        if let Some(r) = self
            .fabric
            .lock()
            .unwrap()
            .released
            .get_mut(&self.engine_id)
        {
            out.finished_sending.extend(r.drain(..));
        }
        out
    }
}

// ---- a TP x PP worker over shards ----

struct GridWorker {
    shards: Arc<Shards>,
    checksums: Vec<ChecksumWorker>,
    connector: PdConnectorWorker,
    /// Wait for the step's sends and report them at once (deterministic tests).
    flush_sends: bool,
}

impl Worker for GridWorker {
    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError> {
        for c in &mut self.checksums {
            c.begin_step(&step.checksum_work, &step.finished_request_ids);
        }
        self.connector
            .start_load_kv(&step.connector_metadata)
            .unwrap();
        let flat = FlatBatch::build(step, self.shards.block_size);
        let seqs: Vec<_> = flat
            .seqs
            .iter()
            .zip(&step.scheduled)
            .map(|(&(qs, ql, ctx), s)| (qs, ql, ctx, s.block_tables[0].as_slice()))
            .collect();
        let next = tiny_forward(
            self.shards.as_ref(),
            &flat.token_ids,
            &flat.positions,
            &flat.slot_mappings[0],
            &seqs,
            &flat.logits_indices,
        );
        for c in &mut self.checksums {
            c.start_sends(&step.checksum_work);
        }
        let connector_output = self.connector.get_finished();
        let mut checksum_records: Vec<ChecksumRecord> = self
            .checksums
            .iter_mut()
            .flat_map(|c| c.end_step(&connector_output))
            .collect();
        if self.flush_sends {
            for c in &mut self.checksums {
                checksum_records.extend(c.finish_sends());
            }
        }
        Ok(WorkerOutput {
            sampled: flat
                .sampled_requests
                .iter()
                .zip(next)
                .map(|(&request_id, token_id)| SampledToken {
                    request_id,
                    token_id,
                    logprob: None,
                })
                .collect(),
            prompt_logprobs: Vec::new(),
            connector_output,
            checksum_records,
        })
    }
}

/// Withholds send records while `hold` is set (a slow checksum thread), then delivers them.
struct Laggard {
    inner: Box<dyn Worker>,
    hold: Arc<AtomicBool>,
    held: Vec<ChecksumRecord>,
}

impl Worker for Laggard {
    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError> {
        let mut out = self.inner.execute(step)?;
        if self.hold.load(Ordering::Relaxed) {
            let (sends, rest) = out
                .checksum_records
                .drain(..)
                .partition(|r| r.side == ChecksumSide::Send);
            self.held.extend::<Vec<_>>(sends);
            out.checksum_records = rest;
        } else {
            out.checksum_records.append(&mut self.held);
        }
        Ok(out)
    }
}

// ---- instances ----

struct Chars;
impl Detokenize for Chars {
    fn decode(&self, ids: &[u32], _skip_special: bool) -> String {
        ids.iter()
            .map(|&i| char::from(b'a' + (i % 26) as u8))
            .collect()
    }
}

#[derive(Clone)]
struct Setup {
    tp: u32,
    pp: u32,
    block_size: usize,
    num_blocks: usize,
    checksums: KvChecksumConfig,
    policy: KvLoadFailurePolicy,
    carries: bool,
    /// Run the engine's `ModelWorker` (TP 1, PP 1 only) rather than the grid worker.
    model_worker: bool,
    max_num_batched_tokens: usize,
    prefix_caching: bool,
    /// Grid worker only: report sends in the step that computes them.
    flush_sends: bool,
}

impl Setup {
    fn new(block_size: usize) -> Setup {
        Setup {
            tp: 1,
            pp: 1,
            block_size,
            num_blocks: 64,
            checksums: KvChecksumConfig {
                enabled: true,
                ..Default::default()
            },
            policy: KvLoadFailurePolicy::Recompute,
            carries: true,
            model_worker: true,
            max_num_batched_tokens: 2048,
            prefix_caching: true,
            flush_sends: false,
        }
    }
    fn grid(mut self, tp: u32, pp: u32) -> Setup {
        self.tp = tp;
        self.pp = pp;
        self.model_worker = tp == 1 && pp == 1;
        self
    }
    fn fail_closed(mut self, policy: KvLoadFailurePolicy) -> Setup {
        self.checksums.fail_closed = true;
        self.policy = policy;
        self
    }
    fn fault(mut self, kind: FaultKind) -> Setup {
        self.checksums.fault_injection = Some(FaultInjection {
            kind,
            probability: 1.0,
            seed: 11,
            block_position: None,
            tp_rank: None,
            group: None,
        });
        self
    }
}

struct Instance {
    name: String,
    sched: Scheduler,
    worker: Box<dyn Worker>,
    shards: Arc<Shards>,
    streams: HashMap<u64, UnboundedReceiver<RequestEvent>>,
    events: HashMap<u64, Vec<RequestEvent>>,
    next_id: u64,
    /// Set for instances built with `lagging`: hold send records while true.
    hold_sends: Arc<AtomicBool>,
    /// Send jobs issued per request.
    send_jobs: HashMap<u64, usize>,
}

impl Instance {
    fn new(name: &str, setup: &Setup, fabric: &SharedFabric) -> Instance {
        Self::build(name, setup, fabric, false)
    }

    fn build(name: &str, setup: &Setup, fabric: &SharedFabric, lagging: bool) -> Instance {
        let bs = setup.block_size;
        let shards = Arc::new(if setup.model_worker {
            Shards::new(1, 1, bs, setup.num_blocks)
        } else {
            Shards::new(setup.tp, setup.pp, bs, setup.num_blocks)
        });
        let connector = PdConnectorWorker {
            engine_id: name.into(),
            fabric: fabric.clone(),
            local: shards.clone(),
            done: Vec::new(),
        };
        let mut worker: Box<dyn Worker> = if setup.model_worker {
            Box::new(
                ModelWorker::new(
                    Arc::new(TinyLm::new()),
                    shards.ranks[0].storage.clone(),
                    bs,
                    Box::new(connector),
                )
                .unwrap(),
            )
        } else {
            Box::new(GridWorker {
                shards: shards.clone(),
                checksums: shards.checksum_workers(),
                connector,
                flush_sends: setup.flush_sends,
            })
        };
        let hold_sends = Arc::new(AtomicBool::new(false));
        if lagging {
            worker = Box::new(Laggard {
                inner: worker,
                hold: hold_sends.clone(),
                held: Vec::new(),
            });
        }
        let config = SchedulerConfig {
            kv_load_failure_policy: setup.policy,
            max_num_batched_tokens: setup.max_num_batched_tokens,
            ..Default::default()
        };
        let mut sched = Scheduler::new(
            config,
            KvCacheManager::new(setup.num_blocks, bs, setup.prefix_caching),
            Box::new(PdConnector {
                engine_id: name.into(),
                block_size: bs,
                carries: setup.carries,
                pending: Vec::new(),
            }),
            Arc::new(Chars),
            vec![EOS],
        );
        let grid = WorkerGrid {
            tp_size: setup.tp,
            pp_size: setup.pp,
        };
        let enabled = sched
            .enable_kv_checksums(&setup.checksums, &[group(bs, HEADS, 0..LAYERS)], grid)
            .unwrap();
        assert_eq!(enabled, setup.checksums.enabled && setup.carries);
        fabric
            .lock()
            .unwrap()
            .instances
            .insert(name.into(), shards.clone());
        Instance {
            name: name.into(),
            sched,
            worker,
            shards,
            streams: HashMap::new(),
            events: HashMap::new(),
            next_id: 1,
            hold_sends,
            send_jobs: HashMap::new(),
        }
    }

    fn add(&mut self, prompt: &[u32], max_tokens: usize, kvp: Option<Value>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let rx = common::add_request(
            &mut self.sched,
            id,
            format!("{}-{id}", self.name),
            prompt.to_vec(),
            common::greedy(max_tokens),
            kvp,
        );
        self.streams.insert(id, rx);
        id
    }

    fn step(&mut self) {
        let out = common::step(&mut self.sched, self.worker.as_mut());
        for job in &out.checksum_work.sends {
            *self.send_jobs.entry(job.request_id).or_default() += 1;
        }
        for (id, rx) in &mut self.streams {
            while let Ok(ev) = rx.try_recv() {
                self.events.entry(*id).or_default().push(ev);
            }
        }
        if !out.has_model_work() {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn final_event(&self, id: u64) -> Option<&RequestEvent> {
        self.events
            .get(&id)
            .and_then(|e| e.last())
            .filter(|e| e.finish.is_some())
    }

    /// Steps until the request's final event; returns its tokens and that event.
    fn run_until_finished(&mut self, id: u64) -> (Vec<u32>, RequestEvent) {
        let start = Instant::now();
        while self.final_event(id).is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "{}: request {id} does not finish",
                self.name
            );
            self.step();
        }
        let events = &self.events[&id];
        let tokens = events.iter().flat_map(|e| e.token_ids.clone()).collect();
        (tokens, events.last().unwrap().clone())
    }

    fn idle(&self) -> bool {
        !self.sched.has_work() && !self.sched.has_pending_transfers()
    }

    fn assert_empty(&self) {
        assert_eq!(
            self.sched.num_unfinished(),
            0,
            "{}: requests left",
            self.name
        );
        assert_eq!(
            self.sched.kv().num_free_blocks(),
            self.sched.kv().num_blocks(),
            "{}: blocks leaked",
            self.name
        );
        self.sched.check_invariants().unwrap();
    }
}

/// Steps both instances until neither has anything left to do.
fn settle(a: &mut Instance, b: &mut Instance) {
    let start = Instant::now();
    while !(a.idle() && b.idle()) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "instances do not settle"
        );
        a.step();
        b.step();
    }
    a.assert_empty();
    b.assert_empty();
}

/// One P/D request: prefill on `p` (max_tokens 1), decode on `c` with the producer's answer.
/// Returns the consumer's tokens and final event, and the producer's final event.
fn pd(
    p: &mut Instance,
    c: &mut Instance,
    prompt: &[u32],
    max_tokens: usize,
) -> (Vec<u32>, RequestEvent, RequestEvent) {
    let pid = p.add(prompt, 1, Some(json!({"do_remote_decode": true})));
    let (_, pfin) = p.run_until_finished(pid);
    assert_eq!(pfin.finish, Some(FinishReason::Length));
    let params = pfin
        .kv_transfer_params
        .clone()
        .expect("the producer answers kv_transfer_params");
    let cid = c.add(prompt, max_tokens, Some(params));
    let (tokens, cfin) = c.run_until_finished(cid);
    settle(p, c);
    (tokens, cfin, pfin)
}

/// What a single instance answers.
fn reference(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let fabric = SharedFabric::default();
    let mut setup = Setup::new(16);
    setup.checksums.enabled = false;
    let mut i = Instance::new("solo", &setup, &fabric);
    let id = i.add(prompt, max_tokens, None);
    let (tokens, fin) = i.run_until_finished(id);
    assert_eq!(fin.finish, Some(FinishReason::Length));
    tokens
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7 + seed * 13) % (VOCAB as u32 - 1))
        .collect()
}

/// Runs `f` with a fresh metrics recorder on this thread; returns its result and the rendered
/// metrics.
fn with_metrics<R>(f: impl FnOnce() -> R) -> (R, Metrics) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let r = metrics::with_local_recorder(&recorder, f);
    (r, Metrics(handle.render()))
}

struct Metrics(String);

impl Metrics {
    /// A counter's value; `labels` as rendered, e.g. `verdict="verified"`.
    fn get(&self, name: &str, labels: &str) -> u64 {
        let key = if labels.is_empty() {
            name.to_string()
        } else {
            format!("{name}{{{labels}}}")
        };
        self.0
            .lines()
            .filter_map(|l| l.rsplit_once(' '))
            .find(|(k, _)| *k == key)
            .map_or(0, |(_, v)| v.parse::<f64>().unwrap() as u64)
    }
    fn loads(&self, verdict: &str) -> u64 {
        self.get(
            "tandem:kv_checksum_loads_total",
            &format!("verdict=\"{verdict}\""),
        )
    }
    fn unverified(&self, reason: &str) -> u64 {
        self.get(
            "tandem:kv_checksum_unverified_total",
            &format!("reason=\"{reason}\""),
        )
    }
    fn sends(&self) -> u64 {
        self.get("tandem:kv_checksum_sends_total", "")
    }
    fn mismatched_blocks(&self) -> u64 {
        self.get("tandem:kv_checksum_mismatched_blocks_total", "")
    }
    fn load_failures(&self, policy: &str) -> u64 {
        self.get(
            "tandem:kv_load_failures_total",
            &format!("policy=\"{policy}\""),
        )
    }
}

fn checksums_of(ev: &RequestEvent) -> Option<&str> {
    ev.kv_transfer_params
        .as_ref()
        .and_then(|p| p.get(KV_CHECKSUMS_PARAM))
        .and_then(Value::as_str)
}

// ---- tests ----

#[test]
fn correct_loads_verify_and_decode_like_a_single_instance() {
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut p = Instance::new("p", &Setup::new(16), &fabric);
        let mut c = Instance::new("c", &Setup::new(16), &fabric);
        // whole blocks, a partial last block, a single token, a single partial block
        for (i, len) in [48usize, 50, 17, 1, 9].into_iter().enumerate() {
            let pr = prompt(i as u32, len);
            let (tokens, fin, pfin) = pd(&mut p, &mut c, &pr, 6);
            assert!(
                checksums_of(&pfin).is_some(),
                "prompt of {len}: no checksums sent"
            );
            assert_eq!(fin.finish, Some(FinishReason::Length));
            assert_eq!(tokens, reference(&pr, 6), "prompt of {len}");
        }
    });
    assert_eq!(m.sends(), 5);
    assert_eq!(m.loads("verified"), 5);
    assert_eq!(m.loads("mismatch") + m.loads("unverified"), 0);
}

#[test]
fn chunked_prefill_checksums_the_whole_prompt_once() {
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut setup = Setup::new(16);
        setup.max_num_batched_tokens = 20;
        let mut p = Instance::new("p", &setup, &fabric);
        let mut c = Instance::new("c", &Setup::new(16), &fabric);
        let pr = prompt(3, 70);
        let (tokens, _, pfin) = pd(&mut p, &mut c, &pr, 4);
        assert!(checksums_of(&pfin).is_some());
        assert_eq!(tokens, reference(&pr, 4));
    });
    assert_eq!((m.sends(), m.loads("verified")), (1, 1));
}

#[test]
fn different_block_sizes_verify() {
    for (pb, cb) in [(16, 32), (32, 16)] {
        let ((), m) = with_metrics(|| {
            let fabric = SharedFabric::default();
            let mut p = Instance::new("p", &Setup::new(pb), &fabric);
            let mut c = Instance::new("c", &Setup::new(cb), &fabric);
            for len in [64usize, 70] {
                let pr = prompt(len as u32, len);
                let (tokens, _, _) = pd(&mut p, &mut c, &pr, 5);
                assert_eq!(tokens, reference(&pr, 5), "{pb}/{cb}, {len} tokens");
            }
        });
        assert_eq!(m.loads("verified"), 2, "{pb}/{cb}");
    }
}

#[test]
fn a_corrupted_load_is_caught_with_different_block_sizes() {
    for (pb, cb) in [(16, 32), (32, 16)] {
        let ((), m) = with_metrics(|| {
            let fabric = SharedFabric::default();
            let mut p = Instance::new("p", &Setup::new(pb), &fabric);
            let setup = Setup::new(cb)
                .fail_closed(KvLoadFailurePolicy::Recompute)
                .fault(FaultKind::CorruptByte);
            let mut c = Instance::new("c", &setup, &fabric);
            let pr = prompt(5, 70);
            let (tokens, _, _) = pd(&mut p, &mut c, &pr, 5);
            assert_eq!(tokens, reference(&pr, 5), "{pb}/{cb}");
        });
        assert_eq!(m.loads("mismatch"), 1, "{pb}/{cb}");
        assert_eq!(m.load_failures("recompute"), 1, "{pb}/{cb}");
    }
}

#[test]
fn a_local_prefix_hit_compares_only_the_loaded_blocks() {
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut p = Instance::new("p", &Setup::new(16), &fabric);
        let mut c = Instance::new("c", &Setup::new(16), &fabric);
        let pr = prompt(7, 60);
        // The consumer computes the first 40 tokens itself: blocks 0 and 1 enter its prefix cache.
        let local = c.add(&pr[..40], 1, None);
        c.run_until_finished(local);
        settle(&mut p, &mut c);
        // Damage the consumer's own cached copy of block 0: a load that compared it would
        // mismatch, one that compares only what it loaded verifies.
        assert!(
            c.sched.kv().group_pool(0).num_cached() >= 2,
            "the prefix must be cached"
        );
        let s = c.shards.ranks[0].storage.clone();
        let (k0, v0) = token_kv_bytes(pr[0], 0, 0);
        let block0: Vec<usize> = (0..c.sched.kv().num_blocks())
            .filter(|b| read_row_in(&s, 0, 0, b * 16) == (k0.clone(), v0.clone()))
            .collect();
        assert_eq!(block0.len(), 1, "one block holds token 0");
        let mut k = k0.clone();
        k[0] ^= 1;
        write_row_in(&s, 0, 0, block0[0] * 16, &k, &v0);
        let (tokens, fin, _) = pd(&mut p, &mut c, &pr, 3);
        assert_eq!(fin.num_cached_tokens, 32, "two blocks hit locally");
        assert_eq!(tokens.len(), 3);
    });
    assert_eq!(m.loads("verified"), 1);
    assert_eq!(m.loads("mismatch"), 0);
}

/// The bytes `token_kv` writes for head 0 of `layer`.
fn token_kv_bytes(token: u32, pos: usize, layer: usize) -> (Vec<u8>, Vec<u8>) {
    let (k, v) = token_kv(token, pos, layer);
    let enc = |x: &[f32]| {
        let mut b = vec![0u8; HEAD_DIM * DTYPE.size()];
        DTYPE.encode(&x[..HEAD_DIM], &mut b);
        b
    };
    (enc(&k), enc(&v))
}

fn fault_kinds() -> [FaultKind; 5] {
    [
        FaultKind::CorruptByte,
        FaultKind::SwapBlocks,
        FaultKind::StaleBlocks,
        FaultKind::DropChecksums,
        FaultKind::MalformChecksums,
    ]
}

/// The verdict label and unverified reason each fault must produce.
fn expected_verdict(kind: FaultKind) -> (&'static str, Option<&'static str>) {
    match kind {
        FaultKind::CorruptByte | FaultKind::SwapBlocks | FaultKind::StaleBlocks => {
            ("mismatch", None)
        }
        FaultKind::DropChecksums => ("unverified", Some("missing")),
        FaultKind::MalformChecksums => ("unverified", Some("malformed")),
    }
}

#[test]
fn every_fault_is_counted_and_the_load_used_when_fail_open() {
    for kind in fault_kinds() {
        let ((), m) = with_metrics(|| {
            let fabric = SharedFabric::default();
            let mut p = Instance::new("p", &Setup::new(16), &fabric);
            let mut c = Instance::new("c", &Setup::new(16).fault(kind), &fabric);
            let pr = prompt(9, 50);
            let (tokens, fin, _) = pd(&mut p, &mut c, &pr, 5);
            assert_eq!(fin.finish, Some(FinishReason::Length), "{kind:?}");
            assert!(fin.error.is_none());
            assert_eq!(tokens.len(), 5);
            if kind.touches_blocks() {
                // The damaged KV was used: the output differs from a clean run.
                assert_ne!(tokens, reference(&pr, 5), "{kind:?}");
            } else {
                assert_eq!(tokens, reference(&pr, 5), "{kind:?}");
            }
        });
        let (verdict, reason) = expected_verdict(kind);
        assert_eq!(m.loads(verdict), 1, "{kind:?}");
        assert_eq!(m.loads("verified"), 0, "{kind:?}");
        if let Some(r) = reason {
            assert_eq!(m.unverified(r), 1, "{kind:?}");
        } else {
            assert!(m.mismatched_blocks() >= 1, "{kind:?}");
        }
        assert_eq!(
            m.load_failures("fail") + m.load_failures("recompute"),
            0,
            "{kind:?}"
        );
    }
}

#[test]
fn every_fault_fails_the_request_under_fail_closed_with_policy_fail() {
    for kind in fault_kinds() {
        let ((), m) = with_metrics(|| {
            let fabric = SharedFabric::default();
            let mut p = Instance::new("p", &Setup::new(16), &fabric);
            let setup = Setup::new(16)
                .fail_closed(KvLoadFailurePolicy::Fail)
                .fault(kind);
            let mut c = Instance::new("c", &setup, &fabric);
            let pr = prompt(10, 50);
            let (tokens, fin, _) = pd(&mut p, &mut c, &pr, 5);
            assert!(tokens.is_empty(), "{kind:?}");
            assert_eq!(fin.finish, Some(FinishReason::Error), "{kind:?}");
            match &fin.error {
                Some(EngineError::KvLoadFailed(why)) => {
                    assert!(why.contains("checksum verification"), "{kind:?}: {why}");
                }
                other => panic!("{kind:?}: {other:?}"),
            }
            assert!(
                fin.error
                    .as_ref()
                    .unwrap()
                    .to_string()
                    .contains("KV failed checksum verification"),
                "{kind:?}"
            );
            assert_eq!(
                c.sched.kv().group_pool(0).num_cached(),
                0,
                "bad blocks were cached"
            );
        });
        assert_eq!(m.loads(expected_verdict(kind).0), 1, "{kind:?}");
        assert_eq!(m.load_failures("fail"), 1, "{kind:?}");
    }
}

#[test]
fn every_fault_is_recomputed_under_fail_closed_with_policy_recompute() {
    for kind in fault_kinds() {
        let ((), m) = with_metrics(|| {
            let fabric = SharedFabric::default();
            let mut p = Instance::new("p", &Setup::new(16), &fabric);
            let setup = Setup::new(16)
                .fail_closed(KvLoadFailurePolicy::Recompute)
                .fault(kind);
            let mut c = Instance::new("c", &setup, &fabric);
            let pr = prompt(11, 50);
            let (tokens, fin, _) = pd(&mut p, &mut c, &pr, 5);
            assert_eq!(fin.finish, Some(FinishReason::Length), "{kind:?}");
            assert_eq!(tokens, reference(&pr, 5), "{kind:?}: recomputed output");
            // The bad blocks never entered the prefix cache: a second identical prompt hits
            // only blocks the consumer computed itself, and still answers correctly.
            let again = c.add(&pr, 5, None);
            let (tokens2, _) = c.run_until_finished(again);
            assert_eq!(tokens2, tokens, "{kind:?}");
            settle(&mut p, &mut c);
        });
        assert_eq!(m.loads(expected_verdict(kind).0), 1, "{kind:?}");
        assert_eq!(m.load_failures("recompute"), 1, "{kind:?}");
    }
}

#[test]
fn correct_loads_verify_for_every_tp_pp_pair() {
    let pairs = [
        ((1, 1), (1, 1)),
        ((2, 1), (1, 1)),
        ((1, 1), (2, 1)),
        ((1, 2), (1, 1)),
        ((1, 1), (2, 2)),
        ((2, 2), (2, 1)),
    ];
    for ((ptp, ppp), (ctp, cpp)) in pairs {
        let ((), m) = with_metrics(|| {
            let fabric = SharedFabric::default();
            // the grid worker even for (1, 1), to run the same code as the other pairs
            let mut ps = Setup::new(16).grid(ptp, ppp);
            ps.model_worker = false;
            let mut cs = Setup::new(16).grid(ctp, cpp);
            cs.model_worker = false;
            let mut p = Instance::new("p", &ps, &fabric);
            let mut c = Instance::new("c", &cs, &fabric);
            let pr = prompt(ptp * 10 + ctp, 50);
            let (tokens, _, pfin) = pd(&mut p, &mut c, &pr, 4);
            assert!(checksums_of(&pfin).is_some());
            assert_eq!(tokens, reference(&pr, 4));
        });
        let pair = format!("({ptp},{ppp})/({ctp},{cpp})");
        assert_eq!(m.loads("verified"), 1, "{pair}");
        assert_eq!(m.sends(), 1, "{pair}");
    }
}

#[test]
fn a_corrupted_shard_is_caught_for_every_tp_pp_pair() {
    let pairs = [
        ((2, 1), (1, 1)),
        ((1, 1), (2, 1)),
        ((1, 2), (1, 1)),
        ((1, 1), (2, 2)),
    ];
    for ((ptp, ppp), (ctp, cpp)) in pairs {
        let ((), m) = with_metrics(|| {
            let fabric = SharedFabric::default();
            let mut p = Instance::new("p", &Setup::new(16).grid(ptp, ppp), &fabric);
            let cs = Setup::new(16)
                .grid(ctp, cpp)
                .fail_closed(KvLoadFailurePolicy::Recompute)
                .fault(FaultKind::CorruptByte);
            let mut c = Instance::new("c", &cs, &fabric);
            let pr = prompt(3, 40);
            let (tokens, _, _) = pd(&mut p, &mut c, &pr, 4);
            assert_eq!(tokens, reference(&pr, 4));
        });
        let pair = format!("({ptp},{ppp})/({ctp},{cpp})");
        assert_eq!(m.loads("mismatch"), 1, "{pair}");
        assert_eq!(m.load_failures("recompute"), 1, "{pair}");
    }
}

#[test]
fn a_connector_without_a_carrier_refuses_fail_closed_and_disables_fail_open() {
    let sched = |carries: bool| {
        Scheduler::new(
            SchedulerConfig::default(),
            KvCacheManager::new(8, 16, true),
            Box::new(PdConnector {
                engine_id: "x".into(),
                block_size: 16,
                carries,
                pending: Vec::new(),
            }),
            Arc::new(Chars),
            vec![EOS],
        )
    };
    let groups = [group(16, HEADS, 0..LAYERS)];
    let closed = KvChecksumConfig {
        enabled: true,
        fail_closed: true,
        ..Default::default()
    };
    let err = sched(false)
        .enable_kv_checksums(&closed, &groups, WorkerGrid::default())
        .unwrap_err();
    assert!(matches!(err, EngineError::InvalidConfig(_)), "{err}");
    assert!(err.to_string().contains("carries no KV checksums"), "{err}");
    let open = KvChecksumConfig {
        enabled: true,
        ..Default::default()
    };
    let mut s = sched(false);
    assert!(!s
        .enable_kv_checksums(&open, &groups, WorkerGrid::default())
        .unwrap());
    assert!(!s.kv_checksums_enabled());
    let mut s = sched(true);
    assert!(s
        .enable_kv_checksums(&closed, &groups, WorkerGrid::default())
        .unwrap());
    // a block size other than the scheduler's is refused
    assert!(sched(true)
        .enable_kv_checksums(&open, &[group(32, HEADS, 0..LAYERS)], WorkerGrid::default())
        .is_err());

    // End to end, fail-open without a carrier: nothing is sent or verified, requests complete.
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut setup = Setup::new(16);
        setup.carries = false;
        let mut p = Instance::new("p", &setup, &fabric);
        let mut c = Instance::new("c", &setup, &fabric);
        let pr = prompt(4, 33);
        let (tokens, _, pfin) = pd(&mut p, &mut c, &pr, 3);
        assert!(checksums_of(&pfin).is_none());
        assert_eq!(tokens, reference(&pr, 3));
    });
    assert_eq!(m.sends() + m.loads("verified") + m.loads("unverified"), 0);
}

#[test]
fn a_consumer_without_checksums_enabled_ignores_them_and_a_producer_without_sends_none() {
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut off = Setup::new(16);
        off.checksums.enabled = false;
        // producer on, consumer off: the payload travels, nobody checks it
        let mut p = Instance::new("p", &Setup::new(16), &fabric);
        let mut c = Instance::new("c", &off, &fabric);
        let pr = prompt(12, 40);
        let (tokens, _, pfin) = pd(&mut p, &mut c, &pr, 3);
        assert!(checksums_of(&pfin).is_some());
        assert_eq!(tokens, reference(&pr, 3));
    });
    assert_eq!((m.sends(), m.loads("verified")), (1, 0));
    let ((), m) = with_metrics(|| {
        // producer off, consumer on: every load is unverified (missing)
        let fabric = SharedFabric::default();
        let mut off = Setup::new(16);
        off.checksums.enabled = false;
        let mut p = Instance::new("p", &off, &fabric);
        let mut c = Instance::new("c", &Setup::new(16), &fabric);
        let pr = prompt(13, 40);
        let (tokens, _, pfin) = pd(&mut p, &mut c, &pr, 3);
        assert!(checksums_of(&pfin).is_none());
        assert_eq!(tokens, reference(&pr, 3));
    });
    assert_eq!((m.sends(), m.unverified("missing")), (0, 1));
}

#[test]
fn a_load_of_an_instances_own_kv_is_neither_verified_nor_counted() {
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut p = Instance::new("p", &Setup::new(16), &fabric);
        let mut c = Instance::new("c", &Setup::new(16), &fabric);
        let pr = prompt(14, 40);
        let pid = p.add(&pr, 1, Some(json!({"do_remote_decode": true})));
        let (_, pfin) = p.run_until_finished(pid);
        // a kv_both reload: do_remote_decode set on the load
        let mut params = pfin.kv_transfer_params.clone().unwrap();
        params["do_remote_decode"] = json!(true);
        params.as_object_mut().unwrap().remove(KV_CHECKSUMS_PARAM);
        let cid = c.add(&pr, 1, Some(params));
        let (_, fin) = c.run_until_finished(cid);
        assert_eq!(fin.finish, Some(FinishReason::Length));
        // the reload's own prompt is checksummed as a producer request
        assert!(checksums_of(&fin).is_some());
        // c's request holds its blocks for a consumer that never comes: release them
        fabric
            .lock()
            .unwrap()
            .released
            .entry("c".into())
            .or_default()
            .push(cid);
        settle(&mut p, &mut c);
    });
    assert_eq!(
        m.loads("verified") + m.loads("unverified") + m.loads("mismatch"),
        0
    );
}

#[test]
fn a_finished_producer_answers_once_its_checksums_arrive() {
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut setup = Setup::new(16);
        setup.checksums.send_timeout = Duration::from_secs(60);
        let mut p = Instance::build("p", &setup, &fabric, true);
        let mut c = Instance::new("c", &Setup::new(16), &fabric);
        let pr = prompt(15, 40);
        p.hold_sends.store(true, Ordering::Relaxed);
        let pid = p.add(&pr, 1, Some(json!({"do_remote_decode": true})));
        for _ in 0..30 {
            p.step();
        }
        assert!(
            p.final_event(pid).is_none(),
            "answered before its checksums arrived"
        );
        assert_eq!(p.sched.stats().awaiting_checksums, 1);
        assert_eq!(p.sched.stats().running, 0);
        p.hold_sends.store(false, Ordering::Relaxed);
        let (_, pfin) = p.run_until_finished(pid);
        assert!(checksums_of(&pfin).is_some());
        let cid = c.add(&pr, 3, pfin.kv_transfer_params.clone());
        let (tokens, _) = c.run_until_finished(cid);
        assert_eq!(tokens, reference(&pr, 3));
        settle(&mut p, &mut c);
    });
    assert_eq!((m.sends(), m.loads("verified")), (1, 1));
}

#[test]
fn a_producer_whose_checksums_are_late_answers_without_them_and_holds_its_blocks() {
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut setup = Setup::new(16);
        setup.checksums.send_timeout = Duration::from_millis(30);
        let mut p = Instance::build("p", &setup, &fabric, true);
        let mut c = Instance::new("c", &Setup::new(16), &fabric);
        let pr = prompt(16, 40);
        p.hold_sends.store(true, Ordering::Relaxed);
        let started = Instant::now();
        let pid = p.add(&pr, 1, Some(json!({"do_remote_decode": true})));
        let (_, pfin) = p.run_until_finished(pid);
        assert!(started.elapsed() >= Duration::from_millis(30));
        assert!(pfin.kv_transfer_params.is_some());
        assert!(
            checksums_of(&pfin).is_none(),
            "late checksums must not be sent"
        );
        let cid = c.add(&pr, 3, pfin.kv_transfer_params.clone());
        let (tokens, _) = c.run_until_finished(cid);
        assert_eq!(tokens, reference(&pr, 3));
        // The consumer released the lease; the blocks stay held while the checksum reads them.
        for _ in 0..5 {
            p.step();
        }
        assert_eq!(
            p.sched.num_unfinished(),
            1,
            "blocks freed under a running checksum"
        );
        assert!(p.sched.kv().num_free_blocks() < p.sched.kv().num_blocks());
        p.hold_sends.store(false, Ordering::Relaxed);
        settle(&mut p, &mut c);
    });
    assert_eq!(m.sends(), 0);
    assert_eq!(m.unverified("missing"), 1);
}

#[test]
fn an_aborted_producer_sends_nothing_and_frees_after_its_checksum() {
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut setup = Setup::new(16);
        setup.checksums.send_timeout = Duration::from_secs(60);
        let mut p = Instance::build("p", &setup, &fabric, true);
        let pr = prompt(17, 40);
        p.hold_sends.store(true, Ordering::Relaxed);
        let pid = p.add(&pr, 1, Some(json!({"do_remote_decode": true})));
        for _ in 0..10 {
            p.step();
        }
        assert_eq!(p.sched.stats().awaiting_checksums, 1);
        p.sched.abort_request(pid);
        p.sched.check_invariants().unwrap();
        p.step();
        let fin = p.final_event(pid).unwrap().clone();
        assert_eq!(fin.finish, Some(FinishReason::Abort));
        assert!(fin.kv_transfer_params.is_none());
        assert_eq!(p.sched.num_unfinished(), 1, "held for the running checksum");
        p.hold_sends.store(false, Ordering::Relaxed);
        let start = Instant::now();
        while !p.idle() {
            assert!(start.elapsed() < Duration::from_secs(10));
            p.step();
        }
        p.assert_empty();
    });
    assert_eq!(m.sends(), 0);
}

/// 7 blocks of 4 tokens: a plain request and a producer request (do_remote_decode, 12 output
/// tokens) of 10 + 12 tokens each cannot both finish in place; the producer is admitted last, so
/// it is the first victim.
fn crowded_producer(fabric: &SharedFabric, prefix_caching: bool, lagging: bool) -> Instance {
    let mut setup = Setup::new(4);
    // the grid worker reporting sends at once: the producer is unpinned when blocks run out
    setup.model_worker = false;
    setup.flush_sends = !lagging;
    setup.num_blocks = 7;
    setup.max_num_batched_tokens = 16;
    setup.prefix_caching = prefix_caching;
    setup.checksums.send_timeout = Duration::from_secs(60);
    Instance::build("p", &setup, fabric, lagging)
}

#[test]
fn a_producer_preempted_after_its_prompt_still_sends_matching_checksums() {
    // Without prefix caching the prompt is computed again (a new send job replaces the first);
    // with it, the prefill starts again past the prompt, from the same cached blocks.
    for prefix_caching in [false, true] {
        let ((), m) = with_metrics(|| {
            let fabric = SharedFabric::default();
            let mut p = crowded_producer(&fabric, prefix_caching, false);
            let mut c = Instance::new("c", &Setup::new(4), &fabric);
            let other = p.add(&prompt(18, 10), 12, None);
            let pr = prompt(19, 10);
            let pid = p.add(&pr, 12, Some(json!({"do_remote_decode": true})));
            let (_, pfin) = p.run_until_finished(pid);
            assert!(p.sched.stats().preemptions > 0, "the test must preempt");
            if !prefix_caching {
                assert!(
                    p.send_jobs[&pid] >= 2,
                    "the producer request must be prefilled again after its prompt was checksummed"
                );
            }
            assert!(checksums_of(&pfin).is_some());
            // the consumer's load releases the producer's blocks, which `other` needs
            let cid = c.add(&pr, 3, pfin.kv_transfer_params.clone());
            let (tokens, _) = c.run_until_finished(cid);
            assert_eq!(tokens, reference(&pr, 3));
            p.run_until_finished(other);
            settle(&mut p, &mut c);
        });
        assert_eq!(m.loads("verified"), 1, "prefix caching {prefix_caching}");
        assert_eq!(m.loads("mismatch"), 0);
    }
}

#[test]
fn a_request_whose_checksum_is_running_is_never_preempted() {
    let ((), m) = with_metrics(|| {
        let fabric = SharedFabric::default();
        let mut p = crowded_producer(&fabric, false, true);
        let mut c = Instance::new("c", &Setup::new(4), &fabric);
        p.hold_sends.store(true, Ordering::Relaxed);
        let other = p.add(&prompt(18, 10), 12, None);
        let pr = prompt(19, 10);
        let pid = p.add(&pr, 12, Some(json!({"do_remote_decode": true})));
        // The producer decodes to its end while its send is in flight: the other request is
        // preempted in its place, and the producer, finished, waits for its checksums.
        let start = Instant::now();
        while p.sched.stats().awaiting_checksums == 0 {
            assert!(start.elapsed() < Duration::from_secs(10));
            p.step();
        }
        assert!(
            p.sched.stats().preemptions > 0,
            "the test must run out of blocks"
        );
        assert_eq!(
            p.send_jobs[&pid], 1,
            "the producer was preempted under its checksum"
        );
        p.hold_sends.store(false, Ordering::Relaxed);
        let (_, pfin) = p.run_until_finished(pid);
        let cid = c.add(&pr, 3, pfin.kv_transfer_params.clone());
        let (tokens, _) = c.run_until_finished(cid);
        assert_eq!(tokens, reference(&pr, 3));
        p.run_until_finished(other);
        settle(&mut p, &mut c);
    });
    assert_eq!(m.loads("verified"), 1);
}

#[test]
fn fault_injection_fires_with_its_probability_and_seed() {
    let run = |seed: u64| {
        let ((), m) = with_metrics(|| {
            let fabric = SharedFabric::default();
            let mut p = Instance::new("p", &Setup::new(16), &fabric);
            let mut cs = Setup::new(16);
            cs.checksums.fault_injection = Some(FaultInjection {
                kind: FaultKind::CorruptByte,
                probability: 0.5,
                seed,
                block_position: None,
                tp_rank: None,
                group: None,
            });
            let mut c = Instance::new("c", &cs, &fabric);
            for i in 0..12 {
                pd(&mut p, &mut c, &prompt(i, 20), 1);
            }
        });
        (m.loads("verified"), m.loads("mismatch"))
    };
    let a = run(5);
    assert_eq!(a.0 + a.1, 12);
    assert!(a.0 > 0 && a.1 > 0, "p = 0.5 over 12 loads: {a:?}");
    assert_eq!(run(5), a, "the same seed injects the same faults");
}

#[test]
fn the_engine_loop_answers_a_producer_request_with_its_checksums() {
    let fabric = SharedFabric::default();
    let shards = Arc::new(Shards::new(1, 1, 16, 32));
    let worker = ModelWorker::new(
        Arc::new(TinyLm::new()),
        shards.ranks[0].storage.clone(),
        16,
        Box::new(PdConnectorWorker {
            engine_id: "p".into(),
            fabric: fabric.clone(),
            local: shards.clone(),
            done: Vec::new(),
        }),
    )
    .unwrap();
    let mut sched = Scheduler::new(
        SchedulerConfig::default(),
        KvCacheManager::new(32, 16, true),
        Box::new(PdConnector {
            engine_id: "p".into(),
            block_size: 16,
            carries: true,
            pending: Vec::new(),
        }),
        Arc::new(Chars),
        vec![EOS],
    );
    let config = KvChecksumConfig {
        enabled: true,
        ..Default::default()
    };
    assert!(sched
        .enable_kv_checksums(
            &config,
            &[group(16, HEADS, 0..LAYERS)],
            WorkerGrid::default()
        )
        .unwrap());
    let engine = tandem_engine::EngineHandle::spawn(sched, Box::new(worker), VOCAB).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fin = rt.block_on(async {
        let mut stream = engine
            .submit(NewRequest {
                external_id: "e2e".into(),
                prompt_token_ids: prompt(21, 40),
                params: common::greedy(1),
                kv_transfer_params: Some(json!({"do_remote_decode": true})),
            })
            .unwrap();
        let mut last = None;
        while let Some(ev) = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("the answer does not wait for the poll forever")
        {
            last = Some(ev);
        }
        last.unwrap()
    });
    assert_eq!(fin.finish, Some(FinishReason::Length));
    let sent = checksums_of(&fin).expect("the answer carries the checksums");
    assert!(tandem_kv_checksum::Payload::decode(sent).is_ok());
    engine.shutdown();
}
