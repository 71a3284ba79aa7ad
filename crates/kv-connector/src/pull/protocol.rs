//! What the pull connector's parts say to each other: the scheduler side's per-step
//! [`PullMetadata`] for its workers, and the NIXL notifications a consumer sends a producer.
//!
//! Notifications (consumer → producer, bytes, one per message):
//! - `tandem/v1/renew:{remote_request_id}`: "I am working on it": the producer extends the
//!   request's lease to now + its `kv_lease_duration`. Sent before the READ is posted and every
//!   half lease (of the consumer's own `kv_lease_duration`) while it is in flight.
//! - `tandem/v1/done:{remote_request_id}`: "I no longer need these blocks": attached to the READ
//!   (NIXL delivers it only after the data has landed), or sent alone when a load is cancelled,
//!   fails after the handshake, or a request ends before its load began. The producer frees.
//!
//! Invariants: a `remote_request_id` is chosen by the producer and is unguessable (it carries
//! 128 random bits), so a notification can only free the lease of a request whose params the
//! sender was given; anything that does not parse as one of the two is ignored.

use std::time::Instant;

use crate::nixl::BlockPairs;

/// Prefix of the completion notification.
pub const DONE_PREFIX: &[u8] = b"tandem/v1/done:";
/// Prefix of the lease renewal notification.
pub const RENEW_PREFIX: &[u8] = b"tandem/v1/renew:";

/// A notification of the pull protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullNotif<'a> {
    /// The consumer is done with the request's blocks.
    Done(&'a str),
    /// The consumer is still working on the request.
    Renew(&'a str),
}

impl<'a> PullNotif<'a> {
    pub fn encode(&self) -> Vec<u8> {
        let (prefix, id) = match self {
            PullNotif::Done(id) => (DONE_PREFIX, id),
            PullNotif::Renew(id) => (RENEW_PREFIX, id),
        };
        [prefix, id.as_bytes()].concat()
    }

    /// Parses a notification; `None` for anything else (another protocol, garbage).
    pub fn decode(bytes: &'a [u8]) -> Option<PullNotif<'a>> {
        let id = |rest: &'a [u8]| std::str::from_utf8(rest).ok().filter(|s| !s.is_empty());
        if let Some(rest) = bytes.strip_prefix(DONE_PREFIX) {
            id(rest).map(PullNotif::Done)
        } else if let Some(rest) = bytes.strip_prefix(RENEW_PREFIX) {
            id(rest).map(PullNotif::Renew)
        } else {
            None
        }
    }
}

/// A producer as a consumer addresses it: where its handshake is served and who it must be.
/// Peers are cached by this key (a restarted producer has a new engine id or agent, and a
/// failed transfer drops the cache entry).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerAddr {
    pub host: String,
    /// The producer's HTTP port.
    pub port: u16,
    pub engine_id: String,
}

impl PeerAddr {
    /// Where the producer serves its handshake (IPv6 literals bracketed).
    pub fn handshake_url(&self) -> String {
        self.url(super::HANDSHAKE_PATH)
    }

    /// `path` on the producer's HTTP port.
    pub fn url(&self, path: &str) -> String {
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("http://[{}]:{}{path}", self.host, self.port)
        } else {
            format!("http://{}:{}{path}", self.host, self.port)
        }
    }
}

impl std::fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "engine {:?} at {}:{}",
            self.engine_id, self.host, self.port
        )
    }
}

/// What a worker does for a consumer request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadKind {
    /// READ the blocks, then report the request in `finished_recving` (with
    /// `failed_recving` on failure).
    Read,
    /// Only tell the producer to free (the request ended, or needs nothing, before a READ);
    /// nothing is reported.
    Release,
    /// The scheduler side found the load impossible; the worker reports it failed at once.
    Reject(String),
    /// Push producer: WRITE `local` into the consumer's `remote` blocks with `notif` attached,
    /// never after `deadline` (not posted after it; abandoned if still in flight then); on a
    /// failure, `fail_notif` tells the consumer (best effort). Reported `Loaded` or `Failed`.
    Write {
        notif: Vec<u8>,
        fail_notif: Vec<u8>,
        deadline: Instant,
    },
    /// Push consumer: after the producer's handshake, POST the job's body (the registration) to
    /// its register route. Reported `Registered`.
    Register,
    /// Send this notification to the peer (after its handshake). Reported `Released`.
    Notify(Vec<u8>),
}

/// One consumer load (or release) for the workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSpec {
    /// The engine's id of the request.
    pub request_id: u64,
    pub kind: LoadKind,
    pub peer: PeerAddr,
    pub remote_request_id: String,
    /// Per KV cache group (or one list for all), local destination blocks in prompt order,
    /// paired with the producer's source blocks; local ids are in the producer's units when
    /// its blocks are smaller (block `b` of ours is sub-blocks `b * k .. (b + 1) * k`).
    pub blocks: BlockPairs,
    /// A READ: the producer's tokens per block the ids assume (from the params); the worker
    /// refuses the READ unless the producer's handshake says the same.
    pub remote_block_size: Option<usize>,
    /// A READ's `POST /v1/kv/claim` body (the request's params as the producer issued them).
    pub claim_body: Option<String>,
}

/// A producer request whose blocks are held for a consumer until `deadline` (or its done
/// notification).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSpec {
    pub request_id: u64,
    pub remote_request_id: String,
    pub deadline: Instant,
}

/// The pull connector's [`crate::base::ConnectorMetadata`] payload: what is new since the last
/// step. Empty steps send no metadata at all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PullMetadata {
    pub loads: Vec<LoadSpec>,
    /// Loads whose request ended while the load was in flight: the worker stops them and
    /// reports the request in `finished_sending` once nothing writes into its blocks any more.
    pub cancelled_loads: Vec<u64>,
    pub leases: Vec<LeaseSpec>,
}

impl PullMetadata {
    pub fn is_empty(&self) -> bool {
        self.loads.is_empty() && self.cancelled_loads.is_empty() && self.leases.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_round_trip_and_garbage_is_ignored() {
        for n in [PullNotif::Done("7-abc"), PullNotif::Renew("x:y:z")] {
            assert_eq!(PullNotif::decode(&n.encode()), Some(n));
        }
        assert_eq!(PullNotif::Done("r1").encode(), b"tandem/v1/done:r1");
        let mut a = PeerAddr {
            host: "10.0.0.1".into(),
            port: 8100,
            engine_id: "p".into(),
        };
        assert_eq!(a.handshake_url(), "http://10.0.0.1:8100/v1/kv/handshake");
        a.host = "::1".into();
        assert_eq!(a.handshake_url(), "http://[::1]:8100/v1/kv/handshake");
        for junk in [
            &b""[..],
            b"tandem/v1/done:",
            b"tandem/v2/done:r1",
            b"tandem/v1/done:\xff\xfe",
            b"pull-done",
        ] {
            assert_eq!(PullNotif::decode(junk), None, "{junk:?}");
        }
    }
}
