//! [`ChecksumWorker`]: the checksum side of one worker (one TP rank of one PP stage).
//!
//! Per step, around the connector and the forward:
//! 1. [`ChecksumWorker::begin_step`], before the connector starts loads: forget ended requests,
//!    keep the loads announced this step (so a load that finishes at once is still known);
//! 2. [`ChecksumWorker::start_sends`], after the forward wrote the KV: hand the step's sends to
//!    the side thread; the step never waits for it;
//! 3. [`ChecksumWorker::end_step`], after the connector reported finished transfers: checksum the
//!    blocks the connector reported landed for loads still in flight (a READ split into chunks:
//!    each chunk is checksummed while the next one moves), then inject the configured fault into
//!    each load reported finished (not failed) and checksum what is left of it synchronously,
//!    before any later forward can write its blocks, and collect the side thread's records.
//!
//! The checksums run on the CPU over host storage, or on the backend the worker was given
//! ([`ChecksumWorker::set_backend`]: a GPU's kernel over its device cache), with the same jobs.
//!
//! Invariants: every send job is answered by exactly one record, even if its computation
//! panicked or the thread died (a record whose groups failed, which the scheduler treats as
//! unverified); the side thread only reads blocks the scheduler holds for it; a load's job is
//! dropped when its load failed or its request ended; a landed block is checksummed once, and
//! only blocks the connector reported landed are read before the load finished. A load with an
//! injected fault is checksummed whole once it finished (the fault picks its blocks then).

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use tandem_kv_cache::{KvCacheConfig, KvCacheGroup, KvStorage};
use tandem_kv_checksum::{
    ChecksumBackend, ChecksumRequest, CpuBackend, GroupOutcome, GroupRecord, HeadPlacement,
    IncrementalChecksum, ReplicaKey, RequestRecord, Role, SharedBackend, WorkerChecksums, WorkerId,
};
use tandem_kv_connector::base::ConnectorOutput;
use tandem_parallel::{KvHeadSlice, RankId};

use super::fault;
use crate::metrics as m;
use crate::scheduler_output::{ChecksumJob, ChecksumRecord, ChecksumSide, ChecksumWork};

/// The checksum side of one worker. See the module docs.
pub struct ChecksumWorker {
    storage: Arc<KvStorage>,
    /// Computes the checksums: the CPU over `storage`, unless a device backend was given.
    backend: Backend,
    setup: Arc<WorkerChecksums>,
    /// Loads announced by the scheduler, until the connector reports them.
    loads: HashMap<u64, PendingLoad>,
    /// Started with the first send.
    side: Option<SideThread>,
    /// Whether the skipped groups were logged.
    announced: bool,
}

impl std::fmt::Debug for ChecksumWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChecksumWorker")
            .field("worker", &self.setup.worker())
            .field("pending_loads", &self.loads.len())
            .finish()
    }
}

impl ChecksumWorker {
    /// A worker over `storage` with its checksum setup (which layers, which global heads).
    pub fn new(setup: WorkerChecksums, storage: Arc<KvStorage>) -> Self {
        ChecksumWorker {
            backend: Backend::Cpu(storage.clone()),
            storage,
            setup: Arc::new(setup),
            loads: HashMap::new(),
            side: None,
            announced: false,
        }
    }

    /// Computes the checksums with `backend` (a device kernel over the memory `storage`
    /// describes) instead of the CPU.
    pub fn set_backend(&mut self, backend: SharedBackend) {
        self.backend = Backend::Shared(backend);
    }

    /// Logs, once and only when checksums are in use, the groups this worker cannot checksum.
    fn announce(&mut self) {
        if std::mem::replace(&mut self.announced, true) {
            return;
        }
        for (group, reason) in self.setup.skipped_groups() {
            tracing::warn!(
                worker = ?self.setup.worker(),
                group,
                reason = reason.as_str(),
                "KV cache group cannot be checksummed on this worker ({reason:?}): it is left \
                 out when both sides skip it, unverified otherwise"
            );
        }
    }

    /// The only worker of an instance (TP 1, PP 1): every layer and head of `groups`.
    pub fn single(storage: Arc<KvStorage>, groups: &[KvCacheGroup]) -> Self {
        let config = KvCacheConfig {
            num_blocks: 0,
            groups: groups.to_vec(),
        };
        let setup = WorkerChecksums::single(&storage, &config);
        Self::new(setup, storage)
    }

    /// One rank of a TP x PP group: the layers of `storage` (its stage's) and the model KV heads
    /// `heads` says it holds, of the model's `global_kv_heads`.
    pub fn for_rank(
        storage: Arc<KvStorage>,
        groups: &[KvCacheGroup],
        rank: RankId,
        heads: KvHeadSlice,
        global_kv_heads: usize,
    ) -> Self {
        let config = KvCacheConfig {
            num_blocks: 0,
            groups: groups.to_vec(),
        };
        let placement = HeadPlacement {
            head_offset: heads.first as u32,
            global_kv_heads: global_kv_heads as u32,
            replica: ReplicaKey {
                replicas: heads.replicas as u32,
                index: heads.replica_index as u32,
            },
        };
        let worker = WorkerId {
            tp_rank: rank.tp_rank as u32,
            pp_rank: rank.pp_rank as u32,
        };
        let setup = WorkerChecksums::from_storage(worker, &storage, &config, |_| placement);
        Self::new(setup, storage)
    }

    pub fn worker(&self) -> WorkerId {
        self.setup.worker()
    }

    /// Loads announced and not reported yet.
    pub fn num_pending_loads(&self) -> usize {
        self.loads.len()
    }

    /// Before the connector starts this step's loads: drops the loads of ended requests and
    /// keeps this step's.
    pub fn begin_step(&mut self, work: &ChecksumWork, finished_request_ids: &[u64]) {
        for id in finished_request_ids {
            self.loads.remove(id);
        }
        if !work.is_empty() {
            self.announce();
        }
        for job in &work.recvs {
            self.loads.insert(
                job.request_id,
                PendingLoad {
                    job: job.clone(),
                    landed: None,
                },
            );
        }
    }

    /// After the forward wrote the step's KV: queues this step's sends on the side thread.
    pub fn start_sends(&mut self, work: &ChecksumWork) {
        if work.sends.is_empty() {
            return;
        }
        let side = self
            .side
            .get_or_insert_with(|| SideThread::spawn(self.backend.clone(), self.setup.clone()));
        side.submit(work.sends.clone());
    }

    /// After the connector reported the step's finished transfers: checksums the loads it
    /// reports finished (faults injected first) and returns them with every send record the
    /// side thread has finished.
    pub fn end_step(&mut self, connector: &ConnectorOutput) -> Vec<ChecksumRecord> {
        let mut out = Vec::new();
        let started = Instant::now();
        let landed = self.checksum_landed(connector);
        let mut ids: Vec<u64> = connector
            .finished_recving
            .iter()
            .copied()
            .filter(|id| self.loads.contains_key(id))
            .collect();
        ids.sort_unstable();
        for id in &ids {
            let Some(PendingLoad { job, landed }) = self.loads.remove(id) else {
                continue;
            };
            if connector.failed_recving.contains_key(id) {
                continue; // a failed load is not compared
            }
            let finishing = Instant::now();
            if let Some(f) = fault_on(&job, self.setup.worker().tp_rank) {
                // SAFETY: the connector reported the load finished, and the request runs again
                // only after the scheduler's verdict: nothing else touches its blocks now.
                if let Some(what) = unsafe { fault::inject(&self.storage, &job.blocks, f) } {
                    tracing::warn!(
                        request = id,
                        worker = ?self.setup.worker(),
                        fault = f.kind.as_str(),
                        "KV fault injection: {what}"
                    );
                }
            }
            let record = self.backend.with(|b| match landed {
                Some(partial) => partial.finish(b),
                None => self.setup.checksum(b, Role::Consumer, &job.blocks),
            });
            metrics::histogram!(m::KV_CHECKSUM_LOAD_WAIT_SECONDS)
                .record(finishing.elapsed().as_secs_f64());
            out.push(ChecksumRecord {
                request_id: job.request_id,
                generation: job.generation,
                side: ChecksumSide::Recv,
                record,
            });
        }
        if !out.is_empty() || landed > 0 {
            metrics::histogram!(m::KV_CHECKSUM_COMPUTE_SECONDS)
                .record(started.elapsed().as_secs_f64());
        }
        if let Some(side) = &mut self.side {
            side.collect(&self.setup, &mut out);
        }
        out
    }

    /// Checksums the blocks the connector reported landed for announced loads still in flight
    /// (no injected fault). Returns how many block positions it computed.
    fn checksum_landed(&mut self, connector: &ConnectorOutput) -> usize {
        let mut computed = 0;
        for (id, lists) in &connector.landed_recving {
            // A load that ended in this output is finished whole below (and measured there).
            if connector.finished_recving.contains(id) {
                continue;
            }
            // Per group, or one list every group shares.
            let landed: Vec<HashSet<usize>> = lists
                .iter()
                .map(|l| l.iter().map(|&b| b as usize).collect())
                .collect();
            let ready = |group: usize, block: usize| {
                let list = if landed.len() == 1 {
                    landed.first()
                } else {
                    landed.get(group)
                };
                list.is_some_and(|l| l.contains(&block))
            };
            let (setup, backend) = (&self.setup, &self.backend);
            let Some(load) = self.loads.get_mut(id) else {
                continue;
            };
            if fault_on(&load.job, setup.worker().tp_rank).is_some() {
                continue;
            }
            let partial = load.landed.get_or_insert_with(|| {
                IncrementalChecksum::new(setup, Role::Consumer, &load.job.blocks)
            });
            computed += backend.with(|b| partial.add_ready(b, ready));
        }
        computed
    }

    /// Waits for every queued send and returns the records not collected yet (shutdown, tests).
    pub fn finish_sends(&mut self) -> Vec<ChecksumRecord> {
        let mut out = Vec::new();
        if let Some(mut side) = self.side.take() {
            side.jobs = None;
            if let Some(h) = side.handle.take() {
                let _ = h.join();
            }
            side.collect(&self.setup, &mut out);
        }
        out
    }
}

/// The fault injected into `job`'s load on TP rank `tp_rank`, if any.
fn fault_on(job: &ChecksumJob, tp_rank: u32) -> Option<super::config::BlockFault> {
    job.fault.filter(|f| f.tp_rank.is_none_or(|r| r == tp_rank))
}

/// A load announced by the scheduler and not reported finished yet.
struct PendingLoad {
    job: ChecksumJob,
    /// Its checksums so far, once part of it landed.
    landed: Option<IncrementalChecksum>,
}

/// What computes a worker's checksums.
#[derive(Clone)]
enum Backend {
    /// The CPU, over host storage.
    Cpu(Arc<KvStorage>),
    /// A backend the worker was given (a device kernel).
    Shared(SharedBackend),
}

impl Backend {
    fn with<R>(&self, f: impl FnOnce(&dyn ChecksumBackend) -> R) -> R {
        match self {
            Backend::Cpu(storage) => f(&CpuBackend::new(storage.as_ref())),
            Backend::Shared(b) => f(b.as_ref()),
        }
    }
}

/// A record whose every group failed: the scheduler treats it as unverified.
fn failed_record(setup: &WorkerChecksums, request: &ChecksumRequest, why: &str) -> RequestRecord {
    RequestRecord {
        worker: setup.worker(),
        groups: request
            .groups
            .iter()
            .map(|g| GroupRecord {
                group_id: g.group_id,
                fingerprint: setup.fingerprint(g.group_id),
                outcome: GroupOutcome::Failed(why.to_string()),
            })
            .collect(),
    }
}

/// The thread that checksums sends off the step.
struct SideThread {
    jobs: Option<Sender<Vec<ChecksumJob>>>,
    records: Receiver<ChecksumRecord>,
    handle: Option<JoinHandle<()>>,
    /// Jobs submitted and not answered yet, by (request, generation).
    outstanding: HashMap<(u64, u64), ChecksumRequest>,
}

impl SideThread {
    fn spawn(backend: Backend, setup: Arc<WorkerChecksums>) -> SideThread {
        let (jobs_tx, jobs_rx) = mpsc::channel::<Vec<ChecksumJob>>();
        let (rec_tx, rec_rx) = mpsc::channel();
        let worker = setup.worker();
        let handle = std::thread::Builder::new()
            .name(format!(
                "tandem-kv-checksum-{}-{}",
                worker.tp_rank, worker.pp_rank
            ))
            .spawn(move || run_sends(backend, setup, jobs_rx, rec_tx))
            .map_err(|e| tracing::error!("cannot start the KV checksum thread: {e}"))
            .ok();
        SideThread {
            jobs: handle.is_some().then_some(jobs_tx),
            records: rec_rx,
            handle,
            outstanding: HashMap::new(),
        }
    }

    fn submit(&mut self, jobs: Vec<ChecksumJob>) {
        for j in &jobs {
            self.outstanding
                .insert((j.request_id, j.generation), j.blocks.clone());
        }
        if self.jobs.as_ref().is_none_or(|tx| tx.send(jobs).is_err()) {
            // No thread: collect() answers the outstanding jobs as failed.
            self.jobs = None;
        }
    }

    fn collect(&mut self, setup: &WorkerChecksums, out: &mut Vec<ChecksumRecord>) {
        loop {
            match self.records.try_recv() {
                Ok(r) => {
                    self.outstanding.remove(&(r.request_id, r.generation));
                    out.push(r);
                }
                Err(TryRecvError::Empty) if self.jobs.is_some() => return,
                Err(_) => {
                    // The thread is gone: every unanswered job fails (the scheduler sends no
                    // checksums for it and releases its blocks).
                    for ((request_id, generation), request) in self.outstanding.drain() {
                        tracing::error!(
                            request = request_id,
                            "the KV checksum thread stopped before checksumming this request"
                        );
                        out.push(ChecksumRecord {
                            request_id,
                            generation,
                            side: ChecksumSide::Send,
                            record: failed_record(setup, &request, "the checksum thread stopped"),
                        });
                    }
                    return;
                }
            }
        }
    }
}

impl Drop for SideThread {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn run_sends(
    backend: Backend,
    setup: Arc<WorkerChecksums>,
    jobs: Receiver<Vec<ChecksumJob>>,
    records: Sender<ChecksumRecord>,
) {
    while let Ok(batch) = jobs.recv() {
        let started = Instant::now();
        for job in batch {
            let record = std::panic::catch_unwind(AssertUnwindSafe(|| {
                backend.with(|b| setup.checksum(b, Role::Producer, &job.blocks))
            }))
            .unwrap_or_else(|_| {
                failed_record(&setup, &job.blocks, "checksum computation panicked")
            });
            let r = ChecksumRecord {
                request_id: job.request_id,
                generation: job.generation,
                side: ChecksumSide::Send,
                record,
            };
            if records.send(r).is_err() {
                return;
            }
        }
        metrics::histogram!(m::KV_CHECKSUM_COMPUTE_SECONDS).record(started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_cache::{CacheDtype, KvCacheSpec, KvPart};
    use tandem_kv_checksum::GroupBlocks;

    fn setup() -> (Arc<KvStorage>, Vec<KvCacheGroup>) {
        setup_groups(&[(0, 3)])
    }

    /// One full-attention group per `(first, end)` range of layers, each with its own blocks.
    fn setup_groups(layers: &[(usize, usize)]) -> (Arc<KvStorage>, Vec<KvCacheGroup>) {
        let groups: Vec<KvCacheGroup> = layers
            .iter()
            .enumerate()
            .map(|(g, &(first, end))| KvCacheGroup {
                group_id: g,
                spec: KvCacheSpec::FullAttention {
                    block_size: 4,
                    num_kv_heads: 2,
                    head_dim: 8,
                    dtype: CacheDtype::Bf16,
                },
                layer_names: (first..end)
                    .map(|l| format!("model.layers.{l}.self_attn"))
                    .collect(),
            })
            .collect();
        let config = KvCacheConfig {
            num_blocks: 10,
            groups: groups.clone(),
        };
        let storage = Arc::new(KvStorage::new(&config).unwrap());
        for l in 0..3 {
            for part in [KvPart::K, KvPart::V] {
                for b in 0..10 {
                    // SAFETY: nothing else uses the storage yet.
                    let bytes = unsafe { storage.block_bytes_mut(l, part, b).unwrap() };
                    for (i, x) in bytes.iter_mut().enumerate() {
                        *x = (i * 31 + b * 7 + l * 3) as u8;
                    }
                }
            }
        }
        (storage, groups)
    }

    /// A load of `blocks` in every group (each group's table holds the same ids).
    fn load(groups: &[KvCacheGroup], blocks: &[u32]) -> ChecksumJob {
        let table: Vec<Option<usize>> = blocks.iter().map(|&b| Some(b as usize)).collect();
        let tables: Vec<GroupBlocks<'_>> = groups
            .iter()
            .map(|g| GroupBlocks {
                group_id: g.group_id,
                spec: &g.spec,
                first_position: 0,
                blocks: &table,
            })
            .collect();
        ChecksumJob {
            request_id: 1,
            generation: 0,
            blocks: ChecksumRequest::for_load(0, 4 * blocks.len() - 1, &tables),
            fault: None,
        }
    }

    fn flip_layer(storage: &KvStorage, layer: usize, block: usize) {
        // SAFETY: the test owns the storage; no checksum runs during the call.
        unsafe { storage.block_bytes_mut(layer, KvPart::V, block).unwrap()[5] ^= 0x40 };
    }

    fn flip(storage: &KvStorage, block: usize) {
        flip_layer(storage, 1, block);
    }

    #[test]
    fn landed_blocks_are_checksummed_when_reported_and_the_rest_when_the_load_ends() {
        let (storage, groups) = setup();
        let job = load(&groups, &[3, 5, 7]);
        let whole = |s: &KvStorage| {
            let config = KvCacheConfig {
                num_blocks: 0,
                groups: groups.clone(),
            };
            WorkerChecksums::single(s, &config).checksum(
                &CpuBackend::new(s),
                Role::Consumer,
                &job.blocks,
            )
        };
        let landed_time = whole(&storage);
        let mut w = ChecksumWorker::single(storage.clone(), &groups);
        let work = ChecksumWork {
            sends: Vec::new(),
            recvs: vec![job.clone()],
        };
        w.begin_step(&work, &[]);
        let mut out = ConnectorOutput::default();
        out.landed_recving.insert(1, vec![vec![3, 5, 9]]);
        assert!(
            w.end_step(&out).is_empty(),
            "no record before the load ends"
        );
        // Block 5 changes after it was reported landed (a landed block never changes in real
        // use): its value is the one taken at landing, so the record is the landing-time
        // checksum. Block 7 was not reported landed: it is read when the load ends.
        flip(&storage, 5);
        let mut out = ConnectorOutput::default();
        out.finished_recving.insert(1);
        let records = w.end_step(&out);
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].record, landed_time);
        assert_eq!(w.num_pending_loads(), 0);

        // Not reported landed: everything is read at the end, changes included.
        flip(&storage, 5);
        let mut w = ChecksumWorker::single(storage.clone(), &groups);
        w.begin_step(&work, &[]);
        flip(&storage, 7);
        let records = w.end_step(&out);
        assert_eq!(records[0].record, whole(&storage));
        assert_ne!(records[0].record, landed_time);
    }

    #[test]
    fn landed_blocks_count_only_in_their_own_group() {
        // Two groups with their own pools: block 5 of group 0 and block 5 of group 1 are
        // different memory, and a chunk that landed group 0's says nothing of group 1's.
        let (storage, groups) = setup_groups(&[(0, 2), (2, 3)]);
        let job = load(&groups, &[3, 5]);
        let config = KvCacheConfig {
            num_blocks: 0,
            groups: groups.clone(),
        };
        let whole = |s: &KvStorage| {
            WorkerChecksums::single(s, &config).checksum(
                &CpuBackend::new(s),
                Role::Consumer,
                &job.blocks,
            )
        };
        let mut w = ChecksumWorker::single(storage.clone(), &groups);
        w.begin_step(
            &ChecksumWork {
                sends: Vec::new(),
                recvs: vec![job.clone()],
            },
            &[],
        );
        let mut out = ConnectorOutput::default();
        out.landed_recving.insert(1, vec![vec![3, 5], vec![]]);
        assert!(w.end_step(&out).is_empty());
        // Group 1's block 5 is still being written when group 0's landed.
        flip_layer(&storage, 2, 5);
        let mut out = ConnectorOutput::default();
        out.finished_recving.insert(1);
        let records = w.end_step(&out);
        assert_eq!(records[0].record, whole(&storage));
    }

    #[test]
    fn a_load_that_fails_or_ends_drops_what_landed() {
        let (storage, groups) = setup();
        let job = load(&groups, &[2, 4]);
        let work = ChecksumWork {
            sends: Vec::new(),
            recvs: vec![job],
        };
        let mut w = ChecksumWorker::single(storage.clone(), &groups);
        w.begin_step(&work, &[]);
        let mut out = ConnectorOutput::default();
        out.landed_recving.insert(1, vec![vec![2]]);
        w.end_step(&out);
        let mut out = ConnectorOutput::default();
        out.finished_recving.insert(1);
        out.failed_recving.insert(1, "peer gone".into());
        assert!(w.end_step(&out).is_empty(), "a failed load is not compared");
        assert_eq!(w.num_pending_loads(), 0);

        w.begin_step(&work, &[]);
        let mut out = ConnectorOutput::default();
        out.landed_recving.insert(1, vec![vec![2, 4]]);
        w.end_step(&out);
        w.begin_step(&ChecksumWork::default(), &[1]);
        assert_eq!(
            w.num_pending_loads(),
            0,
            "an ended request's load is dropped"
        );
    }
}
