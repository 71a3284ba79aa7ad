//! `EdgeLimits` (what `serve` enforces per listener) and `ApiKey` (a bearer key that never shows
//! in logs), the settings a binary exposes as its own flags.
//!
//! Each binary declares its own clap flags (the env var names differ per binary:
//! `TANDEM_PROXY_MAX_CONNECTIONS` for the proxy, `TANDEM_MAX_CONNECTIONS` for an instance) with
//! the defaults below, and builds the limits with [`EdgeLimits::new`], the one place that rejects
//! a value. `ApiKey` parses from a flag or env var (`FromStr`) and from TOML (serde).
//!
//! Invariants: an `EdgeLimits` made by `new` (or `Default`) has 1 ≤ `max_connections` ≤
//! [`EdgeLimits::MAX_CONNECTIONS`] and non-zero timeouts; `serve` checks the same again for one
//! built field by field. An `ApiKey` is non-empty visible ASCII, its `Debug` is redacted and its
//! `PartialEq` runs in constant time.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::EdgeError;

/// Default `--max-connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default `--header-read-timeout-secs`.
pub const DEFAULT_HEADER_READ_TIMEOUT_SECS: f64 = 30.0;
/// How long a graceful shutdown waits for requests in flight.
const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// What [`crate::serve`] enforces on every connection of its listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeLimits {
    /// Most connections served at once; one accepted over it is closed at once.
    pub max_connections: usize,
    /// Longest wait for a request's headers, from the connection's start or from the end of the
    /// previous answer on a keep-alive connection (past it the connection is closed), and for a
    /// request's body once its headers arrived (past it the request fails).
    pub header_read_timeout: Duration,
    /// After the shutdown signal, longest wait for the connections still serving a request;
    /// past it `serve` returns and what is left is dropped.
    pub shutdown_timeout: Duration,
}

impl Default for EdgeLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: Duration::from_secs_f64(DEFAULT_HEADER_READ_TIMEOUT_SECS),
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
        }
    }
}

impl EdgeLimits {
    /// The largest `max_connections` accepted (far above any file-descriptor limit).
    pub const MAX_CONNECTIONS: usize = 1 << 20;

    /// Limits from a binary's flags (`--max-connections`, `--header-read-timeout-secs`), with the
    /// default shutdown timeout.
    pub fn new(max_connections: usize, header_read_timeout_secs: f64) -> Result<Self, EdgeError> {
        let limits = Self {
            max_connections,
            header_read_timeout: positive_secs(
                "header_read_timeout_secs",
                header_read_timeout_secs,
            )?,
            ..Self::default()
        };
        limits.check()?;
        Ok(limits)
    }

    /// The same limits with another graceful-shutdown bound.
    pub fn with_shutdown_timeout(self, shutdown_timeout: Duration) -> Self {
        Self {
            shutdown_timeout,
            ..self
        }
    }

    /// Rejects limits that `serve` cannot honour.
    pub fn check(&self) -> Result<(), EdgeError> {
        if self.max_connections == 0 || self.max_connections > Self::MAX_CONNECTIONS {
            return Err(EdgeError::MaxConnections {
                value: self.max_connections,
                max: Self::MAX_CONNECTIONS,
            });
        }
        for (name, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("shutdown_timeout", self.shutdown_timeout),
        ] {
            if d.is_zero() {
                return Err(EdgeError::Seconds { name, value: 0.0 });
            }
        }
        Ok(())
    }
}

fn positive_secs(name: &'static str, value: f64) -> Result<Duration, EdgeError> {
    if value.is_finite() && value > 0.0 {
        Duration::try_from_secs_f64(value).map_err(|_| EdgeError::Seconds { name, value })
    } else {
        Err(EdgeError::Seconds { name, value })
    }
}

/// A bearer API key: non-empty visible ASCII. Its `Debug` never shows it.
#[derive(Clone)]
pub struct ApiKey(Arc<str>);

impl ApiKey {
    /// The key, for building an `Authorization` header. Do not log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The key as the shared string [`crate::require_api_key`] takes.
    pub fn shared(&self) -> Arc<str> {
        self.0.clone()
    }

    /// Whether `presented` is this key, in time that depends only on the lengths.
    pub fn matches(&self, presented: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), presented)
    }
}

impl FromStr for ApiKey {
    type Err = EdgeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(EdgeError::InvalidApiKey);
        }
        Ok(Self(s.into()))
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl PartialEq for ApiKey {
    fn eq(&self, other: &Self) -> bool {
        self.matches(other.0.as_bytes())
    }
}

impl Eq for ApiKey {}

impl Serialize for ApiKey {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ApiKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Compares two byte strings touching every byte of the longer one, whatever they hold: the time
/// reveals the lengths, not where they first differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"sk-abc", b"sk-abc"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-abd"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-ab"));
        assert!(!constant_time_eq(b"sk-ab", b"sk-ab\0"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn api_key_parses_redacts_and_round_trips() {
        let key: ApiKey = "sk-secret".parse().unwrap();
        assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
        assert!(key.matches(b"sk-secret"));
        assert!(!key.matches(b"sk-secreT"));
        assert!("".parse::<ApiKey>().is_err());
        assert!("has space".parse::<ApiKey>().is_err());
        assert!("tab\t".parse::<ApiKey>().is_err());
        let json = serde_json::to_string(&key).unwrap();
        assert_eq!(serde_json::from_str::<ApiKey>(&json).unwrap(), key);
        assert!(serde_json::from_str::<ApiKey>("\"\"").is_err());
    }

    #[test]
    fn limits_reject_what_serve_cannot_honour() {
        assert_eq!(
            EdgeLimits::new(DEFAULT_MAX_CONNECTIONS, DEFAULT_HEADER_READ_TIMEOUT_SECS).unwrap(),
            EdgeLimits::default()
        );
        assert!(EdgeLimits::new(0, 1.0).is_err());
        assert!(EdgeLimits::new(EdgeLimits::MAX_CONNECTIONS + 1, 1.0).is_err());
        assert!(EdgeLimits::new(8, 0.0).is_err());
        assert!(EdgeLimits::new(8, f64::NAN).is_err());
        assert!(EdgeLimits::new(8, -1.0).is_err());
        assert_eq!(
            EdgeLimits::new(8, 0.5).unwrap().header_read_timeout,
            Duration::from_millis(500)
        );
        let zero = EdgeLimits::default().with_shutdown_timeout(Duration::ZERO);
        assert!(zero.check().is_err());
    }
}
