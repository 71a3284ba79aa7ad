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
use crate::base::{KvConnectorScheduler, KvConnectorWorker};
use crate::config::{KvMode, KvTransferConfig};
use crate::error::KvConnectorError;
use crate::nixl::{load_nixl, NixlAgentConfig, NixlLibrary};
use crate::pull::{HandshakeProvider, KvAdmission, KvPeerService, LeaseTable, PullWorkerConfig};

/// Where a push producer accepts registrations (on its OpenAI HTTP port).
pub const REGISTER_PATH: &str = "/v1/kv/push/register";

/// The parts of a push connector, ready to be given to the engine and the server.
#[derive(Debug)]
pub struct NixlPushConnector {
    pub scheduler: NixlPushScheduler,
    pub worker: NixlPushWorker,
    pub handshake: HandshakeProvider,
    /// The KV routes: handshake, registration.
    pub peer_service: KvPeerService,
    pub admission: KvAdmission,
    pub library: NixlLibrary,
}

impl NixlPushConnector {
    /// The parts as the engine takes them.
    pub fn into_parts(
        self,
    ) -> (
        Box<dyn KvConnectorScheduler>,
        Box<dyn KvConnectorWorker>,
        KvPeerService,
        KvAdmission,
    ) {
        (
            Box::new(self.scheduler),
            Box::new(self.worker),
            self.peer_service,
            self.admission,
        )
    }
}

/// Builds the push connector of one instance (TP 1); the arguments are those of
/// [`crate::pull::nixl_pull_connector`]. Loads NIXL first.
pub fn nixl_push_connector(
    config: &KvTransferConfig,
    model_name: &str,
    block_size: usize,
    http_port: u16,
    auth: Option<TransferAuth>,
) -> Result<NixlPushConnector, KvConnectorError> {
    let extra = &config.kv_connector_extra_config;
    let library = load_nixl(extra.nixl_lib_dir.as_deref())?;
    let scheduler = NixlPushScheduler::new(PushSchedulerConfig {
        role: config.kv_role,
        engine_id: config.engine_id.clone(),
        block_size,
        side_channel_host: extra.side_channel_host.clone(),
        http_port,
        kv_lease_duration: extra.kv_lease_duration,
        load_timeout: extra.load_timeout,
    })?;
    let mut agent = NixlAgentConfig::new(&config.engine_id, model_name);
    agent.lib_dir = extra.nixl_lib_dir.clone();
    agent.progress_thread = config.progress_thread();
    agent.kv_mode = KvMode::Push;
    let handshake = HandshakeProvider::new();
    let registry = PushRegistry::new(extra.kv_lease_duration);
    let worker = NixlPushWorker::new(
        PullWorkerConfig {
            role: config.kv_role,
            agent,
            kv_lease_duration: extra.kv_lease_duration,
            load_timeout: extra.load_timeout,
            handshake_timeout: extra.handshake_timeout,
            auth: auth.clone(),
            transport_fault: extra.transport_fault_injection,
        },
        handshake.clone(),
        registry.clone(),
    );
    let peer_service = KvPeerService::new(
        config.engine_id.clone(),
        handshake.clone(),
        LeaseTable::new(),
        auth.clone(),
    )
    .with_push_registry(registry);
    let admission = KvAdmission::new(auth.clone(), extra.producer_allowlist(auth.is_some()));
    tracing::info!(role = config.kv_role.as_str(), engine_id = %config.engine_id,
        side_channel_host = %extra.side_channel_host, http_port,
        library = %library.path.display(), signed = auth.is_some(),
        "NIXL push connector configured");
    Ok(NixlPushConnector {
        scheduler,
        worker,
        handshake,
        peer_service,
        admission,
        library,
    })
}
