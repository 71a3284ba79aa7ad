//! [`KvTransferConfig`]: the `--kv-transfer-config` JSON, with vLLM's keys.
//!
//! ```json
//! {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
//!  "engine_id": "decode-0", "kv_load_failure_policy": "recompute",
//!  "kv_connector_extra_config": {"side_channel_host": "10.0.0.2", "kv_lease_duration": 30}}
//! ```
//!
//! | key | values | default |
//! |---|---|---|
//! | `kv_connector` | `"NixlConnector"` (pull) or `"NixlPushConnector"` (push) | required |
//! | `kv_role` | `"kv_producer"`, `"kv_consumer"`, `"kv_both"` | required |
//! | `engine_id` | non-empty string, at most 128 bytes | a random UUID (v4) |
//! | `kv_load_failure_policy` | `"fail"`, `"recompute"` | `"recompute"` |
//! | `kv_partial_recompute` | bool: under `"recompute"`, a load whose checksums localize the damage keeps its verified blocks and recomputes from the first bad one | `true` |
//! | `enable_kv_checksum` | bool | `false` |
//! | `kv_checksum_fail_closed` | bool | `false` |
//! | `kv_fault_injection` | object (kept as JSON for the fault-injecting connector) | none |
//! | `kv_connector_extra_config` | object, keys below | `{}` |
//! | vLLM's `kv_rank`, `kv_parallel_size`, `kv_ip`, `kv_port`, `kv_buffer_size` | checked, then ignored with a logged note: the NIXL connector sets up its own transfers | none |
//! | vLLM's `kv_buffer_device` | `"cpu"` (KV in host memory); anything else is an error | `"cpu"` |
//! | vLLM's `kv_connector_module_path` | `null` or `""`; a module path is an error (no Python connectors) | none |
//!
//! `kv_connector_extra_config`:
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `side_channel_host` | the host a producer advertises as `remote_host` (consumers fetch its handshake from `http://{host}:{HTTP port}/v1/kv/handshake`) | `$TANDEM_NIXL_SIDE_CHANNEL_HOST`, else `127.0.0.1` |
//! | `kv_lease_duration` | seconds a producer holds a finished request's blocks for its consumer (renewed by the consumer) | 30 |
//! | `load_timeout` | seconds a consumer's READ may take, from its post (push: how long a consumer waits for the producer's WRITE after registering its blocks) | 30 |
//! | `handshake_timeout` | seconds to fetch a producer's handshake | 5 |
//! | `read_chunk_bytes` | pull mode only: a consumer splits a READ larger than this into chunks of about this many bytes (at most 32), and checksums each chunk's blocks while the next moves; `0`: one READ per load | 8 MiB into host memory, 128 MiB into device memory |
//! | `read_chunks_in_flight` | pull mode only: how many of a split READ's chunks are posted at once (1 to 32) | 2 |
//! | `nixl_lib_dir` | directory of `libnixl_capi.so` (see `nixl::library`) | discovery |
//! | `progress_thread` | run NIXL's progress thread | on for the passive side (pull: `kv_producer`/`kv_both`; push: `kv_consumer`/`kv_both`), off for the side that only initiates |
//! | `transport_fault_injection` | testing only: a fault where the bytes move (`corrupt_source`, `wrong_block`, `slow_read`; see `pull::fault`) | none |
//! | `allowed_producers` | the producers a consumer may contact: CIDR ranges, addresses or host names, optionally with `:port` (see `allowlist`) | with a KV transfer secret: any; without: loopback only |
//!
//! Durations are numbers of seconds (fractions allowed), greater than 0 and at most one day.
//!
//! Invariants: parsing is strict (an unknown key, at either level, is an error that lists the
//! known keys; a value of the wrong type or out of range is an error that names the key); a
//! parsed config is complete (every default filled in), so nothing downstream re-derives one.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::allowlist::ProducerAllowlist;
use crate::error::KvConnectorError;
use crate::pull::fault::TransportFault;

/// The NIXL connector in pull mode (vLLM's name): the consumer READs the producer's blocks.
pub const NIXL_CONNECTOR: &str = "NixlConnector";
/// The NIXL connector in push mode: the producer WRITEs into blocks the consumer registered.
pub const NIXL_PUSH_CONNECTOR: &str = "NixlPushConnector";

/// How KV moves between a producer and a consumer; one deployment is one mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvMode {
    /// The consumer READs once the producer has answered (`NixlConnector`).
    #[default]
    Pull,
    /// The consumer registers its blocks when the request arrives; the producer WRITEs into
    /// them when its prefill is done (`NixlPushConnector`).
    Push,
}

impl KvMode {
    pub fn as_str(self) -> &'static str {
        match self {
            KvMode::Pull => "pull",
            KvMode::Push => "push",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pull" => Some(KvMode::Pull),
            "push" => Some(KvMode::Push),
            _ => None,
        }
    }

    /// The `kv_connector` name of the mode.
    pub fn connector_name(self) -> &'static str {
        match self {
            KvMode::Pull => NIXL_CONNECTOR,
            KvMode::Push => NIXL_PUSH_CONNECTOR,
        }
    }
}
/// Environment variable with the default `side_channel_host`.
pub const SIDE_CHANNEL_HOST_ENV: &str = "TANDEM_NIXL_SIDE_CHANNEL_HOST";
/// `side_channel_host` when neither the config nor the environment names one.
pub const DEFAULT_SIDE_CHANNEL_HOST: &str = "127.0.0.1";
pub const DEFAULT_KV_LEASE_DURATION: Duration = Duration::from_secs(30);
pub const DEFAULT_LOAD_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default `read_chunk_bytes` into device memory: an 8B model's 8000-token prompt (1 GiB of bf16
/// KV) moves in 8 chunks (each chunk costs a few descriptors' fixed time).
pub const DEFAULT_DEVICE_READ_CHUNK_BYTES: u64 = 128 << 20;
/// Default `read_chunk_bytes` into host memory: the CPU's checksum is slow enough next to the
/// copy that smaller chunks pay (BENCHMARKS.md, "Chunked loads").
pub const DEFAULT_HOST_READ_CHUNK_BYTES: u64 = 8 << 20;
/// Default `read_chunks_in_flight`: one chunk moves while the last one's checksum runs.
pub const DEFAULT_READ_CHUNKS_IN_FLIGHT: usize = 2;
/// A READ is split into at most this many chunks (each costs its descriptors' fixed time), and no
/// more than this many are posted at once.
pub const MAX_READ_CHUNKS: usize = 32;
/// Longest duration any of the duration keys accepts.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);
/// Longest `engine_id`; it travels in every `kv_transfer_params`.
pub const MAX_ENGINE_ID_LEN: usize = 128;

/// vLLM's other `kv_transfer_config` keys: accepted for configs written for vLLM, checked, and
/// either inapplicable to the NIXL connector (a note says so) or refused when their value asks
/// for what Tandem cannot do (see [`vllm_key_notes`]).
const VLLM_KEYS: [&str; 7] = [
    "kv_buffer_device",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_buffer_size",
    "kv_connector_module_path",
];

/// Tandem's own top-level keys (the vLLM keys above are known too).
const TOP_KEYS: [&str; 9] = [
    "kv_connector",
    "kv_role",
    "engine_id",
    "kv_load_failure_policy",
    "kv_partial_recompute",
    "kv_connector_extra_config",
    "enable_kv_checksum",
    "kv_checksum_fail_closed",
    "kv_fault_injection",
];
const EXTRA_KEYS: [&str; 10] = [
    "side_channel_host",
    "read_chunk_bytes",
    "read_chunks_in_flight",
    "transport_fault_injection",
    "allowed_producers",
    "kv_lease_duration",
    "load_timeout",
    "handshake_timeout",
    "nixl_lib_dir",
    "progress_thread",
];

/// What an instance does in P/D disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvRole {
    /// Prefills requests with `do_remote_decode` and holds their KV for consumers.
    Producer,
    /// Loads the KV of requests with `do_remote_prefill` from producers, then decodes.
    Consumer,
    /// Both.
    Both,
}

impl KvRole {
    pub fn as_str(self) -> &'static str {
        match self {
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
            KvRole::Both => "kv_both",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "kv_producer" => Some(KvRole::Producer),
            "kv_consumer" => Some(KvRole::Consumer),
            "kv_both" => Some(KvRole::Both),
            _ => None,
        }
    }
    /// Whether this instance serves `do_remote_decode` requests (holds KV for others).
    pub fn is_producer(self) -> bool {
        matches!(self, KvRole::Producer | KvRole::Both)
    }
    /// Whether this instance serves `do_remote_prefill` requests (loads KV from others).
    pub fn is_consumer(self) -> bool {
        matches!(self, KvRole::Consumer | KvRole::Both)
    }
}

/// What a consumer does when a KV load fails (the engine has its own copy of this enum).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFailurePolicy {
    /// The request ends with an error response.
    Fail,
    /// The consumer prefills the prompt itself.
    #[default]
    Recompute,
}

impl LoadFailurePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            LoadFailurePolicy::Fail => "fail",
            LoadFailurePolicy::Recompute => "recompute",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "fail" => Some(LoadFailurePolicy::Fail),
            "recompute" => Some(LoadFailurePolicy::Recompute),
            _ => None,
        }
    }
}

/// `kv_connector_extra_config` of the NIXL connector, defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct NixlExtraConfig {
    pub side_channel_host: String,
    pub kv_lease_duration: Duration,
    pub load_timeout: Duration,
    pub handshake_timeout: Duration,
    /// READs larger than this are split into chunks of about this size; 0: never split; `None`:
    /// the default of the consumer's memory ([`DEFAULT_HOST_READ_CHUNK_BYTES`],
    /// [`DEFAULT_DEVICE_READ_CHUNK_BYTES`]).
    pub read_chunk_bytes: Option<u64>,
    /// How many of a split READ's chunks are posted at once (1..=[`MAX_READ_CHUNKS`]).
    pub read_chunks_in_flight: usize,
    pub nixl_lib_dir: Option<PathBuf>,
    /// `None` in the JSON means: the role's default ([`KvTransferConfig::progress_thread`]).
    pub progress_thread: Option<bool>,
    /// `allowed_producers` as written (validated); `None`: the deployment's default (see
    /// [`crate::allowlist`]).
    pub allowed_producers: Option<Vec<String>>,
    /// Testing only: faults where the bytes move (see `pull::fault`).
    pub transport_fault_injection: Option<TransportFault>,
}

impl NixlExtraConfig {
    /// The producers a consumer may contact: the configured list, else any producer when the
    /// deployment has a KV transfer secret and loopback producers when it has none.
    pub fn producer_allowlist(&self, has_secret: bool) -> ProducerAllowlist {
        match &self.allowed_producers {
            Some(entries) => {
                ProducerAllowlist::parse(entries).expect("validated when the config was parsed")
            }
            None if has_secret => ProducerAllowlist::any(),
            None => ProducerAllowlist::loopback(),
        }
    }
}

impl NixlExtraConfig {
    /// Every default; `side_channel_host` read from the environment.
    pub fn defaults() -> Self {
        NixlExtraConfig {
            side_channel_host: std::env::var(SIDE_CHANNEL_HOST_ENV)
                .ok()
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| DEFAULT_SIDE_CHANNEL_HOST.to_string()),
            kv_lease_duration: DEFAULT_KV_LEASE_DURATION,
            load_timeout: DEFAULT_LOAD_TIMEOUT,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            read_chunk_bytes: None,
            read_chunks_in_flight: DEFAULT_READ_CHUNKS_IN_FLIGHT,
            nixl_lib_dir: None,
            progress_thread: None,
            allowed_producers: None,
            transport_fault_injection: None,
        }
    }
}

/// The parsed `--kv-transfer-config`. See the module docs for keys and defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTransferConfig {
    /// Always [`NIXL_CONNECTOR`] today.
    pub kv_connector: String,
    pub kv_role: KvRole,
    pub engine_id: String,
    pub kv_load_failure_policy: LoadFailurePolicy,
    /// Under [`LoadFailurePolicy::Recompute`]: keep a failed load's verified blocks and recompute
    /// from the first bad one (else the whole prompt).
    pub kv_partial_recompute: bool,
    pub kv_connector_extra_config: NixlExtraConfig,
    pub enable_kv_checksum: bool,
    pub kv_checksum_fail_closed: bool,
    /// The fault-injecting connector's settings, uninterpreted here.
    pub kv_fault_injection: Option<Value>,
    /// One line per vLLM key that was given but does not apply to this connector (to log).
    pub notes: Vec<String>,
}

fn invalid(msg: impl Into<String>) -> KvConnectorError {
    KvConnectorError::InvalidConfig(msg.into())
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn check_keys(
    obj: &Map<String, Value>,
    known: &[&str],
    what: &str,
) -> Result<(), KvConnectorError> {
    let mut unknown: Vec<&str> = obj
        .keys()
        .map(String::as_str)
        .filter(|k| !known.contains(k))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort_unstable();
    Err(invalid(format!(
        "unknown key{} {} in {what}; known keys: {}",
        if unknown.len() > 1 { "s" } else { "" },
        unknown
            .iter()
            .map(|k| format!("{k:?}"))
            .collect::<Vec<_>>()
            .join(", "),
        known.join(", ")
    )))
}

fn get_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, KvConnectorError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(invalid(format!(
            "{key} must be a string, got {}",
            type_name(v)
        ))),
    }
}

fn get_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, KvConnectorError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(invalid(format!(
            "{key} must be a boolean, got {}",
            type_name(v)
        ))),
    }
}

fn get_secs(obj: &Map<String, Value>, key: &str) -> Result<Option<Duration>, KvConnectorError> {
    let secs = match obj.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.as_f64().unwrap_or(f64::NAN),
        Some(v) => {
            return Err(invalid(format!(
                "{key} must be a number of seconds, got {}",
                type_name(v)
            )))
        }
    };
    if !(secs > 0.0 && secs <= MAX_DURATION.as_secs_f64()) {
        return Err(invalid(format!(
            "{key} must be more than 0 and at most {} seconds, got {secs}",
            MAX_DURATION.as_secs()
        )));
    }
    Ok(Some(Duration::from_secs_f64(secs)))
}

impl KvTransferConfig {
    /// Parses the `--kv-transfer-config` JSON text.
    pub fn parse(json: &str) -> Result<Self, KvConnectorError> {
        let value: Value =
            serde_json::from_str(json).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        Self::from_value(&value)
    }

    /// Parses an already decoded JSON value (e.g. a TOML table converted to JSON).
    pub fn from_value(value: &Value) -> Result<Self, KvConnectorError> {
        let Value::Object(obj) = value else {
            return Err(invalid(format!(
                "must be a JSON object, got {}",
                type_name(value)
            )));
        };
        let known: Vec<&str> = TOP_KEYS.iter().chain(&VLLM_KEYS).copied().collect();
        check_keys(obj, &known, "kv_transfer_config")?;
        let notes = vllm_key_notes(obj)?;

        let kv_connector = get_str(obj, "kv_connector")?.ok_or_else(|| {
            invalid(format!(
                "kv_connector is required (\"{NIXL_CONNECTOR}\" or \"{NIXL_PUSH_CONNECTOR}\")"
            ))
        })?;
        if kv_connector != NIXL_CONNECTOR && kv_connector != NIXL_PUSH_CONNECTOR {
            return Err(invalid(format!(
                "kv_connector {kv_connector:?} is not supported; the connectors are \
                 \"{NIXL_CONNECTOR}\" (pull) and \"{NIXL_PUSH_CONNECTOR}\" (push)"
            )));
        }
        let role = get_str(obj, "kv_role")?.ok_or_else(|| {
            invalid("kv_role is required: \"kv_producer\", \"kv_consumer\" or \"kv_both\"")
        })?;
        let kv_role = KvRole::parse(role).ok_or_else(|| {
            invalid(format!(
                "kv_role {role:?} is not one of \"kv_producer\", \"kv_consumer\", \"kv_both\""
            ))
        })?;
        let engine_id = match get_str(obj, "engine_id")? {
            None => uuid::Uuid::new_v4().to_string(),
            Some(id) => {
                if id.is_empty() || id.len() > MAX_ENGINE_ID_LEN || id.chars().any(char::is_control)
                {
                    return Err(invalid(format!(
                        "engine_id must be 1 to {MAX_ENGINE_ID_LEN} bytes without control \
                         characters, got {id:?}"
                    )));
                }
                id.to_string()
            }
        };
        let kv_load_failure_policy = match get_str(obj, "kv_load_failure_policy")? {
            None => LoadFailurePolicy::default(),
            Some(p) => LoadFailurePolicy::parse(p).ok_or_else(|| {
                invalid(format!(
                    "kv_load_failure_policy {p:?} is not one of \"fail\", \"recompute\""
                ))
            })?,
        };
        let kv_connector_extra_config = match obj.get("kv_connector_extra_config") {
            None | Some(Value::Null) => NixlExtraConfig::defaults(),
            Some(Value::Object(extra)) => {
                let read_key = ["read_chunk_bytes", "read_chunks_in_flight"]
                    .into_iter()
                    .find(|k| extra.contains_key(*k));
                if let (NIXL_PUSH_CONNECTOR, Some(key)) = (kv_connector, read_key) {
                    return Err(invalid(format!(
                        "{key} splits a consumer's READs (pull mode, \
                         \"{NIXL_CONNECTOR}\"); in push mode (\"{NIXL_PUSH_CONNECTOR}\") the \
                         producer WRITEs and nothing is read"
                    )));
                }
                parse_extra(extra, kv_role)?
            }
            Some(v) => {
                return Err(invalid(format!(
                    "kv_connector_extra_config must be an object, got {}",
                    type_name(v)
                )))
            }
        };
        let host = &kv_connector_extra_config.side_channel_host;
        if !crate::params::valid_host(host) {
            // Only reachable through the environment; the key itself is checked above.
            return Err(invalid(format!(
                "side_channel_host from ${SIDE_CHANNEL_HOST_ENV} must be a host name or IP \
                 address, got {host:?}"
            )));
        }
        let kv_fault_injection = match obj.get("kv_fault_injection") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v.clone()),
            Some(v) => {
                return Err(invalid(format!(
                    "kv_fault_injection must be an object, got {}",
                    type_name(v)
                )))
            }
        };
        Ok(KvTransferConfig {
            kv_connector: kv_connector.to_string(),
            kv_role,
            engine_id,
            kv_load_failure_policy,
            kv_partial_recompute: get_bool(obj, "kv_partial_recompute")?.unwrap_or(true),
            kv_connector_extra_config,
            enable_kv_checksum: get_bool(obj, "enable_kv_checksum")?.unwrap_or(false),
            kv_checksum_fail_closed: get_bool(obj, "kv_checksum_fail_closed")?.unwrap_or(false),
            kv_fault_injection,
            notes,
        })
    }

    /// Whether the NIXL agent runs its progress thread: the explicit setting, else on for a
    /// role that produces (a passive READ target must answer without calling NIXL) and off
    /// for a pure consumer (it only initiates; faster without, see `nixl::agent`).
    pub fn progress_thread(&self) -> bool {
        let passive = match self.kv_mode() {
            KvMode::Pull => self.kv_role.is_producer(),
            KvMode::Push => self.kv_role.is_consumer(),
        };
        self.kv_connector_extra_config
            .progress_thread
            .unwrap_or(passive)
    }

    /// Pull (`NixlConnector`) or push (`NixlPushConnector`).
    pub fn kv_mode(&self) -> KvMode {
        if self.kv_connector == NIXL_PUSH_CONNECTOR {
            KvMode::Push
        } else {
            KvMode::Pull
        }
    }

    /// The config as JSON with every default filled in (for logs and `/v1/…` introspection).
    pub fn to_value(&self) -> Value {
        let x = &self.kv_connector_extra_config;
        let mut extra = serde_json::json!({
            "side_channel_host": x.side_channel_host,
            "kv_lease_duration": x.kv_lease_duration.as_secs_f64(),
            "load_timeout": x.load_timeout.as_secs_f64(),
            "handshake_timeout": x.handshake_timeout.as_secs_f64(),
            "progress_thread": self.progress_thread(),
        });
        if let Some(bytes) = x.read_chunk_bytes {
            extra["read_chunk_bytes"] = Value::from(bytes);
        }
        if self.kv_connector != NIXL_PUSH_CONNECTOR {
            extra["read_chunks_in_flight"] = Value::from(x.read_chunks_in_flight);
        }
        if let Some(dir) = &x.nixl_lib_dir {
            extra["nixl_lib_dir"] = Value::String(dir.display().to_string());
        }
        if let Some(list) = &x.allowed_producers {
            extra["allowed_producers"] = serde_json::json!(list);
        }
        if let Some(f) = &x.transport_fault_injection {
            extra["transport_fault_injection"] = f.to_value();
        }
        let mut v = serde_json::json!({
            "kv_connector": self.kv_connector,
            "kv_role": self.kv_role.as_str(),
            "engine_id": self.engine_id,
            "kv_load_failure_policy": self.kv_load_failure_policy.as_str(),
            "kv_partial_recompute": self.kv_partial_recompute,
            "kv_connector_extra_config": extra,
            "enable_kv_checksum": self.enable_kv_checksum,
            "kv_checksum_fail_closed": self.kv_checksum_fail_closed,
        });
        if let Some(f) = &self.kv_fault_injection {
            v["kv_fault_injection"] = f.clone();
        }
        v
    }
}

fn get_int(
    obj: &Map<String, Value>,
    key: &str,
    min: u64,
    max: u64,
) -> Result<Option<u64>, KvConnectorError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().filter(|n| (min..=max).contains(n)) {
            Some(n) => Ok(Some(n)),
            None => Err(invalid(format!(
                "{key} must be an integer from {min} to {max}, got {v}"
            ))),
        },
    }
}

/// Checks vLLM's keys that Tandem's NIXL connector has no use for ([`VLLM_KEYS`]): a value of the
/// wrong type, or one asking for what cannot be honoured (KV in GPU memory on this CPU build, a
/// Python connector module), is an error; the others are accepted with a note each, since the
/// NIXL connector sets up its own transfer (vLLM's NixlConnector ignores them too).
fn vllm_key_notes(obj: &Map<String, Value>) -> Result<Vec<String>, KvConnectorError> {
    let mut notes = Vec::new();
    let given = |k: &str| !matches!(obj.get(k), None | Some(Value::Null));
    if let Some(device) = get_str(obj, "kv_buffer_device")? {
        if device != "cpu" {
            return Err(invalid(format!(
                "kv_buffer_device {device:?} cannot be honoured: this build keeps the KV cache in \
                 host memory; use \"cpu\" or leave the key out"
            )));
        }
    }
    if let Some(path) = get_str(obj, "kv_connector_module_path")? {
        if !path.is_empty() {
            return Err(invalid(format!(
                "kv_connector_module_path {path:?} cannot be honoured: Tandem loads no Python \
                 connector modules; the connector is \"{NIXL_CONNECTOR}\""
            )));
        }
    }
    let rank = get_int(obj, "kv_rank", 0, u32::MAX as u64)?;
    let size = get_int(obj, "kv_parallel_size", 1, u32::MAX as u64)?;
    if let (Some(r), Some(n)) = (rank, size) {
        if r >= n {
            return Err(invalid(format!(
                "kv_rank {r} must be below kv_parallel_size {n}"
            )));
        }
    }
    get_str(obj, "kv_ip")?;
    get_int(obj, "kv_port", 0, u16::MAX as u64)?;
    match obj.get("kv_buffer_size") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_f64().is_some_and(|n| n > 0.0 && n.is_finite()) => {}
        Some(v) => {
            return Err(invalid(format!(
                "kv_buffer_size must be a number of bytes greater than 0, got {v}"
            )))
        }
    }
    for key in [
        "kv_rank",
        "kv_parallel_size",
        "kv_ip",
        "kv_port",
        "kv_buffer_size",
    ] {
        if given(key) {
            notes.push(format!(
                "kv_transfer_config key {key} does not apply to {NIXL_CONNECTOR} (it sets up \
                 its own transfers: side_channel_host and the HTTP port) and is ignored"
            ));
        }
    }
    Ok(notes)
}

fn parse_extra(
    extra: &Map<String, Value>,
    role: KvRole,
) -> Result<NixlExtraConfig, KvConnectorError> {
    check_keys(extra, &EXTRA_KEYS, "kv_connector_extra_config")?;
    let mut cfg = NixlExtraConfig::defaults();
    if let Some(host) = get_str(extra, "side_channel_host")? {
        // Consumers accept exactly these hosts in `remote_host`.
        if !crate::params::valid_host(host) {
            return Err(invalid(format!(
                "side_channel_host must be a host name or IP address, got {host:?}"
            )));
        }
        cfg.side_channel_host = host.to_string();
    }
    if let Some(d) = get_secs(extra, "kv_lease_duration")? {
        cfg.kv_lease_duration = d;
    }
    if let Some(d) = get_secs(extra, "load_timeout")? {
        cfg.load_timeout = d;
    }
    if let Some(d) = get_secs(extra, "handshake_timeout")? {
        cfg.handshake_timeout = d;
    }
    match extra.get("read_chunk_bytes") {
        None | Some(Value::Null) => {}
        Some(v) => {
            cfg.read_chunk_bytes = Some(v.as_u64().ok_or_else(|| {
                invalid(format!(
                    "read_chunk_bytes must be a whole number of bytes (0: never split), got {v}"
                ))
            })?)
        }
    }
    match extra.get("read_chunks_in_flight") {
        None | Some(Value::Null) => {}
        Some(v) => {
            cfg.read_chunks_in_flight = v
                .as_u64()
                .filter(|n| (1..=MAX_READ_CHUNKS as u64).contains(n))
                .ok_or_else(|| {
                    invalid(format!(
                        "read_chunks_in_flight must be a whole number from 1 to \
                         {MAX_READ_CHUNKS}, got {v}"
                    ))
                })? as usize
        }
    }
    if let Some(dir) = get_str(extra, "nixl_lib_dir")? {
        if dir.is_empty() {
            return Err(invalid("nixl_lib_dir must not be empty"));
        }
        cfg.nixl_lib_dir = Some(PathBuf::from(dir));
    }
    cfg.progress_thread = get_bool(extra, "progress_thread")?;
    match extra.get("allowed_producers") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            let entries = items
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        invalid(format!(
                            "allowed_producers entries must be strings, got {v}"
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            ProducerAllowlist::parse(&entries)?;
            cfg.allowed_producers = Some(entries);
        }
        Some(v) => {
            return Err(invalid(format!(
                "allowed_producers must be an array of strings, got {v}"
            )))
        }
    }
    match extra.get("transport_fault_injection") {
        None | Some(Value::Null) => {}
        Some(Value::Object(f)) => {
            cfg.transport_fault_injection = Some(TransportFault::parse(f, role)?);
        }
        Some(v) => {
            return Err(invalid(format!(
                "transport_fault_injection must be an object, got {v}"
            )))
        }
    }
    Ok(cfg)
}

/// [`KvTransferConfig::parse`].
pub fn parse(json: &str) -> Result<KvTransferConfig, KvConnectorError> {
    KvTransferConfig::parse(json)
}

impl std::str::FromStr for KvTransferConfig {
    type Err = KvConnectorError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl Serialize for KvTransferConfig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

/// Deserializes from any self-describing format (JSON, a TOML table) with the same checks as
/// [`KvTransferConfig::parse`].
impl<'de> Deserialize<'de> for KvTransferConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        // A string holding the JSON (as on the command line) is accepted too.
        let parsed = match &v {
            Value::String(s) => Self::parse(s),
            _ => Self::from_value(&v),
        };
        parsed.map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        KvTransferConfig::parse(json).unwrap_err().to_string()
    }

    #[test]
    fn the_minimal_config_takes_every_default() {
        let c = KvTransferConfig::parse(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#)
            .unwrap();
        assert_eq!(c.kv_role, KvRole::Both);
        assert_eq!(c.kv_load_failure_policy, LoadFailurePolicy::Recompute);
        assert!(
            uuid::Uuid::parse_str(&c.engine_id).is_ok(),
            "{}",
            c.engine_id
        );
        let x = &c.kv_connector_extra_config;
        assert_eq!(x.kv_lease_duration, Duration::from_secs(30));
        assert_eq!(x.load_timeout, Duration::from_secs(30));
        assert_eq!(x.handshake_timeout, Duration::from_secs(5));
        assert_eq!(x.read_chunk_bytes, None, "the consumer's memory decides");
        assert_eq!(x.read_chunks_in_flight, DEFAULT_READ_CHUNKS_IN_FLIGHT);
        assert!(!c.enable_kv_checksum && !c.kv_checksum_fail_closed);
        assert!(c.kv_fault_injection.is_none());
        assert!(c.kv_partial_recompute);
        assert!(c.progress_thread());
        // Two configs without engine_id get different ids.
        let d = KvTransferConfig::parse(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#)
            .unwrap();
        assert_ne!(c.engine_id, d.engine_id);
    }

    #[test]
    fn every_key_is_read() {
        let c = KvTransferConfig::parse(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","engine_id":"d0",
                "kv_load_failure_policy":"fail","enable_kv_checksum":true,
                "kv_partial_recompute":false,
                "kv_checksum_fail_closed":true,"kv_fault_injection":{"drop":0.5},
                "kv_connector_extra_config":{"side_channel_host":"10.1.2.3",
                  "kv_lease_duration":2.5,"load_timeout":7,"handshake_timeout":1,
                  "nixl_lib_dir":"/opt/nixl","progress_thread":true,
                  "read_chunk_bytes":0,"read_chunks_in_flight":5}}"#,
        )
        .unwrap();
        assert_eq!(c.engine_id, "d0");
        assert_eq!(c.kv_role, KvRole::Consumer);
        assert_eq!(c.kv_load_failure_policy, LoadFailurePolicy::Fail);
        assert!(!c.kv_partial_recompute);
        assert!(c.enable_kv_checksum && c.kv_checksum_fail_closed);
        assert_eq!(c.kv_fault_injection, Some(serde_json::json!({"drop": 0.5})));
        let x = &c.kv_connector_extra_config;
        assert_eq!(x.side_channel_host, "10.1.2.3");
        assert_eq!(x.kv_lease_duration, Duration::from_millis(2500));
        assert_eq!(x.load_timeout, Duration::from_secs(7));
        assert_eq!(x.handshake_timeout, Duration::from_secs(1));
        assert_eq!(x.read_chunk_bytes, Some(0));
        assert_eq!(x.read_chunks_in_flight, 5);
        for bad in ["-1", "1.5", "\"64MiB\"", "true"] {
            let e = err(&format!(
                r#"{{"kv_connector":"NixlConnector","kv_role":"kv_consumer",
                    "kv_connector_extra_config":{{"read_chunk_bytes":{bad}}}}}"#
            ));
            assert!(
                e.contains("read_chunk_bytes must be a whole number"),
                "{bad}: {e}"
            );
        }
        assert_eq!(
            x.nixl_lib_dir.as_deref(),
            Some(std::path::Path::new("/opt/nixl"))
        );
        assert!(c.progress_thread());
        // Round trip through the filled-in form.
        let again = KvTransferConfig::from_value(&c.to_value()).unwrap();
        assert_eq!(again, c);
        // A pure consumer runs without the progress thread unless told otherwise.
        let c =
            KvTransferConfig::parse(r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}"#)
                .unwrap();
        assert!(!c.progress_thread());
    }

    #[test]
    fn read_chunks_in_flight_is_bounded_and_pull_only() {
        for bad in ["0", "33", "-1", "1.5", "\"2\"", "true"] {
            let e = err(&format!(
                r#"{{"kv_connector":"NixlConnector","kv_role":"kv_consumer",
                    "kv_connector_extra_config":{{"read_chunks_in_flight":{bad}}}}}"#
            ));
            assert!(
                e.contains("read_chunks_in_flight must be a whole number from 1 to 32"),
                "{bad}: {e}"
            );
        }
        for key in ["read_chunk_bytes", "read_chunks_in_flight"] {
            let e = err(&format!(
                r#"{{"kv_connector":"{NIXL_PUSH_CONNECTOR}","kv_role":"kv_consumer",
                    "kv_connector_extra_config":{{"{key}":4}}}}"#
            ));
            assert!(
                e.contains(key) && e.contains("nothing is read"),
                "{key}: {e}"
            );
        }
        let c = KvTransferConfig::parse(&format!(
            r#"{{"kv_connector":"{NIXL_PUSH_CONNECTOR}","kv_role":"kv_consumer"}}"#
        ))
        .unwrap();
        assert!(c.to_value()["kv_connector_extra_config"]
            .get("read_chunks_in_flight")
            .is_none());
        let c = KvTransferConfig::parse(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer",
                "kv_connector_extra_config":{"read_chunks_in_flight":32}}"#,
        )
        .unwrap();
        assert_eq!(c.kv_connector_extra_config.read_chunks_in_flight, 32);
    }

    #[test]
    fn unknown_keys_are_listed_with_the_known_ones() {
        let e = err(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_sz":1}"#);
        assert!(e.contains("\"kv_buffer_sz\""), "{e}");
        assert!(
            e.contains("known keys: kv_connector, kv_role, engine_id"),
            "{e}"
        );
        let e = err(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both",
                "kv_connector_extra_config":{"lease":3}}"#);
        assert!(e.contains("\"lease\" in kv_connector_extra_config"), "{e}");
        assert!(e.contains("kv_lease_duration"), "{e}");
    }

    #[test]
    fn vllm_keys_are_noted_or_refused_when_they_cannot_be_honoured() {
        let base = r#""kv_connector":"NixlConnector","kv_role":"kv_consumer""#;
        let c = KvTransferConfig::parse(&format!(
            r#"{{{base},"kv_buffer_device":"cpu","kv_rank":1,"kv_parallel_size":2,
                "kv_ip":"10.0.0.1","kv_port":14579,"kv_buffer_size":1e9,
                "kv_connector_module_path":null}}"#
        ))
        .unwrap();
        assert_eq!(c.notes.len(), 5, "{:?}", c.notes);
        for key in [
            "kv_rank",
            "kv_parallel_size",
            "kv_ip",
            "kv_port",
            "kv_buffer_size",
        ] {
            assert!(
                c.notes.iter().any(|n| n.contains(key)),
                "{key}: {:?}",
                c.notes
            );
        }
        let plain = KvTransferConfig::parse(&format!("{{{base}}}")).unwrap();
        assert!(plain.notes.is_empty());
        for (extra, names) in [
            (
                r#""kv_buffer_device":"cuda""#,
                "kv_buffer_device \"cuda\" cannot be honoured",
            ),
            (
                r#""kv_buffer_device":3"#,
                "kv_buffer_device must be a string",
            ),
            (
                r#""kv_connector_module_path":"my.connector""#,
                "kv_connector_module_path",
            ),
            (
                r#""kv_rank":2,"kv_parallel_size":2"#,
                "kv_rank 2 must be below",
            ),
            (r#""kv_rank":-1"#, "kv_rank must be an integer"),
            (
                r#""kv_parallel_size":0"#,
                "kv_parallel_size must be an integer",
            ),
            (r#""kv_port":70000"#, "kv_port must be an integer"),
            (r#""kv_ip":5"#, "kv_ip must be a string"),
            (r#""kv_buffer_size":-1"#, "kv_buffer_size must be"),
        ] {
            let e = err(&format!("{{{base},{extra}}}"));
            assert!(e.contains(names), "{extra}: {e}");
        }
    }

    #[test]
    fn wrong_values_name_their_key() {
        let base = |extra: &str| {
            format!(r#"{{"kv_connector":"NixlConnector","kv_role":"kv_both"{extra}}}"#)
        };
        for (json, needle) in [
            (
                r#"{"kv_connector":"NixlConnector","kv_role":"producer"}"#.to_string(),
                "kv_role \"producer\"",
            ),
            (
                r#"{"kv_connector":"NixlConnector"}"#.to_string(),
                "kv_role is required",
            ),
            (
                r#"{"kv_role":"kv_both"}"#.to_string(),
                "kv_connector is required",
            ),
            (
                r#"{"kv_connector":"LMCacheConnector","kv_role":"kv_both"}"#.to_string(),
                "not supported",
            ),
            (
                base(r#","kv_load_failure_policy":"retry""#),
                "kv_load_failure_policy \"retry\"",
            ),
            (base(r#","engine_id":"""#), "engine_id"),
            (
                base(r#","engine_id":7"#),
                "engine_id must be a string, got a number",
            ),
            (
                base(r#","enable_kv_checksum":"yes""#),
                "enable_kv_checksum must be a boolean",
            ),
            (
                base(r#","kv_fault_injection":[1]"#),
                "kv_fault_injection must be an object",
            ),
            (
                base(r#","kv_connector_extra_config":3"#),
                "kv_connector_extra_config must be an object",
            ),
            (
                base(r#","kv_connector_extra_config":{"kv_lease_duration":0}"#),
                "kv_lease_duration must be more than 0",
            ),
            (
                base(r#","kv_connector_extra_config":{"load_timeout":-1}"#),
                "load_timeout",
            ),
            (
                base(r#","kv_connector_extra_config":{"handshake_timeout":"5s"}"#),
                "handshake_timeout must be a number of seconds",
            ),
            (
                base(r#","kv_connector_extra_config":{"side_channel_host":"a b"}"#),
                "side_channel_host",
            ),
            ("[]".to_string(), "must be a JSON object"),
            ("{".to_string(), "not valid JSON"),
        ] {
            let e = err(&json);
            assert!(e.starts_with("invalid kv_transfer_config: "), "{e}");
            assert!(e.contains(needle), "{json}: {e}");
        }
    }

    #[test]
    fn deserializes_from_a_table_or_a_json_string() {
        let c: KvTransferConfig = serde_json::from_str(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"p"}"#,
        )
        .unwrap();
        assert_eq!(c.kv_role, KvRole::Producer);
        let c: KvTransferConfig = serde_json::from_value(Value::String(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"p"}"#.into(),
        ))
        .unwrap();
        assert_eq!(c.engine_id, "p");
        let e = serde_json::from_str::<KvTransferConfig>(r#"{"kv_role":"x"}"#).unwrap_err();
        assert!(e.to_string().contains("kv_connector is required"), "{e}");
    }
}
