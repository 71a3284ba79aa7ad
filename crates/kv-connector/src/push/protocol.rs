//! What the push connector's parts say to each other: the consumer's registration (an HTTP
//! body), the producer's NIXL notifications, and the per-step [`PushMetadata`].
//!
//! Registration (consumer → producer, `POST /v1/kv/push/register` on the producer's HTTP port,
//! signed with the deployment secret when there is one): [`Registration`] as JSON. Its
//! `block_ids` are the consumer's blocks for the prompt's block positions
//! `first_block .. cdiv(num_tokens, block_size)`; an empty list means "I need nothing, free
//! now" (the consumer prefilled locally, or its request ended before it registered blocks).
//!
//! Notifications (producer → consumer, one per message, attached to the WRITE or alone):
//! - `tandem/v2/pushed:{transfer_id}`: the WRITE of the transfer's blocks has landed (NIXL
//!   delivers an attached notification only after the data). The form without checksums.
//! - `tandem/v2/pushed+ck:{json}`: the same, carrying the KV checksums (the connector-owned
//!   carrier): `{"v": 1, "transfer_id": …, "kv_checksums": …}`, `kv_checksums` the encoded
//!   payload as in `kv_transfer_params`. Another `v` does not decode.
//! - `tandem/v2/push-failed:{transfer_id}\n{reason}`: nothing (more) will be written for the
//!   transfer; the consumer fails its load now.
//!
//! Invariants: a transfer id is the proxy's random id, unguessable, so a notification can only
//! complete a load whose id the sender was given; anything that does not decode is reported as
//! [`PushNotif::Malformed`] (counted) or ignored when it belongs to another protocol.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use tandem_kv_cache::BlockId;

use crate::pull::PeerAddr;

const PUSHED_PREFIX: &[u8] = b"tandem/v2/pushed:";
const PUSHED_CK_PREFIX: &[u8] = b"tandem/v2/pushed+ck:";
const FAILED_PREFIX: &[u8] = b"tandem/v2/push-failed:";
/// The version of the checksum-carrying notification's JSON.
pub const PUSH_NOTIF_VERSION: u64 = 1;

/// A producer → consumer notification of the push protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushNotif {
    /// The WRITE landed; `kv_checksums` when the producer sent them.
    Pushed {
        transfer_id: String,
        kv_checksums: Option<String>,
    },
    /// The producer will not write (more of) this transfer.
    Failed { transfer_id: String, reason: String },
    /// A push notification that does not decode (a bad or unknown payload version).
    Malformed(String),
}

#[derive(Serialize, Deserialize)]
struct CarriedChecksums {
    v: u64,
    transfer_id: String,
    kv_checksums: String,
}

impl PushNotif {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            PushNotif::Pushed {
                transfer_id,
                kv_checksums: None,
            } => [PUSHED_PREFIX, transfer_id.as_bytes()].concat(),
            PushNotif::Pushed {
                transfer_id,
                kv_checksums: Some(payload),
            } => {
                let body = serde_json::to_vec(&CarriedChecksums {
                    v: PUSH_NOTIF_VERSION,
                    transfer_id: transfer_id.clone(),
                    kv_checksums: payload.clone(),
                })
                .expect("strings always serialize");
                [PUSHED_CK_PREFIX, &body].concat()
            }
            PushNotif::Failed {
                transfer_id,
                reason,
            } => [
                FAILED_PREFIX,
                transfer_id.as_bytes(),
                b"\n",
                reason.as_bytes(),
            ]
            .concat(),
            PushNotif::Malformed(why) => why.as_bytes().to_vec(),
        }
    }

    /// Parses a notification; `None` for another protocol's (or garbage without our prefix).
    pub fn decode(bytes: &[u8]) -> Option<PushNotif> {
        let id = |rest: &[u8]| {
            std::str::from_utf8(rest)
                .ok()
                .filter(|s| !s.is_empty())
                .map(str::to_string)
        };
        if let Some(rest) = bytes.strip_prefix(PUSHED_CK_PREFIX) {
            return Some(match serde_json::from_slice::<CarriedChecksums>(rest) {
                Ok(c) if c.v == PUSH_NOTIF_VERSION && !c.transfer_id.is_empty() => {
                    PushNotif::Pushed {
                        transfer_id: c.transfer_id,
                        kv_checksums: Some(c.kv_checksums),
                    }
                }
                Ok(c) => PushNotif::Malformed(format!(
                    "checksum notification of version {} (this instance reads {PUSH_NOTIF_VERSION})",
                    c.v
                )),
                Err(e) => PushNotif::Malformed(format!("checksum notification: {e}")),
            });
        }
        if let Some(rest) = bytes.strip_prefix(PUSHED_PREFIX) {
            return Some(match id(rest) {
                Some(transfer_id) => PushNotif::Pushed {
                    transfer_id,
                    kv_checksums: None,
                },
                None => PushNotif::Malformed("pushed notification without a transfer id".into()),
            });
        }
        if let Some(rest) = bytes.strip_prefix(FAILED_PREFIX) {
            let text = String::from_utf8_lossy(rest);
            let (tid, reason) = text.split_once('\n').unwrap_or((&text, ""));
            return Some(if tid.is_empty() {
                PushNotif::Malformed("failure notification without a transfer id".into())
            } else {
                PushNotif::Failed {
                    transfer_id: tid.to_string(),
                    reason: reason.to_string(),
                }
            });
        }
        None
    }
}

/// Where the producer reaches a registered consumer (its handshake is served there).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerAddr {
    pub engine_id: String,
    pub host: String,
    pub port: u16,
}

impl ConsumerAddr {
    pub fn peer(&self) -> PeerAddr {
        PeerAddr {
            host: self.host.clone(),
            port: self.port,
            engine_id: self.engine_id.clone(),
        }
    }
}

/// A consumer's registration of its blocks for one transfer (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub transfer_id: String,
    pub consumer: ConsumerAddr,
    /// The consumer's prompt length (the producer's must be the same).
    pub num_tokens: usize,
    /// The consumer's tokens per block.
    pub block_size: usize,
    /// The first block position the consumer needs (after its local prefix hit).
    pub first_block: usize,
    /// The consumer's blocks for positions `first_block ..`, in order; empty: nothing needed.
    pub block_ids: Vec<BlockId>,
    /// How long, from its arrival, the producer may write (the consumer's `load_timeout`).
    pub valid_ms: u64,
}

impl Registration {
    /// The same registration asking for nothing: the producer frees its hold at once.
    pub fn into_release(self) -> Registration {
        Registration {
            block_ids: Vec::new(),
            ..self
        }
    }

    /// The release for a serialized registration that asks for blocks; `None` for a release
    /// (or a body that is not a registration).
    pub fn release_body(body: &str) -> Option<String> {
        let reg: Registration = serde_json::from_str(body).ok()?;
        if reg.block_ids.is_empty() {
            return None;
        }
        serde_json::to_string(&reg.into_release()).ok()
    }
}

/// A producer request's finished blocks, waiting for (or matched with) its registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushSpec {
    pub request_id: u64,
    pub transfer_id: String,
    /// The prompt's blocks, in order.
    pub block_ids: Vec<BlockId>,
    pub num_tokens: usize,
    /// The connector-owned carrier's payload, when checksums are on.
    pub kv_checksums: Option<String>,
    /// Freed (lease expired) if no registration is matched by then.
    pub deadline: Instant,
}

/// A consumer request's registration for the workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisterSpec {
    pub request_id: u64,
    /// The producer's address (empty engine id: any engine there).
    pub producer: PeerAddr,
    pub registration: Registration,
}

/// The push connector's [`crate::base::ConnectorMetadata`] payload: what is new since the last
/// step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushMetadata {
    /// Producer: finished requests whose KV is to be written.
    pub pushes: Vec<PushSpec>,
    /// Producer: transfers whose request ended without KV (aborted): refuse or fail them.
    pub aborted: Vec<String>,
    /// Consumer: registrations to send (with blocks: a load; without: a release).
    pub registrations: Vec<RegisterSpec>,
    /// Consumer: loads whose request ended; their blocks are reported in `finished_sending`
    /// once nothing can write into them any more.
    pub cancelled_loads: Vec<u64>,
    /// Consumer: loads the scheduler side found impossible (nothing was registered): failed at
    /// once with the reason.
    pub rejected: Vec<(u64, String)>,
}

impl PushMetadata {
    pub fn is_empty(&self) -> bool {
        self.pushes.is_empty()
            && self.aborted.is_empty()
            && self.registrations.is_empty()
            && self.cancelled_loads.is_empty()
            && self.rejected.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_round_trip_and_bad_payloads_are_malformed() {
        for n in [
            PushNotif::Pushed {
                transfer_id: "t-1".into(),
                kv_checksums: None,
            },
            PushNotif::Pushed {
                transfer_id: "t-2".into(),
                kv_checksums: Some("AAAB".into()),
            },
            PushNotif::Failed {
                transfer_id: "t-3".into(),
                reason: "aborted".into(),
            },
        ] {
            assert_eq!(PushNotif::decode(&n.encode()), Some(n));
        }
        assert_eq!(
            PushNotif::Pushed {
                transfer_id: "x".into(),
                kv_checksums: None
            }
            .encode(),
            b"tandem/v2/pushed:x"
        );
        for bad in [
            &b"tandem/v2/pushed:"[..],
            b"tandem/v2/pushed+ck:{",
            b"tandem/v2/pushed+ck:{\"v\":2,\"transfer_id\":\"t\",\"kv_checksums\":\"A\"}",
            b"tandem/v2/push-failed:",
        ] {
            assert!(
                matches!(PushNotif::decode(bad), Some(PushNotif::Malformed(_))),
                "{bad:?}"
            );
        }
        assert_eq!(PushNotif::decode(b"tandem/v1/done:r1"), None);
        assert_eq!(PushNotif::decode(b""), None);
    }
}
