//! The consumer's transfer thread: handshakes with producers, READs, and their outcomes, off
//! the engine thread.
//!
//! Per load: find the producer's peer (cached by [`PeerAddr`]; otherwise fetch
//! `GET http://{host}:{port}/v1/kv/handshake` on a short-lived thread with `handshake_timeout`,
//! signed with the deployment secret when there is one, check that its engine id is the one the
//! params name, and `add_peer`, which checks compatibility), claim the lease
//! (`POST http://{host}:{port}/v1/kv/claim` with the params, on a short-lived thread: the
//! producer refuses blocks it did not lease for these params, or leased to someone else), send a
//! renew notification, post ONE READ of the request's blocks with the done notification
//! attached, and poll it until it completes, fails, or `load_timeout` passes.
//!
//! A READ larger than `read_chunk_bytes` (of whole local blocks: the producer's block size is
//! ours) is split into chunks of consecutive pairs, posted `read_chunks_in_flight` at a time; each
//! chunk that completes is reported as `Landed` with its local blocks (the consumer checksums
//! them while the next chunk moves), and the done notification goes out, by itself, once the
//! last chunk completed. One claim and one lease cover all chunks.
//!
//! Invariants:
//! - The consumer reads only from peers whose handshake it fetched and accepted itself, and
//!   only blocks whose lease the producer granted it by a claim.
//! - Every READ job yields exactly one `Loaded`, `Failed` or `Cancelled` result, whatever
//!   happens (a split READ's `Landed` reports come before it and are not results: a landed block
//!   holds its final bytes, and nothing of this load writes it again), and a READ's transfers
//!   are dropped (cancelled) before its failure or cancellation is reported, so nothing writes
//!   into the blocks once the scheduler may reuse them. A release job (or a READ cancelled
//!   before it started, which becomes one) also yields `Released` once the producer was told,
//!   or could not be.
//! - After a READ that failed in flight, timed out or was cancelled, the producer is told `done`
//!   (best effort) so it frees before its lease expires (not after a READ refused before its
//!   post: block ids the producer does not have mean params that are not its own); a peer whose transfer failed is forgotten, and the next load
//!   from that address fetches a fresh handshake.
//! - The thread never blocks on one producer for longer than a poll: handshakes run on their own
//!   threads, READs are polled together.

use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::fault::{wrong_block, SplitMix, TransportFault, TransportFaultKind};
use super::protocol::{LoadKind, PeerAddr, PullNotif};
use crate::auth::TransferAuth;
use crate::base::WakerSlot;
use crate::config::{
    DEFAULT_DEVICE_READ_CHUNK_BYTES, DEFAULT_HOST_READ_CHUNK_BYTES, MAX_READ_CHUNKS,
};
use crate::error::KvConnectorError;
use crate::nixl::{BlockPairs, Side};
use crate::nixl::{NixlAgent, NixlHandshake, TransferHandle, TransferStats, TransferStatus};

/// Largest handshake body accepted (a few KB per layer; anything near this is hostile).
const MAX_HANDSHAKE_BYTES: u64 = 16 << 20;
/// NIXL calls (5 ms apart) on shutdown before the agent may be destroyed.
const SHUTDOWN_PROGRESS_ROUNDS: u32 = 20;
/// How long the idle thread waits for a message before checking again (and, without a
/// progress thread, calling NIXL).
const IDLE_WAIT: Duration = Duration::from_millis(10);

/// Timeouts of the loader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderConfig {
    pub load_timeout: Duration,
    pub handshake_timeout: Duration,
    /// Renew notifications go out every half of this while a READ is in flight.
    pub kv_lease_duration: Duration,
    /// READs of more bytes are split into chunks of about this size (0: never split; `None`:
    /// the default of the local memory's kind).
    pub read_chunk_bytes: Option<u64>,
    /// Chunks of a split READ posted at once (1..=[`MAX_READ_CHUNKS`]; with 2, one moves while
    /// the last one landed is checksummed).
    pub read_chunks_in_flight: usize,
    /// Call NIXL from the thread while idle too (every 10 ms), draining notifications:
    /// for an agent without progress thread that nobody else drains (a pure consumer), so that
    /// UCX answers its peers' connection traffic between loads.
    pub progress_when_idle: bool,
}

/// One job for the thread.
#[derive(Debug)]
pub(crate) struct LoadJob {
    pub request_id: u64,
    pub kind: LoadKind,
    pub peer: PeerAddr,
    pub remote_request_id: String,
    /// The blocks it moves, per KV cache group (or one list all groups share).
    pub ids: BlockPairs,
    /// A READ: the producer's block size `ids` are in (see `LoadSpec::remote_block_size`).
    pub remote_block_size: Option<usize>,
    /// The `POST /v1/kv/claim` body of a READ.
    pub claim_body: Option<String>,
    pub cancel: Arc<AtomicBool>,
}

impl LoadJob {
    /// A READ whose request ended (release jobs are never cancelled).
    fn cancelled(&self) -> bool {
        self.kind == LoadKind::Read && self.cancel.load(Ordering::Acquire)
    }
}

/// How a job ended.
#[derive(Debug)]
pub(crate) enum LoadOutcome {
    /// Part of a split READ completed: these local blocks (a list per KV cache group, or one
    /// all groups share) hold their final bytes. Not an end: the job still ends with one of the
    /// outcomes below.
    Landed(Vec<Vec<usize>>),
    Loaded(TransferStats),
    Failed(String),
    /// The job's cancel flag was seen; nothing writes into its blocks any more.
    Cancelled,
    /// A release (or notify) job ended (`Ok`: the peer was told).
    Released(Result<(), String>),
    /// A registration job ended: accepted, or why not.
    Registered(Result<(), PostError>),
}

/// Why a POST to a peer (a claim or a registration) did not succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PostError {
    pub reason: String,
    /// The peer may have received and acted on it (a timeout or a broken answer); false when it
    /// certainly did not (no connection, or it answered a refusal).
    pub maybe_delivered: bool,
}

impl PostError {
    fn undelivered(reason: String) -> Self {
        PostError {
            reason,
            maybe_delivered: false,
        }
    }
}

#[derive(Debug)]
pub(crate) struct LoadResult {
    pub request_id: u64,
    pub outcome: LoadOutcome,
}

enum Msg {
    Job(Box<LoadJob>),
    Handshake(Box<(PeerAddr, Result<NixlHandshake, String>)>),
    /// A claim or registration ended: the job, its peer's NIXL name, and the peer's answer.
    Claimed(Box<(LoadJob, String, Result<(), PostError>)>),
    Shutdown,
}

/// The worker's end of the transfer thread.
pub(crate) struct Loader {
    tx: Sender<Msg>,
    results: Receiver<LoadResult>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Loader {
    /// Starts the transfer thread; it calls the waker in `waker` (once one is set) after every
    /// result it reports.
    pub fn spawn(
        agent: Arc<NixlAgent>,
        config: LoaderConfig,
        auth: Option<TransferAuth>,
        fault: Option<TransportFault>,
        waker: WakerSlot,
    ) -> Result<Self, KvConnectorError> {
        let (tx, rx) = mpsc::channel();
        let (res_tx, results) = mpsc::channel();
        let state = LoaderThread {
            waker,
            agent,
            config,
            tx: tx.clone(),
            rx,
            results: res_tx,
            peers: HashMap::new(),
            handshaking: HashMap::new(),
            in_flight: Vec::new(),
            claiming: 0,
            client: None,
            auth,
            fault: fault.map(|f| (f, SplitMix::new(f.seed))),
            delayed: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name("tandem-kv-loader".into())
            .spawn(move || state.run())
            .map_err(|e| KvConnectorError::Nixl {
                op: "transfer thread start",
                reason: e.to_string(),
            })?;
        Ok(Loader {
            tx,
            results,
            thread: Some(thread),
        })
    }

    /// Hands a job to the thread; false if the thread is gone.
    pub fn submit(&self, job: LoadJob) -> bool {
        self.tx.send(Msg::Job(Box::new(job))).is_ok()
    }

    /// Results so far, without blocking.
    pub fn drain(&self) -> Vec<LoadResult> {
        self.results.try_iter().collect()
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct InFlight {
    job: LoadJob,
    peer_name: String,
    transfers: Transfers,
    /// What the completed parts moved.
    moved: Option<TransferStats>,
    /// When the job's first transfer was created: its duration and deadline start here.
    posted: Instant,
    /// Where the time between `posted` and the last landing went (the `KV load done` debug
    /// line): the first transfer's post began here (a READ's renew notification before it)...
    post_start: Instant,
    /// ...its first part completed this long after `posted`...
    first_landing: Option<Duration>,
    /// ...and this many parts completed.
    parts: u32,
    last_renew: Instant,
    polls: u32,
}

/// A job's transfers: its one transfer, or a split READ's chunks.
struct Transfers {
    /// Posted and not completed, each with the local blocks it lands (reported as they land
    /// when the READ is split).
    posted: VecDeque<(TransferHandle, Vec<Vec<usize>>)>,
    /// A split READ's chunks not posted yet.
    waiting: VecDeque<BlockPairs>,
    /// A split READ's done notification, sent once its last chunk completed.
    done_notif: Option<Vec<u8>>,
}

impl Transfers {
    fn one(handle: TransferHandle) -> Self {
        Transfers {
            posted: VecDeque::from([(handle, Vec::new())]),
            waiting: VecDeque::new(),
            done_notif: None,
        }
    }

    fn split(&self) -> bool {
        self.done_notif.is_some()
    }
}

impl InFlight {
    /// Adds a completed part's stats; the duration is the job's, post to now.
    fn add_moved(&mut self, part: TransferStats) {
        let total = self.moved.get_or_insert(TransferStats {
            bytes: 0,
            blocks: 0,
            descriptors: 0,
            post_duration: Duration::ZERO,
            ..part
        });
        total.bytes += part.bytes;
        total.blocks += part.blocks;
        total.descriptors += part.descriptors;
        total.post_duration += part.post_duration;
        total.duration = self.posted.elapsed();
        self.first_landing.get_or_insert(total.duration);
        self.parts += 1;
    }
}

struct LoaderThread {
    agent: Arc<NixlAgent>,
    config: LoaderConfig,
    /// Cloned into handshake threads.
    tx: Sender<Msg>,
    rx: Receiver<Msg>,
    results: Sender<LoadResult>,
    /// Accepted producers: address → NIXL peer name.
    peers: HashMap<PeerAddr, String>,
    /// Jobs waiting for a handshake in progress.
    handshaking: HashMap<PeerAddr, Vec<LoadJob>>,
    in_flight: Vec<InFlight>,
    /// Claims in progress (their jobs come back in `Msg::Claimed`).
    claiming: usize,
    client: Option<reqwest::blocking::Client>,
    auth: Option<TransferAuth>,
    /// Testing only: `wrong_block` or `slow_read` (see `pull::fault`).
    fault: Option<(TransportFault, SplitMix)>,
    /// `slow_read`: granted jobs and when to post their READ.
    delayed: Vec<(Instant, LoadJob, String)>,
    /// Told after every result (the engine wakes instead of waiting for its next poll).
    waker: WakerSlot,
}

impl LoaderThread {
    fn run(mut self) {
        loop {
            let msg = if self.in_flight.is_empty() {
                match self.rx.recv_timeout(IDLE_WAIT) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => {
                        self.progress();
                        None
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            } else {
                self.rx.try_recv().ok()
            };
            let mut msgs: Vec<Msg> = msg.into_iter().collect();
            msgs.extend(self.rx.try_iter());
            for m in msgs {
                match m {
                    Msg::Job(job) => self.start(*job),
                    Msg::Handshake(done) => {
                        let (addr, hs) = *done;
                        self.handshake_done(addr, hs)
                    }
                    Msg::Claimed(done) => {
                        let (job, name, answer) = *done;
                        self.claimed(job, name, answer)
                    }
                    Msg::Shutdown => {
                        self.shutdown();
                        return;
                    }
                }
            }
            self.post_delayed();
            self.poll_in_flight();
            if !self.in_flight.is_empty() {
                let fresh = self.in_flight.iter().any(|f| f.polls < 64);
                if fresh {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
        self.shutdown();
    }

    /// Lets NIXL progress (see [`LoaderConfig::progress_when_idle`]).
    fn progress(&self) {
        if !self.config.progress_when_idle {
            return;
        }
        match self.agent.get_notifs() {
            Ok(notifs) => {
                for (sender, bytes) in notifs {
                    tracing::debug!(%sender, len = bytes.len(),
                        "notification to a pure consumer ignored");
                }
            }
            Err(e) => tracing::debug!(error = %e, "idle NIXL progress failed"),
        }
    }

    fn shutdown(&mut self) {
        for f in std::mem::take(&mut self.in_flight) {
            drop(f.transfers);
            self.report(
                f.job.request_id,
                LoadOutcome::Failed("the connector shut down".into()),
            );
        }
        for (_, job, _) in std::mem::take(&mut self.delayed) {
            self.report(
                job.request_id,
                LoadOutcome::Failed("the connector shut down".into()),
            );
        }
        // Claims in flight come back (their threads are bounded by the handshake timeout).
        let deadline = Instant::now() + self.config.handshake_timeout;
        while self.claiming > 0 && Instant::now() < deadline {
            match self.rx.recv_timeout(IDLE_WAIT) {
                Ok(Msg::Claimed(done)) => {
                    self.claiming -= 1;
                    self.report(
                        done.0.request_id,
                        LoadOutcome::Failed("the connector shut down".into()),
                    );
                }
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        for (_, jobs) in std::mem::take(&mut self.handshaking) {
            for job in jobs {
                self.report(
                    job.request_id,
                    LoadOutcome::Failed("the connector shut down".into()),
                );
            }
        }
        // Without a progress thread, UCX purges the operations of a failed endpoint only when
        // called; destroying the agent with them still queued aborts the process (UCX asserts
        // in its CMA endpoint's cleanup). Let it finish that work first.
        if self.config.progress_when_idle {
            for _ in 0..SHUTDOWN_PROGRESS_ROUNDS {
                self.progress();
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    fn report(&self, request_id: u64, outcome: LoadOutcome) {
        let _ = self.results.send(LoadResult {
            request_id,
            outcome,
        });
        if let Some(wake) = self.waker.get() {
            wake();
        }
    }

    fn fail(&self, job: &LoadJob, reason: String) {
        tracing::warn!(request = job.request_id, producer = %job.peer, "KV load failed: {reason}");
        let outcome = match job.kind {
            LoadKind::Release | LoadKind::Notify(_) => LoadOutcome::Released(Err(reason)),
            LoadKind::Register => LoadOutcome::Registered(Err(PostError::undelivered(reason))),
            _ => LoadOutcome::Failed(reason),
        };
        self.report(job.request_id, outcome);
    }

    fn start(&mut self, job: LoadJob) {
        if let LoadKind::Reject(reason) = &job.kind {
            let reason = reason.clone();
            self.fail(&job, reason);
            return;
        }
        let mut job = job;
        if job.cancelled() {
            // Nothing was posted: the blocks are free to go now; the producer is still told.
            self.report(job.request_id, LoadOutcome::Cancelled);
            job.kind = LoadKind::Release;
        }
        if let Some(name) = self.peers.get(&job.peer).cloned() {
            self.post(job, name);
            return;
        }
        if let Some(waiting) = self.handshaking.get_mut(&job.peer) {
            waiting.push(job);
            return;
        }
        let addr = job.peer.clone();
        let url = addr.handshake_url();
        let auth_header = self
            .auth
            .as_ref()
            .map(|a| a.sign_request("GET", super::HANDSHAKE_PATH));
        let client = match self.client() {
            Ok(c) => c,
            Err(reason) => {
                self.fail(&job, reason);
                return;
            }
        };
        let tx = self.tx.clone();
        let spawned = std::thread::Builder::new()
            .name("tandem-kv-handshake".into())
            .spawn({
                let addr = addr.clone();
                move || {
                    let hs = fetch_handshake(&client, &url, auth_header.as_deref());
                    let _ = tx.send(Msg::Handshake(Box::new((addr, hs))));
                }
            });
        match spawned {
            Ok(_) => {
                self.handshaking.insert(addr, vec![job]);
            }
            Err(e) => self.fail(&job, format!("cannot start a handshake thread: {e}")),
        }
    }

    fn client(&mut self) -> Result<reqwest::blocking::Client, String> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let c = reqwest::blocking::Client::builder()
            .timeout(self.config.handshake_timeout)
            .connect_timeout(self.config.handshake_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .build()
            .map_err(|e| format!("cannot create the handshake HTTP client: {e}"))?;
        self.client = Some(c.clone());
        Ok(c)
    }

    fn handshake_done(&mut self, addr: PeerAddr, hs: Result<NixlHandshake, String>) {
        let jobs = self.handshaking.remove(&addr).unwrap_or_default();
        let accepted = hs.and_then(|hs| {
            // An empty engine id (a push consumer not told which engine) accepts any.
            if !addr.engine_id.is_empty() && hs.engine_id != addr.engine_id {
                return Err(format!(
                    "engine id mismatch: the params name engine {:?}, but {}:{} is engine {:?}",
                    addr.engine_id, addr.host, addr.port, hs.engine_id
                ));
            }
            self.agent
                .add_peer(&hs)
                .map_err(|e| format!("handshake with {addr} refused: {e}"))
        });
        match accepted {
            Ok(name) => {
                tracing::info!(producer = %addr, peer = %name, "KV producer handshake accepted");
                self.peers.insert(addr, name.clone());
                for job in jobs {
                    if job.cancelled() {
                        let _ = self.release(&job, &name);
                        self.report(job.request_id, LoadOutcome::Cancelled);
                    } else {
                        self.post(job, name.clone());
                    }
                }
            }
            Err(reason) => {
                for job in jobs {
                    if job.cancelled() {
                        self.report(job.request_id, LoadOutcome::Cancelled);
                    } else {
                        self.fail(&job, reason.clone());
                    }
                }
            }
        }
    }

    /// Forgets a peer after a failure; the next load from its address shakes hands again.
    fn forget(&mut self, addr: &PeerAddr, name: &str) {
        self.peers.retain(|_, n| n != name);
        if self.agent.remove_peer(name) {
            tracing::info!(producer = %addr, peer = %name, "KV producer forgotten after a failure");
        }
    }

    /// A posted (or refused) transfer failed: the peer is told (a READ's producer may free, a
    /// WRITE's consumer stops waiting; best effort), then the job is failed.
    fn fail_transfer(&self, job: &LoadJob, name: &str, reason: String) {
        match &job.kind {
            LoadKind::Write { fail_notif, .. } => {
                if let Err(e) = self.agent.send_notif(name, fail_notif) {
                    tracing::debug!(consumer = %job.peer, error = %e, "push failure notification failed");
                }
            }
            _ => {
                let _ = self.release(job, name);
            }
        }
        self.fail(job, reason);
    }

    /// Tells the producer it may free the job's blocks (best effort).
    fn release(&self, job: &LoadJob, name: &str) -> Result<(), String> {
        let msg = PullNotif::Done(&job.remote_request_id).encode();
        self.agent.send_notif(name, &msg).map_err(|e| {
            tracing::debug!(producer = %job.peer, error = %e, "release notification failed");
            e.to_string()
        })
    }

    fn post(&mut self, mut job: LoadJob, name: String) {
        match &job.kind {
            LoadKind::Release => {
                let r = self.release(&job, &name);
                self.report(job.request_id, LoadOutcome::Released(r));
                return;
            }
            LoadKind::Notify(bytes) => {
                let r = self
                    .agent
                    .send_notif(&name, bytes)
                    .map_err(|e| e.to_string());
                self.report(job.request_id, LoadOutcome::Released(r));
                return;
            }
            LoadKind::Write { .. } => {
                self.post_transfer(job, name);
                return;
            }
            LoadKind::Read | LoadKind::Register | LoadKind::Reject(_) => {}
        }
        let Some(mut body) = job.claim_body.clone() else {
            self.fail(&job, "a READ without the params to claim its lease".into());
            return;
        };
        if job.kind == LoadKind::Read {
            // The ids were planned in the block size the params name; the transfer pairs
            // blocks in the one the producer's handshake names. Edited params must not make
            // them differ (the READ would land in other blocks of ours).
            let theirs = self.agent.peer_block_size(&name);
            if theirs.is_none() || theirs != job.remote_block_size {
                let reason = format!(
                    "kv_transfer_params say the producer's blocks hold {:?} tokens, its \
                     handshake says {theirs:?}",
                    job.remote_block_size
                );
                self.fail(&job, reason);
                return;
            }
        }
        let (path, what, auth_header) = if job.kind == LoadKind::Register {
            let (ours, theirs) = (self.agent.block_size(), self.agent.peer_block_size(&name));
            let mismatch = theirs.filter(|t| !t.is_multiple_of(ours));
            // A release asks for no blocks, so it goes whatever the block sizes.
            let release = mismatch.and_then(|_| crate::push::Registration::release_body(&body));
            if let (Some(theirs), Some(release)) = (mismatch, release) {
                let reason = format!(
                    "the producer's block size {theirs} is not a multiple of this consumer's \
                     {ours}: in push mode the producer's blocks must be a multiple of the \
                     consumer's"
                );
                self.fail(&job, reason);
                // The producer holds the prompt's blocks for this consumer: release them now
                // rather than leave them held until its lease expires.
                job.request_id = crate::push::worker::UNTRACKED;
                body = release;
            }
            let path = crate::push::REGISTER_PATH;
            let signed = self.auth.as_ref().map(|a| a.sign_request("POST", path));
            (path, "the push registration", signed)
        } else {
            (super::access::CLAIM_PATH, "the lease claim", None)
        };
        let client = match self.client() {
            Ok(c) => c,
            Err(reason) => {
                self.fail(&job, reason);
                return;
            }
        };
        let url = job.peer.url(path);
        let tx = self.tx.clone();
        // The job waits in a slot the claim thread empties when it answers; if the thread
        // cannot start, it is still there to be failed.
        let slot = Arc::new(std::sync::Mutex::new(Some((job, name))));
        let spawned = std::thread::Builder::new()
            .name("tandem-kv-claim".into())
            .spawn({
                let slot = slot.clone();
                move || {
                    let answer = post_json(&client, &url, what, body, auth_header.as_deref());
                    let taken = slot.lock().ok().and_then(|mut s| s.take());
                    if let Some((job, name)) = taken {
                        let _ = tx.send(Msg::Claimed(Box::new((job, name, answer))));
                    }
                }
            });
        match spawned {
            Ok(_) => self.claiming += 1,
            Err(e) => {
                if let Some((job, _)) = slot.lock().ok().and_then(|mut s| s.take()) {
                    self.fail(&job, format!("cannot start a claim thread: {e}"));
                }
            }
        }
    }

    /// The producer answered a claim: READ if granted, else fail the load. A registration's
    /// answer is reported as it is.
    fn claimed(&mut self, job: LoadJob, name: String, answer: Result<(), PostError>) {
        self.claiming -= 1;
        if job.kind == LoadKind::Register {
            if let Err(e) = &answer {
                tracing::warn!(request = job.request_id, producer = %job.peer,
                    "KV push registration failed: {}", e.reason);
            }
            self.report(job.request_id, LoadOutcome::Registered(answer));
            return;
        }
        let answer = answer.map_err(|e| e.reason);
        if job.cancelled() {
            // Granted or not, nothing was posted: tell the producer, then report.
            let _ = self.release(&job, &name);
            self.report(job.request_id, LoadOutcome::Cancelled);
            return;
        }
        if let Err(reason) = answer {
            self.fail(&job, reason);
            return;
        }
        let slow = match &mut self.fault {
            Some((f, rng)) if f.kind == TransportFaultKind::SlowRead => {
                rng.hit(f.probability).then_some(f.delay)
            }
            _ => None,
        };
        match slow {
            Some(delay) => {
                tracing::warn!(
                    request = job.request_id,
                    ?delay,
                    "transport fault injected (slow_read, testing only): the READ waits"
                );
                self.delayed.push((Instant::now() + delay, job, name));
            }
            None => self.post_transfer(job, name),
        }
    }

    /// Posts the `slow_read` jobs whose wait is over (or ends the cancelled ones).
    fn post_delayed(&mut self) {
        if self.delayed.is_empty() {
            return;
        }
        let now = Instant::now();
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.delayed)
            .into_iter()
            .partition(|(at, job, _)| *at <= now || job.cancelled());
        self.delayed = waiting;
        for (_, job, name) in due {
            if job.cancelled() {
                let _ = self.release(&job, &name);
                self.report(job.request_id, LoadOutcome::Cancelled);
            } else {
                self.post_transfer(job, name);
            }
        }
    }

    /// Posts a READ (pull) or a WRITE (push) of the job's blocks.
    fn post_transfer(&mut self, mut job: LoadJob, name: String) {
        let write = match &job.kind {
            LoadKind::Write { deadline, .. } => {
                if Instant::now() >= *deadline {
                    self.fail(
                        &job,
                        "the consumer's registration expired before the WRITE".into(),
                    );
                    return;
                }
                true
            }
            _ => false,
        };
        let what = if write { "WRITE" } else { "READ" };
        if let Some((f, rng)) = &mut self.fault {
            if f.kind == TransportFaultKind::WrongBlock && rng.hit(f.probability) {
                // The source side of one group is shuffled: a WRITE never lands outside its
                // own blocks.
                let groups: Vec<usize> = (0..job.ids.groups().len())
                    .filter(|&g| !job.ids.groups()[g].local.is_empty())
                    .collect();
                let shifted = (!groups.is_empty()).then(|| groups[rng.below(groups.len())]);
                let shifted = shifted.and_then(|g| {
                    let pairs = &mut job.ids.groups_mut()[g];
                    let source = if write {
                        &mut pairs.local
                    } else {
                        &mut pairs.remote
                    };
                    wrong_block(source, rng).map(|what| format!("{what} (group {g})"))
                });
                if let Some(shifted) = shifted {
                    tracing::warn!(
                        request = job.request_id,
                        "transport fault injected (wrong_block, testing only): the {what} {shifted}"
                    );
                }
            }
        }
        // The job's transfer time runs from here: a transfer may complete inside its post.
        let started = Instant::now();
        let mut post_start = started;
        let posted = if let LoadKind::Write { notif, .. } = &job.kind {
            self.agent
                .write_group_blocks(&name, &job.ids, Some(notif.clone()))
                .map(Transfers::one)
        } else {
            let renew = PullNotif::Renew(&job.remote_request_id).encode();
            if let Err(e) = self.agent.send_notif(&name, &renew) {
                self.forget(&job.peer, &name);
                self.fail(&job, format!("producer {} unreachable: {e}", job.peer));
                return;
            }
            let done = PullNotif::Done(&job.remote_request_id).encode();
            post_start = Instant::now();
            self.post_read(&job, &name, done)
        };
        match posted {
            Ok(transfers) => {
                self.in_flight.push(InFlight {
                    job,
                    peer_name: name,
                    transfers,
                    moved: None,
                    posted: started,
                    post_start,
                    first_landing: None,
                    parts: 0,
                    last_renew: Instant::now(),
                    polls: 0,
                });
            }
            Err(e) => {
                let peer_gone = matches!(
                    e,
                    KvConnectorError::TransferFailed { .. } | KvConnectorError::UnknownPeer(_)
                );
                // Bad block ids and the like mean params that do not match the producer
                // (forged, or another producer's): its lease, if any, is left alone.
                if peer_gone {
                    self.forget(&job.peer, &name);
                }
                self.fail_transfer(
                    &job,
                    &name,
                    format!("{what} with peer {} failed: {e}", job.peer),
                );
            }
        }
    }

    /// Posts a job's READ: one transfer with `done` attached, or, when it is larger than
    /// `read_chunk_bytes` and moves whole local blocks, its first chunks (the rest wait, and
    /// `done` is returned to be sent after the last). On an error nothing stays in flight.
    fn post_read(
        &self,
        job: &LoadJob,
        name: &str,
        done: Vec<u8>,
    ) -> Result<Transfers, KvConnectorError> {
        let chunk = self
            .config
            .read_chunk_bytes
            .unwrap_or(if self.agent.on_device() {
                DEFAULT_DEVICE_READ_CHUNK_BYTES
            } else {
                DEFAULT_HOST_READ_CHUNK_BYTES
            });
        let per_pair = self.agent.whole_block_pair_bytes(name);
        let pairs = job.ids.groups().iter().map(|g| g.local.len()).max();
        let parts = match (chunk, per_pair, pairs) {
            (1.., Some(per_pair), Some(pairs)) => (per_pair.saturating_mul(pairs as u64))
                .div_ceil(chunk)
                .min(MAX_READ_CHUNKS as u64),
            _ => 1,
        };
        if parts < 2 {
            let h = self.agent.read_group_blocks(name, &job.ids, Some(done))?;
            return Ok(Transfers::one(h));
        }
        let mut waiting: VecDeque<BlockPairs> = job.ids.split(parts as usize, Side::Local)?.into();
        let mut posted = VecDeque::new();
        while posted.len() < self.config.read_chunks_in_flight.max(1) {
            let Some(chunk) = waiting.pop_front() else {
                break;
            };
            let h = self.agent.read_group_blocks(name, &chunk, None)?;
            posted.push_back((h, chunk.local_lists()));
        }
        tracing::debug!(
            request = job.request_id,
            chunks = posted.len() + waiting.len(),
            "KV READ split into chunks"
        );
        Ok(Transfers {
            posted,
            waiting,
            done_notif: Some(done),
        })
    }

    fn poll_in_flight(&mut self) {
        let mut i = 0;
        while i < self.in_flight.len() {
            let f = &mut self.in_flight[i];
            f.polls = f.polls.saturating_add(1);
            enum Next {
                Keep,
                Done(TransferStats),
                Failed(String, bool),
                Cancelled,
            }
            let (what, deadline) = match &f.job.kind {
                LoadKind::Write { deadline, .. } => ("WRITE to consumer", *deadline),
                _ => ("READ from producer", f.posted + self.config.load_timeout),
            };
            let mut landed: Vec<Vec<Vec<usize>>> = Vec::new();
            let next = if f.job.cancelled() {
                Next::Cancelled
            } else {
                match poll_parts(&self.agent, f, &mut landed) {
                    Err(e) => Next::Failed(format!("{what} {} failed: {e}", f.job.peer), true),
                    Ok(true) => {
                        if let Some(done) = f.transfers.done_notif.take() {
                            // A split READ: every chunk is in; the producer may free.
                            if let Err(e) = self.agent.send_notif(&f.peer_name, &done) {
                                tracing::debug!(producer = %f.job.peer, error = %e,
                                    "done notification failed (the lease will expire)");
                            }
                        }
                        Next::Done(f.moved.expect("a completed job moved its parts"))
                    }
                    Ok(false) if Instant::now() >= deadline => Next::Failed(
                        format!(
                            "{what} {} did not complete within {:?}",
                            f.job.peer,
                            deadline.saturating_duration_since(f.posted)
                        ),
                        true,
                    ),
                    Ok(false) => {
                        if f.job.kind == LoadKind::Read
                            && f.last_renew.elapsed() >= self.config.kv_lease_duration / 2
                        {
                            f.last_renew = Instant::now();
                            let renew = PullNotif::Renew(&f.job.remote_request_id).encode();
                            if let Err(e) = self.agent.send_notif(&f.peer_name, &renew) {
                                tracing::debug!(producer = %f.job.peer, error = %e,
                                    "lease renewal failed");
                            }
                        }
                        Next::Keep
                    }
                }
            };
            // A job that ended reports its end only (a finished load is checksummed whole).
            if matches!(next, Next::Keep) {
                let request_id = self.in_flight[i].job.request_id;
                for blocks in landed {
                    self.report(request_id, LoadOutcome::Landed(blocks));
                }
                i += 1;
                continue;
            }
            let f = self.in_flight.swap_remove(i);
            // The transfers are cancelled (those still in flight) before anything is reported.
            let InFlight {
                job,
                peer_name,
                transfers,
                posted,
                post_start,
                first_landing,
                parts,
                ..
            } = f;
            drop(transfers);
            match next {
                Next::Keep => unreachable!(),
                Next::Done(stats) => {
                    tracing::debug!(
                        request = job.request_id,
                        bytes = stats.bytes,
                        seconds = stats.seconds(),
                        parts,
                        before_post_us = post_start.duration_since(posted).as_micros() as u64,
                        posting_us = stats.post_duration.as_micros() as u64,
                        first_landing_us = first_landing.unwrap_or_default().as_micros() as u64,
                        "KV load done"
                    );
                    self.report(job.request_id, LoadOutcome::Loaded(stats));
                }
                Next::Failed(reason, forget) => {
                    self.fail_transfer(&job, &peer_name, reason);
                    if forget {
                        self.forget(&job.peer, &peer_name);
                    }
                }
                Next::Cancelled => {
                    let _ = self.release(&job, &peer_name);
                    self.report(job.request_id, LoadOutcome::Cancelled);
                }
            }
        }
    }
}

/// Polls a job's transfers once each: completed ones are counted (a split READ's local blocks
/// pushed to `landed`) and replaced by the next waiting chunks. `Ok(true)` once every part completed and
/// none waits; an error for the first part that failed (or a chunk that could not be posted).
fn poll_parts(
    agent: &NixlAgent,
    f: &mut InFlight,
    landed: &mut Vec<Vec<Vec<usize>>>,
) -> Result<bool, KvConnectorError> {
    // Only the parts in flight at the call: a chunk posted here is polled next time, so a
    // READ whose chunks complete at once (host memory) still lands chunk by chunk.
    let mut k = 0;
    for _ in 0..f.transfers.posted.len() {
        match f.transfers.posted[k].0.poll() {
            TransferStatus::Pending => k += 1,
            TransferStatus::Failed(e) => return Err(e),
            TransferStatus::Done(stats) => {
                let (handle, blocks) = f.transfers.posted.remove(k).expect("k < len");
                drop(handle);
                if f.transfers.split() {
                    landed.push(blocks);
                }
                if let Some(chunk) = f.transfers.waiting.pop_front() {
                    let h = agent.read_group_blocks(&f.peer_name, &chunk, None)?;
                    f.transfers.posted.push_back((h, chunk.local_lists()));
                }
                f.add_moved(stats);
                // The next chunk is polled as closely as a fresh READ (the thread spins for a
                // job's first polls, then sleeps between them).
                f.polls = 0;
            }
        }
    }
    Ok(f.transfers.posted.is_empty() && f.transfers.waiting.is_empty())
}

/// `POST url` with a JSON body (`what`: a claim, or a push registration signed with
/// `auth_header`) → granted, or the peer's reason.
fn post_json(
    client: &reqwest::blocking::Client,
    url: &str,
    what: &str,
    body: String,
    auth_header: Option<&str>,
) -> Result<(), PostError> {
    let mut req = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body);
    if let Some(h) = auth_header {
        req = req.header(crate::auth::KV_AUTH_HEADER, h);
    }
    let resp = req.send().map_err(|e| PostError {
        reason: format!("{url} unreachable: {}", error_chain(&e)),
        maybe_delivered: !e.is_connect(),
    })?;
    let status = resp.status();
    if status.is_success() {
        return Ok(());
    }
    let mut text = String::new();
    let _ = resp.take(4096).read_to_string(&mut text);
    let reason = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or(text);
    Err(PostError::undelivered(format!(
        "the producer refused {what} (HTTP {status}): {reason}"
    )))
}

/// `GET url` → a validated [`NixlHandshake`], or why not.
fn fetch_handshake(
    client: &reqwest::blocking::Client,
    url: &str,
    auth_header: Option<&str>,
) -> Result<NixlHandshake, String> {
    let mut req = client.get(url);
    if let Some(h) = auth_header {
        req = req.header(crate::auth::KV_AUTH_HEADER, h);
    }
    let resp = req
        .send()
        .map_err(|e| format!("handshake {url} unreachable: {}", error_chain(&e)))?;
    let status = resp.status();
    if !status.is_success() {
        return Err(format!("handshake {url} refused: HTTP {status}"));
    }
    let mut body = String::new();
    resp.take(MAX_HANDSHAKE_BYTES)
        .read_to_string(&mut body)
        .map_err(|e| format!("handshake {url}: reading the body failed: {e}"))?;
    NixlHandshake::from_json(&body).map_err(|e| format!("handshake {url}: {e}"))
}

/// An error and its sources on one line (reqwest's own message hides the cause).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
