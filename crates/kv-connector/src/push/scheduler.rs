//! [`NixlPushScheduler`]: the scheduler side of the NIXL push connector.
//!
//! - Producer requests (`do_remote_decode` with a `transfer_id`): no external tokens. When one
//!   finishes normally its prompt's blocks are held (`delay_free`) and handed to the workers as
//!   a [`PushSpec`] (with the KV checksums `send_kv_checksums` attaches in the same call), to be
//!   written into the blocks the consumer registers; an aborted one tells the workers, which
//!   refuse or fail its registration.
//! - Consumer requests (`do_remote_prefill` with a `transfer_id`): every prompt token past the
//!   local prefix hit is external and arrives asynchronously. After allocation the local blocks
//!   `table[local/bs .. cdiv(prompt, bs)]` are registered with the producer.
//! - The checksums travel with the KV (the connector-owned carrier): the producer's in its
//!   WRITE's notification, the consumer's workers report them with the finished load.
//!
//! Invariants:
//! - A consumer request is in `loading` from its registration's hand-off until the workers
//!   report it in `finished_recving`. If it ends meanwhile, `request_finished` returns
//!   `delay_free` and the workers report it in `finished_sending` once nothing can write into
//!   its blocks any more (the producer's WRITE landed or failed, or its window passed).
//! - A producer request is in `pushing` from its normal finish until the workers report it in
//!   `finished_sending` (written, failed, released, or expired unregistered).
//! - A consumer request that needs nothing, or ends before its registration, registers no
//!   blocks (a release), so the producer frees at once.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tandem_kv_cache::BlockId;

use super::protocol::{ConsumerAddr, PushMetadata, PushSpec, RegisterSpec, Registration};
use crate::base::{
    remote_prompt_tokens, ConnectorMetadata, ConnectorOutput, ConnectorRequest, ConsumerEnd,
    ConsumerLoads, FinishKind, FinishedAction, KvChecksumCarrier, KvConnectorScheduler,
    MatchedTokens,
};
use crate::config::{KvMode, KvRole};
use crate::error::KvConnectorError;
use crate::params::{RemotePush, TransferRequest};
use crate::pull::PeerAddr;

/// What the scheduler side needs to know about its instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushSchedulerConfig {
    pub role: KvRole,
    pub engine_id: String,
    pub block_size: usize,
    /// Where producers reach this instance (its handshake): host …
    pub side_channel_host: String,
    /// … and HTTP port.
    pub http_port: u16,
    /// How long a producer holds a finished request's blocks for its registration.
    pub kv_lease_duration: Duration,
    /// How long a consumer waits for the WRITE after registering (`valid_ms`).
    pub load_timeout: Duration,
}

/// Request counts the scheduler side still tracks (all zero when idle).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PushSchedulerStats {
    pub loading: usize,
    pub cancelled: usize,
    pub pushing: usize,
    pub consumers: usize,
}

/// The scheduler side of the push connector. See the module docs.
#[derive(Debug)]
pub struct NixlPushScheduler {
    config: PushSchedulerConfig,
    /// Consumer requests and their loads.
    loads: ConsumerLoads,
    /// Producer requests holding blocks: engine id → transfer id.
    pushing: HashMap<u64, String>,
    pending: PushMetadata,
}

impl NixlPushScheduler {
    pub fn new(config: PushSchedulerConfig) -> Result<Self, KvConnectorError> {
        if config.block_size == 0 {
            return Err(KvConnectorError::InvalidConfig("block size 0".into()));
        }
        if config.http_port == 0 {
            return Err(KvConnectorError::InvalidConfig(
                "the advertised HTTP port is 0; pass the port the server is bound to".into(),
            ));
        }
        Ok(NixlPushScheduler {
            config,
            loads: ConsumerLoads::default(),
            pushing: HashMap::new(),
            pending: PushMetadata::default(),
        })
    }

    pub fn config(&self) -> &PushSchedulerConfig {
        &self.config
    }

    pub fn stats(&self) -> PushSchedulerStats {
        PushSchedulerStats {
            loading: self.loads.counts().0,
            cancelled: self.loads.counts().1,
            pushing: self.pushing.len(),
            consumers: self.loads.counts().2,
        }
    }

    pub fn is_idle(&self) -> bool {
        self.stats() == PushSchedulerStats::default() && self.pending.is_empty()
    }

    fn parse(&self, request: &ConnectorRequest<'_>) -> Result<TransferRequest, KvConnectorError> {
        let t = TransferRequest::parse(
            request.kv_transfer_params,
            request.prompt_token_ids.len(),
            self.config.block_size,
        )?;
        t.check_mode(KvMode::Push)?;
        Ok(t)
    }

    /// A registration of `block_ids` (positions `first_block ..`; empty: a release).
    fn register(
        &mut self,
        request: &ConnectorRequest<'_>,
        remote: &RemotePush,
        first_block: usize,
        block_ids: Vec<BlockId>,
    ) {
        let registration = Registration {
            transfer_id: remote.transfer_id.clone(),
            consumer: ConsumerAddr {
                engine_id: self.config.engine_id.clone(),
                host: self.config.side_channel_host.clone(),
                port: self.config.http_port,
            },
            num_tokens: request.prompt_token_ids.len(),
            block_size: self.config.block_size,
            first_block,
            block_ids,
            valid_ms: self.config.load_timeout.as_millis().max(1) as u64,
        };
        self.pending.registrations.push(RegisterSpec {
            request_id: request.request_id,
            producer: PeerAddr {
                host: remote.remote_host.clone(),
                port: remote.remote_port,
                engine_id: remote.remote_engine_id.clone().unwrap_or_default(),
            },
            registration,
        });
    }
}

impl KvConnectorScheduler for NixlPushScheduler {
    fn carries_kv_checksums(&self) -> bool {
        true
    }

    fn kv_checksum_carrier(
        &self,
        request: &ConnectorRequest<'_>,
        receiving: bool,
    ) -> Option<KvChecksumCarrier> {
        match (self.parse(request).ok()?, receiving) {
            (TransferRequest::PushProducer { .. }, false) if self.config.role.is_producer() => {
                Some(KvChecksumCarrier::Connector)
            }
            (TransferRequest::PushConsumer(_), true) if self.config.role.is_consumer() => {
                Some(KvChecksumCarrier::Connector)
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
            TransferRequest::PushConsumer(_) if self.config.role.is_consumer() => {}
            TransferRequest::PushConsumer(_) => {
                tracing::warn!(request = %request.external_id, role = self.config.role.as_str(),
                    "push do_remote_prefill on an instance that is not a consumer; prefilling locally");
                return Ok(MatchedTokens::default());
            }
            TransferRequest::PushProducer { .. } if !self.config.role.is_producer() => {
                tracing::warn!(request = %request.external_id, role = self.config.role.as_str(),
                    "push do_remote_decode on an instance that is not a producer; serving it locally");
                return Ok(MatchedTokens::default());
            }
            _ => return Ok(MatchedTokens::default()),
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
        let Ok(TransferRequest::PushConsumer(remote)) = self.parse(request) else {
            return;
        };
        let id = request.request_id;
        self.loads.start(id, num_external_tokens > 0);
        if num_external_tokens == 0 {
            // Served locally after all: the producer may free now.
            self.register(request, &remote, 0, Vec::new());
            return;
        }
        let bs = self.config.block_size;
        let prompt_len = request.prompt_token_ids.len();
        let local_computed = prompt_len.saturating_sub(num_external_tokens);
        let (first, end) = (local_computed / bs, prompt_len.div_ceil(bs));
        let block_ids = shared_table(block_tables).unwrap_or(&[]);
        if !local_computed.is_multiple_of(bs) || block_ids.len() < end {
            let reason = format!(
                "cannot place the load: {num_external_tokens} external of {prompt_len} prompt \
                 tokens, {} local blocks in {} tables (push runs one), block size {bs}",
                block_ids.len(),
                block_tables.len()
            );
            tracing::error!(request = %request.external_id, "{reason}");
            self.register(request, &remote, 0, Vec::new());
            self.pending.rejected.push((id, reason));
            return;
        }
        self.register(request, &remote, first, block_ids[first..end].to_vec());
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
            self.pushing.remove(id);
        }
    }

    fn send_kv_checksums(&mut self, request: &ConnectorRequest<'_>, payload: &str) {
        match self
            .pending
            .pushes
            .iter_mut()
            .find(|p| p.request_id == request.request_id)
        {
            Some(push) => push.kv_checksums = Some(payload.to_string()),
            None => tracing::debug!(request = %request.external_id,
                "KV checksums of a request with nothing to push dropped"),
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
        let Ok(kind) = self.parse(request) else {
            return FinishedAction::default();
        };
        match kind {
            TransferRequest::PushConsumer(remote) if self.config.role.is_consumer() => {
                // Ended before it registered: the producer may free as soon as it finishes.
                self.register(request, &remote, 0, Vec::new());
                FinishedAction::default()
            }
            TransferRequest::PushProducer { transfer_id } if self.config.role.is_producer() => {
                let n = request
                    .prompt_token_ids
                    .len()
                    .div_ceil(self.config.block_size);
                let block_ids = shared_table(block_tables).unwrap_or(&[]);
                if finish != FinishKind::Normal || block_ids.len() < n {
                    if finish == FinishKind::Normal {
                        tracing::error!(request = %request.external_id, blocks = block_ids.len(),
                            tables = block_tables.len(), needed = n,
                            "producer request finished without its prompt's blocks in one \
                             block table (push runs one for every KV cache group)");
                    }
                    self.pending.aborted.push(transfer_id);
                    return FinishedAction::default();
                }
                self.pushing.insert(id, transfer_id.clone());
                self.pending.pushes.push(PushSpec {
                    request_id: id,
                    transfer_id,
                    block_ids: block_ids[..n].to_vec(),
                    num_tokens: request.prompt_token_ids.len(),
                    kv_checksums: None,
                    deadline: Instant::now() + self.config.kv_lease_duration,
                });
                FinishedAction {
                    delay_free: true,
                    kv_transfer_params: None,
                }
            }
            _ => FinishedAction::default(),
        }
    }
}

/// Push moves one block table that every KV cache group shares (the server runs one in push
/// mode); `None` for a table per group.
fn shared_table(block_tables: &[Vec<BlockId>]) -> Option<&[BlockId]> {
    match block_tables {
        [shared] => Some(shared),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn sched(role: KvRole) -> NixlPushScheduler {
        NixlPushScheduler::new(PushSchedulerConfig {
            role,
            engine_id: "d0".into(),
            block_size: 4,
            side_channel_host: "10.0.0.2".into(),
            http_port: 8200,
            kv_lease_duration: Duration::from_secs(30),
            load_timeout: Duration::from_secs(20),
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

    fn meta(s: &mut NixlPushScheduler) -> PushMetadata {
        match s.build_connector_meta().0 {
            None => PushMetadata::default(),
            Some(b) => *b.downcast::<PushMetadata>().unwrap(),
        }
    }

    #[test]
    fn producer_holds_its_prompt_blocks_for_the_push_with_its_checksums() {
        let mut s = sched(KvRole::Producer);
        let prompt = [1u32; 9];
        let p = json!({"do_remote_decode": true, "transfer_id": "t1"});
        let r = req(3, &prompt, Some(&p));
        assert_eq!(
            s.kv_checksum_carrier(&r, false),
            Some(KvChecksumCarrier::Connector)
        );
        assert_eq!(
            s.get_num_new_matched_tokens(&r, 0).unwrap(),
            MatchedTokens::default()
        );
        let a = s.request_finished(&r, &[vec![7, 8, 9, 10]], FinishKind::Normal);
        assert!(a.delay_free && a.kv_transfer_params.is_none());
        s.send_kv_checksums(&r, "CK");
        let m = meta(&mut s);
        assert_eq!(m.pushes.len(), 1);
        let push = &m.pushes[0];
        assert_eq!(
            (
                push.transfer_id.as_str(),
                &push.block_ids[..],
                push.num_tokens
            ),
            ("t1", &[7, 8, 9][..], 9)
        );
        assert_eq!(push.kv_checksums.as_deref(), Some("CK"));
        assert!(!s.is_idle());
        let mut out = ConnectorOutput::default();
        out.finished_sending.insert(3);
        s.update_connector_output(&out);
        assert!(s.is_idle());
        // Aborted: nothing held, the transfer is ended for the workers; checksums dropped.
        let r = req(4, &prompt, Some(&p));
        assert_eq!(
            s.request_finished(&r, &[vec![1, 2, 3]], FinishKind::Aborted),
            FinishedAction::default()
        );
        s.send_kv_checksums(&r, "CK");
        let m = meta(&mut s);
        assert!(m.pushes.is_empty());
        assert_eq!(m.aborted, vec!["t1".to_string()]);
    }

    #[test]
    fn consumer_registers_the_blocks_past_its_local_hit() {
        let mut s = sched(KvRole::Consumer);
        let prompt = [1u32; 10];
        let p = json!({"do_remote_prefill": true, "transfer_id": "t9",
            "remote_host": "10.0.0.1", "remote_port": 8100});
        let r = req(5, &prompt, Some(&p));
        assert_eq!(
            s.kv_checksum_carrier(&r, true),
            Some(KvChecksumCarrier::Connector)
        );
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
        assert_eq!(m.registrations.len(), 1);
        let reg = &m.registrations[0];
        assert_eq!(reg.producer.host, "10.0.0.1");
        assert_eq!(reg.producer.engine_id, "", "not pinned");
        let g = &reg.registration;
        assert_eq!((g.first_block, &g.block_ids[..]), (1, &[31, 32][..]));
        assert_eq!((g.num_tokens, g.block_size, g.valid_ms), (10, 4, 20_000));
        assert_eq!(
            (
                g.consumer.host.as_str(),
                g.consumer.port,
                g.consumer.engine_id.as_str()
            ),
            ("10.0.0.2", 8200, "d0")
        );
        // Ending mid-load holds the blocks until the workers release them.
        let a = s.request_finished(&r, &[vec![30, 31, 32]], FinishKind::Aborted);
        assert!(a.delay_free);
        assert_eq!(meta(&mut s).cancelled_loads, vec![5]);
        let mut out = ConnectorOutput::default();
        out.finished_sending.insert(5);
        s.update_connector_output(&out);
        assert!(s.is_idle());
        // Ending before allocation registers nothing: a release.
        let r = req(6, &prompt, Some(&p));
        s.request_finished(&r, &[vec![]], FinishKind::Aborted);
        let m = meta(&mut s);
        assert!(m.registrations[0].registration.block_ids.is_empty());
    }

    #[test]
    fn params_of_the_other_mode_are_refused_with_what_to_do() {
        let mut s = sched(KvRole::Both);
        let prompt = [1u32; 4];
        let pull = json!({"do_remote_prefill": true, "remote_engine_id": "p0",
            "remote_request_id": "r", "remote_block_ids": [20],
            "remote_host": "h", "remote_port": 1, "tp_size": 1});
        let e = s
            .get_num_new_matched_tokens(&req(1, &prompt, Some(&pull)), 0)
            .unwrap_err();
        assert!(e.to_string().contains("pull mode"), "{e}");
        assert!(e.to_string().contains("--kv-mode push"), "{e}");
        let p = json!({"do_remote_decode": true});
        assert!(s
            .get_num_new_matched_tokens(&req(2, &prompt, Some(&p)), 0)
            .is_err());
        assert!(s.is_idle());
    }
}
