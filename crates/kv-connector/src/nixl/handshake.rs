//! The handshake two instances exchange before any KV moves: who the NIXL agent is, where its KV
//! memory lives, how blocks are laid out, and whether the two are compatible at all.
//!
//! The producer serves its [`NixlHandshake`] (JSON, metadata as base64) on a side channel; a
//! consumer parses it with [`NixlHandshake::from_json`] and checks it against its own with
//! [`NixlHandshake::check_compatible`] (which `NixlAgent::add_peer` also does) before it loads the
//! peer's metadata.
//!
//! Invariants: `compat_hash` is a function of exactly (protocol version, model, dtype, block size,
//! layer count) — [`compat_hash`] — and a handshake whose hash does not match its own fields is
//! invalid; `layers[i]` describes storage layer `i`, its K and V arrays each covering at least
//! `(num_blocks - 1) * stride + block_bytes` bytes, block `b` at `addr + b * stride` (`stride` is
//! `block_stride`, or `block_bytes` when that is 0), in the memory `memory` names (host DRAM, or
//! the VRAM of GPU `device`); every layer of one handshake is in one kind of memory. Allocation
//! ids only say where a transfer may merge blocks into one descriptor: a peer that lies about
//! them makes its own transfers fail (NIXL checks every descriptor against its registrations).

use serde::{Deserialize, Serialize};

use tandem_kv_cache::{BlockLayout, CacheDtype, LayoutOrder};

use crate::config::KvMode;
use crate::error::KvConnectorError;

/// Version of this handshake and of the transfer protocol behind it (the connector version);
/// bump on any change of meaning. Peers with different versions never connect, so neither side
/// misreads the other's notifications. 2: push mode (`kv_mode`, the push notifications). 3: the
/// layers of every TP rank and pipeline stage of an instance, with the model heads each holds.
/// 4: block strides, memory kind and device, allocation ids (device memory, block-major caches).
pub const HANDSHAKE_PROTOCOL_VERSION: u32 = 4;

/// One contiguous array (a layer's K or V) of a peer, as its process sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    pub addr: u64,
    pub len: u64,
}

/// One layer's cache on one TP rank: its shape and where its K and V arrays live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerInfo {
    /// The layer's name in the model (e.g. `model.layers.3.self_attn`).
    pub name: String,
    pub num_blocks: usize,
    pub block_size: usize,
    /// Bytes of one block of the K (or V) array.
    pub block_bytes: usize,
    /// KV heads held by this rank.
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Cache dtype name (`f32`, `f16`, `bf16`).
    pub dtype: String,
    /// `token_major` or `head_major`, within kernel blocks of `kernel_block_size` tokens.
    pub order: String,
    pub kernel_block_size: usize,
    pub k: RegionInfo,
    pub v: RegionInfo,
    /// The worker holding this cache: its TP rank and pipeline stage (0 for TP 1, PP 1).
    #[serde(default)]
    pub tp_rank: usize,
    #[serde(default)]
    pub pp_rank: usize,
    /// The model's KV heads this cache holds, in its order (empty: `0..num_kv_heads`).
    #[serde(default)]
    pub kv_heads: Vec<u32>,
    /// Which copy of those heads it is, when TP exceeds the KV heads (0 otherwise).
    #[serde(default)]
    pub kv_replica: u32,
    /// Bytes from one block's start to the next in both arrays (0: `block_bytes`, per-layer
    /// arrays; larger where a device cache interleaves the layers of a block).
    #[serde(default)]
    pub block_stride: usize,
    /// `dram` or `vram`: where the arrays live.
    #[serde(default = "dram")]
    pub memory: String,
    /// The GPU holding them (`vram`), 0 for host memory.
    #[serde(default)]
    pub device: u64,
    /// Ids of the registered allocations holding K and V: arrays with one id are one
    /// allocation, which a transfer may cross in one descriptor. Absent: each array is its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocations: Option<[u32; 2]>,
}

fn dram() -> String {
    "dram".into()
}

impl LayerInfo {
    /// Describes a storage layer of `layout` with K at `k` and V at `v`.
    pub fn new(name: &str, layout: &BlockLayout, k: RegionInfo, v: RegionInfo) -> Self {
        LayerInfo {
            name: name.to_string(),
            num_blocks: layout.num_blocks,
            block_size: layout.block_size,
            block_bytes: layout.block_bytes(),
            num_kv_heads: layout.num_kv_heads,
            head_dim: layout.head_dim,
            dtype: layout.dtype.name().to_string(),
            order: order_name(layout.order).to_string(),
            kernel_block_size: layout.kernel_block_size,
            k,
            v,
            tp_rank: 0,
            pp_rank: 0,
            kv_heads: (0..layout.num_kv_heads as u32).collect(),
            kv_replica: 0,
            block_stride: 0,
            memory: dram(),
            device: 0,
            allocations: None,
        }
    }

    /// Bytes from one block's start to the next.
    pub fn stride(&self) -> usize {
        if self.block_stride == 0 {
            self.block_bytes
        } else {
            self.block_stride
        }
    }
}

fn order_name(order: LayoutOrder) -> &'static str {
    match order {
        LayoutOrder::TokenMajor => "token_major",
        LayoutOrder::HeadMajor => "head_major",
    }
}

/// What one instance's worker (one TP rank) tells a peer about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlHandshake {
    pub protocol_version: u32,
    /// The engine (instance) id, as in `kv_transfer_params.remote_engine_id`.
    pub engine_id: String,
    /// `"pull"` or `"push"` ([`KvMode`]): one deployment is one mode.
    pub kv_mode: String,
    /// The NIXL agent's name; notifications from this peer carry it.
    pub agent_name: String,
    /// The NIXL agent's metadata (`get_local_md`), base64 in JSON.
    #[serde(with = "base64_bytes")]
    pub agent_metadata: Vec<u8>,
    /// The model's name (what `/v1/models` serves).
    pub model: String,
    /// Cache dtype of all layers.
    pub dtype: String,
    /// Tokens per block.
    pub block_size: usize,
    pub num_layers: usize,
    pub tp_rank: usize,
    pub tp_size: usize,
    /// Pipeline stages of the instance.
    #[serde(default = "one")]
    pub pp_size: usize,
    /// Every rank's layers (rank by rank, each in storage order).
    pub layers: Vec<LayerInfo>,
    /// [`compat_hash`] of this handshake's fields, as `0x` and 16 hex digits.
    pub compat_hash: String,
}

fn one() -> usize {
    1
}

/// Why a peer's handshake does not match ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeMismatch {
    #[error("protocol version {theirs} (ours is {ours})")]
    ProtocolVersion { ours: u32, theirs: u32 },
    #[error(
        "the peer runs {theirs} mode, this instance runs {ours} mode: one deployment is one mode \
         (kv_connector NixlConnector is pull, NixlPushConnector is push)"
    )]
    KvMode { ours: String, theirs: String },
    #[error("different model: {theirs:?} (ours is {ours:?})")]
    Model { ours: String, theirs: String },
    #[error("different KV cache dtype: {theirs} (ours is {ours})")]
    Dtype { ours: String, theirs: String },
    #[error(
        "block sizes {ours} (ours) and {theirs} (the peer's) tokens: KV moves between different \
         block sizes only when one is a multiple of the other and both caches have the same \
         order (token-major, or head-major without split kernel blocks)"
    )]
    BlockSize { ours: usize, theirs: usize },
    #[error(
        "the peer's blocks ({theirs} tokens) are not a divisor of ours ({ours}): the side that \
         moves the KV needs the larger blocks (pull: the consumer's block size a multiple of the \
         producer's; push: the producer's a multiple of the consumer's)"
    )]
    BlockSizeDirection { ours: usize, theirs: usize },
    #[error("different layer count: {theirs} (ours is {ours})")]
    LayerCount { ours: usize, theirs: usize },
    #[error("different TP size: {theirs} (ours is {ours}); heterogeneous TP is not supported")]
    TpSize { ours: usize, theirs: usize },
    #[error("peer is TP rank {theirs}, we are rank {ours}: ranks pair one to one")]
    TpRank { ours: usize, theirs: usize },
    #[error("layer {layer}: different {field}: {theirs} (ours is {ours})")]
    Layout {
        layer: usize,
        field: &'static str,
        ours: String,
        theirs: String,
    },
    #[error("compatibility hash {theirs} (ours is {ours})")]
    CompatHash { ours: String, theirs: String },
}

/// The compatibility hash: xxh3-64 of the protocol version, model, dtype, block size and layer
/// count. Two instances can exchange KV only if their hashes are equal.
pub fn compat_hash(model: &str, dtype: &str, block_size: usize, num_layers: usize) -> u64 {
    let canon = format!(
        "tandem-kv-transfer/v{HANDSHAKE_PROTOCOL_VERSION}\nmodel={model}\ndtype={dtype}\n\
         block_size={block_size}\nnum_layers={num_layers}"
    );
    xxhash_rust::xxh3::xxh3_64(canon.as_bytes())
}

fn hash_string(h: u64) -> String {
    format!("0x{h:016x}")
}

impl NixlHandshake {
    /// Builds a handshake; `dtype`, `block_size` and `num_layers` are taken from `layers`
    /// (layer 0 for the first two), and the hash is computed.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        engine_id: &str,
        agent_name: &str,
        agent_metadata: Vec<u8>,
        model: &str,
        tp_rank: usize,
        tp_size: usize,
        layers: Vec<LayerInfo>,
    ) -> Self {
        let dtype = layers.first().map(|l| l.dtype.clone()).unwrap_or_default();
        let block_size = layers.first().map(|l| l.block_size).unwrap_or(0);
        let num_layers = layers.len();
        NixlHandshake {
            protocol_version: HANDSHAKE_PROTOCOL_VERSION,
            engine_id: engine_id.to_string(),
            kv_mode: KvMode::Pull.as_str().to_string(),
            agent_name: agent_name.to_string(),
            agent_metadata,
            model: model.to_string(),
            compat_hash: hash_string(compat_hash(model, &dtype, block_size, num_layers)),
            dtype,
            block_size,
            num_layers,
            tp_rank,
            tp_size,
            pp_size: layers.iter().map(|l| l.pp_rank + 1).max().unwrap_or(1),
            layers,
        }
    }

    /// Whether `peer` describes the same regions as ours (same layer names and heads, in the
    /// same order): the one-to-one case, compared field by field.
    fn same_regions(&self, peer: &NixlHandshake) -> bool {
        self.layers.len() == peer.layers.len()
            && self
                .layers
                .iter()
                .zip(&peer.layers)
                .all(|(a, b)| a.name == b.name && a.kv_heads == b.kv_heads)
    }

    /// The same handshake for a connector in `mode`.
    pub fn with_kv_mode(mut self, mode: KvMode) -> Self {
        self.kv_mode = mode.as_str().to_string();
        self
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a handshake always serializes")
    }

    /// Parses and [validates](Self::validate) a handshake.
    pub fn from_json(s: &str) -> Result<Self, KvConnectorError> {
        let hs: NixlHandshake = serde_json::from_str(s)
            .map_err(|e| KvConnectorError::InvalidHandshake(format!("not a handshake: {e}")))?;
        hs.validate()?;
        Ok(hs)
    }

    /// Checks the handshake on its own: its hash matches its fields, and every layer is a
    /// well-formed description of memory (non-zero sizes, arrays large enough for every block).
    pub fn validate(&self) -> Result<(), KvConnectorError> {
        let bad = |m: String| Err(KvConnectorError::InvalidHandshake(m));
        if self.protocol_version != HANDSHAKE_PROTOCOL_VERSION {
            // Fields may mean something else; only the version itself is trusted.
            return Ok(());
        }
        let want = hash_string(compat_hash(
            &self.model,
            &self.dtype,
            self.block_size,
            self.num_layers,
        ));
        if self.compat_hash != want {
            return bad(format!(
                "compat_hash {} does not match its own fields (expected {want})",
                self.compat_hash
            ));
        }
        if KvMode::parse(&self.kv_mode).is_none() {
            return bad(format!(
                "kv_mode {:?} is not \"pull\" or \"push\"",
                self.kv_mode
            ));
        }
        if self.agent_name.is_empty() || self.agent_metadata.is_empty() {
            return bad("empty agent name or metadata".into());
        }
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return bad(format!("TP rank {} of size {}", self.tp_rank, self.tp_size));
        }
        if self.layers.len() != self.num_layers || self.num_layers == 0 {
            return bad(format!(
                "num_layers {} but {} layer descriptions",
                self.num_layers,
                self.layers.len()
            ));
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.num_blocks == 0 || l.block_bytes == 0 || l.block_size == 0 {
                return bad(format!("layer {i}: zero blocks or zero-sized blocks"));
            }
            let Some(dtype) = CacheDtype::parse(&l.dtype) else {
                return bad(format!("layer {i}: unknown dtype {:?}", l.dtype));
            };
            // Checked: the sizes are the peer's, and a product that wraps must not match.
            let shape = l
                .block_size
                .checked_mul(l.num_kv_heads)
                .and_then(|n| n.checked_mul(l.head_dim))
                .and_then(|n| n.checked_mul(dtype.size()));
            if shape != Some(l.block_bytes) {
                return bad(format!(
                    "layer {i}: block_bytes {} is not block_size x heads x head_dim x dtype size",
                    l.block_bytes
                ));
            }
            if !l.kv_heads.is_empty() && l.kv_heads.len() != l.num_kv_heads {
                return bad(format!(
                    "layer {i}: {} model heads named for {} KV heads",
                    l.kv_heads.len(),
                    l.num_kv_heads
                ));
            }
            let mut distinct = l.kv_heads.clone();
            distinct.sort_unstable();
            distinct.dedup();
            if distinct.len() != l.kv_heads.len() {
                return bad(format!("layer {i}: a model head is named twice"));
            }
            if l.memory != "dram" && l.memory != "vram" {
                return bad(format!(
                    "layer {i}: memory {:?} is not \"dram\" or \"vram\"",
                    l.memory
                ));
            }
            if l.memory != self.layers[0].memory {
                return bad(format!(
                    "layer {i} is in {} but layer 0 in {}: one handshake, one kind of memory",
                    l.memory, self.layers[0].memory
                ));
            }
            if l.stride() < l.block_bytes {
                return bad(format!(
                    "layer {i}: block_stride {} is shorter than a block ({} bytes)",
                    l.block_stride, l.block_bytes
                ));
            }
            let need = ((l.num_blocks - 1) as u64)
                .checked_mul(l.stride() as u64)
                .and_then(|n| n.checked_add(l.block_bytes as u64));
            for (part, r) in [("K", l.k), ("V", l.v)] {
                if need.is_none_or(|n| r.len < n) || r.addr.checked_add(r.len).is_none() {
                    return bad(format!(
                        "layer {i} {part}: region of {} bytes cannot hold {} blocks of {} bytes \
                         at a stride of {}",
                        r.len,
                        l.num_blocks,
                        l.block_bytes,
                        l.stride()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks that a peer's handshake is compatible with ours (`self`): same protocol version,
    /// model, dtype, block size, layer count, TP size and rank, and per layer the same block
    /// shape. The first difference is the error. The peer's handshake is validated too.
    pub fn check_compatible(&self, peer: &NixlHandshake) -> Result<(), KvConnectorError> {
        let fail = |mismatch| {
            Err(KvConnectorError::IncompatiblePeer {
                engine_id: peer.engine_id.clone(),
                mismatch,
            })
        };
        if peer.protocol_version != self.protocol_version {
            return fail(HandshakeMismatch::ProtocolVersion {
                ours: self.protocol_version,
                theirs: peer.protocol_version,
            });
        }
        peer.validate()?;
        if peer.kv_mode != self.kv_mode {
            return fail(HandshakeMismatch::KvMode {
                ours: self.kv_mode.clone(),
                theirs: peer.kv_mode.clone(),
            });
        }
        if peer.model != self.model {
            return fail(HandshakeMismatch::Model {
                ours: self.model.clone(),
                theirs: peer.model.clone(),
            });
        }
        if peer.dtype != self.dtype {
            return fail(HandshakeMismatch::Dtype {
                ours: self.dtype.clone(),
                theirs: peer.dtype.clone(),
            });
        }
        let same_blocks = peer.block_size == self.block_size;
        let same_layout = (self.tp_size, self.pp_size) == (peer.tp_size, peer.pp_size);
        if !same_blocks && same_layout {
            let (big, small) = if peer.block_size > self.block_size {
                (peer.block_size, self.block_size)
            } else {
                (self.block_size, peer.block_size)
            };
            // Blocks regroup per token (token-major) or per head and token (head-major,
            // unsplit kernel blocks), the same order on both sides.
            let all_in = |h: &NixlHandshake, order: LayoutOrder| {
                h.layers.iter().all(|l| {
                    l.order == order_name(order)
                        && (order == LayoutOrder::TokenMajor || l.kernel_block_size == l.block_size)
                })
            };
            let regroups = [LayoutOrder::TokenMajor, LayoutOrder::HeadMajor]
                .into_iter()
                .any(|o| all_in(self, o) && all_in(peer, o));
            if small == 0 || big % small != 0 || !regroups {
                return fail(HandshakeMismatch::BlockSize {
                    ours: self.block_size,
                    theirs: peer.block_size,
                });
            }
        }
        if !self.same_regions(peer) && (self.tp_size, self.pp_size) != (peer.tp_size, peer.pp_size)
        {
            // Different parallel layouts: every cache of the side with the larger blocks (the
            // one that moves the bytes) must find its heads among the other's.
            let (mover, other) = if self.block_size >= peer.block_size {
                (self, peer)
            } else {
                (peer, self)
            };
            return match super::pairing::pair_layers(
                &mover.layers,
                &other.layers,
                mover.block_size,
                other.block_size,
            ) {
                Ok(_) => Ok(()),
                Err(m) => fail(m),
            };
        }
        if peer.num_layers != self.num_layers {
            return fail(HandshakeMismatch::LayerCount {
                ours: self.num_layers,
                theirs: peer.num_layers,
            });
        }
        // The hash covers the block size; with different ones every hashed field was compared.
        if same_blocks && peer.compat_hash != self.compat_hash {
            return fail(HandshakeMismatch::CompatHash {
                ours: self.compat_hash.clone(),
                theirs: peer.compat_hash.clone(),
            });
        }
        if peer.tp_size != self.tp_size {
            return fail(HandshakeMismatch::TpSize {
                ours: self.tp_size,
                theirs: peer.tp_size,
            });
        }
        if peer.tp_rank != self.tp_rank {
            return fail(HandshakeMismatch::TpRank {
                ours: self.tp_rank,
                theirs: peer.tp_rank,
            });
        }
        for (i, (ours, theirs)) in self.layers.iter().zip(&peer.layers).enumerate() {
            // Between block sizes, blocks compare per token (one order on both, checked above).
            let scaled = |l: &LayerInfo| {
                if same_blocks {
                    (l.block_size.to_string(), l.block_bytes.to_string())
                } else {
                    (
                        "per token".to_string(),
                        (l.block_bytes / l.block_size.max(1)).to_string(),
                    )
                }
            };
            let ((ours_bs, ours_bytes), (theirs_bs, theirs_bytes)) = (scaled(ours), scaled(theirs));
            let kernel = |l: &LayerInfo| {
                if same_blocks {
                    l.kernel_block_size.to_string()
                } else {
                    "any (regrouped)".to_string()
                }
            };
            let fields: [(&'static str, String, String); 7] = [
                ("block_size", ours_bs, theirs_bs),
                ("block_bytes", ours_bytes, theirs_bytes),
                (
                    "num_kv_heads",
                    ours.num_kv_heads.to_string(),
                    theirs.num_kv_heads.to_string(),
                ),
                (
                    "head_dim",
                    ours.head_dim.to_string(),
                    theirs.head_dim.to_string(),
                ),
                ("dtype", ours.dtype.clone(), theirs.dtype.clone()),
                ("order", ours.order.clone(), theirs.order.clone()),
                ("kernel_block_size", kernel(ours), kernel(theirs)),
            ];
            for (field, o, t) in fields {
                if o != t {
                    return fail(HandshakeMismatch::Layout {
                        layer: i,
                        field,
                        ours: o,
                        theirs: t,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Serde adapter: `Vec<u8>` as a standard base64 string.
mod base64_bytes {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        STANDARD
            .decode(s.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(i: usize, dtype: CacheDtype) -> LayerInfo {
        let layout = BlockLayout::token_major(8, 16, 3, 64, dtype);
        let len = layout.total_bytes() as u64;
        let base = 0x1000_0000 + (i as u64) * 2 * len;
        LayerInfo::new(
            &format!("model.layers.{i}.self_attn"),
            &layout,
            RegionInfo { addr: base, len },
            RegionInfo {
                addr: base + len,
                len,
            },
        )
    }

    fn hs(model: &str, dtype: CacheDtype, layers: usize) -> NixlHandshake {
        NixlHandshake::new(
            "engine-a",
            "agent-a",
            vec![1, 2, 3, 0, 255],
            model,
            0,
            1,
            (0..layers).map(|i| layer(i, dtype)).collect(),
        )
    }

    #[test]
    fn json_round_trip_keeps_binary_metadata() {
        let a = hs("smollm2-135m", CacheDtype::F32, 2);
        let json = a.to_json();
        assert!(json.contains("\"agent_metadata\":\"AQIDAP8=\""), "{json}");
        assert_eq!(NixlHandshake::from_json(&json).unwrap(), a);
    }

    #[test]
    fn model_heads_must_name_each_kv_head_once() {
        let mut a = hs("smollm2-135m", CacheDtype::F32, 2);
        a.validate().unwrap();
        a.layers[1].kv_heads = vec![0, 1];
        let e = a.validate().unwrap_err().to_string();
        assert!(e.contains("2 model heads named for 3 KV heads"), "{e}");
        a.layers[1].kv_heads = vec![0, 1, 1];
        let e = a.validate().unwrap_err().to_string();
        assert!(e.contains("named twice"), "{e}");
        // left out by older handshakes: every head in order
        a.layers[1].kv_heads = Vec::new();
        a.validate().unwrap();
    }

    #[test]
    fn each_incompatibility_has_its_own_error() {
        let ours = hs("smollm2-135m", CacheDtype::F32, 2);
        ours.check_compatible(&ours.clone()).unwrap();
        let mismatch = |peer: &NixlHandshake| match ours.check_compatible(peer) {
            Err(KvConnectorError::IncompatiblePeer { mismatch, .. }) => mismatch,
            other => panic!("expected a mismatch, got {other:?}"),
        };
        assert!(matches!(
            mismatch(&hs("llama-3-8b", CacheDtype::F32, 2)),
            HandshakeMismatch::Model { .. }
        ));
        assert!(matches!(
            mismatch(&hs("smollm2-135m", CacheDtype::Bf16, 2)),
            HandshakeMismatch::Dtype { .. }
        ));
        assert!(matches!(
            mismatch(&hs("smollm2-135m", CacheDtype::F32, 3)),
            HandshakeMismatch::LayerCount { ours: 2, theirs: 3 }
        ));
        let mut peer = ours.clone();
        peer.protocol_version = 99;
        assert!(matches!(
            mismatch(&peer),
            HandshakeMismatch::ProtocolVersion {
                ours: HANDSHAKE_PROTOCOL_VERSION,
                theirs: 99
            }
        ));
        let peer = ours.clone().with_kv_mode(KvMode::Push);
        let e = mismatch(&peer);
        assert!(matches!(e, HandshakeMismatch::KvMode { .. }));
        assert!(e
            .to_string()
            .contains("the peer runs push mode, this instance runs pull mode"));
        let mut peer = ours.clone();
        peer.tp_size = 2;
        peer.tp_rank = 1;
        assert!(matches!(mismatch(&peer), HandshakeMismatch::TpSize { .. }));
        let mut peer = ours.clone();
        peer.layers[1].num_kv_heads = 1;
        peer.layers[1].kv_heads = vec![0];
        peer.layers[1].block_bytes = 16 * 64 * 4;
        let m = mismatch(&peer);
        assert!(
            matches!(
                m,
                HandshakeMismatch::Layout {
                    layer: 1,
                    field: "block_bytes",
                    ..
                }
            ),
            "{m}"
        );
        // Block size: rebuilt from layers with another block size, so the hash is consistent.
        let with_block_size = |bs: usize, order: LayoutOrder| {
            let mut layout = BlockLayout::token_major(8, bs, 3, 64, CacheDtype::F32);
            layout.order = order;
            let layers = ours
                .layers
                .iter()
                .map(|l| {
                    let mut n = LayerInfo::new(&l.name, &layout, l.k, l.v);
                    n.k.len = n.k.len.max(layout.total_bytes() as u64);
                    n.v.len = n.v.len.max(layout.total_bytes() as u64);
                    n
                })
                .collect();
            NixlHandshake::new("engine-b", "agent-b", vec![1], &ours.model, 0, 1, layers)
        };
        // A multiple or a divisor of ours, token-major: compatible (regrouped when moving).
        ours.check_compatible(&with_block_size(32, LayoutOrder::TokenMajor))
            .unwrap();
        ours.check_compatible(&with_block_size(8, LayoutOrder::TokenMajor))
            .unwrap();
        // Neither, or head-major blocks that cannot be regrouped: refused, naming both sizes.
        for peer in [
            with_block_size(24, LayoutOrder::TokenMajor),
            with_block_size(32, LayoutOrder::HeadMajor),
        ] {
            let m = mismatch(&peer);
            assert!(
                matches!(
                    m,
                    HandshakeMismatch::BlockSize { ours: 16, theirs }
                        if theirs == peer.block_size
                ),
                "{m}"
            );
            let text = m.to_string();
            assert!(
                text.contains("block sizes 16 (ours) and") && text.contains("multiple"),
                "{text}"
            );
        }
    }

    #[test]
    fn a_forged_or_inconsistent_handshake_is_invalid() {
        let ours = hs("smollm2-135m", CacheDtype::F32, 2);
        let mut peer = ours.clone();
        peer.model = "other".into(); // hash no longer matches its fields
        assert!(matches!(
            ours.check_compatible(&peer),
            Err(KvConnectorError::InvalidHandshake(_))
        ));
        let mut peer = ours.clone();
        peer.layers[0].k.len = 10;
        assert!(matches!(
            peer.validate(),
            Err(KvConnectorError::InvalidHandshake(_))
        ));
        let mut peer = ours.clone();
        peer.layers[0].k.addr = u64::MAX - 4;
        assert!(peer.validate().is_err());
        assert!(NixlHandshake::from_json("{\"protocol_version\":1}").is_err());
        assert!(
            NixlHandshake::from_json(&ours.to_json().replace("AQIDAP8=", "not base64!")).is_err()
        );
    }
}
