//! [`NixlPullScheduler`]: the scheduler side of the NIXL pull connector.
//!
//! - Producer requests (`do_remote_decode`): no external tokens. When one finishes normally its
//!   blocks are held (`delay_free`) under a lease of `kv_lease_duration`, handed to the workers,
//!   and the response carries the consumer's `kv_transfer_params` (`RemotePrefill::to_value`).
//!   An aborted one frees at once and answers nothing.
//! - Consumer requests (`do_remote_prefill`): every prompt token past the local prefix hit is
//!   external and loads asynchronously. After allocation, for each KV cache group, the local
//!   blocks `table[local/bs .. cdiv(prompt, bs)]` are paired with the same positions of that
//!   group's `remote_block_ids` (a sliding-window group skips the positions before its window,
//!   null in its table) and handed to the workers as one READ. A producer whose blocks are `k`
//!   times smaller (`remote_block_size`) pairs each of its blocks with a `k`-th of one of ours.
//! - Roles are lenient like vLLM's: a `do_remote_decode` request on a consumer-only instance, or
//!   a `do_remote_prefill` one on a producer-only instance, is served locally (a warning is
//!   logged; malformed params are rejected whatever the role).
//!
//! Invariants:
//! - A request is in `loading` from its READ's hand-off until the workers report it in
//!   `finished_recving`. If it ends meanwhile (abort, client gone), `request_finished` returns
//!   `delay_free`, the workers cancel the READ and report the request in `finished_sending` when
//!   nothing writes into its blocks any more: blocks are never freed under an in-flight READ.
//! - A request is in `leases` from its normal finish until the workers report it in
//!   `finished_sending` (done notification or expiry); the engine frees its blocks then.
//! - A consumer request that ends before its load was handed off (aborted while queued) hands
//!   the workers a release, so the producer frees without waiting for its lease to expire.
//! - [`NixlPullScheduler::is_idle`] holds once every request has finished and been reported.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tandem_kv_cache::{BlockId, NULL_BLOCK};

use crate::nixl::{BlockPairs, GroupPairs};

use super::access::PARAMS_FIELD;
use super::leases::LeaseTable;
use super::protocol::{LeaseSpec, LoadKind, LoadSpec, PeerAddr, PullMetadata};
use crate::auth::{unix_millis, TransferAuth};
use crate::base::{
    remote_prompt_tokens, ConnectorMetadata, ConnectorOutput, ConnectorRequest, ConsumerEnd,
    ConsumerLoads, FinishKind, FinishedAction, KvChecksumCarrier, KvConnectorScheduler,
    MatchedTokens,
};
use crate::config::{KvMode, KvRole};
use crate::error::KvConnectorError;
use crate::params::{RemotePrefill, TransferRequest};

/// What the scheduler side needs to know about its instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullSchedulerConfig {
    pub role: KvRole,
    pub engine_id: String,
    pub block_size: usize,
    /// Advertised as `remote_host`.
    pub side_channel_host: String,
    /// This instance's HTTP port, advertised as `remote_port`.
    pub http_port: u16,
    pub kv_lease_duration: Duration,
    /// The deployment secret: a producer signs the params it answers with it.
    pub auth: Option<TransferAuth>,
    /// This instance's tensor-parallel size, answered as `tp_size` (informational: the
    /// handshake says how the producer's KV is split).
    pub tp_size: usize,
}

/// Request counts the scheduler side still tracks (all zero when idle).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PullSchedulerStats {
    /// Consumer READs handed to workers and not yet reported.
    pub loading: usize,
    /// Ended requests whose cancelled READ is not yet reported.
    pub cancelled: usize,
    /// Producer requests holding blocks for a consumer.
    pub leases: usize,
    /// Consumer requests with a load (finished or not) that have not ended yet.
    pub consumers: usize,
}

/// The scheduler side of the pull connector. See the module docs.
#[derive(Debug)]
pub struct NixlPullScheduler {
    config: PullSchedulerConfig,
    /// Consumer requests and their loads.
    loads: ConsumerLoads,
    /// Producer requests under lease: engine id → remote request id.
    leases: HashMap<u64, String>,
    pending: PullMetadata,
    /// Issued leases as the producer's claim and release routes see them.
    lease_table: LeaseTable,
}

impl NixlPullScheduler {
    /// A scheduler side with a lease table of its own (tests; see [`Self::with_lease_table`]).
    pub fn new(config: PullSchedulerConfig) -> Result<Self, KvConnectorError> {
        Self::with_lease_table(config, LeaseTable::new())
    }

    /// A scheduler side that issues its leases into `lease_table` (shared with the worker side
    /// and the producer's HTTP routes).
    pub fn with_lease_table(
        config: PullSchedulerConfig,
        lease_table: LeaseTable,
    ) -> Result<Self, KvConnectorError> {
        if config.block_size == 0 {
            return Err(KvConnectorError::InvalidConfig("block size 0".into()));
        }
        if config.http_port == 0 {
            return Err(KvConnectorError::InvalidConfig(
                "the advertised HTTP port is 0; pass the port the server is bound to".into(),
            ));
        }
        Ok(NixlPullScheduler {
            config,
            loads: ConsumerLoads::default(),
            leases: HashMap::new(),
            pending: PullMetadata::default(),
            lease_table,
        })
    }

    /// The table this side issues leases into.
    pub fn lease_table(&self) -> &LeaseTable {
        &self.lease_table
    }

    /// Sets the `tp_size` the producer answers (its tensor-parallel size).
    pub fn set_tp_size(&mut self, tp_size: usize) {
        self.config.tp_size = tp_size;
    }

    pub fn config(&self) -> &PullSchedulerConfig {
        &self.config
    }

    pub fn stats(&self) -> PullSchedulerStats {
        PullSchedulerStats {
            loading: self.loads.counts().0,
            cancelled: self.loads.counts().1,
            leases: self.leases.len(),
            consumers: self.loads.counts().2,
        }
    }

    /// Nothing tracked and nothing waiting to be handed to workers.
    pub fn is_idle(&self) -> bool {
        self.stats() == PullSchedulerStats::default() && self.pending.is_empty()
    }

    fn parse(&self, request: &ConnectorRequest<'_>) -> Result<TransferRequest, KvConnectorError> {
        let t = TransferRequest::parse(
            request.kv_transfer_params,
            request.prompt_token_ids.len(),
            self.config.block_size,
        )?;
        t.check_mode(KvMode::Pull)?;
        Ok(t)
    }

    fn peer(remote: &RemotePrefill) -> PeerAddr {
        PeerAddr {
            host: remote.remote_host.clone(),
            port: remote.remote_port,
            engine_id: remote.remote_engine_id.clone(),
        }
    }

    fn spec(request_id: u64, remote: &RemotePrefill, kind: LoadKind) -> LoadSpec {
        LoadSpec {
            request_id,
            kind,
            peer: Self::peer(remote),
            remote_request_id: remote.remote_request_id.clone(),
            blocks: BlockPairs::shared(Vec::new(), Vec::new()),
            remote_block_size: None,
            claim_body: None,
        }
    }

    /// Pairs the load's local blocks with the producer's, group by group: positions
    /// `local_computed / remote_bs .. cdiv(prompt, remote_bs)` in the producer's units, skipping
    /// those a sliding-window group of ours holds no block for (before its window: not needed).
    /// A block we need that the producer does not hold, or tables that do not match, make the
    /// load impossible (the reason). Also returns the producer block size the ids are in.
    fn plan_load(
        &self,
        request: &ConnectorRequest<'_>,
        block_tables: &[Vec<BlockId>],
        num_external_tokens: usize,
        remote: &RemotePrefill,
    ) -> Result<(BlockPairs, usize), String> {
        let bs = self.config.block_size;
        // The producer's blocks may be smaller: `ratio` of them fill one of ours (checked when
        // the params were parsed), and the READ is planned in its units.
        let remote_bs = remote.remote_block_size.unwrap_or(bs);
        let ratio = bs / remote_bs;
        let prompt_len = request.prompt_token_ids.len();
        let local_computed = prompt_len.saturating_sub(num_external_tokens);
        let (first, end) = (local_computed / remote_bs, prompt_len.div_ceil(remote_bs));
        let place = |why: String| {
            format!(
                "cannot place the load ({num_external_tokens} external of {prompt_len} prompt \
                 tokens, block size {bs}): {why}"
            )
        };
        if !local_computed.is_multiple_of(bs) {
            return Err(place("the local prefix is not block-aligned".into()));
        }
        if block_tables.len() != remote.remote_block_ids.len() {
            return Err(place(format!(
                "the producer sends {} block tables (KV cache groups), this instance runs {}",
                remote.remote_block_ids.len(),
                block_tables.len()
            )));
        }
        let mut groups = Vec::with_capacity(block_tables.len());
        for (g, (local, theirs)) in block_tables
            .iter()
            .zip(&remote.remote_block_ids)
            .enumerate()
        {
            if local.len() < prompt_len.div_ceil(bs) || theirs.len() != end {
                return Err(place(format!(
                    "group {g}: {} local blocks, {} remote blocks",
                    local.len(),
                    theirs.len()
                )));
            }
            let mut pairs = GroupPairs::default();
            for q in first..end {
                let ours = local[q / ratio];
                if ours == NULL_BLOCK {
                    continue;
                }
                if theirs[q] == NULL_BLOCK {
                    return Err(place(format!(
                        "group {g}: the producer holds no block at position {q} (its sliding \
                         window freed it), which this instance needs"
                    )));
                }
                pairs.local.push(ours as usize * ratio + q % ratio);
                pairs.remote.push(theirs[q] as usize);
            }
            groups.push(pairs);
        }
        Ok((BlockPairs::per_group(groups), remote_bs))
    }

    /// A new, unguessable id for a producer request's lease.
    fn new_remote_request_id(request_id: u64) -> String {
        format!("{request_id}-{}", uuid::Uuid::new_v4().simple())
    }
}

impl KvConnectorScheduler for NixlPullScheduler {
    /// Pull carries checksums in `kv_transfer_params`: the producer's answer holds them and the
    /// proxy forwards them to the consumer with the request.
    fn carries_kv_checksums(&self) -> bool {
        true
    }

    /// A producer request (`do_remote_decode`) on a producing role sends its checksums; a load
    /// (`do_remote_prefill`) on a consuming role is verified against them. Anything else (a
    /// request served locally) carries none.
    fn kv_checksum_carrier(
        &self,
        request: &ConnectorRequest<'_>,
        receiving: bool,
    ) -> Option<KvChecksumCarrier> {
        match (self.parse(request).ok()?, receiving) {
            (TransferRequest::Producer, false) if self.config.role.is_producer() => {
                Some(KvChecksumCarrier::KvTransferParams)
            }
            (TransferRequest::Consumer(_), true) if self.config.role.is_consumer() => {
                Some(KvChecksumCarrier::KvTransferParams)
            }
            _ => None,
        }
    }

    fn get_num_new_matched_tokens(
        &mut self,
        request: &ConnectorRequest<'_>,
        num_computed_tokens: usize,
    ) -> Result<MatchedTokens, KvConnectorError> {
        match self.parse(request)? {
            TransferRequest::Consumer(_) => {}
            TransferRequest::Producer if !self.config.role.is_producer() => {
                tracing::warn!(request = %request.external_id, role = self.config.role.as_str(),
                    "do_remote_decode on an instance that is not a producer; serving it locally");
                return Ok(MatchedTokens::default());
            }
            TransferRequest::Local
            | TransferRequest::Producer
            | TransferRequest::PushProducer { .. }
            | TransferRequest::PushConsumer(_) => return Ok(MatchedTokens::default()),
        }
        if !self.config.role.is_consumer() {
            tracing::warn!(request = %request.external_id, role = self.config.role.as_str(),
                "do_remote_prefill on an instance that is not a consumer; prefilling locally");
            return Ok(MatchedTokens::default());
        }
        Ok(remote_prompt_tokens(
            request,
            num_computed_tokens,
            self.config.block_size,
        ))
    }

    fn update_state_after_alloc(
        &mut self,
        request: &ConnectorRequest<'_>,
        block_tables: &[Vec<BlockId>],
        num_external_tokens: usize,
    ) {
        if !self.config.role.is_consumer() {
            return;
        }
        let Ok(TransferRequest::Consumer(remote)) = self.parse(request) else {
            return;
        };
        let id = request.request_id;
        self.loads.start(id, num_external_tokens > 0);
        if num_external_tokens == 0 {
            // Served locally after all: the producer may free now.
            self.pending
                .loads
                .push(Self::spec(id, &remote, LoadKind::Release));
            return;
        }
        let mut spec = Self::spec(id, &remote, LoadKind::Read);
        match self.plan_load(request, block_tables, num_external_tokens, &remote) {
            Ok((blocks, remote_bs)) => {
                spec.blocks = blocks;
                spec.remote_block_size = Some(remote_bs);
                let params = request.kv_transfer_params.cloned().unwrap_or_default();
                spec.claim_body = Some(serde_json::json!({ PARAMS_FIELD: params }).to_string());
            }
            Err(reason) => {
                tracing::error!(request = %request.external_id, "{reason}");
                spec.kind = LoadKind::Reject(reason);
            }
        }
        self.pending.loads.push(spec);
    }

    fn build_connector_meta(&mut self) -> ConnectorMetadata {
        if self.pending.is_empty() {
            return ConnectorMetadata(None);
        }
        ConnectorMetadata(Some(Box::new(std::mem::take(&mut self.pending))))
    }

    fn update_connector_output(&mut self, output: &ConnectorOutput) {
        self.loads.update(output);
        for id in &output.finished_sending {
            self.leases.remove(id);
        }
    }

    fn seal_transfer_params(&mut self, params: &mut serde_json::Map<String, serde_json::Value>) {
        if let Some(auth) = &self.config.auth {
            auth.sign_params(params, unix_millis(), self.config.kv_lease_duration);
        }
    }

    fn request_finished(
        &mut self,
        request: &ConnectorRequest<'_>,
        block_tables: &[Vec<BlockId>],
        finish: FinishKind,
    ) -> FinishedAction {
        let id = request.request_id;
        if let Some(end) = self.loads.finish(id) {
            // Mid-load, its blocks may still be written into: the workers stop the load and
            // release them.
            if end == ConsumerEnd::MidLoad {
                self.pending.cancelled_loads.push(id);
            }
            return end.action();
        }
        // Params were validated at admission; a request rejected there ends here quietly.
        let Ok(kind) = self.parse(request) else {
            return FinishedAction::default();
        };
        match kind {
            TransferRequest::Consumer(remote) if self.config.role.is_consumer() => {
                // Ended before its load began: let the producer free now.
                self.pending
                    .loads
                    .push(Self::spec(id, &remote, LoadKind::Release));
                FinishedAction::default()
            }
            TransferRequest::Producer
                if self.config.role.is_producer() && finish == FinishKind::Normal =>
            {
                let bs = self.config.block_size;
                let n = request.prompt_token_ids.len().div_ceil(bs);
                if block_tables.is_empty() || block_tables.iter().any(|t| t.len() < n) {
                    tracing::error!(request = %request.external_id, needed = n,
                        "producer request finished without its prompt's blocks");
                    return FinishedAction::default();
                }
                let remote_request_id = Self::new_remote_request_id(id);
                let params = RemotePrefill {
                    remote_engine_id: self.config.engine_id.clone(),
                    remote_request_id: remote_request_id.clone(),
                    remote_block_ids: block_tables.iter().map(|t| t[..n].to_vec()).collect(),
                    remote_host: self.config.side_channel_host.clone(),
                    remote_port: self.config.http_port,
                    tp_size: self.config.tp_size as u64,
                    remote_block_size: Some(bs),
                };
                let deadline = Instant::now() + self.config.kv_lease_duration;
                self.lease_table.issue(
                    &remote_request_id,
                    &params.remote_block_ids,
                    request.prompt_token_ids.len(),
                    deadline,
                );
                self.leases.insert(id, remote_request_id.clone());
                self.pending.leases.push(LeaseSpec {
                    request_id: id,
                    remote_request_id,
                    deadline,
                });
                FinishedAction {
                    delay_free: true,
                    kv_transfer_params: Some(params.to_value()),
                }
            }
            _ => FinishedAction::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn sched(role: KvRole) -> NixlPullScheduler {
        NixlPullScheduler::new(PullSchedulerConfig {
            role,
            engine_id: "p0".into(),
            block_size: 4,
            side_channel_host: "10.0.0.1".into(),
            http_port: 8100,
            kv_lease_duration: Duration::from_secs(30),
            auth: None,
            tp_size: 1,
        })
        .unwrap()
    }

    fn req<'a>(id: u64, prompt: &'a [u32], params: Option<&'a Value>) -> ConnectorRequest<'a> {
        ConnectorRequest {
            request_id: id,
            external_id: "ext",
            prompt_token_ids: prompt,
            kv_transfer_params: params,
        }
    }

    fn meta(s: &mut NixlPullScheduler) -> PullMetadata {
        match s.build_connector_meta().0 {
            None => PullMetadata::default(),
            Some(b) => *b.downcast::<PullMetadata>().unwrap(),
        }
    }

    #[test]
    fn producer_requests_lease_their_prompt_blocks_and_answer_params() {
        let mut s = sched(KvRole::Producer);
        let prompt = [1u32; 9];
        let p = json!({"do_remote_decode": true});
        let r = req(3, &prompt, Some(&p));
        assert_eq!(
            s.get_num_new_matched_tokens(&r, 0).unwrap(),
            MatchedTokens::default()
        );
        s.update_state_after_alloc(&r, &[vec![7, 8, 9]], 0);
        assert!(meta(&mut s).is_empty());
        let before = Instant::now();
        let a = s.request_finished(&r, &[vec![7, 8, 9, 10]], FinishKind::Normal);
        assert!(a.delay_free);
        let v = a.kv_transfer_params.unwrap();
        let TransferRequest::Consumer(back) = TransferRequest::parse(Some(&v), 9, 4).unwrap()
        else {
            panic!("{v}")
        };
        assert_eq!(back.remote_block_ids, vec![vec![7, 8, 9]]);
        assert_eq!(
            (
                back.remote_host.as_str(),
                back.remote_port,
                back.remote_engine_id.as_str()
            ),
            ("10.0.0.1", 8100, "p0")
        );
        assert!(back.remote_request_id.starts_with("3-"));
        let m = meta(&mut s);
        assert_eq!(m.leases.len(), 1);
        assert_eq!(m.leases[0].remote_request_id, back.remote_request_id);
        assert!(m.leases[0].deadline >= before + Duration::from_secs(30));
        assert!(!s.is_idle());
        let mut out = ConnectorOutput::default();
        out.finished_sending.insert(3);
        s.update_connector_output(&out);
        assert!(s.is_idle());
        // Aborted: no lease, no params; remote request ids are never reused.
        let a = s.request_finished(
            &req(4, &prompt, Some(&p)),
            &[vec![1, 2, 3]],
            FinishKind::Aborted,
        );
        assert_eq!(a, FinishedAction::default());
        assert!(s.is_idle());
    }

    #[test]
    fn consumer_loads_the_rest_of_the_prompt_after_a_local_hit() {
        let mut s = sched(KvRole::Consumer);
        let prompt = [1u32; 10];
        let p = json!({"do_remote_prefill": true, "remote_engine_id": "p0",
            "remote_request_id": "r", "remote_block_ids": [20, 21, 22],
            "remote_host": "h", "remote_port": 1, "tp_size": 1});
        let r = req(5, &prompt, Some(&p));
        let m = s.get_num_new_matched_tokens(&r, 4).unwrap();
        assert_eq!(
            m,
            MatchedTokens {
                num_external_tokens: 6,
                load_async: true
            }
        );
        s.update_state_after_alloc(&r, &[vec![30, 31, 32]], 6);
        let m = meta(&mut s);
        assert_eq!(m.loads.len(), 1);
        let l = &m.loads[0];
        assert_eq!(l.kind, LoadKind::Read);
        assert_eq!(l.blocks, BlockPairs::shared(vec![31, 32], vec![21, 22]));
        assert_eq!(l.peer.engine_id, "p0");
        // Misaligned local hits are never loaded into.
        assert_eq!(
            s.get_num_new_matched_tokens(&r, 3).unwrap(),
            MatchedTokens::default()
        );
        // Finished loading, then the request ends normally: nothing to release.
        let mut out = ConnectorOutput::default();
        out.finished_recving.insert(5);
        s.update_connector_output(&out);
        assert_eq!(
            s.request_finished(&r, &[vec![30, 31, 32]], FinishKind::Normal),
            FinishedAction::default()
        );
        assert!(meta(&mut s).is_empty());
        assert!(s.is_idle());
    }

    #[test]
    fn each_kv_cache_group_loads_its_own_blocks_and_a_sliding_group_only_its_window() {
        let n = NULL_BLOCK;
        // Producer: group 0 (full) holds every block, group 1 (sliding) freed positions 0..2.
        let mut prod = sched(KvRole::Producer);
        let prompt = [1u32; 18];
        let pp = json!({"do_remote_decode": true});
        let a = prod.request_finished(
            &req(3, &prompt, Some(&pp)),
            &[vec![7, 8, 9, 10, 11, 12], vec![n, n, 2, 3, 4, 5]],
            FinishKind::Normal,
        );
        let v = a.kv_transfer_params.unwrap();
        assert_eq!(
            v["remote_block_ids"],
            json!([[7, 8, 9, 10, 11], [null, null, 2, 3, 4]])
        );
        // Consumer: a local hit of one block; its sliding group holds positions 3.. only.
        let mut s = sched(KvRole::Consumer);
        let r = req(5, &prompt, Some(&v));
        assert_eq!(
            s.get_num_new_matched_tokens(&r, 4)
                .unwrap()
                .num_external_tokens,
            14
        );
        s.update_state_after_alloc(&r, &[vec![30, 31, 32, 33, 34], vec![n, n, n, 43, 44]], 14);
        let l = &meta(&mut s).loads[0];
        assert_eq!(l.kind, LoadKind::Read);
        assert_eq!(
            l.blocks.groups(),
            [
                GroupPairs {
                    local: vec![31, 32, 33, 34],
                    remote: vec![8, 9, 10, 11]
                },
                GroupPairs {
                    local: vec![43, 44],
                    remote: vec![3, 4]
                }
            ]
        );
        // A block we need that the producer freed, or tables of another shape, fail the load.
        let mut early = v.clone();
        early["remote_block_ids"][1] = json!([null, null, null, null, 4]);
        let mut other = v.clone();
        other["remote_block_ids"] = json!([7, 8, 9, 10, 11]);
        for (params, needle) in [
            (&early, "group 1: the producer holds no block at position 3"),
            (
                &other,
                "the producer sends 1 block tables (KV cache groups), this instance runs 2",
            ),
        ] {
            let r = req(6, &prompt, Some(params));
            s.update_state_after_alloc(&r, &[vec![30, 31, 32, 33, 34], vec![n, n, n, 43, 44]], 14);
            let l = &meta(&mut s).loads[0];
            let LoadKind::Reject(reason) = &l.kind else {
                panic!("{:?}", l.kind)
            };
            assert!(reason.contains(needle), "{reason}");
        }
    }

    #[test]
    fn a_producer_with_smaller_blocks_is_read_into_sub_blocks_of_ours() {
        // Ours: 4-token blocks; the producer's: 2-token blocks (remote_block_size), 2 per ours.
        let mut s = sched(KvRole::Consumer);
        let prompt = [1u32; 11];
        let p = json!({"do_remote_prefill": true, "remote_engine_id": "p0",
            "remote_request_id": "r", "remote_block_ids": [50, 51, 52, 53, 54, 55],
            "remote_host": "h", "remote_port": 1, "tp_size": 1, "remote_block_size": 2});
        let r = req(8, &prompt, Some(&p));
        let m = s.get_num_new_matched_tokens(&r, 4).unwrap();
        assert_eq!(m.num_external_tokens, 7);
        s.update_state_after_alloc(&r, &[vec![30, 31, 32]], 7);
        let l = &meta(&mut s).loads[0];
        assert_eq!(l.kind, LoadKind::Read);
        // Producer positions 2..6 into our blocks 31 (sub 62, 63) and 32 (sub 64, 65).
        assert_eq!(
            l.blocks,
            BlockPairs::shared(vec![62, 63, 64, 65], vec![52, 53, 54, 55])
        );
        // Blocks larger than ours, or not dividing ours, are refused naming both sizes.
        for bs in [8, 3] {
            let mut bad = p.clone();
            bad["remote_block_size"] = json!(bs);
            let e = s
                .get_num_new_matched_tokens(&req(9, &prompt, Some(&bad)), 0)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("block size {bs}")) && e.contains('4'),
                "{e}"
            );
        }
        // The producer answers its own block size.
        let mut prod = sched(KvRole::Producer);
        let pp = json!({"do_remote_decode": true});
        let a = prod.request_finished(
            &req(3, &prompt, Some(&pp)),
            &[vec![7, 8, 9]],
            FinishKind::Normal,
        );
        assert_eq!(a.kv_transfer_params.unwrap()["remote_block_size"], json!(4));
    }

    #[test]
    fn a_consumer_request_ending_mid_load_holds_its_blocks_until_the_workers_release_them() {
        let mut s = sched(KvRole::Both);
        let prompt = [1u32; 4];
        let p = json!({"do_remote_prefill": true, "remote_engine_id": "p0",
            "remote_request_id": "r", "remote_block_ids": [20],
            "remote_host": "h", "remote_port": 1, "tp_size": 1});
        let r = req(6, &prompt, Some(&p));
        s.get_num_new_matched_tokens(&r, 0).unwrap();
        s.update_state_after_alloc(&r, &[vec![1]], 4);
        meta(&mut s);
        let a = s.request_finished(&r, &[vec![1]], FinishKind::Aborted);
        assert!(a.delay_free && a.kv_transfer_params.is_none());
        assert_eq!(meta(&mut s).cancelled_loads, vec![6]);
        let mut out = ConnectorOutput::default();
        out.finished_sending.insert(6);
        s.update_connector_output(&out);
        assert!(s.is_idle());

        // Aborted before allocation: a release goes to the workers.
        let r = req(7, &prompt, Some(&p));
        s.get_num_new_matched_tokens(&r, 0).unwrap();
        assert_eq!(
            s.request_finished(&r, &[vec![]], FinishKind::Aborted),
            FinishedAction::default()
        );
        let m = meta(&mut s);
        assert_eq!(m.loads.len(), 1);
        assert_eq!(m.loads[0].kind, LoadKind::Release);
        assert_eq!(m.loads[0].remote_request_id, "r");
        assert!(s.is_idle());
    }

    #[test]
    fn roles_serve_the_other_kind_locally_but_reject_malformed_params() {
        let prompt = [1u32; 4];
        let consumer_params = json!({"do_remote_prefill": true, "remote_engine_id": "p0",
            "remote_request_id": "r", "remote_block_ids": [20],
            "remote_host": "h", "remote_port": 1, "tp_size": 1});
        let mut s = sched(KvRole::Producer);
        let r = req(1, &prompt, Some(&consumer_params));
        assert_eq!(
            s.get_num_new_matched_tokens(&r, 0).unwrap(),
            MatchedTokens::default()
        );
        s.update_state_after_alloc(&r, &[vec![1]], 0);
        assert_eq!(
            s.request_finished(&r, &[vec![1]], FinishKind::Normal),
            FinishedAction::default()
        );
        assert!(meta(&mut s).is_empty() && s.is_idle());

        let mut s = sched(KvRole::Consumer);
        let p = json!({"do_remote_decode": true});
        let r = req(2, &prompt, Some(&p));
        assert_eq!(
            s.get_num_new_matched_tokens(&r, 0).unwrap(),
            MatchedTokens::default()
        );
        assert_eq!(
            s.request_finished(&r, &[vec![1]], FinishKind::Normal),
            FinishedAction::default()
        );
        assert!(meta(&mut s).is_empty() && s.is_idle());

        let bad = json!({"do_remote_prefill": true, "remote_engine_id": "p0"});
        let r = req(3, &prompt, Some(&bad));
        assert!(matches!(
            s.get_num_new_matched_tokens(&r, 0),
            Err(KvConnectorError::InvalidTransferParams(_))
        ));
        assert_eq!(
            s.request_finished(&r, &[vec![]], FinishKind::Aborted),
            FinishedAction::default()
        );
        assert!(s.is_idle());
    }
}
