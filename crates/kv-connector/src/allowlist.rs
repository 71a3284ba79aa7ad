//! [`ProducerAllowlist`]: the producers a consumer may contact at all
//! (`kv_connector_extra_config.allowed_producers`).
//!
//! Entries are strings: a CIDR range (`10.0.0.0/8`, `fd00::/8`, any port), an IP address with
//! or without a port (`10.0.0.5:8100`, `[::1]:8100`, `10.0.0.5`), or a host name with or without
//! a port (`prefill-0:8100`, `prefill-0`; compared case-insensitively with `remote_host` as
//! written, never resolved). The default, when the key is absent, depends on the deployment: with
//! a KV transfer secret every producer is allowed (only a secret-holder can sign params), without
//! one only loopback producers are ([`ProducerAllowlist::loopback`]), since such instances listen
//! on loopback only.
//!
//! Invariant: [`ProducerAllowlist::check`] runs before any connection a request's params cause.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::error::KvConnectorError;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Net(IpNet),
    Ip(IpAddr, Option<u16>),
    Name(String, Option<u16>),
}

/// Which producers a consumer may contact (`None`: any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerAllowlist {
    entries: Option<Vec<Entry>>,
}

fn parse_port(p: &str, entry: &str) -> Result<u16, KvConnectorError> {
    match p.parse::<u16>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(KvConnectorError::InvalidConfig(format!(
            "allowed_producers entry {entry:?}: port {p:?} is not in 1..=65535"
        ))),
    }
}

fn parse_entry(s: &str) -> Result<Entry, KvConnectorError> {
    let bad = |why: &str| {
        KvConnectorError::InvalidConfig(format!(
            "allowed_producers entry {s:?} {why} (expected a CIDR range like 10.0.0.0/8, \
             an address or host name, optionally with :port)"
        ))
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(bad("is empty"));
    }
    if t.contains('/') {
        return t
            .parse::<IpNet>()
            .map(Entry::Net)
            .map_err(|_| bad("is not a CIDR range"));
    }
    if let Ok(ip) = t.parse::<IpAddr>() {
        return Ok(Entry::Ip(ip, None));
    }
    if let Some(rest) = t.strip_prefix('[') {
        let (ip, port) = rest.split_once("]:").ok_or_else(|| bad("is malformed"))?;
        let ip = ip.parse::<IpAddr>().map_err(|_| bad("is not an address"))?;
        return Ok(Entry::Ip(ip, Some(parse_port(port, s)?)));
    }
    let (host, port) = match t.rsplit_once(':') {
        Some((h, p)) => (h, Some(parse_port(p, s)?)),
        None => (t, None),
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(Entry::Ip(ip, port));
    }
    if !crate::params::valid_host(host) || host.contains(':') {
        return Err(bad("is not a host name"));
    }
    Ok(Entry::Name(host.to_ascii_lowercase(), port))
}

fn host_ip(host: &str) -> Option<IpAddr> {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.parse().ok()
}

impl ProducerAllowlist {
    /// Every producer.
    pub fn any() -> Self {
        ProducerAllowlist { entries: None }
    }

    /// Loopback producers only: `127.0.0.0/8`, `::1`, `localhost`.
    pub fn loopback() -> Self {
        Self::only(vec![
            Entry::Net("127.0.0.0/8".parse().expect("valid CIDR")),
            Entry::Net("::1/128".parse().expect("valid CIDR")),
            Entry::Name("localhost".into(), None),
        ])
    }

    fn only(entries: Vec<Entry>) -> Self {
        ProducerAllowlist {
            entries: Some(entries),
        }
    }

    /// Parses the configured entries (an empty list allows nobody).
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, KvConnectorError> {
        entries
            .iter()
            .map(|e| parse_entry(e.as_ref()))
            .collect::<Result<Vec<_>, _>>()
            .map(Self::only)
    }

    /// Whether `host:port` (as a request's `remote_host`/`remote_port` name it) may be contacted.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        let Some(entries) = &self.entries else {
            return true;
        };
        let ip = host_ip(host);
        let name = host.to_ascii_lowercase();
        let port_ok = |p: &Option<u16>| p.is_none_or(|p| p == port);
        entries.iter().any(|e| match (e, ip) {
            (Entry::Net(net), Some(ip)) => net.contains(&ip),
            (Entry::Ip(a, p), Some(ip)) => *a == ip && port_ok(p),
            (Entry::Name(n, p), None) => *n == name && port_ok(p),
            _ => false,
        })
    }

    /// [`Self::allows`] as a result with the refusal a client sees.
    pub fn check(&self, host: &str, port: u16) -> Result<(), KvConnectorError> {
        if self.allows(host, port) {
            Ok(())
        } else {
            Err(KvConnectorError::ProducerNotAllowed(format!(
                "{host}:{port} is not in this instance's allowed_producers"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_match_by_range_address_name_and_port() {
        let a = ProducerAllowlist::parse(&[
            "10.0.0.0/8",
            "192.168.1.5:8100",
            "[fd00::7]:9000",
            "Prefill-0:8100",
            "prefill-1",
            "172.16.0.9",
        ])
        .unwrap();
        for (host, port, ok) in [
            ("10.1.2.3", 1, true),
            ("11.0.0.1", 8100, false),
            ("192.168.1.5", 8100, true),
            ("192.168.1.5", 8101, false),
            ("fd00::7", 9000, true),
            ("[fd00::7]", 9000, true),
            ("fd00::7", 9001, false),
            ("prefill-0", 8100, true),
            ("PREFILL-0", 8100, true),
            ("prefill-0", 8200, false),
            ("prefill-1", 1234, true),
            ("prefill-2", 8100, false),
            ("172.16.0.9", 5, true),
            ("127.0.0.1", 8100, false),
            // A name is never resolved, so an address does not match a name entry.
            ("10.0.0.1.example", 8100, false),
        ] {
            assert_eq!(a.allows(host, port), ok, "{host}:{port}");
        }
        assert!(a
            .check("11.0.0.1", 80)
            .unwrap_err()
            .to_string()
            .contains("11.0.0.1:80"));
        assert!(ProducerAllowlist::any().allows("anything", 1));
        assert!(!ProducerAllowlist::parse::<&str>(&[])
            .unwrap()
            .allows("127.0.0.1", 1));
    }

    #[test]
    fn loopback_default_allows_only_this_host() {
        let l = ProducerAllowlist::loopback();
        for (host, ok) in [
            ("127.0.0.1", true),
            ("127.3.4.5", true),
            ("::1", true),
            ("localhost", true),
            ("10.0.0.1", false),
            ("169.254.169.254", false),
            ("example.com", false),
        ] {
            assert_eq!(l.allows(host, 8100), ok, "{host}");
        }
    }

    #[test]
    fn malformed_entries_are_config_errors() {
        for bad in [
            "",
            "10.0.0.0/33",
            "host:0",
            "host:99999",
            "a b",
            "[::1]",
            "x:y:z",
        ] {
            let e = ProducerAllowlist::parse(&[bad]).unwrap_err();
            assert!(e.to_string().contains("allowed_producers"), "{bad}: {e}");
        }
    }
}
