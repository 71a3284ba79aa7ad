//! `ProxyArgs`: every setting of `tandem proxy`, as clap flags (each with a `TANDEM_PROXY_*` env var)
//! and as a TOML table (serde, every field optional with the same default as the flag).
//!
//! Invariants: `Default` equals the clap defaults (a test checks it); `validate` is the one place
//! that rejects a configuration (no upstream of a role, a URL that is not http(s), a non-positive
//! timeout, edge limits `tandem_http_edge::EdgeLimits` refuses), so `ProxyState::new` never starts
//! with a setting it cannot honour. API keys are `ApiKey`s: parsed non-empty, never printed
//! (`Debug` redacts them, `--help` hides their env values); the upstream key defaults to the
//! client-facing one.

use std::time::Duration;

use clap::Args;
use serde::{Deserialize, Serialize};
use tandem_http_edge::{
    ApiKey, EdgeLimits, DEFAULT_HEADER_READ_TIMEOUT_SECS, DEFAULT_MAX_CONNECTIONS,
};

use crate::error::ProxyError;

const DEFAULT_HOST: &str = "0.0.0.0";
const DEFAULT_PORT: u16 = 8000;
const DEFAULT_CONNECT_TIMEOUT_SECS: f64 = 5.0;
const DEFAULT_PREFILL_TIMEOUT_SECS: f64 = 300.0;
const DEFAULT_DECODE_FIRST_BYTE_TIMEOUT_SECS: f64 = 600.0;
const DEFAULT_DECODE_IDLE_TIMEOUT_SECS: f64 = 300.0;
const DEFAULT_HEALTH_CHECK_INTERVAL_SECS: f64 = 5.0;
const DEFAULT_HEALTH_CHECK_TIMEOUT_SECS: f64 = 2.0;
const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// How the KV moves between the proxy's instances; one deployment is one mode, and the
/// instances refuse requests of the other mode (their `kv_connector` decides theirs).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvMode {
    /// Prefill first; the decode instance READs the KV the producer's answer names
    /// (`NixlConnector`).
    #[default]
    Pull,
    /// Prefill and decode at once, with one transfer id; the producer WRITEs the KV into the
    /// blocks the decode instance registered (`NixlPushConnector`).
    Push,
}

/// Settings of the P/D proxy (`tandem proxy`).
///
/// Each flag also reads the environment variable named beside it, and the same field names
/// form the TOML table of `--config` (durations are seconds, fractions allowed).
#[derive(Args, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyArgs {
    /// Address the proxy listens on.
    #[arg(long, env = "TANDEM_PROXY_HOST", default_value = DEFAULT_HOST)]
    pub host: String,

    /// Port the proxy listens on.
    #[arg(long, env = "TANDEM_PROXY_PORT", default_value_t = DEFAULT_PORT)]
    pub port: u16,

    /// How KV moves: `pull` (instances with `NixlConnector`) or `push` (`NixlPushConnector`).
    #[arg(long, env = "TANDEM_PROXY_KV_MODE", value_enum, default_value_t = KvMode::Pull)]
    pub kv_mode: KvMode,

    /// Base URL of a prefill instance (`kv_producer`), e.g. `http://127.0.0.1:8100`.
    /// Repeat the flag for several instances; the env var takes a comma-separated list.
    #[arg(
        long = "prefill",
        env = "TANDEM_PROXY_PREFILL",
        value_name = "URL",
        value_delimiter = ','
    )]
    pub prefill: Vec<String>,

    /// Base URL of a decode instance (`kv_consumer`), e.g. `http://127.0.0.1:8200`.
    /// Repeat the flag for several instances; the env var takes a comma-separated list.
    #[arg(
        long = "decode",
        env = "TANDEM_PROXY_DECODE",
        value_name = "URL",
        value_delimiter = ','
    )]
    pub decode: Vec<String>,

    /// Seconds to open a TCP connection to an upstream instance; a failure answers 502
    /// (after one retry on another instance of the same role, when there is one).
    #[arg(long, env = "TANDEM_PROXY_CONNECT_TIMEOUT_SECS", default_value_t = DEFAULT_CONNECT_TIMEOUT_SECS)]
    pub connect_timeout_secs: f64,

    /// Seconds for a whole prefill request (send, queue, prefill, answer); past it the client gets 504.
    /// Also bounds other short upstream calls (`/v1/models`).
    #[arg(long, env = "TANDEM_PROXY_PREFILL_TIMEOUT_SECS", default_value_t = DEFAULT_PREFILL_TIMEOUT_SECS)]
    pub prefill_timeout_secs: f64,

    /// Seconds until a decode instance answers with its status and headers; past it the client gets 504.
    /// A non-streaming decode instance answers only when it is done, so this bounds the whole generation.
    #[arg(long, env = "TANDEM_PROXY_DECODE_FIRST_BYTE_TIMEOUT_SECS", default_value_t = DEFAULT_DECODE_FIRST_BYTE_TIMEOUT_SECS)]
    pub decode_first_byte_timeout_secs: f64,

    /// Seconds a decode response body may stay silent between two chunks; past it the proxy aborts
    /// the response (the client sees a truncated body) and closes the upstream connection.
    #[arg(long, env = "TANDEM_PROXY_DECODE_IDLE_TIMEOUT_SECS", default_value_t = DEFAULT_DECODE_IDLE_TIMEOUT_SECS)]
    pub decode_idle_timeout_secs: f64,

    /// Seconds between two health checks (`GET {url}/health`) of every upstream instance.
    /// A failed check (or a failed connect on a request) takes the instance out; a passing one brings it back.
    #[arg(long, env = "TANDEM_PROXY_HEALTH_CHECK_INTERVAL_SECS", default_value_t = DEFAULT_HEALTH_CHECK_INTERVAL_SECS)]
    pub health_check_interval_secs: f64,

    /// Seconds one health check may take before it counts as failed.
    #[arg(long, env = "TANDEM_PROXY_HEALTH_CHECK_TIMEOUT_SECS", default_value_t = DEFAULT_HEALTH_CHECK_TIMEOUT_SECS)]
    pub health_check_timeout_secs: f64,

    /// Resolve the host name of each `--prefill`/`--decode` URL to all its addresses at every
    /// health round and balance over each address as an instance (the replicas of a scaled
    /// Docker Compose or Kubernetes headless service). A failed lookup keeps the instances found
    /// before; an IP address is used as it is.
    #[arg(long, env = "TANDEM_PROXY_RESOLVE_REPLICAS")]
    pub resolve_replicas: bool,

    /// Largest request body accepted, in bytes; a larger one answers 413.
    #[arg(long, env = "TANDEM_PROXY_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,

    /// Key clients must send as `Authorization: Bearer <key>` on every route but `/health` and
    /// `/metrics`; a missing or wrong key answers 401. Unset: no key is asked for.
    #[arg(long, env = "TANDEM_PROXY_API_KEY", hide_env_values = true)]
    pub api_key: Option<ApiKey>,

    /// Key the proxy sends as `Authorization: Bearer <key>` on every call to a prefill or decode
    /// instance (completions, models, health checks, KV releases). Default: the `--api-key` value.
    /// The client's own `Authorization` header is never forwarded.
    #[arg(long, env = "TANDEM_PROXY_UPSTREAM_API_KEY", hide_env_values = true)]
    pub upstream_api_key: Option<ApiKey>,

    /// Most client connections served at once; a connection over it is closed at once.
    #[arg(long, env = "TANDEM_PROXY_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,

    /// Seconds a client connection may take to send its request headers (and may stay idle
    /// between two requests on a keep-alive connection), and to send a request's body once its headers
    /// arrived; past it the connection is closed (the request fails).
    #[arg(long, env = "TANDEM_PROXY_HEADER_READ_TIMEOUT_SECS", default_value_t = DEFAULT_HEADER_READ_TIMEOUT_SECS)]
    pub header_read_timeout_secs: f64,
}

impl Default for ProxyArgs {
    fn default() -> Self {
        Self {
            host: DEFAULT_HOST.to_owned(),
            port: DEFAULT_PORT,
            kv_mode: KvMode::Pull,
            prefill: Vec::new(),
            decode: Vec::new(),
            connect_timeout_secs: DEFAULT_CONNECT_TIMEOUT_SECS,
            prefill_timeout_secs: DEFAULT_PREFILL_TIMEOUT_SECS,
            decode_first_byte_timeout_secs: DEFAULT_DECODE_FIRST_BYTE_TIMEOUT_SECS,
            decode_idle_timeout_secs: DEFAULT_DECODE_IDLE_TIMEOUT_SECS,
            health_check_interval_secs: DEFAULT_HEALTH_CHECK_INTERVAL_SECS,
            health_check_timeout_secs: DEFAULT_HEALTH_CHECK_TIMEOUT_SECS,
            resolve_replicas: false,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            api_key: None,
            upstream_api_key: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout_secs: DEFAULT_HEADER_READ_TIMEOUT_SECS,
        }
    }
}

/// The validated, typed form of [`ProxyArgs`] that the rest of the crate reads.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub kv_mode: KvMode,
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
    pub connect_timeout: Duration,
    pub prefill_timeout: Duration,
    pub decode_first_byte_timeout: Duration,
    pub decode_idle_timeout: Duration,
    pub health_check_interval: Duration,
    pub health_check_timeout: Duration,
    pub resolve_replicas: bool,
    pub max_body_bytes: usize,
    /// What clients must send; `None`: every route is open.
    pub api_key: Option<ApiKey>,
    /// What the proxy sends upstream; `None`: no `Authorization` header.
    pub upstream_api_key: Option<ApiKey>,
    pub edge: EdgeLimits,
}

impl ProxyArgs {
    /// Checks the configuration and returns its typed form.
    pub(crate) fn validate(&self) -> Result<Settings, ProxyError> {
        Ok(Settings {
            kv_mode: self.kv_mode,
            prefill: urls("prefill", &self.prefill)?,
            decode: urls("decode", &self.decode)?,
            connect_timeout: secs("connect_timeout_secs", self.connect_timeout_secs)?,
            prefill_timeout: secs("prefill_timeout_secs", self.prefill_timeout_secs)?,
            decode_first_byte_timeout: secs(
                "decode_first_byte_timeout_secs",
                self.decode_first_byte_timeout_secs,
            )?,
            decode_idle_timeout: secs("decode_idle_timeout_secs", self.decode_idle_timeout_secs)?,
            health_check_interval: secs(
                "health_check_interval_secs",
                self.health_check_interval_secs,
            )?,
            health_check_timeout: secs(
                "health_check_timeout_secs",
                self.health_check_timeout_secs,
            )?,
            resolve_replicas: self.resolve_replicas,
            max_body_bytes: self.max_body_bytes,
            api_key: self.api_key.clone(),
            upstream_api_key: self
                .upstream_api_key
                .clone()
                .or_else(|| self.api_key.clone()),
            edge: EdgeLimits::new(self.max_connections, self.header_read_timeout_secs)
                .map_err(|e| ProxyError::Config(e.to_string()))?,
        })
    }
}

/// Normalises a role's base URLs (trailing `/` removed) and rejects what is not `http(s)://host`.
fn urls(role: &str, raw: &[String]) -> Result<Vec<String>, ProxyError> {
    if raw.is_empty() {
        return Err(ProxyError::Config(format!(
            "at least one --{role} URL is required"
        )));
    }
    raw.iter()
        .map(|url| {
            let trimmed = url.trim().trim_end_matches('/');
            let parsed = reqwest::Url::parse(trimmed).map_err(|e| {
                ProxyError::Config(format!("--{role} {url:?} is not a valid URL: {e}"))
            })?;
            if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
                return Err(ProxyError::Config(format!(
                    "--{role} {url:?} must be an http:// or https:// URL with a host"
                )));
            }
            Ok(trimmed.to_owned())
        })
        .collect()
}

fn secs(name: &str, value: f64) -> Result<Duration, ProxyError> {
    if value.is_finite() && value > 0.0 {
        Duration::try_from_secs_f64(value)
            .map_err(|e| ProxyError::Config(format!("{name} = {value}: {e}")))
    } else {
        Err(ProxyError::Config(format!(
            "{name} must be a positive number of seconds, got {value}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ProxyArgs,
    }

    #[test]
    fn clap_defaults_equal_serde_defaults() {
        let cli = Cli::try_parse_from(["proxy"]).unwrap();
        assert_eq!(cli.args, ProxyArgs::default());
    }

    #[test]
    fn repeated_flags_collect_urls() {
        let cli = Cli::try_parse_from([
            "proxy",
            "--prefill",
            "http://a:1/",
            "--prefill",
            "http://b:2",
            "--decode",
            "http://c:3",
            "--prefill-timeout-secs",
            "0.5",
        ])
        .unwrap();
        let settings = cli.args.validate().unwrap();
        assert_eq!(settings.prefill, ["http://a:1", "http://b:2"]);
        assert_eq!(settings.decode, ["http://c:3"]);
        assert_eq!(settings.prefill_timeout, Duration::from_millis(500));
    }

    #[test]
    fn rejects_missing_role_bad_url_and_bad_timeout() {
        let mut args = ProxyArgs {
            prefill: vec!["http://a:1".into()],
            ..ProxyArgs::default()
        };
        assert!(args.validate().is_err(), "no decode URL");
        args.decode = vec!["ftp://c:3".into()];
        assert!(args.validate().is_err(), "ftp scheme");
        args.decode = vec!["http://c:3".into()];
        assert!(args.validate().is_ok());
        args.connect_timeout_secs = 0.0;
        assert!(args.validate().is_err(), "zero timeout");
        args.connect_timeout_secs = f64::NAN;
        assert!(args.validate().is_err(), "NaN timeout");
        args.connect_timeout_secs = 1.0;
        args.max_connections = 0;
        assert!(args.validate().is_err(), "zero max_connections");
        args.max_connections = 8;
        args.header_read_timeout_secs = 0.0;
        assert!(args.validate().is_err(), "zero header read timeout");
    }

    #[test]
    fn upstream_key_defaults_to_the_client_key_and_keys_are_redacted() {
        let cli = Cli::try_parse_from([
            "proxy",
            "--prefill",
            "http://a:1",
            "--decode",
            "http://c:3",
            "--api-key",
            "sk-client",
            "--max-connections",
            "64",
            "--header-read-timeout-secs",
            "2.5",
        ])
        .unwrap();
        let settings = cli.args.validate().unwrap();
        assert!(settings.upstream_api_key.unwrap().matches(b"sk-client"));
        assert_eq!(settings.edge.max_connections, 64);
        assert_eq!(
            settings.edge.header_read_timeout,
            Duration::from_millis(2500)
        );
        assert!(!format!("{:?}", cli.args).contains("sk-client"));

        let mut args = cli.args;
        args.upstream_api_key = Some("sk-upstream".parse().unwrap());
        let settings = args.validate().unwrap();
        assert!(settings.upstream_api_key.unwrap().matches(b"sk-upstream"));
        assert!(settings.api_key.unwrap().matches(b"sk-client"));
        assert!(Cli::try_parse_from(["proxy", "--api-key", "has space"]).is_err());
    }
}
