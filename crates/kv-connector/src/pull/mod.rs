//! The NIXL pull connector (vLLM's `NixlConnector` in pull mode): the consumer READs the
//! prompt's KV from the producer's blocks, then notifies it so it frees them.
//!
//! - [`scheduler`]: [`NixlPullScheduler`], leases for producer requests, loads for consumer
//!   requests, the `kv_transfer_params` a producer answers.
//! - [`worker`]: [`NixlPullWorker`], the NIXL agent, leases and notifications, and the transfer
//!   thread ([`loader`]) that fetches handshakes and runs READs off the engine thread.
//! - [`protocol`]: the per-step metadata and the notification format.
//!
//! A request, end to end: the producer answers `kv_transfer_params` (`do_remote_prefill`,
//! `remote_engine_id`, `remote_request_id`, `remote_block_ids`, `remote_host`, `remote_port`,
//! `tp_size`) and holds the blocks under a lease; the consumer, the first time it meets that
//! producer, fetches `GET http://{remote_host}:{remote_port}/v1/kv/handshake` (the server serves
//! [`HandshakeProvider::json`] there) and accepts it only if the engine id matches and the peer is
//! compatible; then it sends `renew`, posts one READ with `done` attached, and reports the
//! request loaded (or failed, with a reason). The producer frees on `done` or lease expiry.
//!
//! Security ([`access`]): a consumer reads only blocks the producer leased for the params it
//! was given, once (the claim), and with a deployment secret only params the producer signed,
//! from producers in `allowed_producers`; the handshake (which carries the NIXL metadata a READ
//! needs) is served only to signed requests then. NIXL itself does not authenticate peers: a
//! process that has the handshake and reaches UCX can read the registered memory, which is why
//! an instance without a secret listens on loopback only (the server enforces it).
//!
//! Invariants: [`nixl_pull_connector`] loads NIXL before anything else touches it (and fails
//! with the library's error if it cannot); the handshake is published once, when the worker
//! registers its KV caches, and never changes afterwards.

pub mod access;
pub mod fault;
pub mod leases;
pub mod loader;
pub mod protocol;
pub mod scheduler;
pub mod worker;

use std::sync::{Arc, OnceLock};

pub use access::{KvAdmission, KvPeerService, CLAIM_PATH, RELEASE_PATH};
pub use leases::{LeaseTable, ReleaseOutcome};
pub use loader::LoaderConfig;
pub use protocol::{LeaseSpec, LoadKind, LoadSpec, PeerAddr, PullMetadata, PullNotif};
pub use scheduler::{NixlPullScheduler, PullSchedulerConfig, PullSchedulerStats};
pub use worker::{NixlPullWorker, PullWorkerConfig};

use crate::auth::TransferAuth;
use crate::base::{KvConnectorScheduler, KvConnectorWorker};
use crate::config::{KvMode, KvTransferConfig};
use crate::error::KvConnectorError;
use crate::nixl::{load_nixl, NixlAgentConfig, NixlLibrary};

/// Where a producer serves its handshake (on its OpenAI HTTP port).
pub const HANDSHAKE_PATH: &str = "/v1/kv/handshake";

/// This instance's handshake, for the server's `GET /v1/kv/handshake` route: cheap to clone,
/// shared with the worker, which publishes the JSON once its agent exists.
#[derive(Debug, Clone, Default)]
pub struct HandshakeProvider(Arc<OnceLock<String>>);

impl HandshakeProvider {
    pub fn new() -> Self {
        Self::default()
    }

    /// The handshake JSON ([`crate::nixl::NixlHandshake::to_json`]); `None` until the worker
    /// registered its KV caches (answer 503 then).
    pub fn json(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }

    pub(crate) fn publish(&self, json: String) {
        if self.0.set(json).is_err() {
            tracing::warn!("the NIXL handshake was already published; keeping the first");
        }
    }
}

/// The parts of a NIXL connector (pull or push), ready to be given to the engine and the server.
#[derive(Debug)]
pub struct NixlConnectorParts<S, W> {
    pub scheduler: S,
    /// Creates its NIXL agent in `register_kv_caches`.
    pub worker: W,
    /// Serve [`HandshakeProvider::json`] at [`HANDSHAKE_PATH`] (through [`Self::peer_service`]).
    pub handshake: HandshakeProvider,
    /// The instance's KV routes: handshake, claim, release (and push registrations).
    pub peer_service: KvPeerService,
    /// The consumer's check of a request's params, before the engine sees them.
    pub admission: KvAdmission,
    /// The NIXL library this process loaded (for the startup log).
    pub library: NixlLibrary,
}

/// The pull connector's parts.
pub type NixlPullConnector = NixlConnectorParts<NixlPullScheduler, NixlPullWorker>;

impl<S, W> NixlConnectorParts<S, W>
where
    S: KvConnectorScheduler + 'static,
    W: KvConnectorWorker + 'static,
{
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

/// Builds the pull connector of one instance (TP 1): `model_name` is what `/v1/models` serves
/// (part of the handshake's compatibility hash), `block_size` the KV cache's tokens per block,
/// `http_port` the port the server is bound to (advertised as `remote_port`; not 0).
///
/// Call it at startup, before the engine's threads exist: it loads NIXL first and returns
/// [`KvConnectorError::NixlLibraryNotFound`] / [`KvConnectorError::NixlLibraryLoad`] if it
/// cannot. The agent itself is created when the engine registers its KV caches with the worker.
pub fn nixl_pull_connector(
    config: &KvTransferConfig,
    model_name: &str,
    block_size: usize,
    http_port: u16,
    auth: Option<TransferAuth>,
) -> Result<NixlPullConnector, KvConnectorError> {
    let shared = SharedParts::new(config, model_name, auth, KvMode::Pull, http_port)?;
    let extra = &config.kv_connector_extra_config;
    let lease_table = LeaseTable::new();
    let scheduler = NixlPullScheduler::with_lease_table(
        PullSchedulerConfig {
            role: config.kv_role,
            engine_id: config.engine_id.clone(),
            block_size,
            side_channel_host: extra.side_channel_host.clone(),
            http_port,
            kv_lease_duration: extra.kv_lease_duration,
            auth: shared.auth.clone(),
            tp_size: 1,
        },
        lease_table.clone(),
    )?;
    let worker = NixlPullWorker::new(
        shared.worker_config.clone(),
        shared.handshake.clone(),
        lease_table.clone(),
    );
    Ok(shared.finish(scheduler, worker, lease_table))
}

/// What the pull and push connectors build alike: NIXL loaded first, the worker's config (its
/// agent's included), the handshake, the admission check.
pub(crate) struct SharedParts {
    pub library: NixlLibrary,
    pub worker_config: PullWorkerConfig,
    pub handshake: HandshakeProvider,
    pub admission: KvAdmission,
    pub auth: Option<TransferAuth>,
    engine_id: String,
}

impl SharedParts {
    pub fn new(
        config: &KvTransferConfig,
        model_name: &str,
        auth: Option<TransferAuth>,
        mode: KvMode,
        http_port: u16,
    ) -> Result<Self, KvConnectorError> {
        let extra = &config.kv_connector_extra_config;
        let library = load_nixl(extra.nixl_lib_dir.as_deref())?;
        let mut agent = NixlAgentConfig::new(&config.engine_id, model_name);
        agent.lib_dir = extra.nixl_lib_dir.clone();
        agent.progress_thread = config.progress_thread();
        agent.kv_mode = mode;
        let worker_config = PullWorkerConfig {
            role: config.kv_role,
            agent,
            kv_lease_duration: extra.kv_lease_duration,
            load_timeout: extra.load_timeout,
            handshake_timeout: extra.handshake_timeout,
            read_chunk_bytes: extra.read_chunk_bytes,
            read_chunks_in_flight: extra.read_chunks_in_flight,
            auth: auth.clone(),
            transport_fault: extra.transport_fault_injection,
        };
        let admission = KvAdmission::new(auth.clone(), extra.producer_allowlist(auth.is_some()));
        tracing::info!(role = config.kv_role.as_str(), mode = mode.as_str(),
            engine_id = %config.engine_id, side_channel_host = %extra.side_channel_host,
            http_port, library = %library.path.display(), signed = auth.is_some(),
            "NIXL connector configured");
        Ok(SharedParts {
            library,
            worker_config,
            handshake: HandshakeProvider::new(),
            admission,
            auth,
            engine_id: config.engine_id.clone(),
        })
    }

    /// The connector's parts around its two sides; `leases` backs its KV routes.
    pub fn finish<S, W>(
        self,
        scheduler: S,
        worker: W,
        leases: LeaseTable,
    ) -> NixlConnectorParts<S, W> {
        let peer_service =
            KvPeerService::new(self.engine_id, self.handshake.clone(), leases, self.auth);
        NixlConnectorParts {
            scheduler,
            worker,
            handshake: self.handshake,
            peer_service,
            admission: self.admission,
            library: self.library,
        }
    }
}
