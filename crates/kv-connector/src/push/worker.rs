//! [`NixlPushWorker`]: the worker side of the NIXL push connector.
//!
//! It owns the worker's [`NixlAgent`] (created in `register_kv_caches`, which also publishes the
//! handshake) and the transfer thread (`pull::loader`, shared with pull mode), which fetches
//! peers' handshakes, posts registrations and WRITEs, and polls them off the engine thread.
//!
//! Producer, per step: finished requests ([`PushSpec`]) wait for their consumer's registration
//! (taken from the [`PushRegistry`] the HTTP route fills); a matched one becomes one WRITE of
//! the prompt's blocks into the registered ones, with the completion notification (carrying the
//! checksums) attached, never posted or left in flight past the registration's window
//! (`arrival + valid_ms - margin`). Its end (written, failed, or no registration within the
//! lease) is `finished_sending`; a failed WRITE also tells the consumer.
//!
//! Consumer, per step: registrations go to the transfer thread; the producer's notifications
//! (drained here) end loads: `pushed` → `finished_recving` (with the checksums it carries in
//! `kv_checksums`), `push-failed` → a failed load. A load with no notification by its deadline
//! (`load_timeout` + [`WRITE_GRACE`] after its registration was answered) fails.
//!
//! Invariants:
//! - Nothing writes into a consumer's blocks once they are reported (finished, failed or, for a
//!   cancelled load, in `finished_sending`): the producer WRITEs only within `valid_ms -
//!   margin` of the registration's arrival, which precedes the consumer's answer, and the
//!   consumer waits `valid_ms + grace` from that answer. No clock is shared; only durations.
//! - A registration the producer certainly did not take (refused, or never sent) fails at once.
//! - Each request appears at most once in `finished_recving` and at most once in
//!   `finished_sending`.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_kv_cache::KvStorage;

use super::protocol::{PushMetadata, PushNotif, PushSpec, RegisterSpec, Registration};
use super::registry::PushRegistry;
use crate::base::{
    ConnectorMetadata, ConnectorOutput, KvConnectorWorker, RankKvCaches, Waker, WakerSlot,
};
use crate::error::KvConnectorError;
use crate::nixl::{BlockPairs, NixlAgent};
use crate::pull::fault::{SplitMix, TransportFault, TransportFaultKind};
use crate::pull::loader::{LoadJob, LoadOutcome, Loader};
use crate::pull::{HandshakeProvider, LoadKind, PeerAddr, PullWorkerConfig};

/// How much longer than a registration's window the consumer waits before it may reuse blocks.
pub const WRITE_GRACE: Duration = Duration::from_secs(1);
/// Loader jobs that report nothing the worker tracks (notifications, releases).
pub(crate) const UNTRACKED: u64 = u64::MAX;

/// The producer's margin inside a registration's window: it neither posts nor keeps a WRITE
/// in flight past `valid - margin`.
fn write_margin(valid: Duration) -> Duration {
    (valid / 4).min(Duration::from_secs(1))
}

/// What a completion notification carries.
enum NotifPayload {
    Checksums(Option<String>),
    /// Testing only (`garble_notif`): bytes that do not decode.
    Garbled(Vec<u8>),
}

#[derive(Debug)]
struct ConsumerLoad {
    transfer_id: String,
    producer: PeerAddr,
    /// Set when the registration was answered (or may have arrived): fail after it.
    deadline: Option<Instant>,
    cancelled: bool,
}

/// The worker side of the push connector. See the module docs.
pub struct NixlPushWorker {
    config: PullWorkerConfig,
    handshake: HandshakeProvider,
    registry: PushRegistry,
    // Drop order: the transfer thread stops before the agent goes.
    loader: Option<Loader>,
    /// The engine's waker, shared with the transfer thread.
    waker: WakerSlot,
    agent: Option<Arc<NixlAgent>>,
    /// Producer: finished requests waiting for their registration, by transfer id.
    waiting: HashMap<String, PushSpec>,
    /// Producer: WRITEs with the transfer thread: request id → transfer id.
    writing: HashMap<u64, String>,
    /// Consumer: loads by request id, and their transfer ids.
    loads: HashMap<u64, ConsumerLoad>,
    by_transfer: HashMap<String, u64>,
    pending: ConnectorOutput,
    /// Testing only: the RNG of `transport_fault_injection`.
    fault_rng: Option<SplitMix>,
}

impl std::fmt::Debug for NixlPushWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlPushWorker")
            .field("role", &self.config.role)
            .field("waiting", &self.waiting.len())
            .field("writing", &self.writing.len())
            .field("loads", &self.loads.len())
            .finish()
    }
}

impl NixlPushWorker {
    /// A worker side; `registry` is the one the producer's HTTP route fills.
    pub fn new(
        config: PullWorkerConfig,
        handshake: HandshakeProvider,
        registry: PushRegistry,
    ) -> Self {
        NixlPushWorker {
            config,
            handshake,
            registry,
            loader: None,
            waker: WakerSlot::default(),
            agent: None,
            waiting: HashMap::new(),
            writing: HashMap::new(),
            loads: HashMap::new(),
            by_transfer: HashMap::new(),
            pending: ConnectorOutput::default(),
            fault_rng: None,
        }
    }

    pub fn agent(&self) -> Option<&Arc<NixlAgent>> {
        self.agent.as_ref()
    }

    pub fn handshake(&self) -> &HandshakeProvider {
        &self.handshake
    }

    /// Nothing waiting, written, or loading.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.writing.is_empty() && self.loads.is_empty()
    }

    fn job(request_id: u64, kind: LoadKind, peer: PeerAddr) -> LoadJob {
        LoadJob {
            request_id,
            kind,
            peer,
            remote_request_id: String::new(),
            ids: BlockPairs::shared(Vec::new(), Vec::new()),
            remote_block_size: None,
            claim_body: None,
            cancel: Arc::new(AtomicBool::new(false)),
        }
    }

    fn submit(&self, job: LoadJob) -> bool {
        self.loader.as_ref().is_some_and(|l| l.submit(job))
    }

    /// Ends a consumer load: failed (`Some(reason)`) or loaded; a cancelled one only frees.
    fn end_load(&mut self, out: &mut ConnectorOutput, request_id: u64, failure: Option<String>) {
        let Some(load) = self.loads.remove(&request_id) else {
            return;
        };
        self.by_transfer.remove(&load.transfer_id);
        if load.cancelled {
            out.finished_sending.insert(request_id);
            return;
        }
        out.finished_recving.insert(request_id);
        if let Some(reason) = failure {
            tracing::warn!(request = request_id, producer = %load.producer, "KV push load failed: {reason}");
            out.failed_recving.insert(request_id, reason);
            out.stats.failures += 1;
        }
    }

    // --- consumer ---

    fn register(&mut self, spec: &RegisterSpec) {
        let release = spec.registration.block_ids.is_empty();
        let body = serde_json::to_string(&spec.registration).expect("a registration serializes");
        let mut job = Self::job(
            if release { UNTRACKED } else { spec.request_id },
            LoadKind::Register,
            spec.producer.clone(),
        );
        job.claim_body = Some(body);
        if !release {
            self.loads.insert(
                spec.request_id,
                ConsumerLoad {
                    transfer_id: spec.registration.transfer_id.clone(),
                    producer: spec.producer.clone(),
                    deadline: None,
                    cancelled: false,
                },
            );
            self.by_transfer
                .insert(spec.registration.transfer_id.clone(), spec.request_id);
        }
        if !self.submit(job) && !release {
            let reason = format!(
                "this instance ({}) does not load KV (or its caches are not registered)",
                self.config.role.as_str()
            );
            self.fail_load_now(spec.request_id, reason);
        }
    }

    /// Fails a load from `start_load_kv`: reported at the next `get_finished`.
    fn fail_load_now(&mut self, request_id: u64, reason: String) {
        let mut out = std::mem::take(&mut self.pending);
        self.end_load(&mut out, request_id, Some(reason));
        self.pending = out;
    }

    fn registered(
        &mut self,
        out: &mut ConnectorOutput,
        request_id: u64,
        answer: Result<(), crate::pull::loader::PostError>,
    ) {
        let window = self.config.load_timeout + WRITE_GRACE;
        match answer {
            Err(e) if !e.maybe_delivered => self.end_load(out, request_id, Some(e.reason)),
            other => {
                if let Err(e) = other {
                    tracing::warn!(request = request_id,
                        "KV push registration may have reached the producer ({}); waiting for its WRITE until the window ends", e.reason);
                }
                if let Some(load) = self.loads.get_mut(&request_id) {
                    load.deadline.get_or_insert(Instant::now() + window);
                }
            }
        }
    }

    fn drain_notifs(&mut self, out: &mut ConnectorOutput) {
        let Some(agent) = &self.agent else {
            return;
        };
        let notifs = match agent.get_notifs() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "fetching NIXL notifications failed");
                return;
            }
        };
        for (sender, bytes) in notifs {
            let (transfer_id, result) = match PushNotif::decode(&bytes) {
                None => {
                    tracing::debug!(%sender, len = bytes.len(), "notification of another protocol ignored");
                    continue;
                }
                Some(PushNotif::Malformed(why)) => {
                    tracing::warn!(%sender, "KV push notification dropped: {why}");
                    out.stats.failed_notifications += 1;
                    continue;
                }
                Some(PushNotif::Pushed {
                    transfer_id,
                    kv_checksums,
                }) => (transfer_id, Ok(kv_checksums)),
                Some(PushNotif::Failed {
                    transfer_id,
                    reason,
                }) => (transfer_id, Err(reason)),
            };
            let Some(&id) = self.by_transfer.get(&transfer_id) else {
                tracing::debug!(%sender, transfer_id, "push notification for no pending load ignored");
                continue;
            };
            match result {
                Ok(checksums) => {
                    if let Some(c) = checksums {
                        out.kv_checksums.entry(id).or_insert(c);
                    }
                    self.end_load(out, id, None);
                }
                Err(reason) => self.end_load(
                    out,
                    id,
                    Some(format!("the producer did not push the KV: {reason}")),
                ),
            }
        }
    }

    fn expire_loads(&mut self, out: &mut ConnectorOutput) {
        let now = Instant::now();
        let late: Vec<u64> = self
            .loads
            .iter()
            .filter(|(_, l)| l.deadline.is_some_and(|d| now >= d))
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            let reason = format!(
                "the producer wrote no KV within {:?} of the registration",
                self.config.load_timeout
            );
            self.end_load(out, id, Some(reason));
        }
    }

    // --- producer ---

    fn match_registrations(&mut self, out: &mut ConnectorOutput) {
        let ready: Vec<(String, Registration, Instant)> = self
            .waiting
            .keys()
            .filter_map(|tid| self.registry.take(tid).map(|(r, at)| (tid.clone(), r, at)))
            .collect();
        for (tid, reg, at) in ready {
            let spec = self.waiting.remove(&tid).expect("waiting spec");
            self.start_write(out, spec, reg, at);
        }
        let now = Instant::now();
        let expired: Vec<String> = self
            .waiting
            .iter()
            .filter(|(_, s)| now >= s.deadline)
            .map(|(tid, _)| tid.clone())
            .collect();
        for tid in expired {
            let spec = self.waiting.remove(&tid).expect("waiting spec");
            tracing::warn!(request = spec.request_id, transfer_id = %tid,
                lease = ?self.config.kv_lease_duration,
                "no consumer registered for the pushed KV before the lease expired; freeing");
            self.registry
                .end(&tid, "its lease expired before a consumer registered");
            out.finished_sending.insert(spec.request_id);
            out.stats.expired_leases += 1;
        }
    }

    fn start_write(
        &mut self,
        out: &mut ConnectorOutput,
        spec: PushSpec,
        reg: Registration,
        at: Instant,
    ) {
        let id = spec.request_id;
        let tid = spec.transfer_id.clone();
        // The consumer's blocks may be smaller: `ratio` of them fill one of ours, and the WRITE
        // is planned in its units.
        let ours = self
            .agent
            .as_ref()
            .map_or(reg.block_size, |a| a.block_size());
        // `block_size` >= 1: registrations are validated when they arrive.
        let ratio = ours / reg.block_size;
        let refusal = if reg.num_tokens != spec.num_tokens {
            Some(format!(
                "the consumer's prompt has {} tokens, the producer's {}: not the same request",
                reg.num_tokens, spec.num_tokens
            ))
        } else if !ours.is_multiple_of(reg.block_size) {
            Some(format!(
                "the consumer's block size {} does not divide the producer's {ours}: in push mode \
                 the producer's blocks must be a multiple of the consumer's",
                reg.block_size
            ))
        } else if (reg.first_block + reg.block_ids.len()).div_ceil(ratio) > spec.block_ids.len()
            && !reg.block_ids.is_empty()
        {
            Some(format!(
                "the consumer registered blocks up to position {}, the producer has {} of {ratio}x \
                 their size",
                reg.first_block + reg.block_ids.len(),
                spec.block_ids.len()
            ))
        } else {
            None
        };
        if reg.block_ids.is_empty() || refusal.is_some() {
            let reason = refusal
                .clone()
                .unwrap_or_else(|| "released by the consumer".into());
            self.registry.end(&tid, &reason);
            out.finished_sending.insert(id);
            if let Some(reason) = refusal {
                tracing::warn!(request = id, transfer_id = %tid, "KV push refused: {reason}");
                self.notify_failed(&reg, &reason);
            }
            return;
        }
        let checksums = self.inject_notif_fault(id, spec.kv_checksums.clone());
        let valid = Duration::from_millis(reg.valid_ms);
        let deadline = at + valid - write_margin(valid);
        let first = reg.first_block;
        let mut job = Self::job(
            id,
            LoadKind::Write {
                notif: match checksums {
                    NotifPayload::Checksums(kv_checksums) => PushNotif::Pushed {
                        transfer_id: tid.clone(),
                        kv_checksums,
                    }
                    .encode(),
                    NotifPayload::Garbled(bytes) => bytes,
                },
                fail_notif: PushNotif::Failed {
                    transfer_id: tid.clone(),
                    reason: "the producer's WRITE failed".into(),
                }
                .encode(),
                deadline,
            },
            reg.consumer.peer(),
        );
        // Push runs one block table for every KV cache group.
        job.ids = BlockPairs::shared(
            (first..first + reg.block_ids.len())
                .map(|p| spec.block_ids[p / ratio] as usize * ratio + p % ratio)
                .collect(),
            reg.block_ids.iter().map(|&b| b as usize).collect(),
        );
        if self.submit(job) {
            self.writing.insert(id, tid);
        } else {
            self.registry
                .end(&tid, "the producer's transfer thread is gone");
            out.finished_sending.insert(id);
            out.stats.failures += 1;
        }
    }

    /// Testing only: `drop_checksums` and `garble_notif` change what the completion notification
    /// carries.
    fn inject_notif_fault(&mut self, request_id: u64, checksums: Option<String>) -> NotifPayload {
        let (Some(f), Some(rng)) = (self.config.transport_fault, self.fault_rng.as_mut()) else {
            return NotifPayload::Checksums(checksums);
        };
        let hit = matches!(
            f.kind,
            TransportFaultKind::DropChecksums | TransportFaultKind::GarbleNotif
        ) && rng.hit(f.probability);
        if !hit {
            return NotifPayload::Checksums(checksums);
        }
        tracing::warn!(
            request = request_id,
            kind = f.kind.as_str(),
            "transport fault injected (testing only): the push completion notification is broken"
        );
        match f.kind {
            TransportFaultKind::DropChecksums => NotifPayload::Checksums(None),
            _ => NotifPayload::Garbled(b"tandem/v2/pushed+ck:{\"v\":1,\"garbled".to_vec()),
        }
    }

    /// Tells a registered consumer that nothing will be written (best effort).
    fn notify_failed(&self, reg: &Registration, reason: &str) {
        let notif = PushNotif::Failed {
            transfer_id: reg.transfer_id.clone(),
            reason: reason.to_string(),
        }
        .encode();
        self.submit(Self::job(
            UNTRACKED,
            LoadKind::Notify(notif),
            reg.consumer.peer(),
        ));
    }

    fn drain_loader(&mut self, out: &mut ConnectorOutput) {
        let Some(loader) = &self.loader else {
            return;
        };
        for r in loader.drain() {
            let id = r.request_id;
            match r.outcome {
                LoadOutcome::Registered(answer) if id != UNTRACKED => {
                    self.registered(out, id, answer)
                }
                LoadOutcome::Registered(Err(e)) => {
                    tracing::debug!("KV push release not delivered: {}", e.reason)
                }
                LoadOutcome::Loaded(stats) => {
                    if let Some(tid) = self.writing.remove(&id) {
                        self.registry.end(&tid, "its KV was pushed");
                    }
                    out.finished_sending.insert(id);
                    out.stats.bytes += stats.bytes;
                    out.stats.descriptors += stats.descriptors as u64;
                    out.stats.transfers.push((&stats).into());
                }
                LoadOutcome::Failed(reason) => {
                    if let Some(tid) = self.writing.remove(&id) {
                        tracing::warn!(request = id, transfer_id = %tid, "KV push failed: {reason}");
                        self.registry.end(&tid, &reason);
                        out.finished_sending.insert(id);
                        out.stats.failures += 1;
                    }
                }
                LoadOutcome::Released(res) => {
                    if let Err(e) = res {
                        tracing::debug!("KV push notification not delivered: {e}");
                    }
                }
                // Only READs are split into landing chunks.
                LoadOutcome::Registered(Ok(()))
                | LoadOutcome::Cancelled
                | LoadOutcome::Landed(_) => {}
            }
        }
    }
}

impl KvConnectorWorker for NixlPushWorker {
    fn register_kv_caches(&mut self, storage: Arc<KvStorage>) -> Result<(), KvConnectorError> {
        if self.agent.is_some() {
            return Err(KvConnectorError::InvalidConfig(
                "KV caches are already registered with this connector".into(),
            ));
        }
        let fault = self.config.transport_fault;
        if let Some(f) = fault {
            let push_fault = matches!(
                f.kind,
                TransportFaultKind::WrongBlock
                    | TransportFaultKind::DropChecksums
                    | TransportFaultKind::GarbleNotif
            );
            if !push_fault || !self.config.role.is_producer() {
                return Err(KvConnectorError::InvalidConfig(format!(
                    "transport_fault_injection {} does not apply to a push {}: push faults are \
                     a producer's wrong_block, drop_checksums and garble_notif",
                    f.kind.as_str(),
                    self.config.role.as_str()
                )));
            }
            self.fault_rng = Some(SplitMix::new(f.seed));
            tracing::warn!(kind = f.kind.as_str(), probability = f.probability,
                "transport fault injection is on (testing only): KV pushes will be broken on purpose");
        }
        // A consumer's notifications are drained by `get_finished`, never by the thread.
        let (agent, loader) = self.config.start(
            vec![RankKvCaches::whole(storage)],
            &self.handshake,
            Some(fault.filter(|f: &TransportFault| f.kind == TransportFaultKind::WrongBlock)),
            !self.config.role.is_consumer(),
            &self.waker,
        )?;
        self.loader = loader;
        self.agent = Some(agent);
        Ok(())
    }

    fn start_load_kv(&mut self, metadata: &ConnectorMetadata) -> Result<(), KvConnectorError> {
        let Some(meta) = metadata.payload::<PushMetadata>()? else {
            return Ok(());
        };
        for spec in &meta.registrations {
            self.register(spec);
        }
        for (id, reason) in &meta.rejected {
            self.fail_load_now(*id, reason.clone());
        }
        for &id in &meta.cancelled_loads {
            match self.loads.get_mut(&id) {
                Some(load) => load.cancelled = true,
                None => {
                    // Already reported (the report crossed the cancel): nothing writes now.
                    self.pending.finished_recving.remove(&id);
                    self.pending.failed_recving.remove(&id);
                    self.pending.kv_checksums.remove(&id);
                    self.pending.finished_sending.insert(id);
                }
            }
        }
        for spec in &meta.pushes {
            self.waiting.insert(spec.transfer_id.clone(), spec.clone());
        }
        for tid in &meta.aborted {
            if let Some(reg) = self.registry.end(
                tid,
                "the producer's request ended without KV (aborted or failed)",
            ) {
                self.notify_failed(
                    &reg,
                    "the producer's request ended without KV (aborted or failed)",
                );
            }
        }
        Ok(())
    }

    fn set_waker(&mut self, waker: Waker) {
        let _ = self.waker.set(waker);
    }

    fn get_finished(&mut self) -> ConnectorOutput {
        let mut out = std::mem::take(&mut self.pending);
        self.drain_loader(&mut out);
        if self.config.role.is_consumer() {
            self.drain_notifs(&mut out);
            self.expire_loads(&mut out);
        }
        if self.config.role.is_producer() {
            self.match_registrations(&mut out);
        }
        out
    }
}
