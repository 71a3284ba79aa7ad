//! The KV connector interface, scheduler side and worker side.
//!
//! The scheduler side lives with the scheduler (one per engine) and decides, per request, how many
//! tokens come from a remote instance and whether a finished request's blocks must outlive it
//! (a producer holds them until the consumer has read them). The worker side lives with each
//! worker and moves bytes. They talk only through [`ConnectorMetadata`] (scheduler -> workers,
//! once per step) and [`ConnectorOutput`] (workers -> scheduler, once per step).
//!
//! Invariants the engine keeps for every connector:
//! - `update_state_after_alloc` is called once per request that was matched, after its blocks
//!   exist and before `build_connector_meta` of the same step.
//! - A request whose `request_finished` returned `delay_free` keeps its blocks until the connector
//!   reports it in `ConnectorOutput::finished_sending`.
//! - A request waiting for a load is scheduled again only after it appears in
//!   `finished_recving` (or `failed_recving`).

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde_json::Value;
use tandem_kv_cache::{BlockId, KvStorage};

use crate::error::KvConnectorError;

/// What the connector sees of a request.
#[derive(Debug, Clone, Copy)]
pub struct ConnectorRequest<'a> {
    /// The engine's id of the request.
    pub request_id: u64,
    /// The id the client and the proxy know (X-Request-Id).
    pub external_id: &'a str,
    pub prompt_token_ids: &'a [u32],
    pub kv_transfer_params: Option<&'a Value>,
}

/// Tokens a connector can provide beyond the local prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MatchedTokens {
    pub num_external_tokens: usize,
    /// The tokens arrive asynchronously: the request waits for remote KV.
    pub load_async: bool,
}

/// Why a request finished, as far as a connector cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishKind {
    /// Stop or length: the KV is complete and may be sent.
    Normal,
    /// Aborted or failed: nothing is sent.
    Aborted,
}

/// What to do with a finished request's blocks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FinishedAction {
    /// Keep the blocks until the connector reports the request in `finished_sending`.
    pub delay_free: bool,
    /// Returned to the client in the response's `kv_transfer_params`.
    pub kv_transfer_params: Option<Value>,
}

/// Connector-specific data sent from the scheduler side to the worker side each step.
#[derive(Default)]
pub struct ConnectorMetadata(pub Option<Box<dyn Any + Send + Sync>>);

impl std::fmt::Debug for ConnectorMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ConnectorMetadata(..)"
        } else {
            "ConnectorMetadata(none)"
        })
    }
}

/// Transfer statistics reported by workers, turned into metrics by the engine.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TransferStats {
    pub bytes: u64,
    pub descriptors: u64,
    /// Each finished transfer (READ or WRITE) of the step.
    pub transfers: Vec<TransferRecord>,
    pub failures: u64,
    pub expired_leases: u64,
    /// Notifications of the connector's protocol that did not decode (dropped).
    pub failed_notifications: u64,
}

/// One finished transfer, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TransferRecord {
    /// Post to completion.
    pub seconds: f64,
    /// Creating and posting it.
    pub post_seconds: f64,
    pub bytes: u64,
    pub descriptors: u64,
}

impl From<&crate::nixl::TransferStats> for TransferRecord {
    fn from(s: &crate::nixl::TransferStats) -> Self {
        TransferRecord {
            seconds: s.seconds(),
            post_seconds: s.post_duration.as_secs_f64(),
            bytes: s.bytes,
            descriptors: s.descriptors as u64,
        }
    }
}

/// What workers report to the scheduler side each step.
#[derive(Debug, Clone, Default)]
pub struct ConnectorOutput {
    /// Producer: requests whose blocks were read (or whose lease expired) and may be freed.
    pub finished_sending: HashSet<u64>,
    /// Consumer: requests whose load finished (successfully or not).
    pub finished_recving: HashSet<u64>,
    /// Consumer: loads that failed, with the reason.
    pub failed_recving: HashMap<u64, String>,
    /// Blocks whose content is known to be bad, as (KV cache group, block id) (group 0 where
    /// every group shares one table).
    pub invalid_block_ids: HashSet<(usize, BlockId)>,
    /// Consumer, connector-owned carrier: the KV checksums (the encoded payload, as in
    /// [`KV_CHECKSUMS_PARAM`]) received for a load, reported no later than the load's
    /// `finished_recving`. The scheduler takes the first copy.
    pub kv_checksums: HashMap<u64, String>,
    /// Consumer: blocks of loads still in flight that hold their final bytes, per KV cache group
    /// (indexed by group id; one list when every group shares one table, as in the transfer's
    /// block pairs): a READ split into chunks reports each chunk's local blocks as it lands, so
    /// they can be checksummed while the rest moves. Only connectors that split loads report it.
    pub landed_recving: HashMap<u64, Vec<Vec<BlockId>>>,
    pub stats: TransferStats,
}

impl ConnectorOutput {
    /// Merges another worker's output into this one (a request counts as finished when any
    /// worker reports it here; connectors with several workers aggregate before that).
    pub fn merge(&mut self, other: ConnectorOutput) {
        self.finished_sending.extend(other.finished_sending);
        self.finished_recving.extend(other.finished_recving);
        self.failed_recving.extend(other.failed_recving);
        self.invalid_block_ids.extend(other.invalid_block_ids);
        for (id, payload) in other.kv_checksums {
            self.kv_checksums.entry(id).or_insert(payload);
        }
        for (id, lists) in other.landed_recving {
            merge_landed(self.landed_recving.entry(id).or_default(), lists);
        }
        self.stats.merge(other.stats);
    }
}

/// Adds `more` landed blocks to `into`, list by list (group by group).
pub fn merge_landed(into: &mut Vec<Vec<BlockId>>, more: Vec<Vec<BlockId>>) {
    if into.len() < more.len() {
        into.resize(more.len(), Vec::new());
    }
    for (list, blocks) in into.iter_mut().zip(more) {
        list.extend(blocks);
    }
}

impl TransferStats {
    /// Adds another worker's statistics to these.
    pub fn merge(&mut self, other: TransferStats) {
        self.bytes += other.bytes;
        self.descriptors += other.descriptors;
        self.transfers.extend(other.transfers);
        self.failures += other.failures;
        self.expired_leases += other.expired_leases;
        self.failed_notifications += other.failed_notifications;
    }
}

/// The `kv_transfer_params` key that carries a producer's KV checksums (base64 of the payload
/// `tandem_kv_checksum::Payload::encode` writes) to the consumer.
pub const KV_CHECKSUMS_PARAM: &str = "kv_checksums";

/// How a connector carries a request's KV checksums from the producer to the consumer.
///
/// The engine computes, sends and verifies the checksums itself; a connector only declares the
/// carrier. With [`KvChecksumCarrier::KvTransferParams`] the engine adds
/// [`KV_CHECKSUMS_PARAM`] to the `kv_transfer_params` that `request_finished` returns on the
/// producer, and reads it from the request's `kv_transfer_params` on the consumer: a connector
/// whose producer answer reaches the consumer through the proxy needs no other change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvChecksumCarrier {
    /// In `kv_transfer_params["kv_checksums"]`.
    KvTransferParams,
    /// In the connector's own messages: the engine hands a producer request's payload to
    /// [`KvConnectorScheduler::send_kv_checksums`] after `request_finished` (normal finishes
    /// only), and takes a load's from [`ConnectorOutput::kv_checksums`]. A load whose checksums
    /// never arrive is unverified.
    Connector,
}

impl ConnectorMetadata {
    /// The payload as the connector's own type; `None` for a step without metadata, an error
    /// for another connector's.
    pub fn payload<T: 'static>(&self) -> Result<Option<&T>, KvConnectorError> {
        match &self.0 {
            None => Ok(None),
            Some(any) => any.downcast_ref::<T>().map(Some).ok_or_else(|| {
                KvConnectorError::InvalidConfig(
                    "the scheduler side sent metadata of another connector".into(),
                )
            }),
        }
    }
}

/// The consumer requests a connector's scheduler side tracks: those whose load was handed to
/// the workers (`loading` until reported in `finished_recving`), those whose request ended
/// mid-load (`cancelled`: their blocks held until reported in `finished_sending`), and every
/// request whose load was recorded, until it ends.
#[derive(Debug, Default)]
pub struct ConsumerLoads {
    loading: HashSet<u64>,
    cancelled: HashSet<u64>,
    consumers: HashSet<u64>,
}

/// How a tracked consumer request ended (see [`ConsumerLoads::finish`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerEnd {
    /// Its load was in flight: the workers must stop it; its blocks wait for them.
    MidLoad,
    /// After its load (or with none needed): nothing to do.
    Done,
}

impl ConsumerLoads {
    /// A consumer request's load is recorded (`loading`: handed to the workers).
    pub fn start(&mut self, request_id: u64, loading: bool) {
        self.consumers.insert(request_id);
        if loading {
            self.loading.insert(request_id);
        }
    }

    /// The request ended; `None` when it was never recorded here.
    pub fn finish(&mut self, request_id: u64) -> Option<ConsumerEnd> {
        if self.loading.remove(&request_id) {
            self.consumers.remove(&request_id);
            self.cancelled.insert(request_id);
            return Some(ConsumerEnd::MidLoad);
        }
        self.consumers
            .remove(&request_id)
            .then_some(ConsumerEnd::Done)
    }

    /// The workers' report of a step.
    pub fn update(&mut self, output: &ConnectorOutput) {
        for id in &output.finished_recving {
            self.loading.remove(id);
        }
        for id in &output.finished_sending {
            self.cancelled.remove(id);
        }
    }

    /// (loading, cancelled, consumers).
    pub fn counts(&self) -> (usize, usize, usize) {
        (
            self.loading.len(),
            self.cancelled.len(),
            self.consumers.len(),
        )
    }
}

impl ConsumerEnd {
    /// What the engine does with the request's blocks.
    pub fn action(self) -> FinishedAction {
        FinishedAction {
            delay_free: self == ConsumerEnd::MidLoad,
            kv_transfer_params: None,
        }
    }
}

/// Tokens a consumer loads past its local prefix hit of `num_computed_tokens`: the rest of the
/// prompt, asynchronously, when the hit ends on a block boundary; none (prefill locally)
/// otherwise, since a load never writes into a partly computed, possibly shared, block.
pub fn remote_prompt_tokens(
    request: &ConnectorRequest<'_>,
    num_computed_tokens: usize,
    block_size: usize,
) -> MatchedTokens {
    if !num_computed_tokens.is_multiple_of(block_size) {
        tracing::warn!(request = %request.external_id, num_computed_tokens,
            "local prefix hit is not block-aligned; prefilling locally");
        return MatchedTokens::default();
    }
    let n = request
        .prompt_token_ids
        .len()
        .saturating_sub(num_computed_tokens);
    MatchedTokens {
        num_external_tokens: n,
        load_async: n > 0,
    }
}

/// The scheduler side of a connector.
pub trait KvConnectorScheduler: Send {
    /// Tokens beyond `num_computed_tokens` (the local prefix hit) the connector can provide.
    /// An error rejects the request (e.g. malformed `kv_transfer_params`).
    fn get_num_new_matched_tokens(
        &mut self,
        request: &ConnectorRequest<'_>,
        num_computed_tokens: usize,
    ) -> Result<MatchedTokens, KvConnectorError>;

    /// The request's blocks are allocated; `block_tables` are its whole block tables: one per
    /// KV cache group, by group id (one table: shared by every group), with [`NULL_BLOCK`]
    /// where a sliding-window group holds no block (before its window).
    ///
    /// [`NULL_BLOCK`]: tandem_kv_cache::NULL_BLOCK
    fn update_state_after_alloc(
        &mut self,
        request: &ConnectorRequest<'_>,
        block_tables: &[Vec<BlockId>],
        num_external_tokens: usize,
    );

    /// The metadata for this step's workers.
    fn build_connector_meta(&mut self) -> ConnectorMetadata;

    /// Workers' report for the step.
    fn update_connector_output(&mut self, _output: &ConnectorOutput) {}

    /// A request finished; decide whether its blocks outlive it. `block_tables` as in
    /// [`Self::update_state_after_alloc`].
    fn request_finished(
        &mut self,
        request: &ConnectorRequest<'_>,
        block_tables: &[Vec<BlockId>],
        finish: FinishKind,
    ) -> FinishedAction;

    /// Connector-owned carrier: the encoded KV checksums of a producer request that finished
    /// normally, after its `request_finished`. The connector sends them with the request's KV
    /// (or drops them if it has nothing to send). The default ignores them.
    fn send_kv_checksums(&mut self, _request: &ConnectorRequest<'_>, _payload: &str) {}

    /// Last word on the `kv_transfer_params` a finished request answers, once everything else
    /// (the KV checksums) is in them: a connector that signs its params does it here. The
    /// default leaves them as they are.
    fn seal_transfer_params(&mut self, _params: &mut serde_json::Map<String, serde_json::Value>) {}

    /// Whether this connector can carry KV checksums for some request at all. Checked once at
    /// startup: with `enable_kv_checksum`, a connector that carries none refuses to start under
    /// `kv_checksum_fail_closed` and disables checksums (with a warning) otherwise.
    fn carries_kv_checksums(&self) -> bool {
        false
    }

    /// How the checksums of `request` travel: for a producer request (`receiving == false`),
    /// those of its prompt's KV; for a load (`receiving == true`), those the load is verified
    /// against. `None` (the default): not carried, so the request is neither checksummed nor
    /// verified (e.g. a load of KV whose source sent no checksums).
    fn kv_checksum_carrier(
        &self,
        _request: &ConnectorRequest<'_>,
        _receiving: bool,
    ) -> Option<KvChecksumCarrier> {
        None
    }
}

/// One worker's KV storage and what it holds of the model, for a connector that moves the KV of
/// every worker (TP rank x pipeline stage) of an instance.
#[derive(Debug, Clone)]
pub struct RankKvCaches {
    pub tp_rank: usize,
    pub pp_rank: usize,
    /// The model's KV heads this worker holds, in its storage's order.
    pub kv_heads: Vec<u32>,
    /// Which copy of those heads this worker holds (0 unless TP exceeds the KV heads).
    pub kv_replica: u32,
    pub storage: Arc<KvStorage>,
}

impl RankKvCaches {
    /// The only worker of an instance: every head of `storage`.
    pub fn whole(storage: Arc<KvStorage>) -> Self {
        let heads = if storage.num_layers() == 0 {
            0
        } else {
            storage.layout(0).num_kv_heads as u32
        };
        RankKvCaches {
            tp_rank: 0,
            pp_rank: 0,
            kv_heads: (0..heads).collect(),
            kv_replica: 0,
            storage,
        }
    }
}

/// Wakes the engine loop when a connector has something new to report (a load finished, or part
/// of one landed), so it need not wait for its next poll. Cheap and non-blocking; may be called
/// from any thread, any number of times.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Where a connector keeps the engine's waker for its threads: set once, whenever it comes.
pub type WakerSlot = Arc<std::sync::OnceLock<Waker>>;

/// The worker side of a connector.
pub trait KvConnectorWorker: Send {
    /// Called once with the worker's KV storage before the first step.
    fn register_kv_caches(&mut self, storage: Arc<KvStorage>) -> Result<(), KvConnectorError>;

    /// Called once, instead of [`Self::register_kv_caches`], by an instance with several
    /// workers (TP or PP above 1), with every worker's storage: the connector moves all of them.
    fn register_rank_kv_caches(
        &mut self,
        ranks: Vec<RankKvCaches>,
    ) -> Result<(), KvConnectorError> {
        match <[RankKvCaches; 1]>::try_from(ranks) {
            Ok([one]) if one.tp_rank == 0 && one.pp_rank == 0 => {
                self.register_kv_caches(one.storage)
            }
            _ => Err(KvConnectorError::InvalidConfig(
                "this connector does not move the KV of several workers (TP or PP above 1)".into(),
            )),
        }
    }
    /// Starts the loads (and saves) described by this step's metadata.
    fn start_load_kv(&mut self, metadata: &ConnectorMetadata) -> Result<(), KvConnectorError>;
    /// Transfers that finished since the last call.
    fn get_finished(&mut self) -> ConnectorOutput;
    /// Called once by the engine: the connector calls `waker` when [`Self::get_finished`] has
    /// something new (connectors that never wake are polled).
    fn set_waker(&mut self, _waker: Waker) {}
}

/// The connector of a single instance: nothing comes from elsewhere, nothing outlives a request.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopConnector;

impl KvConnectorScheduler for NoopConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        _request: &ConnectorRequest<'_>,
        _num_computed_tokens: usize,
    ) -> Result<MatchedTokens, KvConnectorError> {
        Ok(MatchedTokens::default())
    }
    fn update_state_after_alloc(
        &mut self,
        _request: &ConnectorRequest<'_>,
        _block_tables: &[Vec<BlockId>],
        _num_external_tokens: usize,
    ) {
    }
    fn build_connector_meta(&mut self) -> ConnectorMetadata {
        ConnectorMetadata(None)
    }
    fn request_finished(
        &mut self,
        _request: &ConnectorRequest<'_>,
        _block_tables: &[Vec<BlockId>],
        _finish: FinishKind,
    ) -> FinishedAction {
        FinishedAction::default()
    }
}

impl KvConnectorWorker for NoopConnector {
    fn register_kv_caches(&mut self, _storage: Arc<KvStorage>) -> Result<(), KvConnectorError> {
        Ok(())
    }
    fn register_rank_kv_caches(
        &mut self,
        _ranks: Vec<RankKvCaches>,
    ) -> Result<(), KvConnectorError> {
        Ok(())
    }
    fn start_load_kv(&mut self, _metadata: &ConnectorMetadata) -> Result<(), KvConnectorError> {
        Ok(())
    }
    fn get_finished(&mut self) -> ConnectorOutput {
        ConnectorOutput::default()
    }
}
