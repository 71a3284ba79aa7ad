//! `TANDEM_NIXL_SIDE_CHANNEL_HOST=auto`: a P/D instance finds, at start, the address it
//! advertises and the network interface UCX should use, for deployments that cannot name each
//! replica in advance (the replicas of a scaled Docker Compose service share one configuration:
//! a service name would not say which replica holds a lease, and interface names differ).
//!
//! `auto` becomes the first non-loopback address (IPv4 before IPv6) that the machine's host name
//! resolves to; in a container that is the container's address on its network (Docker writes it
//! to `/etc/hosts`). When `UCX_NET_DEVICES` is unset it becomes the interface that holds that
//! address, so the KV bytes move over the network the address belongs to (without it, NIXL's
//! loader would pick loopback, which only reaches the same host). Both variables are rewritten
//! before any thread exists and before anything reads them; a host name without a usable address
//! stops `tandem serve` with the reason. Any other value, and a `UCX_NET_DEVICES` the user set,
//! are left as they are.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs};

use anyhow::{bail, Context};

pub use tandem_kv_connector::config::SIDE_CHANNEL_HOST_ENV;
/// The value that asks for the machine's own address.
pub const AUTO: &str = "auto";
/// UCX's list of network devices.
pub const UCX_NET_DEVICES_ENV: &str = "UCX_NET_DEVICES";

/// What `auto` resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advertised {
    /// The address now in `TANDEM_NIXL_SIDE_CHANNEL_HOST`.
    pub ip: IpAddr,
    /// The interface now in `UCX_NET_DEVICES`, when this step set it.
    pub ucx_net_device: Option<String>,
}

/// Rewrites `TANDEM_NIXL_SIDE_CHANNEL_HOST=auto` to this machine's address (and an unset
/// `UCX_NET_DEVICES` to that address's interface); returns what it set, `None` without `auto`.
/// Call it while the process has one thread.
pub fn resolve_auto() -> anyhow::Result<Option<Advertised>> {
    if std::env::var(SIDE_CHANNEL_HOST_ENV).ok().as_deref() != Some(AUTO) {
        return Ok(None);
    }
    let name = host_name()?;
    let addrs: Vec<IpAddr> = (name.as_str(), 0)
        .to_socket_addrs()
        .with_context(|| format!("{SIDE_CHANNEL_HOST_ENV}=auto: resolving the host name {name:?}"))?
        .map(|a| a.ip())
        .collect();
    let Some(ip) = pick(&addrs) else {
        bail!(
            "{SIDE_CHANNEL_HOST_ENV}=auto: the host name {name:?} resolves to no address other \
             than loopback ({addrs:?}); set the address to advertise instead"
        );
    };
    // Single-threaded here (called before the runtime and the tracing subscriber start).
    std::env::set_var(SIDE_CHANNEL_HOST_ENV, ip.to_string());
    let mut ucx_net_device = None;
    if std::env::var_os(UCX_NET_DEVICES_ENV).is_none() {
        if let Some(device) = interface_of(ip) {
            std::env::set_var(UCX_NET_DEVICES_ENV, &device);
            ucx_net_device = Some(device);
        }
    }
    Ok(Some(Advertised { ip, ucx_net_device }))
}

/// The first IPv4 address that is not loopback or unspecified, else the first such IPv6 one.
fn pick(addrs: &[IpAddr]) -> Option<IpAddr> {
    let usable = |ip: &&IpAddr| !ip.is_loopback() && !ip.is_unspecified();
    addrs
        .iter()
        .filter(usable)
        .find(|ip| ip.is_ipv4())
        .or_else(|| addrs.iter().find(usable))
        .copied()
}

fn host_name() -> anyhow::Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        bail!(
            "{SIDE_CHANNEL_HOST_ENV}=auto: gethostname failed: {}",
            std::io::Error::last_os_error()
        );
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).into_owned();
    if name.is_empty() {
        bail!("{SIDE_CHANNEL_HOST_ENV}=auto: the machine has no host name");
    }
    Ok(name)
}

/// The name of the network interface that holds `ip`, if any.
fn interface_of(ip: IpAddr) -> Option<String> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list that freeifaddrs releases below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points at a sockaddr whose family says its layout.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                        sin.sin_addr.s_addr,
                    ))))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
                }
                _ => None,
            }
        };
        if addr == Some(ip) {
            // SAFETY: `ifa_name` is a non-null NUL-terminated string owned by the list.
            found = Some(
                unsafe { CStr::from_ptr(ifa.ifa_name) }
                    .to_string_lossy()
                    .into_owned(),
            );
            break;
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once; nothing borrowed from it survives.
    unsafe { libc::freeifaddrs(list) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_ipv4_then_ipv6_never_loopback() {
        let ips =
            |list: &[&str]| -> Vec<IpAddr> { list.iter().map(|s| s.parse().unwrap()).collect() };
        assert_eq!(
            pick(&ips(&["127.0.0.1", "fd00::2", "172.18.0.3"])),
            Some("172.18.0.3".parse().unwrap())
        );
        assert_eq!(
            pick(&ips(&["::1", "fd00::2"])),
            Some("fd00::2".parse().unwrap())
        );
        assert_eq!(pick(&ips(&["127.0.1.1", "::1", "0.0.0.0"])), None);
        assert!(!host_name().unwrap().is_empty());
    }

    #[test]
    fn finds_the_interface_of_an_address() {
        assert_eq!(
            interface_of("127.0.0.1".parse().unwrap()).as_deref(),
            Some("lo")
        );
        assert_eq!(interface_of("192.0.2.77".parse().unwrap()), None);
    }
}
