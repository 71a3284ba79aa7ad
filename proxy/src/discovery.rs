//! DNS discovery of a service's replicas (`--resolve-replicas`): one configured base URL whose
//! host is a name becomes one base URL per address the name resolves to.
//!
//! Invariants: the scheme, port and path of the configured URL are kept; only the host changes
//! (IPv6 addresses in brackets); the result is sorted and free of duplicates, so the same answer
//! in another order changes nothing. An IP literal resolves to itself without a lookup.

use std::io;
use std::net::IpAddr;

/// Every base URL `source` stands for: one per address of its host.
pub(crate) async fn resolve_all(source: &str) -> io::Result<Vec<String>> {
    let url = reqwest::Url::parse(source)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let host = url
        .host_str()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no host"))?;
    let port = url
        .port_or_known_default()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no port"))?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.parse::<IpAddr>().is_ok() {
        return Ok(vec![source.to_owned()]);
    }
    let mut ips: Vec<IpAddr> = tokio::net::lookup_host((bare, port))
        .await?
        .map(|addr| addr.ip())
        .collect();
    ips.sort();
    ips.dedup();
    Ok(ips.into_iter().map(|ip| with_ip(&url, ip)).collect())
}

/// `url` with `ip` as its host, as the string the pool keys instances by (no trailing `/`).
fn with_ip(url: &reqwest::Url, ip: IpAddr) -> String {
    let mut url = url.clone();
    // Infallible for an http(s) URL, which has a host to replace.
    let _ = url.set_ip_host(ip);
    url.as_str().trim_end_matches('/').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_literal_is_itself_and_a_name_becomes_addresses() {
        assert_eq!(
            resolve_all("http://10.1.2.3:8200").await.unwrap(),
            ["http://10.1.2.3:8200"]
        );
        let local = resolve_all("http://localhost:8100").await.unwrap();
        assert!(
            local.contains(&"http://127.0.0.1:8100".to_owned()),
            "{local:?}"
        );
        let url = reqwest::Url::parse("https://decode:9000/base").unwrap();
        assert_eq!(
            with_ip(&url, "fd00::7".parse().unwrap()),
            "https://[fd00::7]:9000/base"
        );
        assert!(resolve_all("http://no-such-host.invalid:1").await.is_err());
    }
}
