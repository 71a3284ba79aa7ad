//! Fuzzes the parser of a peer's NIXL handshake ([`NixlHandshake::from_json`]), what a consumer
//! reads from a producer's `GET /v1/kv/handshake` before it trusts any memory description, and
//! the compatibility check that follows ([`NixlHandshake::check_compatible`]). Parsing needs no
//! NIXL library: it is loaded only when an agent is made.
//!
//! Properties: nothing panics; an accepted handshake of this protocol version has the
//! invariants of `handshake.rs`'s module docs (its `compat_hash` matches its fields, it describes
//! `num_layers > 0` layers, a TP rank below the TP size, each layer's `block_bytes` the product of
//! its shape and its K and V regions large enough for every block without wrapping the address
//! space), survives `to_json` / `from_json` unchanged, and is compatible with itself.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_kv_cache::{BlockLayout, CacheDtype};
use tandem_kv_connector::nixl::handshake::{
    compat_hash, LayerInfo, NixlHandshake, RegionInfo, HANDSHAKE_PROTOCOL_VERSION,
};

fn ours() -> NixlHandshake {
    let layers = (0..2)
        .map(|i| {
            let layout = BlockLayout::token_major(8, 16, 2, 64, CacheDtype::F16);
            let len = layout.total_bytes() as u64;
            let base = 0x1000_0000 + i * 2 * len;
            LayerInfo::new(
                &format!("model.layers.{i}.self_attn"),
                &layout,
                RegionInfo { addr: base, len },
                RegionInfo {
                    addr: base + len,
                    len,
                },
            )
        })
        .collect();
    NixlHandshake::new("p0", "agent-p0", vec![1, 2, 3], "tiny", 0, 1, layers)
}

fn assert_invariants(hs: &NixlHandshake) {
    let want = format!(
        "0x{:016x}",
        compat_hash(&hs.model, &hs.dtype, hs.block_size, hs.num_layers)
    );
    assert_eq!(hs.compat_hash, want);
    assert!(!hs.agent_name.is_empty() && !hs.agent_metadata.is_empty());
    assert!(hs.tp_rank < hs.tp_size);
    assert!(hs.num_layers > 0 && hs.layers.len() == hs.num_layers);
    for l in &hs.layers {
        let dtype = CacheDtype::parse(&l.dtype).expect("a known dtype");
        assert!(l.num_blocks > 0 && l.block_size > 0 && l.block_bytes > 0);
        let shape = l
            .block_size
            .checked_mul(l.num_kv_heads)
            .and_then(|x| x.checked_mul(l.head_dim))
            .and_then(|x| x.checked_mul(dtype.size()));
        assert_eq!(shape, Some(l.block_bytes), "{l:?}");
        let need = (l.num_blocks as u64)
            .checked_mul(l.block_bytes as u64)
            .expect("every block addressable");
        for r in [l.k, l.v] {
            assert!(r.len >= need, "{l:?}");
            assert!(r.addr.checked_add(r.len).is_some(), "{l:?}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(hs) = NixlHandshake::from_json(text) else {
        return;
    };
    let again = NixlHandshake::from_json(&hs.to_json()).expect("a parsed handshake reparses");
    assert_eq!(again, hs, "from_json(to_json(x)) != x");
    if hs.protocol_version != HANDSHAKE_PROTOCOL_VERSION {
        // Another version is never compatible, whatever its fields say.
        assert!(ours().check_compatible(&hs).is_err());
        return;
    }
    assert_invariants(&hs);
    hs.check_compatible(&hs)
        .expect("a valid handshake is compatible with itself");
    let mine = ours();
    if mine.check_compatible(&hs).is_ok() {
        assert_eq!(hs.compat_hash, mine.compat_hash);
        assert_eq!((hs.tp_rank, hs.tp_size), (mine.tp_rank, mine.tp_size));
    }
});
