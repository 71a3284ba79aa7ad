//! The NIXL push connector (`"kv_connector": "NixlPushConnector"`): the consumer registers its
//! blocks with the producer when the request arrives, and the producer WRITEs the prompt's KV
//! into them as soon as its prefill is done, so the transfer overlaps the consumer's queueing
//! instead of following the producer's answer.
//!
//! - [`scheduler`]: [`NixlPushScheduler`], push specs for finished producer requests,
//!   registrations for consumer requests, the connector-owned checksum carrier.
//! - [`worker`]: [`NixlPushWorker`], the NIXL agent, matching registrations with finished
//!   requests, WRITEs and their completion notifications (on the transfer thread shared with
//!   pull mode), load deadlines.
//! - [`registry`]: [`PushRegistry`], the registrations the producer's HTTP route accepted.
//! - [`protocol`]: the registration body, the notifications, the per-step metadata.
//!
//! A request, end to end: the proxy sends the same request to a producer
//! (`{"do_remote_decode": true, "transfer_id": T}`) and a consumer (`{"do_remote_prefill": true,
//! "transfer_id": T, "remote_host", "remote_port"}`) at once. The consumer allocates the
//! prompt's blocks, fetches the producer's handshake (checking mode and version), and POSTs its
//! [`protocol::Registration`] to [`REGISTER_PATH`]. The producer prefills; when the request
//! finishes it fetches the consumer's handshake (signed), WRITEs the blocks with the completion
//! notification attached (carrying the checksums), and frees them when the WRITE completes. The
//! consumer's notification ends the load; it verifies the checksums and decodes.
//!
//! Failures end the same way as pull's: a registration refused or a WRITE that fails tells the
//! consumer, which fails or recomputes by `kv_load_failure_policy`; a producer that never
//! writes (dead, or never got the request) lets the consumer's load time out; a consumer that
//! never registers (or dies) lets the producer's hold expire after `kv_lease_duration`.

pub mod protocol;
pub mod registry;
pub mod scheduler;
pub mod worker;

pub use protocol::{PushMetadata, PushNotif, PushSpec, RegisterSpec, Registration};
pub use registry::PushRegistry;
pub use scheduler::{NixlPushScheduler, PushSchedulerConfig, PushSchedulerStats};
pub use worker::NixlPushWorker;

use crate::auth::TransferAuth;
use crate::config::{KvMode, KvTransferConfig};
use crate::error::KvConnectorError;
use crate::pull::{LeaseTable, NixlConnectorParts, SharedParts};

/// Where a push producer accepts registrations (on its OpenAI HTTP port).
pub const REGISTER_PATH: &str = "/v1/kv/push/register";

/// The push connector's parts.
pub type NixlPushConnector = NixlConnectorParts<NixlPushScheduler, NixlPushWorker>;

/// Builds the push connector of one instance (TP 1); the arguments are those of
/// [`crate::pull::nixl_pull_connector`]. Loads NIXL first.
pub fn nixl_push_connector(
    config: &KvTransferConfig,
    model_name: &str,
    block_size: usize,
    http_port: u16,
    auth: Option<TransferAuth>,
) -> Result<NixlPushConnector, KvConnectorError> {
    let shared = SharedParts::new(config, model_name, auth, KvMode::Push, http_port)?;
    let extra = &config.kv_connector_extra_config;
    let scheduler = NixlPushScheduler::new(PushSchedulerConfig {
        role: config.kv_role,
        engine_id: config.engine_id.clone(),
        block_size,
        side_channel_host: extra.side_channel_host.clone(),
        http_port,
        kv_lease_duration: extra.kv_lease_duration,
        load_timeout: extra.load_timeout,
    })?;
    let registry = PushRegistry::new(extra.kv_lease_duration);
    let worker = NixlPushWorker::new(
        shared.worker_config.clone(),
        shared.handshake.clone(),
        registry.clone(),
    );
    let mut parts = shared.finish(scheduler, worker, LeaseTable::new());
    parts.peer_service = parts.peer_service.with_push_registry(registry);
    Ok(parts)
}
