//! `kv_transfer_params`: what a request says about P/D, and what a producer answers.
//!
//! A request's `kv_transfer_params` (set by the proxy, never by a client: the proxy strips them)
//! is one of:
//! - absent, `null`, `{}`, or both flags false: an ordinary local request;
//! - `{"do_remote_decode": true}`: a producer request (prefill here, keep the KV for a consumer);
//!   the proxy adds `decode_max_tokens` (the client's output limit), which the server checks
//!   against the prompt before the request reaches the engine;
//! - `{"do_remote_prefill": true, "remote_engine_id", "remote_request_id", "remote_block_ids",
//!   "remote_host", "remote_port", "tp_size"}`: a consumer request (load the prompt's KV from the
//!   producer, then decode). This is exactly what the producer answered ([`RemotePrefill::to_value`]),
//!   with `remote_block_size`, the producer's tokens per block (absent: the consumer's own); a
//!   consumer whose block size is a multiple of it regroups the producer's blocks into its own.
//!
//! Push mode (`NixlPushConnector`): the proxy sends one request to both instances at once, with
//! one `transfer_id` (its own random id, never shown to clients):
//! - `{"do_remote_decode": true, "transfer_id"}` to the producer: prefill, then WRITE the KV
//!   into the blocks the consumer registered for that transfer ([`TransferRequest::PushProducer`]);
//! - `{"do_remote_prefill": true, "transfer_id", "remote_host", "remote_port"}` to the consumer:
//!   register blocks with the producer at that address, wait for its WRITE, then decode
//!   ([`TransferRequest::PushConsumer`], optional `remote_engine_id` to pin the producer).
//!
//! A connector of one mode refuses params of the other with an error that says so.
//!
//! Invariants of a parsed [`RemotePrefill`] (anything else is
//! [`KvConnectorError::InvalidTransferParams`], so a forged or malformed value never reaches a
//! transfer): `remote_block_ids` is one block table (a flat list) or one per KV cache group (a
//! list of at most [`MAX_KV_GROUPS`] lists, by group id), each with exactly
//! `cdiv(prompt_len, block_size)` entries, distinct within the table, where only leading entries
//! may be `null` (blocks a sliding-window group freed before its window) and the last is not; the
//! ids are non-empty strings of at most [`MAX_ID_LEN`] bytes without control characters; the host
//! is a plain host name or IP literal; the port is 1..=65535; `tp_size` (the producer's TP size)
//! is 1 to 1024. Unknown keys are ignored (the checksum feature adds `kv_checksums`). Whether
//! remote block ids exist on the producer is checked against its handshake at transfer time.

use std::collections::HashSet;

use serde_json::{Map, Value};
use tandem_kv_cache::{BlockId, NULL_BLOCK};

use crate::config::KvMode;
use crate::error::KvConnectorError;

/// Longest `remote_engine_id` / `remote_request_id` accepted.
pub const MAX_ID_LEN: usize = 256;
/// Longest `remote_host` accepted (a DNS name's limit).
pub const MAX_HOST_LEN: usize = 253;
/// Most `remote_block_ids` accepted (over every group) where the prompt's length is not known.
pub const MAX_BLOCK_IDS: usize = 1 << 20;
/// Most KV cache groups (block tables) in `remote_block_ids`.
pub const MAX_KV_GROUPS: usize = 16;
/// Largest `remote_block_size` accepted.
pub const MAX_BLOCK_SIZE: usize = 1 << 16;
/// Largest `tp_size` accepted (the producer's tensor-parallel size).
pub const MAX_TP_SIZE: u64 = 1024;

/// What a request's `kv_transfer_params` ask of this instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferRequest {
    /// Nothing: serve it like a single instance.
    Local,
    /// `do_remote_decode`: prefill here and hold the KV for a consumer.
    Producer,
    /// `do_remote_prefill`: load the prompt's KV from a producer.
    Consumer(RemotePrefill),
    /// Push mode, `do_remote_decode` with a `transfer_id`: prefill here, then WRITE the KV into
    /// the blocks the consumer registers for that transfer.
    PushProducer { transfer_id: String },
    /// Push mode, `do_remote_prefill` with a `transfer_id`: register blocks with the producer
    /// and wait for its WRITE.
    PushConsumer(RemotePush),
}

impl TransferRequest {
    /// The mode the params are written for (`None`: a local request, either mode serves it).
    pub fn mode(&self) -> Option<KvMode> {
        match self {
            TransferRequest::Local => None,
            TransferRequest::Producer | TransferRequest::Consumer(_) => Some(KvMode::Pull),
            TransferRequest::PushProducer { .. } | TransferRequest::PushConsumer(_) => {
                Some(KvMode::Push)
            }
        }
    }

    /// An error unless the params suit a connector in `mode` (local requests suit both).
    pub fn check_mode(&self, mode: KvMode) -> Result<(), KvConnectorError> {
        match self.mode() {
            Some(m) if m != mode => Err(bad(format!(
                "these kv_transfer_params are for {} mode ({}), but this instance runs {} \
                 (kv_connector {:?}); run the proxy with --kv-mode {}",
                m.as_str(),
                if m == KvMode::Push {
                    "they carry a transfer_id"
                } else {
                    "they carry no transfer_id"
                },
                mode.as_str(),
                mode.connector_name(),
                mode.as_str()
            ))),
            _ => Ok(()),
        }
    }
}

/// Where a push consumer registers its blocks: the producer's address, from the proxy.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemotePush {
    /// The proxy's id for the request on both instances.
    pub transfer_id: String,
    pub remote_host: String,
    /// The producer's HTTP port (its registration route and handshake are served there).
    pub remote_port: u16,
    /// The producer's engine id, when the proxy pins it; else whatever engine answers there.
    pub remote_engine_id: Option<String>,
}

impl RemotePush {
    fn from_object(obj: &Map<String, Value>) -> Result<RemotePush, KvConnectorError> {
        let (remote_host, remote_port) = get_host_port(obj)?;
        let remote_engine_id = match obj.get("remote_engine_id") {
            None | Some(Value::Null) => None,
            Some(_) => Some(get_id(obj, "remote_engine_id")?),
        };
        Ok(RemotePush {
            transfer_id: get_id(obj, "transfer_id")?,
            remote_host,
            remote_port,
            remote_engine_id,
        })
    }

    /// The params the proxy gives the consumer.
    pub fn to_value(&self) -> Value {
        let mut v = serde_json::json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "transfer_id": self.transfer_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
        });
        if let Some(e) = &self.remote_engine_id {
            v["remote_engine_id"] = Value::String(e.clone());
        }
        v
    }
}

/// `remote_block_size`, if present: 1..=[`MAX_BLOCK_SIZE`].
fn get_block_size(obj: &Map<String, Value>) -> Result<Option<usize>, KvConnectorError> {
    if matches!(obj.get("remote_block_size"), None | Some(Value::Null)) {
        return Ok(None);
    }
    match get_uint(obj, "remote_block_size")? {
        n @ 1.. if n as usize <= MAX_BLOCK_SIZE => Ok(Some(n as usize)),
        n => Err(bad(format!(
            "remote_block_size {n} is not in 1..={MAX_BLOCK_SIZE}"
        ))),
    }
}

/// `remote_host` and `remote_port`, checked.
fn get_host_port(obj: &Map<String, Value>) -> Result<(String, u16), KvConnectorError> {
    let remote_host = match obj.get("remote_host") {
        None | Some(Value::Null) => return Err(bad("remote_host is missing")),
        Some(Value::String(h)) if valid_host(h) => h.clone(),
        Some(Value::String(h)) if h.is_empty() => return Err(bad("remote_host is empty")),
        Some(_) => return Err(bad("remote_host must be a host name or IP address")),
    };
    let port = get_uint(obj, "remote_port")?;
    match u16::try_from(port) {
        Ok(p) if p > 0 => Ok((remote_host, p)),
        _ => Err(bad(format!("remote_port {port} is not in 1..=65535"))),
    }
}

/// Where a consumer request's KV lives: the producer's answer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemotePrefill {
    pub remote_engine_id: String,
    pub remote_request_id: String,
    /// The producer's blocks holding the prompt, in prompt order: one table per KV cache group
    /// (one table: shared by every group), [`NULL_BLOCK`] where it holds none (before a sliding
    /// window).
    pub remote_block_ids: Vec<Vec<BlockId>>,
    pub remote_host: String,
    /// The producer's HTTP port (its handshake is served there).
    pub remote_port: u16,
    pub tp_size: u64,
    /// The producer's tokens per block (`remote_block_size`; absent: the consumer's own). The
    /// consumer's block size must be a multiple of it.
    pub remote_block_size: Option<usize>,
}

fn bad(reason: impl Into<String>) -> KvConnectorError {
    KvConnectorError::InvalidTransferParams(reason.into())
}

fn get_flag(obj: &Map<String, Value>, key: &str) -> Result<bool, KvConnectorError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("{key} must be a boolean"))),
    }
}

fn get_id(obj: &Map<String, Value>, key: &str) -> Result<String, KvConnectorError> {
    match obj.get(key) {
        None | Some(Value::Null) => Err(bad(format!("{key} is missing"))),
        Some(Value::String(s)) => {
            if s.is_empty() || s.len() > MAX_ID_LEN || s.chars().any(char::is_control) {
                Err(bad(format!(
                    "{key} must be 1 to {MAX_ID_LEN} bytes without control characters"
                )))
            } else {
                Ok(s.clone())
            }
        }
        Some(_) => Err(bad(format!("{key} must be a string"))),
    }
}

fn get_uint(obj: &Map<String, Value>, key: &str) -> Result<u64, KvConnectorError> {
    match obj.get(key) {
        None | Some(Value::Null) => Err(bad(format!("{key} is missing"))),
        Some(Value::Number(n)) => n
            .as_u64()
            .ok_or_else(|| bad(format!("{key} must be a non-negative integer, got {n}"))),
        Some(_) => Err(bad(format!("{key} must be an integer"))),
    }
}

/// A host name or IP literal: letters, digits, `.`, `-`, `_`, and for IPv6 `:`, `[`, `]`, `%`.
pub(crate) fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= MAX_HOST_LEN
        && h.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '[' | ']' | '%')
        })
}

impl TransferRequest {
    /// Classifies a request by its `kv_transfer_params`; a consumer request is fully validated
    /// against the prompt's length and the block size (see the module docs).
    pub fn parse(
        params: Option<&Value>,
        prompt_len: usize,
        block_size: usize,
    ) -> Result<TransferRequest, KvConnectorError> {
        let obj = match params {
            None | Some(Value::Null) => return Ok(TransferRequest::Local),
            Some(Value::Object(obj)) => obj,
            Some(_) => return Err(bad("kv_transfer_params must be an object")),
        };
        let remote_decode = get_flag(obj, "do_remote_decode")?;
        let remote_prefill = get_flag(obj, "do_remote_prefill")?;
        let push = !matches!(obj.get("transfer_id"), None | Some(Value::Null));
        match (remote_decode, remote_prefill) {
            (false, false) => Ok(TransferRequest::Local),
            (true, false) if push => Ok(TransferRequest::PushProducer {
                transfer_id: get_id(obj, "transfer_id")?,
            }),
            (false, true) if push => {
                Ok(TransferRequest::PushConsumer(RemotePush::from_object(obj)?))
            }
            (true, false) => Ok(TransferRequest::Producer),
            (false, true) => Ok(TransferRequest::Consumer(RemotePrefill::from_object(
                obj, prompt_len, block_size,
            )?)),
            (true, true) => Err(bad(
                "do_remote_decode and do_remote_prefill cannot both be true",
            )),
        }
    }
}

/// `remote_block_ids` on the wire: one table as a flat list, several as a list of lists; a
/// [`NULL_BLOCK`] as `null`.
pub fn block_tables_value(tables: &[Vec<BlockId>]) -> Value {
    let table = |t: &Vec<BlockId>| {
        Value::Array(
            t.iter()
                .map(|&b| {
                    if b == NULL_BLOCK {
                        Value::Null
                    } else {
                        b.into()
                    }
                })
                .collect(),
        )
    };
    match tables {
        [one] => table(one),
        many => Value::Array(many.iter().map(table).collect()),
    }
}

/// Parses `remote_block_ids` (module docs); `prompt`: (expected entries per table, prompt
/// length, block size), when known.
fn parse_block_tables(
    value: Option<&Value>,
    prompt: Option<(usize, usize, usize)>,
) -> Result<Vec<Vec<BlockId>>, KvConnectorError> {
    let ids = match value {
        None | Some(Value::Null) => return Err(bad("remote_block_ids is missing")),
        Some(Value::Array(ids)) => ids,
        Some(_) => return Err(bad("remote_block_ids must be an array of block ids")),
    };
    let nested = ids.first().is_some_and(Value::is_array);
    let tables: Vec<&Vec<Value>> = if nested {
        if ids.len() > MAX_KV_GROUPS {
            return Err(bad(format!(
                "remote_block_ids names {} KV cache groups (at most {MAX_KV_GROUPS})",
                ids.len()
            )));
        }
        ids.iter()
            .map(|t| {
                t.as_array().ok_or_else(|| {
                    bad("remote_block_ids must be a list of block ids or a list of such lists")
                })
            })
            .collect::<Result<_, _>>()?
    } else {
        vec![ids]
    };
    let total: usize = tables.iter().map(|t| t.len()).sum();
    if prompt.is_none() && (tables.iter().any(|t| t.is_empty()) || total > MAX_BLOCK_IDS) {
        return Err(bad(format!(
            "remote_block_ids must hold 1 to {MAX_BLOCK_IDS} block ids per table"
        )));
    }
    tables
        .iter()
        .enumerate()
        .map(|(g, ids)| {
            let what = if nested {
                format!("remote_block_ids[{g}]")
            } else {
                "remote_block_ids".to_string()
            };
            if let Some((expected, prompt_len, block_size)) = prompt {
                if ids.len() != expected {
                    return Err(bad(format!(
                        "{what} has {} entries, but a prompt of {prompt_len} tokens fills \
                         {expected} blocks of {block_size}",
                        ids.len()
                    )));
                }
            }
            let mut seen = HashSet::with_capacity(ids.len());
            let mut out = Vec::with_capacity(ids.len());
            for v in ids.iter() {
                let id = match v {
                    Value::Null if seen.is_empty() => NULL_BLOCK,
                    Value::Null => {
                        return Err(bad(format!(
                            "{what} holds null after a block: only leading entries may be null"
                        )))
                    }
                    v => v
                        .as_u64()
                        .and_then(|n| BlockId::try_from(n).ok())
                        .filter(|&b| b != NULL_BLOCK)
                        .ok_or_else(|| bad(format!("{what} holds {v}, not a block id")))?,
                };
                if id != NULL_BLOCK && !seen.insert(id) {
                    return Err(bad(format!("{what} holds block {id} twice")));
                }
                out.push(id);
            }
            if seen.is_empty() {
                return Err(bad(format!("{what} holds no block")));
            }
            Ok(out)
        })
        .collect()
}

impl RemotePrefill {
    fn from_object(
        obj: &Map<String, Value>,
        prompt_len: usize,
        block_size: usize,
    ) -> Result<RemotePrefill, KvConnectorError> {
        let remote_bs = get_block_size(obj)?.unwrap_or(block_size).max(1);
        if !block_size.is_multiple_of(remote_bs) {
            return Err(bad(format!(
                "the producer's block size {remote_bs} does not divide this consumer's \
                 {block_size}: in pull mode the consumer's blocks must be a multiple of the \
                 producer's"
            )));
        }
        let expected = prompt_len.div_ceil(remote_bs);
        Self::parse_fields(obj, Some((expected, prompt_len, remote_bs)))
    }

    /// Parses a consumer's params without knowing its prompt (a producer checking a claim):
    /// every invariant of the module docs but the block count's relation to the prompt.
    pub fn from_params(params: &Value) -> Result<RemotePrefill, KvConnectorError> {
        let obj = params
            .as_object()
            .ok_or_else(|| bad("kv_transfer_params must be an object"))?;
        if !get_flag(obj, "do_remote_prefill")? {
            return Err(bad("do_remote_prefill must be true"));
        }
        Self::parse_fields(obj, None)
    }

    /// `prompt`: (expected block count, prompt length, block size), when known.
    fn parse_fields(
        obj: &Map<String, Value>,
        prompt: Option<(usize, usize, usize)>,
    ) -> Result<RemotePrefill, KvConnectorError> {
        let remote_engine_id = get_id(obj, "remote_engine_id")?;
        let remote_request_id = get_id(obj, "remote_request_id")?;
        let remote_block_ids = parse_block_tables(obj.get("remote_block_ids"), prompt)?;
        let (remote_host, remote_port) = get_host_port(obj)?;
        let tp_size = get_uint(obj, "tp_size")?;
        if !(1..=MAX_TP_SIZE).contains(&tp_size) {
            return Err(bad(format!(
                "tp_size {tp_size} is out of range (1 to {MAX_TP_SIZE})"
            )));
        }
        Ok(RemotePrefill {
            remote_engine_id,
            remote_request_id,
            remote_block_ids,
            remote_host,
            remote_port,
            tp_size,
            remote_block_size: get_block_size(obj)?,
        })
    }

    /// The `kv_transfer_params` a producer answers (and a consumer receives).
    pub fn to_value(&self) -> Value {
        let mut v = serde_json::json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_block_ids": block_tables_value(&self.remote_block_ids),
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "tp_size": self.tp_size,
        });
        if let Some(bs) = self.remote_block_size {
            v["remote_block_size"] = Value::from(bs);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn good() -> Value {
        json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p0",
               "remote_request_id": "7-abc", "remote_block_ids": [4, 9, 2],
               "remote_host": "10.0.0.1", "remote_port": 8100, "tp_size": 1,
               "kv_checksums": "AAAA"})
    }

    fn parse(v: &Value, prompt_len: usize) -> Result<TransferRequest, KvConnectorError> {
        TransferRequest::parse(Some(v), prompt_len, 16)
    }

    #[test]
    fn classifies_requests() {
        assert_eq!(
            TransferRequest::parse(None, 5, 16).unwrap(),
            TransferRequest::Local
        );
        assert_eq!(parse(&Value::Null, 5).unwrap(), TransferRequest::Local);
        assert_eq!(parse(&json!({}), 5).unwrap(), TransferRequest::Local);
        assert_eq!(
            parse(&json!({"do_remote_decode": true}), 5).unwrap(),
            TransferRequest::Producer
        );
        let TransferRequest::Consumer(r) = parse(&good(), 33).unwrap() else {
            panic!()
        };
        assert_eq!(r.remote_block_ids, vec![vec![4, 9, 2]]);
        assert_eq!(r.remote_port, 8100);
        assert_eq!(r.to_value()["remote_block_ids"], json!([4, 9, 2]));
        // A table per KV cache group; a sliding-window group's leading blocks are null.
        let mut two = good();
        two["remote_block_ids"] = json!([[4, 9, 2], [null, 4, 7]]);
        let TransferRequest::Consumer(r2) = parse(&two, 33).unwrap() else {
            panic!()
        };
        assert_eq!(
            r2.remote_block_ids,
            vec![vec![4, 9, 2], vec![NULL_BLOCK, 4, 7]]
        );
        assert_eq!(r2.to_value()["remote_block_ids"], two["remote_block_ids"]);
        assert_eq!(
            RemotePrefill::from_params(&r2.to_value()).unwrap(),
            r2.clone()
        );
        // What the producer answers parses back to the same thing (unknown keys ignored).
        assert_eq!(
            parse(&r.to_value(), 48).unwrap(),
            TransferRequest::Consumer(r.clone())
        );
    }

    #[test]
    fn malformed_or_forged_params_are_rejected_with_a_reason() {
        let with = |key: &str, val: Value| {
            let mut v = good();
            v[key] = val;
            v
        };
        let without = |key: &str| {
            let mut v = good();
            v.as_object_mut().unwrap().remove(key);
            v
        };
        let cases: Vec<(Value, usize, &str)> = vec![
            (json!([1]), 33, "must be an object"),
            (
                json!({"do_remote_prefill": "true"}),
                33,
                "do_remote_prefill must be a boolean",
            ),
            (
                with("do_remote_decode", json!(true)),
                33,
                "cannot both be true",
            ),
            (
                without("remote_engine_id"),
                33,
                "remote_engine_id is missing",
            ),
            (
                with("remote_engine_id", json!("")),
                33,
                "remote_engine_id must be 1 to",
            ),
            (
                with("remote_request_id", json!(7)),
                33,
                "remote_request_id must be a string",
            ),
            (
                with("remote_request_id", json!("x".repeat(300))),
                33,
                "remote_request_id must be 1 to",
            ),
            (
                without("remote_block_ids"),
                33,
                "remote_block_ids is missing",
            ),
            (
                with("remote_block_ids", json!("4,9,2")),
                33,
                "must be an array",
            ),
            (
                good(),
                32,
                "has 3 entries, but a prompt of 32 tokens fills 2 blocks",
            ),
            (good(), 49, "fills 4 blocks"),
            (with("remote_block_ids", json!([4, -1, 2])), 33, "holds -1"),
            (
                with("remote_block_ids", json!([4, 1.5, 2])),
                33,
                "holds 1.5",
            ),
            (
                with("remote_block_ids", json!([4, 4294967296u64, 2])),
                33,
                "not a block id",
            ),
            (
                with("remote_block_ids", json!([4, 9, 4])),
                33,
                "block 4 twice",
            ),
            (
                with("remote_block_ids", json!(vec![0; 100_000])),
                33,
                "100000 entries",
            ),
            (
                with("remote_block_ids", json!([[4, 9, 2], [4, 9]])),
                33,
                "remote_block_ids[1] has 2 entries",
            ),
            (
                with("remote_block_ids", json!([[4, 9, 2], 5])),
                33,
                "or a list of such lists",
            ),
            (
                with("remote_block_ids", json!([[4, 9, 2], [4, null, 2]])),
                33,
                "remote_block_ids[1] holds null after a block",
            ),
            (
                with("remote_block_ids", json!([null, null, null])),
                33,
                "remote_block_ids holds no block",
            ),
            (
                with("remote_block_ids", json!([4, 9, 4294967295u64])),
                33,
                "holds 4294967295, not a block id",
            ),
            (
                with("remote_block_ids", json!(vec![json!([1, 2, 3]); 17])),
                33,
                "names 17 KV cache groups",
            ),
            (without("remote_host"), 33, "remote_host is missing"),
            (with("remote_host", json!("")), 33, "remote_host is empty"),
            (
                with("remote_host", json!("evil.com/x?")),
                33,
                "remote_host must be",
            ),
            (with("remote_host", json!("a@b")), 33, "remote_host must be"),
            (with("remote_host", json!(5)), 33, "remote_host must be"),
            (
                with("remote_port", json!(0)),
                33,
                "remote_port 0 is not in 1..=65535",
            ),
            (with("remote_port", json!(65536)), 33, "remote_port 65536"),
            (
                with("remote_port", json!(-1)),
                33,
                "remote_port must be a non-negative integer",
            ),
            (
                with("remote_port", json!("8100")),
                33,
                "remote_port must be an integer",
            ),
            (without("tp_size"), 33, "tp_size is missing"),
            (with("tp_size", json!(0)), 33, "tp_size 0 is out of range"),
            (
                with("tp_size", json!(5000)),
                33,
                "tp_size 5000 is out of range",
            ),
        ];
        for (v, prompt_len, needle) in cases {
            match parse(&v, prompt_len) {
                Err(KvConnectorError::InvalidTransferParams(reason)) => {
                    assert!(reason.contains(needle), "{v}: {reason}")
                }
                other => panic!("{v}: expected a rejection with {needle:?}, got {other:?}"),
            }
        }
    }
}
