//! [`NixlPullWorker`]: the worker side of the NIXL pull connector.
//!
//! It owns the worker's [`NixlAgent`] (created in `register_kv_caches`, which also publishes the
//! handshake) and, on a consumer, the transfer thread (`loader.rs`). Per step:
//! - `start_load_kv` hands new loads to the transfer thread, raises the cancel flag of loads
//!   whose request ended, and records new leases. It never blocks.
//! - `get_finished` drains what the transfer thread reported (never blocks) and, on a producer,
//!   the NIXL notifications: `done` for a leased request → `finished_sending`; `renew` extends its
//!   lease to now + `kv_lease_duration`; a lease past its deadline → `finished_sending` and
//!   `stats.expired_leases` (with a warning).
//!
//! Invariants:
//! - Each request appears at most once in `finished_recving` (a load's outcome) and at most once
//!   in `finished_sending` (a lease's end, or the end of a cancelled load).
//! - A `done` that arrives before its lease is known (the consumer can be faster than the next
//!   step) is kept for up to a lease duration and matched when the lease arrives; other
//!   notifications for unknown requests are ignored (logged at debug).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_kv_cache::{BlockId, KvStorage};

use super::fault::{TransportFault, TransportFaultKind};
use super::leases::LeaseTable;
use super::loader::{LoadJob, LoadOutcome, Loader, LoaderConfig};
use super::protocol::{LoadKind, LoadSpec, PullMetadata, PullNotif};
use super::HandshakeProvider;
use crate::auth::TransferAuth;
use crate::base::{
    merge_landed, ConnectorMetadata, ConnectorOutput, KvConnectorWorker, RankKvCaches, Waker,
    WakerSlot,
};
use crate::config::KvRole;
use crate::error::KvConnectorError;
use crate::nixl::{NixlAgent, NixlAgentConfig};

/// Most early `done` notifications kept (older ones are dropped first).
const MAX_EARLY_DONE: usize = 65_536;

/// What the worker side needs to know.
#[derive(Debug, Clone, PartialEq)]
pub struct PullWorkerConfig {
    pub role: KvRole,
    /// The NIXL agent to create.
    pub agent: NixlAgentConfig,
    pub kv_lease_duration: Duration,
    pub load_timeout: Duration,
    pub handshake_timeout: Duration,
    /// A consumer splits READs larger than this into chunks (`read_chunk_bytes`; 0: never;
    /// `None`: the default of its memory's kind).
    pub read_chunk_bytes: Option<u64>,
    /// How many chunks of a split READ are posted at once (`read_chunks_in_flight`).
    pub read_chunks_in_flight: usize,
    /// The deployment secret: a consumer signs its handshake requests with it.
    pub auth: Option<TransferAuth>,
    /// Testing only: a fault where the bytes move (`pull::fault`).
    pub transport_fault: Option<TransportFault>,
}

impl PullWorkerConfig {
    /// Creates the worker's agent over every worker's storage and publishes its handshake; with
    /// `loader_fault` (the transfer thread's fault, if any) also spawns the transfer thread,
    /// which drains notifications while idle when the agent has no progress thread and
    /// `drain_when_idle` (nobody else drains them); the thread wakes the engine through `waker`.
    pub(crate) fn start(
        &self,
        ranks: Vec<RankKvCaches>,
        handshake: &HandshakeProvider,
        loader_fault: Option<Option<TransportFault>>,
        drain_when_idle: bool,
        waker: &WakerSlot,
    ) -> Result<(Arc<NixlAgent>, Option<Loader>), KvConnectorError> {
        let agent = Arc::new(NixlAgent::for_ranks(self.agent.clone(), ranks)?);
        handshake.publish(agent.handshake()?.to_json());
        let loader = match loader_fault {
            None => None,
            Some(fault) => Some(Loader::spawn(
                agent.clone(),
                LoaderConfig {
                    load_timeout: self.load_timeout,
                    handshake_timeout: self.handshake_timeout,
                    kv_lease_duration: self.kv_lease_duration,
                    read_chunk_bytes: self.read_chunk_bytes,
                    read_chunks_in_flight: self.read_chunks_in_flight,
                    progress_when_idle: !self.agent.progress_thread && drain_when_idle,
                },
                self.auth.clone(),
                fault,
                waker.clone(),
            )?),
        };
        Ok((agent, loader))
    }
}

#[derive(Debug, Clone, Copy)]
struct Lease {
    request_id: u64,
    deadline: Instant,
}

/// The worker side of the pull connector. See the module docs.
pub struct NixlPullWorker {
    config: PullWorkerConfig,
    handshake: HandshakeProvider,
    // Drop order: the transfer thread stops before the agent goes.
    loader: Option<Loader>,
    /// The engine's waker, shared with the transfer thread.
    waker: WakerSlot,
    agent: Option<Arc<NixlAgent>>,
    /// Producer: remote request id → lease.
    leases: HashMap<String, Lease>,
    /// Producer: `done` notifications for leases not known yet, with their arrival.
    early_done: HashMap<String, Instant>,
    /// Consumer: cancel flags of jobs with the transfer thread (Read and Release jobs).
    jobs: HashMap<u64, Arc<AtomicBool>>,
    /// Consumer: loads cancelled by the scheduler side, not yet reported back.
    cancelled: HashSet<u64>,
    /// Reported at the next `get_finished` (loads that could not even be handed off).
    pending: ConnectorOutput,
    /// Producer: the issued leases as the HTTP routes see them (ended here when freed).
    lease_table: LeaseTable,
}

impl std::fmt::Debug for NixlPullWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlPullWorker")
            .field("role", &self.config.role)
            .field("agent", &self.agent)
            .field("leases", &self.leases.len())
            .field("jobs", &self.jobs.len())
            .finish()
    }
}

impl NixlPullWorker {
    /// A worker side; `lease_table` is the one its scheduler side issues leases into.
    pub fn new(
        config: PullWorkerConfig,
        handshake: HandshakeProvider,
        lease_table: LeaseTable,
    ) -> Self {
        NixlPullWorker {
            lease_table,
            config,
            handshake,
            loader: None,
            waker: WakerSlot::default(),
            agent: None,
            leases: HashMap::new(),
            early_done: HashMap::new(),
            jobs: HashMap::new(),
            cancelled: HashSet::new(),
            pending: ConnectorOutput::default(),
        }
    }

    pub fn config(&self) -> &PullWorkerConfig {
        &self.config
    }

    /// The agent, once `register_kv_caches` ran.
    pub fn agent(&self) -> Option<&Arc<NixlAgent>> {
        self.agent.as_ref()
    }

    /// The handshake this worker publishes (the same provider the constructor returned).
    pub fn handshake(&self) -> &HandshakeProvider {
        &self.handshake
    }

    /// Producer leases not yet ended.
    pub fn num_leases(&self) -> usize {
        self.leases.len()
    }

    /// Consumer jobs with the transfer thread, not yet reported.
    pub fn num_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// No lease, no job, nothing waiting to be reported.
    pub fn is_idle(&self) -> bool {
        self.leases.is_empty()
            && self.jobs.is_empty()
            && self.cancelled.is_empty()
            && self.pending.finished_recving.is_empty()
            && self.pending.finished_sending.is_empty()
    }

    fn fail_now(&mut self, request_id: u64, reason: String) {
        tracing::warn!(request = request_id, "KV load failed: {reason}");
        self.pending.finished_recving.insert(request_id);
        self.pending.failed_recving.insert(request_id, reason);
        self.pending.stats.failures += 1;
    }

    fn submit(&mut self, spec: &LoadSpec) {
        let read = spec.kind != LoadKind::Release;
        let Some(loader) = &self.loader else {
            if read {
                self.fail_now(
                    spec.request_id,
                    format!(
                        "this instance ({}) does not load KV (or its caches are not registered)",
                        self.config.role.as_str()
                    ),
                );
            }
            return;
        };
        let cancel = Arc::new(AtomicBool::new(false));
        let job = LoadJob {
            request_id: spec.request_id,
            kind: spec.kind.clone(),
            peer: spec.peer.clone(),
            remote_request_id: spec.remote_request_id.clone(),
            ids: spec.blocks.clone(),
            remote_block_size: spec.remote_block_size,
            claim_body: spec.claim_body.clone(),
            cancel: cancel.clone(),
        };
        if loader.submit(job) {
            if read {
                self.jobs.insert(spec.request_id, cancel);
            }
        } else if read {
            self.fail_now(spec.request_id, "the transfer thread is gone".into());
        }
    }

    fn add_lease(&mut self, request_id: u64, remote_request_id: &str, deadline: Instant) {
        if self.early_done.remove(remote_request_id).is_some() {
            tracing::debug!(request = request_id, "KV lease released by an early done");
            self.lease_table.end(remote_request_id);
            self.pending.finished_sending.insert(request_id);
            return;
        }
        self.leases.insert(
            remote_request_id.to_string(),
            Lease {
                request_id,
                deadline,
            },
        );
    }

    fn drain_loads(&mut self, out: &mut ConnectorOutput) {
        let Some(loader) = &self.loader else {
            return;
        };
        for r in loader.drain() {
            let id = r.request_id;
            if let LoadOutcome::Landed(lists) = r.outcome {
                // Part of a READ in flight; a cancelled one's blocks are nobody's concern.
                if !self.cancelled.contains(&id) {
                    let lists = lists
                        .into_iter()
                        .map(|l| l.into_iter().map(|b| b as BlockId).collect())
                        .collect();
                    merge_landed(out.landed_recving.entry(id).or_default(), lists);
                }
                continue;
            }
            let cancelled = self.cancelled.remove(&id);
            match r.outcome {
                LoadOutcome::Released(res) => {
                    if let Err(reason) = res {
                        tracing::debug!(request = id, "KV release not delivered: {reason}");
                    }
                    continue;
                }
                // Pull submits no registrations; landings were taken above.
                LoadOutcome::Registered(_) | LoadOutcome::Landed(_) => continue,
                _ if cancelled => {
                    self.jobs.remove(&id);
                    out.finished_sending.insert(id);
                }
                LoadOutcome::Cancelled => {
                    // Only the scheduler side cancels; its request is gone either way.
                    self.jobs.remove(&id);
                    out.finished_sending.insert(id);
                }
                LoadOutcome::Loaded(stats) => {
                    self.jobs.remove(&id);
                    out.finished_recving.insert(id);
                    out.stats.bytes += stats.bytes;
                    out.stats.descriptors += stats.descriptors as u64;
                    out.stats.transfers.push((&stats).into());
                }
                LoadOutcome::Failed(reason) => {
                    self.jobs.remove(&id);
                    out.finished_recving.insert(id);
                    out.failed_recving.insert(id, reason);
                    out.stats.failures += 1;
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
        let now = Instant::now();
        for (sender, bytes) in notifs {
            match PullNotif::decode(&bytes) {
                Some(PullNotif::Done(rid)) => match self.leases.remove(rid) {
                    Some(lease) => {
                        self.lease_table.end(rid);
                        tracing::debug!(request = lease.request_id, consumer = %sender,
                            "KV blocks read; freeing");
                        out.finished_sending.insert(lease.request_id);
                    }
                    None => {
                        tracing::debug!(remote_request_id = rid, consumer = %sender,
                            "done for an unknown lease (kept in case its lease is coming)");
                        if self.early_done.len() >= MAX_EARLY_DONE {
                            self.prune_early_done(now, true);
                        }
                        self.early_done.insert(rid.to_string(), now);
                    }
                },
                Some(PullNotif::Renew(rid)) => match self.leases.get_mut(rid) {
                    Some(lease) => {
                        lease.deadline = lease.deadline.max(now + self.config.kv_lease_duration)
                    }
                    None => tracing::debug!(remote_request_id = rid, consumer = %sender,
                        "renewal for an unknown lease ignored"),
                },
                None => tracing::debug!(consumer = %sender, len = bytes.len(),
                    "notification of another protocol ignored"),
            }
        }
    }

    fn expire_leases(&mut self, out: &mut ConnectorOutput) {
        let now = Instant::now();
        let lease = self.config.kv_lease_duration;
        let table = &self.lease_table;
        self.leases.retain(|rid, l| {
            if l.deadline > now {
                return true;
            }
            tracing::warn!(request = l.request_id, remote_request_id = %rid,
                lease = ?lease, "KV lease expired before the consumer read the blocks; freeing");
            table.end(rid);
            out.finished_sending.insert(l.request_id);
            out.stats.expired_leases += 1;
            false
        });
        self.prune_early_done(now, false);
    }

    /// Leases the proxy gave back (`POST /v1/kv/release`) end like a `done`.
    fn drain_releases(&mut self, out: &mut ConnectorOutput) {
        let now = Instant::now();
        for rid in self.lease_table.take_released() {
            match self.leases.remove(&rid) {
                Some(lease) => {
                    tracing::debug!(request = lease.request_id, "KV lease released; freeing");
                    self.lease_table.end(&rid);
                    out.finished_sending.insert(lease.request_id);
                }
                None => {
                    self.early_done.insert(rid, now);
                }
            }
        }
    }

    /// Drops early `done`s older than a lease (all but the newest half when `full`).
    fn prune_early_done(&mut self, now: Instant, full: bool) {
        let max_age = self.config.kv_lease_duration;
        self.early_done
            .retain(|_, at| now.saturating_duration_since(*at) < max_age);
        if full && self.early_done.len() >= MAX_EARLY_DONE {
            let mut ages: Vec<Instant> = self.early_done.values().copied().collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            self.early_done.retain(|_, at| *at > cut);
        }
    }
}

impl KvConnectorWorker for NixlPullWorker {
    fn register_kv_caches(&mut self, storage: Arc<KvStorage>) -> Result<(), KvConnectorError> {
        self.register_rank_kv_caches(vec![RankKvCaches::whole(storage)])
    }

    /// One agent over every worker's caches; a source-corruption fault corrupts the first
    /// worker's copy only.
    fn register_rank_kv_caches(
        &mut self,
        ranks: Vec<RankKvCaches>,
    ) -> Result<(), KvConnectorError> {
        let Some(storage) = ranks.first().map(|r| r.storage.clone()) else {
            return Err(KvConnectorError::InvalidConfig(
                "no KV caches to register".into(),
            ));
        };
        if self.agent.is_some() {
            return Err(KvConnectorError::InvalidConfig(
                "KV caches are already registered with this connector".into(),
            ));
        }
        if let Some(f) = self.config.transport_fault {
            let applies = match f.kind {
                TransportFaultKind::CorruptSource | TransportFaultKind::SlowRead => true,
                TransportFaultKind::WrongBlock => self.config.role.is_consumer(),
                TransportFaultKind::DropChecksums | TransportFaultKind::GarbleNotif => false,
            };
            if !applies {
                return Err(KvConnectorError::InvalidConfig(format!(
                    "transport_fault_injection {} does not apply to a pull {} (wrong_block is \
                     a pull consumer's; drop_checksums and garble_notif are push faults)",
                    f.kind.as_str(),
                    self.config.role.as_str()
                )));
            }
            tracing::warn!(
                kind = f.kind.as_str(),
                probability = f.probability,
                "transport fault injection is on (testing only): KV transfers will be broken \
                 on purpose; unset kv_connector_extra_config.transport_fault_injection for real \
                 traffic"
            );
            if f.kind == TransportFaultKind::CorruptSource {
                self.lease_table.arm_source_fault(storage.clone(), f);
            }
        }
        let (agent, loader) = self.config.start(
            ranks,
            &self.handshake,
            self.config.role.is_consumer().then_some(
                self.config
                    .transport_fault
                    .filter(|f| f.kind != TransportFaultKind::CorruptSource),
            ),
            !self.config.role.is_producer(),
            &self.waker,
        )?;
        self.loader = loader;
        self.agent = Some(agent);
        Ok(())
    }

    fn start_load_kv(&mut self, metadata: &ConnectorMetadata) -> Result<(), KvConnectorError> {
        let Some(meta) = metadata.payload::<PullMetadata>()? else {
            return Ok(());
        };
        for spec in &meta.loads {
            self.submit(spec);
        }
        for &id in &meta.cancelled_loads {
            match self.jobs.get(&id) {
                Some(flag) => {
                    flag.store(true, Ordering::Release);
                    self.cancelled.insert(id);
                }
                None => {
                    // Never handed off (or already reported failed): nothing writes into it.
                    self.pending.finished_recving.remove(&id);
                    self.pending.failed_recving.remove(&id);
                    self.pending.finished_sending.insert(id);
                }
            }
        }
        for l in &meta.leases {
            self.add_lease(l.request_id, &l.remote_request_id, l.deadline);
        }
        Ok(())
    }

    fn set_waker(&mut self, waker: Waker) {
        let _ = self.waker.set(waker);
    }

    fn get_finished(&mut self) -> ConnectorOutput {
        let mut out = std::mem::take(&mut self.pending);
        self.drain_loads(&mut out);
        if self.config.role.is_producer() {
            self.drain_notifs(&mut out);
            self.drain_releases(&mut out);
            self.expire_leases(&mut out);
        }
        out
    }
}
