//! Block transfers: one NIXL READ (pull) or WRITE (push) over every layer's K and V for a list of
//! blocks, a handle to poll it, and what it moved.
//!
//! Invariants:
//! - One transfer is one request and one post. Where the plan's moves merge into fewer runs
//!   contiguous on both sides (consecutive blocks of a per-layer array; in a block-major device
//!   cache every layer of a run of blocks), the request is created from those runs
//!   (`create_xfer_req`), one descriptor each: each costs ~5-10 us over CUDA IPC whatever its size,
//!   and NIXL does not merge prepared descriptors itself. Otherwise it is `make_xfer_req` over the
//!   prepared lists' indices. Runs never cross an allocation: host arrays are separate heap
//!   allocations (never contiguous), and a GPU's block-major cache is one allocation.
//! - A notification attached to a transfer reaches the peer only once the transfer is complete,
//!   and NIXL sends it from the status check: a transfer's notification goes out only if someone
//!   polls its handle ([`TransferHandle::poll`] / [`TransferHandle::wait`]) until it is done.
//! - The outcome is cached at the first poll that sees it, so `duration` is post → first observed
//!   completion and later polls repeat the same answer. Errors never panic.
//! - Dropping a handle of a transfer still in flight cancels it: the destination blocks then hold
//!   unspecified bytes and must be treated as a failed load.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nixl_sys::{OptArgs, XferDescList, XferOp, XferRequest, XferStatus};

use super::agent::{LocalSide, NixlAgent, PeerEntry};
use super::descriptors::Side;
use super::descriptors::{plan_transfer, plan_unit_transfer, BlockPairs};
use super::pairing::Pairing;
use crate::error::KvConnectorError;

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferOp {
    /// Remote blocks into local blocks (pull mode: the consumer reads the producer).
    Read,
    /// Local blocks into remote blocks (push mode: the producer writes the consumer).
    Write,
}

impl TransferOp {
    pub fn name(self) -> &'static str {
        match self {
            TransferOp::Read => "READ",
            TransferOp::Write => "WRITE",
        }
    }
}

/// What a finished transfer moved, for metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferStats {
    pub op: TransferOp,
    /// Bytes moved.
    pub bytes: u64,
    /// Blocks moved (per array; each moves every layer's K and V).
    pub blocks: usize,
    /// NIXL descriptors after merging consecutive blocks.
    pub descriptors: usize,
    /// From the request's creation to the first poll that saw it complete.
    pub duration: Duration,
    /// Creating and posting the request (part of `duration`).
    pub post_duration: Duration,
}

impl TransferStats {
    pub fn seconds(&self) -> f64 {
        self.duration.as_secs_f64()
    }
    /// Bandwidth in GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.duration.as_secs_f64().max(1e-12) / 1e9
    }
}

/// The state of a transfer.
#[derive(Debug)]
pub enum TransferStatus {
    Pending,
    Done(TransferStats),
    Failed(KvConnectorError),
}

/// An in-flight (or finished) transfer. `Send + Sync`; keeps its peer and the local memory
/// registered while it lives.
pub struct TransferHandle {
    // Dropped first: releasing the request happens before the peer or local side can go.
    req: Option<XferRequest>,
    peer: Arc<PeerEntry>,
    local: Arc<LocalSide>,
    op: TransferOp,
    bytes: u64,
    blocks: usize,
    descriptors: usize,
    started: Instant,
    /// How long creating and posting the request took.
    post: Duration,
    /// `Err` holds the failure's reason; the error is rebuilt for every poll.
    outcome: Mutex<Option<Result<TransferStats, String>>>,
}

impl std::fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferHandle")
            .field("op", &self.op)
            .field("peer", &self.peer.name)
            .field("bytes", &self.bytes)
            .field("descriptors", &self.descriptors)
            .finish()
    }
}

impl TransferHandle {
    pub fn op(&self) -> TransferOp {
        self.op
    }
    /// The peer's agent name.
    pub fn peer(&self) -> &str {
        &self.peer.name
    }
    /// Bytes this transfer moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// NIXL descriptors after merging.
    pub fn descriptors(&self) -> usize {
        self.descriptors
    }

    fn stats(&self) -> TransferStats {
        TransferStats {
            op: self.op,
            bytes: self.bytes,
            blocks: self.blocks,
            descriptors: self.descriptors,
            duration: self.started.elapsed(),
            post_duration: self.post,
        }
    }

    /// Checks the transfer without blocking. Polling is also what sends the transfer's
    /// notification once it completes.
    pub fn poll(&self) -> TransferStatus {
        let mut outcome = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        if outcome.is_none() {
            let req = self
                .req
                .as_ref()
                .expect("a request exists until its outcome");
            match self.local.agent.get_xfer_status(req) {
                Ok(XferStatus::InProgress) => return TransferStatus::Pending,
                Ok(XferStatus::Success) => *outcome = Some(Ok(self.stats())),
                Err(e) => *outcome = Some(Err(describe(&e))),
            }
        }
        match outcome.as_ref().expect("set above") {
            Ok(stats) => TransferStatus::Done(*stats),
            Err(reason) => TransferStatus::Failed(KvConnectorError::TransferFailed {
                op: self.op.name(),
                peer: self.peer.name.clone(),
                reason: reason.clone(),
            }),
        }
    }

    /// Polls until the transfer is done, failed, or `timeout` has passed (then
    /// [`KvConnectorError::TransferTimeout`]; the transfer is still in flight and is cancelled
    /// when the handle is dropped).
    pub fn wait(&self, timeout: Duration) -> Result<TransferStats, KvConnectorError> {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            match self.poll() {
                TransferStatus::Done(stats) => return Ok(stats),
                TransferStatus::Failed(e) => return Err(e),
                TransferStatus::Pending => {}
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(KvConnectorError::TransferTimeout {
                    op: self.op.name(),
                    peer: self.peer.name.clone(),
                    timeout,
                });
            }
            polls += 1;
            // Spin briefly (a typical transfer takes a few ms), then back off.
            if waited < Duration::from_millis(2) || polls < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50).min(timeout - waited));
            }
        }
    }
}

/// A `nixl_sys` error during a transfer, with a hint for the one that means "peer gone".
fn describe(e: &nixl_sys::NixlError) -> String {
    match e {
        nixl_sys::NixlError::BackendError => {
            format!("{e} (the peer may have exited or be unreachable)")
        }
        nixl_sys::NixlError::NotFound => format!("{e} (the peer's metadata is no longer loaded)"),
        _ => e.to_string(),
    }
}

impl NixlAgent {
    /// Posts ONE NIXL READ of `remote_block_ids[i]` of `peer` into `local_block_ids[i]`, over
    /// every layer's K and V (one list every KV cache group shares; [`Self::read_group_blocks`]
    /// for a list per group). `notif`, if any, reaches the peer once the data has landed (poll
    /// the handle to completion). With no blocks, the notification is sent at once. With a peer
    /// of smaller blocks, ids are in its units ([`NixlAgent::transfer_ratio`]).
    pub fn read_blocks(
        &self,
        peer: &str,
        local_block_ids: &[usize],
        remote_block_ids: &[usize],
        notif: Option<Vec<u8>>,
    ) -> Result<TransferHandle, KvConnectorError> {
        let ids = BlockPairs::shared(local_block_ids.to_vec(), remote_block_ids.to_vec());
        self.transfer(TransferOp::Read, peer, &ids, notif)
    }

    /// Posts ONE NIXL READ of every layer's K and V, each layer moving its KV cache group's
    /// pairs of `ids` (a sliding-window group only the blocks of its window); otherwise as
    /// [`Self::read_blocks`].
    pub fn read_group_blocks(
        &self,
        peer: &str,
        ids: &BlockPairs,
        notif: Option<Vec<u8>>,
    ) -> Result<TransferHandle, KvConnectorError> {
        self.transfer(TransferOp::Read, peer, ids, notif)
    }

    /// Posts ONE NIXL WRITE of `local_block_ids[i]` into `remote_block_ids[i]` of `peer`
    /// (push mode); otherwise as [`Self::read_blocks`].
    pub fn write_blocks(
        &self,
        peer: &str,
        local_block_ids: &[usize],
        remote_block_ids: &[usize],
        notif: Option<Vec<u8>>,
    ) -> Result<TransferHandle, KvConnectorError> {
        let ids = BlockPairs::shared(local_block_ids.to_vec(), remote_block_ids.to_vec());
        self.transfer(TransferOp::Write, peer, &ids, notif)
    }

    /// Posts ONE NIXL WRITE, each layer moving its group's pairs of `ids` (push mode); otherwise
    /// as [`Self::read_group_blocks`].
    pub fn write_group_blocks(
        &self,
        peer: &str,
        ids: &BlockPairs,
        notif: Option<Vec<u8>>,
    ) -> Result<TransferHandle, KvConnectorError> {
        self.transfer(TransferOp::Write, peer, ids, notif)
    }

    /// [`TransferHandle::poll`].
    pub fn poll(&self, handle: &TransferHandle) -> TransferStatus {
        handle.poll()
    }

    /// [`TransferHandle::wait`].
    pub fn wait(
        &self,
        handle: &TransferHandle,
        timeout: Duration,
    ) -> Result<TransferStats, KvConnectorError> {
        handle.wait(timeout)
    }

    fn transfer(
        &self,
        op: TransferOp,
        peer: &str,
        ids: &BlockPairs,
        notif: Option<Vec<u8>>,
    ) -> Result<TransferHandle, KvConnectorError> {
        let peer = self.peer(peer)?;
        let dest = match op {
            TransferOp::Read => Side::Local,
            TransferOp::Write => Side::Remote,
        };
        let ratio = self.transfer_ratio(&peer.name)?;
        // The lists and index plan of this peer's pairing (see `pairing.rs`).
        let (local_split, remote_split, plan) = match &peer.pairing {
            Some(Pairing::Units(units)) => {
                let local = self.local.split_list(units.local_units())?;
                let remote = peer.split_list(units.remote_units)?;
                let plan = plan_unit_transfer(&local.table, &remote.table, units, ids, dest)?;
                (Some(local), Some(remote), plan)
            }
            _ => {
                let local = match ratio {
                    1 => None,
                    k => Some(self.local.split_list(k)?),
                };
                let local_table = local.as_ref().map_or(&self.local.table, |s| &s.table);
                let plan = plan_transfer(local_table, &peer.table, ids, dest)?;
                (local, None, plan)
            }
        };
        let started = Instant::now();
        let failed = |reason: String| KvConnectorError::TransferFailed {
            op: op.name(),
            peer: peer.name.clone(),
            reason,
        };
        let mut handle = TransferHandle {
            req: None,
            peer: peer.clone(),
            local: self.local.clone(),
            op,
            bytes: plan.bytes,
            blocks: plan.blocks,
            descriptors: plan.descriptors,
            started,
            post: Duration::ZERO,
            outcome: Mutex::new(None),
        };
        if plan.local_indices.is_empty() {
            if let Some(msg) = &notif {
                self.send_notif(&peer.name, msg)?;
            }
            *handle.outcome.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(Ok(handle.stats()));
            return Ok(handle);
        }
        let mut opt = OptArgs::new().map_err(|e| failed(e.to_string()))?;
        if let Some(msg) = &notif {
            opt.set_has_notification(true)
                .and_then(|()| opt.set_notification_message(msg))
                .map_err(|e| failed(format!("notification: {e}")))?;
        }
        let xop = match op {
            TransferOp::Read => XferOp::Read,
            TransferOp::Write => XferOp::Write,
        };
        let req = if plan.runs.len() < plan.local_indices.len() {
            let list = |mem, remote: bool| -> Result<XferDescList, KvConnectorError> {
                let mut l = XferDescList::new(mem).map_err(|e| failed(e.to_string()))?;
                for r in &plan.runs {
                    match remote {
                        false => l.add_desc(r.local, r.len, r.local_device),
                        true => l.add_desc(r.remote, r.len, r.remote_device),
                    }
                }
                Ok(l)
            };
            let (local, remote) = (list(self.local.mem, false)?, list(peer.mem, true)?);
            self.local
                .agent
                .create_xfer_req(xop, &local, &remote, &peer.name, Some(&opt))
        } else {
            self.local.agent.make_xfer_req(
                xop,
                local_split
                    .as_ref()
                    .map_or(self.local.dlist(), |s| &s.dlist),
                &plan.local_indices,
                remote_split.as_ref().map_or(peer.dlist(), |s| &s.dlist),
                &plan.remote_indices,
                Some(&opt),
            )
        }
        .map_err(|e| failed(format!("request creation: {}", describe(&e))))?;
        let in_progress = self
            .local
            .agent
            .post_xfer_req(&req, None)
            .map_err(|e| failed(format!("post: {}", describe(&e))))?;
        handle.req = Some(req);
        handle.post = started.elapsed();
        if !in_progress {
            *handle.outcome.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(Ok(handle.stats()));
        }
        Ok(handle)
    }
}
