//! [`NixlAgent`]: one NIXL agent with a UCX backend over one worker's KV memory, and the peers it
//! has completed a handshake with.
//!
//! On creation the agent registers the allocations holding every layer's K and V array (host
//! DRAM: each array; a GPU's VRAM: the device cache's allocations) and prepares, once, a local
//! descriptor list with one descriptor per block of every array. [`NixlAgent::add_peer`]
//! checks a peer's [`NixlHandshake`] against ours, loads its metadata and prepares the peer's
//! list the same way ("prepared once per peer"); transfers are then `make_xfer_req` over index
//! lists (see `transfer.rs`).
//!
//! Invariants:
//! - The agent never owns KV memory. It either holds an `Arc<KvStorage>` ([`NixlAgent::new`]) or
//!   the caller promises the memory outlives it ([`NixlAgent::with_memory`]). Registrations are
//!   dropped after the local prepared list and before the memory.
//! - A prepared list is released before the agent it came from is destroyed, and a peer's
//!   metadata is invalidated only when no transfer handle uses the peer any more: transfer handles
//!   hold the peer's and the local side's `Arc`, so removing a peer with transfers in flight is
//!   safe and takes effect when the last of them is dropped.
//! - The agent is `Send + Sync`; NIXL runs with `ThreadSync::Rw`, so threads may share it.
//! - Its progress thread (on by default) sleeps in `poll()` on UCX's event fd with a timeout of
//!   `progress_delay_us` (at least 1 ms), so an idle agent costs almost no CPU.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nixl_sys::{
    Agent, AgentConfig, MemType, NixlDescriptor, NotificationMap, RegistrationHandle, ThreadSync,
    XferDescList, XferDlistHandle,
};
use tandem_kv_cache::{Allocation, BlockLayout, KvPart, KvStorage, MemoryKind, MemoryRegion};

use super::descriptors::{DescTable, RegionGeometry, OWN_ALLOCATION};
use super::handshake::{HandshakeMismatch, LayerInfo, NixlHandshake, RegionInfo};
use super::library::{load_nixl, NixlLibrary};
use super::nixl_err;
use super::pairing::{pair_layers, Pairing};
use crate::base::RankKvCaches;
use crate::config::KvMode;
use crate::error::KvConnectorError;

/// How to create a [`NixlAgent`]; [`NixlAgentConfig::new`] gives the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlAgentConfig {
    /// This instance's engine id (goes into the handshake).
    pub engine_id: String,
    /// The served model's name (part of the compatibility hash).
    pub model: String,
    pub tp_rank: usize,
    pub tp_size: usize,
    /// Pull or push: published in the handshake; a peer of the other mode is refused.
    pub kv_mode: KvMode,
    /// The NIXL agent name; default `tandem-{engine_id}-tp{rank}-{pid}-{nonce}`, unique per
    /// process start so a restarted peer never reuses a name.
    pub agent_name: Option<String>,
    /// Directory of `libnixl_capi.so` (a `--nixl-lib-dir` flag); default: see `library.rs`.
    pub lib_dir: Option<PathBuf>,
    /// Run NIXL's progress thread. On (default): a passive peer (the producer of a READ, the
    /// target of a WRITE) answers flushes and receives notifications without calling NIXL.
    /// Off: nobody answers for this agent between its own NIXL calls, so peers' transfers from
    /// or into it stall; fine for an agent that only initiates (pull mode's consumer, push
    /// mode's producer), and faster there: UCX then runs single-threaded, without the locks
    /// that cost 3-13% on 16 cores and up to half the bandwidth on a loaded 2-core host
    /// (BENCHMARKS.md, "NIXL transfer"). Its own notifications still go out without further calls.
    pub progress_thread: bool,
    /// Longest sleep of the progress thread between event checks, in µs (NIXL rounds up to ms).
    pub progress_delay_us: u64,
    /// Extra UCX backend parameters (`get_plugin_params("UCX")` keys), e.g.
    /// `("ucx_error_handling_mode", "none")`.
    pub ucx_params: Vec<(String, String)>,
}

impl NixlAgentConfig {
    /// Defaults: TP 1 rank 0, generated agent name, library discovery, progress thread on with
    /// a 10 ms delay.
    pub fn new(engine_id: &str, model: &str) -> Self {
        NixlAgentConfig {
            engine_id: engine_id.to_string(),
            model: model.to_string(),
            tp_rank: 0,
            tp_size: 1,
            kv_mode: KvMode::Pull,
            agent_name: None,
            lib_dir: None,
            progress_thread: true,
            progress_delay_us: DEFAULT_PROGRESS_DELAY_US,
            ucx_params: Vec::new(),
        }
    }
}

/// Default [`NixlAgentConfig::progress_delay_us`]: the thread wakes on UCX events at once, so
/// the delay only bounds its sleep when idle (measured: 1 ms costs 1.5-2% of a core when idle,
/// 10 ms 0.5%, with the same one-block READ latency).
pub const DEFAULT_PROGRESS_DELAY_US: u64 = 10_000;

/// One layer of the memory an agent registers: its layout, name, its K and V arrays, and the
/// worker and model heads it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayerMemory {
    pub name: String,
    pub layout: BlockLayout,
    pub k: MemoryRegion,
    pub v: MemoryRegion,
    pub tp_rank: usize,
    pub pp_rank: usize,
    /// The model's KV heads of this cache, in its order.
    pub kv_heads: Vec<u32>,
    pub kv_replica: u32,
    /// The KV cache group of the layer (its block table).
    pub group: usize,
    /// Where its arrays live.
    pub memory: MemoryKind,
}

/// The layers of every worker's storage, worker by worker, each in storage order.
pub fn rank_layers(ranks: &[RankKvCaches]) -> Vec<KvLayerMemory> {
    ranks
        .iter()
        .flat_map(|r| {
            storage_layers(&r.storage)
                .into_iter()
                .map(|l| KvLayerMemory {
                    tp_rank: r.tp_rank,
                    pp_rank: r.pp_rank,
                    kv_heads: r.kv_heads.clone(),
                    kv_replica: r.kv_replica,
                    ..l
                })
        })
        .collect()
}

/// The layers of a storage, in storage order (of the only worker: every head).
pub fn storage_layers(storage: &KvStorage) -> Vec<KvLayerMemory> {
    let regions = storage.regions();
    (0..storage.num_layers())
        .map(|layer| {
            let find = |part| {
                *regions
                    .iter()
                    .find(|r| r.layer == layer && r.part == part)
                    .expect("KvStorage::regions covers K and V of every layer")
            };
            let layout = storage.layout(layer);
            KvLayerMemory {
                name: storage.layer_name(layer).to_string(),
                layout,
                k: find(KvPart::K),
                v: find(KvPart::V),
                tp_rank: 0,
                pp_rank: 0,
                kv_heads: (0..layout.num_kv_heads as u32).collect(),
                kv_replica: 0,
                group: storage.layer_group(layer),
                memory: storage.memory_kind(),
            }
        })
        .collect()
}

/// A region of host or device memory in the shape `nixl_sys` registers.
#[derive(Debug)]
struct Registered {
    addr: usize,
    len: usize,
    mem: MemType,
    device: u64,
}

impl nixl_sys::MemoryRegion for Registered {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Registered {
    fn mem_type(&self) -> MemType {
        self.mem
    }
    fn device_id(&self) -> u64 {
        self.device
    }
}

/// NIXL's name for a kind of memory, and the device id its descriptors carry.
fn nixl_memory(kind: MemoryKind) -> (MemType, u64) {
    match kind {
        MemoryKind::Host => (MemType::Dram, 0),
        MemoryKind::Device(d) => (MemType::Vram, d),
    }
}

/// The one kind of memory every layer of a side lives in (a side never mixes DRAM and VRAM).
fn side_memory(kinds: impl IntoIterator<Item = MemoryKind>) -> Result<MemType, KvConnectorError> {
    let mut types = kinds.into_iter().map(|k| nixl_memory(k).0);
    let first = types.next().unwrap_or(MemType::Dram);
    if types.any(|t| t != first) {
        return Err(KvConnectorError::InvalidRegions(
            "the KV memory mixes host and device arrays".into(),
        ));
    }
    Ok(first)
}

/// Builds a descriptor list of `mem` over `table` and prepares it for `agent_name` ("" = local).
fn prepare_dlist(
    agent: &Agent,
    agent_name: &str,
    table: &DescTable,
    mem: MemType,
) -> Result<XferDlistHandle, nixl_sys::NixlError> {
    let mut list = XferDescList::new(mem)?;
    for r in table.regions() {
        for b in 0..r.num_blocks {
            list.add_desc(r.desc_addr(b), r.block_bytes, r.device);
        }
    }
    agent.prepare_xfer_dlist(agent_name, &list, None)
}

/// The local side: registrations, the prepared local list, and what keeps the memory alive.
pub(crate) struct LocalSide {
    // Released in Drop, in this order, before `agent` and `_memory`.
    dlist: Option<XferDlistHandle>,
    /// Lists over the same memory in smaller blocks, by ratio (peers with smaller blocks).
    split: SplitLists,
    registrations: Vec<RegistrationHandle>,
    pub(crate) table: DescTable,
    pub(crate) mem: MemType,
    pub(crate) agent: Agent,
    _memory: Vec<Arc<KvStorage>>,
}

// SAFETY: the prepared list handle is immutable after creation and only passed to NIXL calls,
// which the agent serializes itself (ThreadSync::Rw); the handle is released once, in Drop.
unsafe impl Send for LocalSide {}
unsafe impl Sync for LocalSide {}

impl LocalSide {
    pub(crate) fn dlist(&self) -> &XferDlistHandle {
        self.dlist.as_ref().expect("present until drop")
    }

    /// The local memory as blocks `ratio` times smaller, prepared once per ratio.
    pub(crate) fn split_list(&self, ratio: usize) -> Result<Arc<SplitList>, KvConnectorError> {
        self.split
            .get(&self.agent, "", &self.table, self.mem, ratio)
    }
}

impl Drop for LocalSide {
    fn drop(&mut self) {
        drop(self.dlist.take());
        self.split.clear();
        self.registrations.clear();
    }
}

/// One side's memory described in smaller blocks (see [`DescTable::split`]).
pub(crate) struct SplitList {
    pub(crate) dlist: XferDlistHandle,
    pub(crate) table: DescTable,
}

// SAFETY: as for LocalSide (an immutable prepared list, used only in NIXL calls).
unsafe impl Send for SplitList {}
unsafe impl Sync for SplitList {}

/// A side's split lists, prepared once per split factor and kept until the side is dropped.
#[derive(Default)]
struct SplitLists(Mutex<HashMap<usize, Arc<SplitList>>>);

impl SplitLists {
    /// `table` cut in `factor`, prepared for `agent_name` ("" = local) on first use.
    fn get(
        &self,
        agent: &Agent,
        agent_name: &str,
        table: &DescTable,
        mem: MemType,
        factor: usize,
    ) -> Result<Arc<SplitList>, KvConnectorError> {
        let mut lists = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = lists.get(&factor) {
            return Ok(l.clone());
        }
        let table = table.split(factor)?;
        let dlist = prepare_dlist(agent, agent_name, &table, mem)
            .map_err(|e| nixl_err("split descriptor list preparation", e))?;
        let list = Arc::new(SplitList { dlist, table });
        lists.insert(factor, list.clone());
        Ok(list)
    }

    /// Releases the lists (before the side's memory or metadata goes).
    fn clear(&mut self) {
        self.0.get_mut().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// A peer whose handshake we accepted: its metadata is loaded and its list prepared.
pub(crate) struct PeerEntry {
    // Released in Drop before the metadata is invalidated and before `agent`.
    dlist: Option<XferDlistHandle>,
    pub(crate) name: String,
    pub(crate) engine_id: String,
    /// Tokens per block of the peer.
    pub(crate) block_size: usize,
    metadata: Vec<u8>,
    pub(crate) table: DescTable,
    pub(crate) mem: MemType,
    /// How our regions pair with the peer's, when our blocks are a multiple of its (we can move
    /// bytes with it); `None` otherwise.
    pub(crate) pairing: Option<Pairing>,
    /// The peer's memory in smaller units, by units per block (unit pairings).
    split: SplitLists,
    agent: Agent,
}

// SAFETY: as for LocalSide.
unsafe impl Send for PeerEntry {}
unsafe impl Sync for PeerEntry {}

impl PeerEntry {
    pub(crate) fn dlist(&self) -> &XferDlistHandle {
        self.dlist.as_ref().expect("present until drop")
    }

    /// The peer's memory as `units` units per block, prepared once per count.
    pub(crate) fn split_list(&self, units: usize) -> Result<Arc<SplitList>, KvConnectorError> {
        self.split
            .get(&self.agent, &self.name, &self.table, self.mem, units)
    }
}

impl Drop for PeerEntry {
    fn drop(&mut self) {
        drop(self.dlist.take());
        self.split.clear();
        if let Err(e) = self.agent.invalidate_remote_md(&self.name) {
            tracing::debug!(peer = %self.name, error = %e, "invalidating NIXL peer metadata failed");
        }
        tracing::debug!(peer = %self.name, engine = %self.engine_id, "NIXL peer removed");
    }
}

/// One NIXL agent over one worker's KV memory. See the module docs.
pub struct NixlAgent {
    // Field order is drop order: peers, then the local side, then the agent handle.
    peers: Mutex<HashMap<String, Arc<PeerEntry>>>,
    pub(crate) local: Arc<LocalSide>,
    config: NixlAgentConfig,
    name: String,
    layers: Vec<LayerInfo>,
    library: NixlLibrary,
    agent: Agent,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent")
            .field("name", &self.name)
            .field("engine_id", &self.config.engine_id)
            .field("layers", &self.layers.len())
            .field("peers", &self.peers().len())
            .finish()
    }
}

fn default_agent_name(config: &NixlAgentConfig) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "tandem-{}-tp{}-{}-{:x}{}",
        config.engine_id,
        config.tp_rank,
        std::process::id(),
        nonce,
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

impl NixlAgent {
    /// Creates an agent over `storage` (kept alive by the agent and its transfers), registering
    /// every layer's K and V arrays.
    pub fn new(config: NixlAgentConfig, storage: Arc<KvStorage>) -> Result<Self, KvConnectorError> {
        Self::for_ranks(config, vec![RankKvCaches::whole(storage)])
    }

    /// Creates one agent over every worker's storage of an instance (TP x PP: one agent per
    /// process), registering each layer's K and V arrays of each worker.
    pub fn for_ranks(
        mut config: NixlAgentConfig,
        ranks: Vec<RankKvCaches>,
    ) -> Result<Self, KvConnectorError> {
        let layers = rank_layers(&ranks);
        if ranks.len() > 1 {
            // one agent for the whole instance: the handshake's TP size is the instance's
            config.tp_size = ranks.iter().map(|r| r.tp_rank + 1).max().unwrap_or(1);
            config.tp_rank = 0;
        }
        let allocations = ranks
            .iter()
            .flat_map(|r| {
                let kind = r.storage.memory_kind();
                r.storage.allocations().into_iter().map(move |a| (a, kind))
            })
            .collect();
        let memory = ranks.into_iter().map(|r| r.storage).collect();
        // SAFETY: the agent and its transfers hold every storage, so the memory outlives them.
        unsafe { Self::create(config, layers, allocations, memory) }
    }

    /// Creates an agent over memory the caller owns: `layers` lying in `allocations` (what is
    /// registered), all in the memory the layers name.
    ///
    /// # Safety
    /// Every allocation must stay allocated, and must not be freed or moved, until this agent
    /// and every [`super::TransferHandle`] it returned are dropped. NIXL writes into the local
    /// blocks named by READs while they are in flight.
    pub unsafe fn with_memory(
        config: NixlAgentConfig,
        layers: Vec<KvLayerMemory>,
        allocations: Vec<Allocation>,
    ) -> Result<Self, KvConnectorError> {
        let kind = layers.first().map_or(MemoryKind::Host, |l| l.memory);
        let allocations = allocations.into_iter().map(|a| (a, kind)).collect();
        // SAFETY: forwarded to the caller.
        unsafe { Self::create(config, layers, allocations, Vec::new()) }
    }

    /// Registers `allocations` (which hold every region of `layers`) and prepares the lists.
    unsafe fn create(
        config: NixlAgentConfig,
        layers: Vec<KvLayerMemory>,
        allocations: Vec<(Allocation, MemoryKind)>,
        memory: Vec<Arc<KvStorage>>,
    ) -> Result<Self, KvConnectorError> {
        if layers.is_empty() {
            return Err(KvConnectorError::InvalidRegions("no layers".into()));
        }
        if config.tp_size == 0 || config.tp_rank >= config.tp_size {
            return Err(KvConnectorError::InvalidRegions(format!(
                "TP rank {} of size {}",
                config.tp_rank, config.tp_size
            )));
        }
        // Must come before any nixl_sys call: a missing library would abort the process.
        let library = load_nixl(config.lib_dir.as_deref())?;

        let mut geometry = Vec::with_capacity(2 * layers.len());
        let mut infos = Vec::with_capacity(layers.len());
        let mem = side_memory(layers.iter().map(|l| l.memory))?;
        for l in &layers {
            if l.k.block_stride != l.v.block_stride {
                // The handshake carries one stride per layer.
                return Err(KvConnectorError::InvalidRegions(format!(
                    "layer {}: K and V blocks at different strides ({} and {} bytes)",
                    l.name, l.k.block_stride, l.v.block_stride
                )));
            }
            let mut holders = [0u32; 2];
            for (part, r) in [l.k, l.v].into_iter().enumerate() {
                let bb = l.layout.block_bytes();
                let holder = allocations
                    .iter()
                    .position(|(a, _)| {
                        r.addr >= a.addr && r.addr.saturating_add(r.len) <= a.addr + a.len
                    })
                    .ok_or_else(|| {
                        KvConnectorError::InvalidRegions(format!(
                            "layer {}: a region of {} bytes at {:#x} lies in no allocation",
                            l.name, r.len, r.addr
                        ))
                    })?;
                holders[part] = holder as u32;
                geometry.push(RegionGeometry {
                    block_stride: r.block_stride,
                    device: nixl_memory(l.memory).1,
                    allocation: holder as u64,
                    ..RegionGeometry::array(r.addr, r.len, bb, l.layout.num_blocks, l.group)
                });
            }
            let info = |r: MemoryRegion| RegionInfo {
                addr: r.addr as u64,
                len: r.len as u64,
            };
            infos.push(LayerInfo {
                tp_rank: l.tp_rank,
                pp_rank: l.pp_rank,
                kv_heads: l.kv_heads.clone(),
                kv_replica: l.kv_replica,
                block_stride: l.k.block_stride,
                memory: l.memory.name().to_string(),
                device: nixl_memory(l.memory).1,
                allocations: Some(holders),
                ..LayerInfo::new(&l.name, &l.layout, info(l.k), info(l.v))
            });
        }
        let table = DescTable::new(geometry)?;

        let name = config
            .agent_name
            .clone()
            .unwrap_or_else(|| default_agent_name(&config));
        let cfg = AgentConfig {
            enable_prog_thread: config.progress_thread,
            enable_listen_thread: false,
            thread_sync: ThreadSync::Rw,
            pthr_delay_us: config.progress_delay_us,
            capture_telemetry: false,
            ..AgentConfig::default()
        };
        let agent =
            Agent::new_configured(&name, &cfg).map_err(|e| nixl_err("agent creation", e))?;
        let (_mems, mut params) =
            agent
                .get_plugin_params("UCX")
                .map_err(|e| KvConnectorError::Nixl {
                    op: "UCX plugin lookup",
                    reason: format!(
                        "{e} (is libplugin_UCX.so in the library's plugins/ directory?)"
                    ),
                })?;
        for (k, v) in &config.ucx_params {
            params.set(k, v).map_err(|e| nixl_err("UCX parameter", e))?;
        }
        agent
            .create_backend("UCX", &params)
            .map_err(|e| nixl_err("UCX backend creation", e))?;

        let mut registrations = Vec::with_capacity(allocations.len());
        for (a, kind) in &allocations {
            let (mem, device) = nixl_memory(*kind);
            let region = Registered {
                addr: a.addr,
                len: a.len,
                mem,
                device,
            };
            registrations.push(
                agent
                    .register_memory(&region, None)
                    .map_err(|e| nixl_err("memory registration", e))?,
            );
        }
        let dlist = prepare_dlist(&agent, "", &table, mem)
            .map_err(|e| nixl_err("local descriptor list preparation", e))?;
        let memory_name = layers[0].memory.name();
        tracing::info!(agent = %name, layers = layers.len(), descriptors = table.len(),
            memory = memory_name, registrations = registrations.len(),
            ucx_tls = %std::env::var("UCX_TLS").unwrap_or_else(|_| "(UCX default)".into()),
            cuda_ipc_get_zcopy = %std::env::var("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
                .unwrap_or_else(|_| "(UCX default)".into()),
            progress_thread = config.progress_thread, "NIXL agent ready");
        Ok(NixlAgent {
            peers: Mutex::new(HashMap::new()),
            local: Arc::new(LocalSide {
                dlist: Some(dlist),
                split: SplitLists::default(),
                registrations,
                table,
                mem,
                agent: agent.clone(),
                _memory: memory,
            }),
            config,
            name,
            layers: infos,
            library,
            agent,
        })
    }

    /// The NIXL agent name (peers see it as the sender of notifications).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn config(&self) -> &NixlAgentConfig {
        &self.config
    }

    /// The NIXL library this process loaded.
    pub fn library(&self) -> &NixlLibrary {
        &self.library
    }

    /// Blocks per array of the local cache.
    pub fn num_blocks(&self) -> usize {
        self.local.table.num_blocks()
    }

    /// The agent's metadata for peers (`get_local_md`), including its registered memory.
    pub fn metadata(&self) -> Result<Vec<u8>, KvConnectorError> {
        self.agent
            .get_local_md()
            .map_err(|e| nixl_err("metadata export", e))
    }

    /// Our handshake, to be served to peers.
    pub fn handshake(&self) -> Result<NixlHandshake, KvConnectorError> {
        Ok(self.handshake_with(self.metadata()?))
    }

    fn handshake_with(&self, agent_metadata: Vec<u8>) -> NixlHandshake {
        NixlHandshake::new(
            &self.config.engine_id,
            &self.name,
            agent_metadata,
            &self.config.model,
            self.config.tp_rank,
            self.config.tp_size,
            self.layers.clone(),
        )
        .with_kv_mode(self.config.kv_mode)
    }

    /// Accepts a peer: checks its handshake against ours, loads its metadata and prepares its
    /// descriptor list. Returns the peer's agent name, the key of every later call. Adding the
    /// same handshake again is a no-op.
    pub fn add_peer(&self, peer: &NixlHandshake) -> Result<String, KvConnectorError> {
        // Our metadata plays no part in the comparison.
        self.handshake_with(Vec::new()).check_compatible(peer)?;
        if peer.agent_name == self.name {
            return Err(KvConnectorError::InvalidHandshake(
                "the peer is this agent itself".into(),
            ));
        }
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = peers.get(&peer.agent_name) {
            if existing.metadata == peer.agent_metadata {
                return Ok(existing.name.clone());
            }
            return Err(KvConnectorError::InvalidHandshake(format!(
                "peer agent {:?} is already loaded with other metadata; remove it first",
                peer.agent_name
            )));
        }
        let mut geometry = Vec::with_capacity(2 * peer.layers.len());
        for l in &peer.layers {
            for (part, r) in [l.k, l.v].into_iter().enumerate() {
                geometry.push(RegionGeometry {
                    block_stride: l.stride(),
                    device: l.device,
                    // A peer that names no allocations has each array in its own; ids it names
                    // only decide where runs may merge (NIXL checks every descriptor against
                    // the peer's registrations).
                    allocation: l.allocations.map_or(OWN_ALLOCATION, |a| a[part] as u64),
                    // Transfers pick ids by the local region's group.
                    ..RegionGeometry::array(
                        r.addr as usize,
                        r.len as usize,
                        l.block_bytes,
                        l.num_blocks,
                        0,
                    )
                });
            }
        }
        // validate() (in check_compatible) made every layer's memory the first's.
        let peer_mem = match peer.layers.first().map(|l| l.memory.as_str()) {
            Some("vram") => MemType::Vram,
            _ => MemType::Dram,
        };
        let table = DescTable::new(geometry)?;
        // Different block sizes (checked compatible above) pair in the smaller one; different
        // parallel layouts pair by layer name and model head.
        let ours = self.block_size();
        let pairing = if ours >= peer.block_size {
            let pairing = pair_layers(&self.layers, &peer.layers, ours, peer.block_size).map_err(
                |mismatch| KvConnectorError::IncompatiblePeer {
                    engine_id: peer.engine_id.clone(),
                    mismatch,
                },
            )?;
            if pairing == Pairing::Regions {
                self.local
                    .table
                    .split(ours / peer.block_size)?
                    .check_pairs_with(&table)?;
            }
            Some(pairing)
        } else {
            if peer.layers.len() == self.layers.len() {
                self.local
                    .table
                    .check_pairs_with(&table.split(peer.block_size / ours)?)?;
            }
            None
        };

        let loaded = self
            .agent
            .load_remote_md(&peer.agent_metadata)
            .map_err(|e| nixl_err("peer metadata load", e))?;
        let invalidate = |name: &str| {
            let _ = self.agent.invalidate_remote_md(name);
        };
        if loaded != peer.agent_name {
            invalidate(&loaded);
            return Err(KvConnectorError::InvalidHandshake(format!(
                "metadata is of agent {loaded:?}, handshake says {:?}",
                peer.agent_name
            )));
        }
        let dlist = match prepare_dlist(&self.agent, &loaded, &table, peer_mem) {
            Ok(d) => d,
            Err(e) => {
                invalidate(&loaded);
                return Err(KvConnectorError::InvalidHandshake(format!(
                    "the peer's regions are not covered by its registered memory ({e})"
                )));
            }
        };
        tracing::info!(peer = %loaded, engine = %peer.engine_id, "NIXL peer added");
        peers.insert(
            loaded.clone(),
            Arc::new(PeerEntry {
                dlist: Some(dlist),
                name: loaded.clone(),
                engine_id: peer.engine_id.clone(),
                block_size: peer.block_size,
                metadata: peer.agent_metadata.clone(),
                table,
                mem: peer_mem,
                pairing,
                split: SplitLists::default(),
                agent: self.agent.clone(),
            }),
        );
        Ok(loaded)
    }

    /// Forgets a peer. Its metadata is invalidated once the last transfer handle to it is
    /// dropped. Returns whether it was known.
    pub fn remove_peer(&self, peer: &str) -> bool {
        let removed = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(peer);
        removed.is_some()
    }

    /// Agent names of the accepted peers.
    pub fn peers(&self) -> Vec<String> {
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<String> = peers.keys().cloned().collect();
        names.sort();
        names
    }

    pub fn has_peer(&self, peer: &str) -> bool {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(peer)
    }

    /// The engine id a peer's handshake named.
    pub fn peer_engine_id(&self, peer: &str) -> Option<String> {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(peer)
            .map(|p| p.engine_id.clone())
    }

    /// Blocks per array of a peer's cache.
    /// Tokens per block of this agent's KV cache.
    pub fn block_size(&self) -> usize {
        self.layers.first().map(|l| l.block_size).unwrap_or(1)
    }

    /// How many of `peer`'s blocks one of ours holds, when this agent can move KV to or from it
    /// (READ or WRITE): the side that moves the bytes needs blocks a multiple of the other's.
    /// Block ids of a transfer with ratio `k > 1` are then in the peer's units: local block `b`
    /// is the sub-blocks `b * k .. (b + 1) * k`.
    pub fn transfer_ratio(&self, peer: &str) -> Result<usize, KvConnectorError> {
        let p = self.peer(peer)?;
        let ours = self.block_size();
        if !ours.is_multiple_of(p.block_size) {
            return Err(KvConnectorError::IncompatiblePeer {
                engine_id: p.engine_id.clone(),
                mismatch: HandshakeMismatch::BlockSizeDirection {
                    ours,
                    theirs: p.block_size,
                },
            });
        }
        Ok(ours / p.block_size)
    }

    /// Bytes a transfer with `peer` moves per pair of block ids, over every local region, when
    /// its ids name whole local blocks (the same block size on both sides); `None` otherwise.
    /// A transfer of whole local blocks can be split into chunks of pairs, each landing whole
    /// blocks (see `pull::loader`).
    pub fn whole_block_pair_bytes(&self, peer: &str) -> Option<u64> {
        if self.transfer_ratio(peer).ok()? != 1 {
            return None;
        }
        Some(
            self.local
                .table
                .regions()
                .iter()
                .map(|r| (r.block_bytes * r.units) as u64)
                .sum(),
        )
    }

    /// Whether this agent's KV lives in device memory (VRAM).
    pub fn on_device(&self) -> bool {
        self.local.mem == MemType::Vram
    }

    /// The peer's tokens per block, once its handshake was accepted.
    pub fn peer_block_size(&self, peer: &str) -> Option<usize> {
        self.peer(peer).ok().map(|p| p.block_size)
    }

    pub fn peer_num_blocks(&self, peer: &str) -> Option<usize> {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(peer)
            .map(|p| p.table.num_blocks())
    }

    pub(crate) fn peer(&self, peer: &str) -> Result<Arc<PeerEntry>, KvConnectorError> {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(peer)
            .cloned()
            .ok_or_else(|| KvConnectorError::UnknownPeer(peer.to_string()))
    }

    /// Notifications received since the last call, as (sender agent name, bytes), in arrival
    /// order per sender. Binary-safe. Senders need not be peers of ours (in pull mode only the
    /// consumer loads metadata).
    pub fn get_notifs(&self) -> Result<Vec<(String, Vec<u8>)>, KvConnectorError> {
        let mut map = NotificationMap::new().map_err(|e| nixl_err("notification map", e))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(|e| nixl_err("notification fetch", e))?;
        let senders: Vec<String> = map
            .agents()
            .map(|a| a.map(str::to_string))
            .collect::<Result<_, _>>()
            .map_err(|e| nixl_err("notification sender", e))?;
        let mut out = Vec::new();
        for sender in senders {
            let n = map
                .get_notifications_size(&sender)
                .map_err(|e| nixl_err("notification count", e))?;
            for i in 0..n {
                let bytes = map
                    .get_notification_bytes(&sender, i)
                    .map_err(|e| nixl_err("notification read", e))?;
                out.push((sender.clone(), bytes));
            }
        }
        Ok(out)
    }

    /// Sends a notification to a peer, outside of any transfer (e.g. a lease renewal).
    pub fn send_notif(&self, peer: &str, message: &[u8]) -> Result<(), KvConnectorError> {
        let peer = self.peer(peer)?;
        self.agent
            .send_notification(&peer.name, message, None)
            .map_err(|e| KvConnectorError::TransferFailed {
                op: "notification",
                peer: peer.name.clone(),
                reason: e.to_string(),
            })
    }
}
