//! Two NIXL agents in one process, over the real library (UCX): READs and WRITEs of scrambled
//! block lists compared byte for byte, notifications, handshake refusals, bad block ids, and a
//! peer destroyed under a transfer.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tandem_kv_cache::{CacheDtype, KvPart};
use tandem_kv_connector::nixl::{
    HandshakeMismatch, NixlAgentConfig, NixlHandshake, TransferOp, TransferStatus,
};
use tandem_kv_connector::KvConnectorError;

/// The consumer accepts the producer's handshake, as it would after fetching it over HTTP.
fn connect(
    consumer: &tandem_kv_connector::nixl::NixlAgent,
    producer: &tandem_kv_connector::nixl::NixlAgent,
) -> String {
    let json = producer.handshake().unwrap().to_json();
    let hs = NixlHandshake::from_json(&json).unwrap();
    consumer.add_peer(&hs).unwrap()
}

#[test]
fn read_of_scrambled_blocks_lands_byte_exact_and_notifies_the_producer() {
    let p_mem = small_storage();
    let c_mem = small_storage();
    fill_random(&p_mem, 1);
    let producer = agent("prefill", p_mem.clone());
    let consumer = agent("decode", c_mem.clone());
    let peer = connect(&consumer, &producer);
    assert_eq!(peer, producer.name());
    assert_eq!(consumer.peers(), vec![peer.clone()]);
    assert_eq!(consumer.peer_engine_id(&peer).as_deref(), Some("prefill"));

    // remote 4,5,6 -> local 20,21,22 (one run), then scattered blocks, given out of order.
    let remote = [6, 30, 4, 0, 5, 17];
    let local = [22, 1, 20, 31, 21, 9];
    let payload = b"done:req-7\x00\xff\x01".to_vec();
    let h = consumer
        .read_blocks(&peer, &local, &remote, Some(payload.clone()))
        .unwrap();
    assert_eq!(h.op(), TransferOp::Read);
    let stats = h.wait(TIMEOUT).unwrap();

    let pairs: Vec<(usize, usize)> = remote.iter().copied().zip(local).collect();
    assert_blocks_equal(&p_mem, &c_mem, &pairs);
    assert_blocks_zero(&c_mem, (0..32).filter(|b| !local.contains(b)));
    let block_bytes = 16 * 3 * 64 * 2;
    assert_eq!(stats.bytes, (6 * 4 * 2 * block_bytes) as u64);
    assert_eq!(stats.blocks, 6);
    // Per array: the run 4..=6 and three single blocks.
    assert_eq!(stats.descriptors, 4 * 4 * 2);
    assert!(stats.duration > Duration::ZERO && stats.gbps() > 0.0);
    // A later poll repeats the same outcome.
    match h.poll() {
        TransferStatus::Done(again) => assert_eq!(again, stats),
        other => panic!("{other:?}"),
    }

    // The producer never loaded the consumer's metadata, yet gets the notification.
    let notifs = wait_notifs(&producer, 1, TIMEOUT);
    assert_eq!(notifs, vec![(consumer.name().to_string(), payload)]);
}

#[test]
fn write_pushes_blocks_into_the_peer_and_notifies_it() {
    let p_mem = small_storage();
    let c_mem = small_storage();
    fill_random(&p_mem, 2);
    let producer = agent("prefill", p_mem.clone());
    let consumer = agent("decode", c_mem.clone());
    // Push mode: the producer accepts the consumer's handshake and writes into its blocks.
    let peer = connect(&producer, &consumer);
    let local = [3, 4, 5, 6, 29];
    let remote = [10, 11, 12, 13, 0];
    let h = producer
        .write_blocks(&peer, &local, &remote, Some(vec![0xab; 32 * 1024]))
        .unwrap();
    let stats = h.wait(TIMEOUT).unwrap();
    assert_eq!(stats.op, TransferOp::Write);
    assert_eq!(stats.descriptors, 2 * 4 * 2);
    let pairs: Vec<(usize, usize)> = local.iter().copied().zip(remote).collect();
    assert_blocks_equal(&p_mem, &c_mem, &pairs);
    assert_blocks_zero(&c_mem, (0..32).filter(|b| !remote.contains(b)));
    let notifs = wait_notifs(&consumer, 1, TIMEOUT);
    assert_eq!(notifs.len(), 1);
    assert_eq!(notifs[0].0, producer.name());
    assert_eq!(notifs[0].1, vec![0xab; 32 * 1024]);
}

#[test]
fn a_consumer_without_progress_thread_reads_and_its_notifications_still_arrive() {
    // Pull mode's consumer only initiates and polls, so it may run without a progress thread
    // (faster on few cores); its notifications must reach the producer without further calls.
    let p_mem = small_storage();
    let c_mem = small_storage();
    fill_random(&p_mem, 4);
    let producer = agent("prefill", p_mem.clone());
    let mut cfg = NixlAgentConfig::new("decode", MODEL);
    cfg.progress_thread = false;
    let consumer = agent_with(cfg, c_mem.clone());
    let peer = connect(&consumer, &producer);
    for (i, size) in [8usize, 32 * 1024, 1 << 20].into_iter().enumerate() {
        let h = consumer
            .read_blocks(&peer, &[i], &[31 - i], Some(vec![i as u8; size]))
            .unwrap();
        h.wait(TIMEOUT).unwrap();
        let got = wait_notifs(&producer, 1, TIMEOUT);
        assert_eq!(got.len(), 1, "notification of {size} bytes lost");
        assert_eq!(got[0].1, vec![i as u8; size]);
        consumer.send_notif(&peer, &vec![0xee; size]).unwrap();
        assert_eq!(wait_notifs(&producer, 1, TIMEOUT)[0].1, vec![0xee; size]);
    }
    assert_blocks_equal(&p_mem, &c_mem, &[(31, 0), (30, 1), (29, 2)]);
}

#[test]
fn a_producer_that_nobody_progresses_times_the_read_out_until_it_is_polled() {
    // Without its progress thread and without NIXL calls, the producer never answers the
    // consumer's flush: the READ must time out (not hang), and complete once the producer polls.
    let p_mem = small_storage();
    let c_mem = small_storage();
    fill_random(&p_mem, 5);
    let mut cfg = NixlAgentConfig::new("prefill", MODEL);
    cfg.progress_thread = false;
    let producer = agent_with(cfg, p_mem.clone());
    let consumer = agent("decode", c_mem.clone());
    let peer = connect(&consumer, &producer);
    let h = consumer.read_blocks(&peer, &[7], &[9], None).unwrap();
    let start = Instant::now();
    match h.wait(Duration::from_millis(300)) {
        Err(KvConnectorError::TransferTimeout { timeout, .. }) => {
            assert_eq!(timeout, Duration::from_millis(300));
            assert!(start.elapsed() < Duration::from_secs(2));
            assert!(matches!(h.poll(), TransferStatus::Pending));
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let deadline = Instant::now() + TIMEOUT;
    let stats = loop {
        producer.get_notifs().unwrap();
        match h.poll() {
            TransferStatus::Done(stats) => break stats,
            TransferStatus::Pending if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1))
            }
            other => panic!("{other:?}"),
        }
    };
    assert!(stats.duration >= Duration::from_millis(300));
    assert_blocks_equal(&p_mem, &c_mem, &[(9, 7)]);
}

#[test]
fn threads_share_one_agent() {
    let p_mem = storage(2, 64, 16, CacheDtype::Bf16);
    let c_mem = storage(2, 64, 16, CacheDtype::Bf16);
    fill_random(&p_mem, 6);
    let producer = agent("prefill", p_mem.clone());
    let consumer = agent("decode", c_mem.clone());
    let peer = connect(&consumer, &producer);
    std::thread::scope(|s| {
        for t in 0..4usize {
            let (consumer, peer) = (&consumer, &peer);
            s.spawn(move || {
                for round in 0..25usize {
                    let b = t * 16 + round % 16;
                    let h = consumer
                        .read_blocks(peer, &[63 - b], &[b], Some(vec![t as u8, round as u8]))
                        .unwrap();
                    h.wait(TIMEOUT).unwrap();
                }
            });
        }
    });
    let pairs: Vec<(usize, usize)> = (0..64).map(|b| (b, 63 - b)).collect();
    assert_blocks_equal(&p_mem, &c_mem, &pairs);
    assert_eq!(wait_notifs(&producer, 100, TIMEOUT).len(), 100);
}

#[test]
fn concurrent_transfers_and_plain_notifications() {
    let p_mem = storage(3, 64, 16, CacheDtype::F32);
    let c_mem = storage(3, 64, 16, CacheDtype::F32);
    fill_random(&p_mem, 3);
    let producer = agent("prefill", p_mem.clone());
    let consumer = agent("decode", c_mem.clone());
    let peer = connect(&consumer, &producer);
    // Four READs in flight at once, each of 8 blocks, into disjoint local blocks (reversed).
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let remote: Vec<usize> = (i * 8..i * 8 + 8).collect();
            let local: Vec<usize> = remote.iter().map(|b| 63 - b).collect();
            consumer
                .read_blocks(
                    &peer,
                    &local,
                    &remote,
                    Some(format!("read-{i}").into_bytes()),
                )
                .unwrap()
        })
        .collect();
    for h in &handles {
        h.wait(TIMEOUT).unwrap();
    }
    let pairs: Vec<(usize, usize)> = (0..32).map(|b| (b, 63 - b)).collect();
    assert_blocks_equal(&p_mem, &c_mem, &pairs);

    // A plain notification (lease renewal) and an empty READ that only notifies.
    consumer.send_notif(&peer, b"renew\x00lease").unwrap();
    let h = consumer
        .read_blocks(&peer, &[], &[], Some(b"nothing-to-read".to_vec()))
        .unwrap();
    assert_eq!(h.wait(TIMEOUT).unwrap().bytes, 0);
    let mut got: Vec<Vec<u8>> = wait_notifs(&producer, 6, TIMEOUT)
        .into_iter()
        .map(|(from, bytes)| {
            assert_eq!(from, consumer.name());
            bytes
        })
        .collect();
    got.sort();
    let mut want: Vec<Vec<u8>> = (0..4).map(|i| format!("read-{i}").into_bytes()).collect();
    want.push(b"renew\x00lease".to_vec());
    want.push(b"nothing-to-read".to_vec());
    want.sort();
    assert_eq!(got, want);
}

#[test]
fn incompatible_or_forged_handshakes_are_refused_before_loading() {
    let mem = small_storage();
    let consumer = agent("decode", mem.clone());
    let producer = agent("prefill", small_storage());
    let good = producer.handshake().unwrap();
    let rebuilt = |model: &str, layers: Vec<_>| {
        NixlHandshake::new(
            &good.engine_id,
            &good.agent_name,
            good.agent_metadata.clone(),
            model,
            0,
            1,
            layers,
        )
    };
    let mismatch = |hs: &NixlHandshake| match consumer.add_peer(hs) {
        Err(KvConnectorError::IncompatiblePeer { mismatch, .. }) => mismatch,
        other => panic!("expected an incompatible peer, got {other:?}"),
    };

    let m = mismatch(&rebuilt("llama-3.2-1b", good.layers.clone()));
    assert!(matches!(m, HandshakeMismatch::Model { .. }), "{m}");
    let m = mismatch(&rebuilt(MODEL, good.layers[..3].to_vec()));
    assert!(
        matches!(m, HandshakeMismatch::LayerCount { ours: 4, theirs: 3 }),
        "{m}"
    );
    // A real agent with another dtype, and one with another block size.
    let f32_agent = agent("prefill-f32", storage(4, 32, 16, CacheDtype::F32));
    let m = mismatch(&f32_agent.handshake().unwrap());
    assert!(matches!(m, HandshakeMismatch::Dtype { .. }), "{m}");
    let bs24 = agent("prefill-bs24", storage(4, 32, 24, CacheDtype::Bf16));
    let m = mismatch(&bs24.handshake().unwrap());
    assert!(
        matches!(
            m,
            HandshakeMismatch::BlockSize {
                ours: 16,
                theirs: 24
            }
        ),
        "{m}"
    );
    assert!(m.to_string().contains("16") && m.to_string().contains("24"));
    let mut v2 = good.clone();
    // Another connector version (push bumped it to 2) never connects.
    v2.protocol_version = 99;
    let m = mismatch(&v2);
    assert!(
        matches!(m, HandshakeMismatch::ProtocolVersion { .. }),
        "{m}"
    );
    // A push agent's handshake is refused by a pull agent, naming both modes.
    let mut push = good.clone();
    push.kv_mode = "push".into();
    let m = mismatch(&push);
    assert!(matches!(m, HandshakeMismatch::KvMode { .. }), "{m}");
    let err = consumer
        .add_peer(&rebuilt("llama-3.2-1b", good.layers.clone()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("different model"), "{err}");

    // Forged: regions outside the peer's registered memory.
    let mut forged = good.clone();
    for l in &mut forged.layers {
        l.k.addr += 1 << 40;
    }
    assert!(matches!(
        consumer.add_peer(&forged),
        Err(KvConnectorError::InvalidHandshake(_))
    ));
    // Our own handshake is not a peer.
    assert!(consumer.add_peer(&consumer.handshake().unwrap()).is_err());
    assert!(consumer.peers().is_empty());

    // The genuine one is accepted, twice is a no-op, and removal forgets it.
    let peer = consumer.add_peer(&good).unwrap();
    assert_eq!(consumer.add_peer(&good).unwrap(), peer);
    assert!(consumer.remove_peer(&peer));
    assert!(matches!(
        consumer.read_blocks(&peer, &[0], &[0], None),
        Err(KvConnectorError::UnknownPeer(_))
    ));
    consumer.add_peer(&good).unwrap();
    consumer
        .read_blocks(&peer, &[0], &[0], None)
        .unwrap()
        .wait(TIMEOUT)
        .unwrap();
}

#[test]
fn bad_block_ids_are_refused_without_posting() {
    let producer = agent("prefill", storage(2, 8, 16, CacheDtype::Bf16));
    let consumer = agent("decode", storage(2, 16, 16, CacheDtype::Bf16));
    let peer = connect(&consumer, &producer);
    assert_eq!(consumer.peer_num_blocks(&peer), Some(8));
    assert!(matches!(
        consumer.read_blocks(&peer, &[15], &[8], None),
        Err(KvConnectorError::BlockOutOfRange {
            block: 8,
            num_blocks: 8,
            ..
        })
    ));
    assert!(matches!(
        consumer.read_blocks(&peer, &[16], &[0], None),
        Err(KvConnectorError::BlockOutOfRange { block: 16, .. })
    ));
    assert!(matches!(
        consumer.read_blocks(&peer, &[1, 2], &[0], None),
        Err(KvConnectorError::BlockCountMismatch {
            local: 2,
            remote: 1
        })
    ));
    assert!(matches!(
        consumer.read_blocks(&peer, &[3, 3], &[0, 1], None),
        Err(KvConnectorError::DuplicateBlock { block: 3, .. })
    ));
    assert!(matches!(
        consumer.read_blocks("nobody", &[0], &[0], None),
        Err(KvConnectorError::UnknownPeer(_))
    ));
    // The agent still works after refusals.
    consumer
        .read_blocks(&peer, &[15, 14], &[7, 6], None)
        .unwrap()
        .wait(TIMEOUT)
        .unwrap();
}

#[test]
fn a_destroyed_peer_fails_the_transfer_without_hanging() {
    let p_mem = small_storage();
    let consumer = agent("decode", small_storage());
    let producer = agent("prefill", p_mem.clone());
    let peer = connect(&consumer, &producer);
    consumer
        .read_blocks(&peer, &[0], &[0], None)
        .unwrap()
        .wait(TIMEOUT)
        .unwrap();
    drop(producer);

    let start = Instant::now();
    let outcome = consumer
        .read_blocks(&peer, &[1, 2, 3], &[1, 2, 3], Some(b"x".to_vec()))
        .and_then(|h| h.wait(Duration::from_secs(30)));
    let waited = start.elapsed();
    match outcome {
        Err(KvConnectorError::TransferFailed { peer: p, .. }) => assert_eq!(p, peer),
        other => panic!("expected a failed transfer, got {other:?} after {waited:?}"),
    }
    assert!(waited < Duration::from_secs(30), "took {waited:?}");
}

#[test]
fn agents_take_their_identity_from_the_config() {
    let mut cfg = NixlAgentConfig::new("engine-x", MODEL);
    cfg.tp_rank = 1;
    cfg.tp_size = 2;
    cfg.agent_name = Some("custom-agent-name".into());
    let a = agent_with(cfg, small_storage());
    let hs = a.handshake().unwrap();
    assert_eq!(a.name(), "custom-agent-name");
    assert_eq!((hs.tp_rank, hs.tp_size), (1, 2));
    assert_eq!(hs.engine_id, "engine-x");
    assert_eq!(hs.num_layers, 4);
    assert_eq!(hs.dtype, "bf16");
    assert_eq!(hs.layers[0].block_bytes, 16 * 3 * 64 * 2);
    hs.validate().unwrap();
    // The library was found without any variable, and UCX has its device setting.
    assert!(a.library().path.ends_with("libnixl_capi.so"));
    assert_eq!(
        std::env::var("UCX_NET_DEVICES").ok().as_deref(),
        Some(a.library().ucx_net_devices.as_str())
    );
    // Two generated names never collide.
    let b = agent("engine-x", small_storage());
    let c = agent("engine-x", small_storage());
    assert_ne!(b.name(), c.name());
    // A bad TP config is an error, not a panic.
    let mut bad = NixlAgentConfig::new("e", MODEL);
    bad.tp_rank = 2;
    bad.tp_size = 2;
    assert!(tandem_kv_connector::nixl::NixlAgent::new(bad, small_storage()).is_err());
}

#[test]
fn blocks_of_different_sizes_are_regrouped_by_the_side_with_the_larger_ones() {
    // Pull: a consumer with 32-token blocks READs a producer's 16-token blocks, two per block.
    let p_mem = storage(4, 32, 16, CacheDtype::Bf16);
    let c_mem = storage(4, 16, 32, CacheDtype::Bf16);
    fill_random(&p_mem, 5);
    let producer = agent("prefill", p_mem.clone());
    let consumer = agent("decode", c_mem.clone());
    let peer = connect(&consumer, &producer);
    assert_eq!(consumer.transfer_ratio(&peer).unwrap(), 2);
    // Consumer block 3 <- producer 7 and 2; consumer block 9 (first half) <- producer 30.
    consumer
        .read_blocks(&peer, &[6, 7, 18], &[7, 2, 30], None)
        .unwrap()
        .wait(TIMEOUT)
        .unwrap();
    let half = 16 * 3 * 64 * 2;
    for layer in 0..4 {
        for part in [KvPart::K, KvPart::V] {
            let dst = block(&c_mem, layer, part, 3);
            assert_eq!(dst[..half], block(&p_mem, layer, part, 7)[..]);
            assert_eq!(dst[half..], block(&p_mem, layer, part, 2)[..]);
            let dst = block(&c_mem, layer, part, 9);
            assert_eq!(dst[..half], block(&p_mem, layer, part, 30)[..]);
            assert!(dst[half..].iter().all(|&b| b == 0), "the rest is untouched");
        }
    }
    // The producer, with the smaller blocks, cannot move KV to or from the consumer.
    let back = connect(&producer, &consumer);
    let e = producer.read_blocks(&back, &[0], &[0], None).unwrap_err();
    assert!(
        e.to_string().contains("(32 tokens)") && e.to_string().contains("(16)"),
        "{e}"
    );

    // Push: a producer with 32-token blocks WRITEs into a consumer's 16-token blocks.
    let p_mem = storage(4, 16, 32, CacheDtype::Bf16);
    let c_mem = storage(4, 32, 16, CacheDtype::Bf16);
    fill_random(&p_mem, 6);
    let producer = agent("prefill-push", p_mem.clone());
    let consumer = agent("decode-push", c_mem.clone());
    let peer = connect(&producer, &consumer);
    producer
        .write_blocks(&peer, &[10, 11], &[4, 20], None)
        .unwrap()
        .wait(TIMEOUT)
        .unwrap();
    for layer in 0..4 {
        for part in [KvPart::K, KvPart::V] {
            let src = block(&p_mem, layer, part, 5);
            assert_eq!(block(&c_mem, layer, part, 4)[..], src[..half]);
            assert_eq!(block(&c_mem, layer, part, 20)[..], src[half..]);
        }
    }
    assert_blocks_zero(&c_mem, (0..32).filter(|b| ![4, 20].contains(b)));
}

/// A side whose blocks hold every layer's K and V together (`[block][layer][K, V][bytes]`), as
/// a GPU's block-major cache does: 3 layers, 8 blocks of 16 tokens x 2 heads x 64 bf16.
struct BlockMajor {
    words: Vec<u64>,
    layout: tandem_kv_cache::BlockLayout,
    layers: usize,
}

impl BlockMajor {
    fn new(seed: u64) -> Self {
        let layout = tandem_kv_cache::BlockLayout::token_major(8, 16, 2, 64, CacheDtype::Bf16);
        let layers = 3;
        let words = (0..8 * layers * 2 * layout.block_bytes() / 8)
            .map(|i| {
                if seed == 0 {
                    0
                } else {
                    (i as u64 + 1).wrapping_mul(seed | 1)
                }
            })
            .collect();
        BlockMajor {
            words,
            layout,
            layers,
        }
    }
    fn base(&self) -> usize {
        self.words.as_ptr() as usize
    }
    fn offset(&self, layer: usize, part: KvPart, block: usize) -> usize {
        let bb = self.layout.block_bytes();
        (block * 2 * self.layers + 2 * layer + usize::from(part == KvPart::V)) * bb
    }
    fn bytes(&self, layer: usize, part: KvPart, block: usize) -> &[u8] {
        let all: &[u8] = bytemuck_bytes(&self.words);
        let o = self.offset(layer, part, block);
        &all[o..o + self.layout.block_bytes()]
    }
    fn agent(&self, engine: &str) -> tandem_kv_connector::nixl::NixlAgent {
        self.agent_with(engine, |_, _| {}).expect("NIXL agent")
    }
    /// An agent over this memory, its layers and allocations edited by `edit` first.
    fn agent_with(
        &self,
        engine: &str,
        edit: impl FnOnce(
            &mut Vec<tandem_kv_connector::nixl::KvLayerMemory>,
            &mut Vec<tandem_kv_cache::Allocation>,
        ),
    ) -> Result<tandem_kv_connector::nixl::NixlAgent, tandem_kv_connector::KvConnectorError> {
        use tandem_kv_cache::{Allocation, MemoryKind, MemoryRegion};
        let total = self.words.len() * 8;
        let stride = 2 * self.layers * self.layout.block_bytes();
        let region = |layer, part| {
            let off = self.offset(layer, part, 0);
            MemoryRegion {
                layer,
                part,
                addr: self.base() + off,
                len: total - off,
                block_stride: stride,
            }
        };
        let mut layers = (0..self.layers)
            .map(|l| tandem_kv_connector::nixl::KvLayerMemory {
                name: format!("model.layers.{l}.self_attn"),
                layout: self.layout,
                k: region(l, KvPart::K),
                v: region(l, KvPart::V),
                tp_rank: 0,
                pp_rank: 0,
                kv_heads: vec![0, 1],
                kv_replica: 0,
                group: 0,
                memory: MemoryKind::Host,
            })
            .collect();
        let mut allocations = vec![Allocation {
            addr: self.base(),
            len: total,
        }];
        edit(&mut layers, &mut allocations);
        // SAFETY: the test keeps `self` alive (and unmoved) past the agent and its transfers;
        // edited regions that leave the memory are refused before anything is registered.
        unsafe {
            tandem_kv_connector::nixl::NixlAgent::with_memory(
                NixlAgentConfig::new(engine, MODEL),
                layers,
                allocations,
            )
        }
    }
}

fn bytemuck_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding; the byte view covers exactly the words' memory.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), words.len() * 8) }
}

#[test]
fn block_major_memory_moves_each_run_of_blocks_as_one_descriptor() {
    let p_mem = BlockMajor::new(0x9e37_79b9);
    let c_mem = BlockMajor::new(0);
    let producer = p_mem.agent("prefill");
    let consumer = c_mem.agent("decode");
    let hs = producer.handshake().unwrap();
    assert_eq!(hs.layers[1].block_stride, 6 * p_mem.layout.block_bytes());
    let peer = connect(&consumer, &producer);
    // Remote 1, 2, 3 -> local 4, 5, 6 (one run of three whole blocks), remote 6 -> local 0.
    let (remote, local) = ([2, 6, 1, 3], [5, 0, 4, 6]);
    let stats = consumer
        .read_blocks(&peer, &local, &remote, None)
        .unwrap()
        .wait(TIMEOUT)
        .unwrap();
    assert_eq!(stats.descriptors, 2);
    assert_eq!(stats.bytes, (4 * 3 * 2 * p_mem.layout.block_bytes()) as u64);
    assert!(hs.layers.iter().all(|l| l.allocations == Some([0, 0])));
    for layer in 0..3 {
        for part in [KvPart::K, KvPart::V] {
            for (&r, &l) in remote.iter().zip(&local) {
                assert_eq!(
                    c_mem.bytes(layer, part, l),
                    p_mem.bytes(layer, part, r),
                    "layer {layer} {part:?} block {l}"
                );
            }
            for untouched in [1, 2, 3, 7] {
                assert!(c_mem.bytes(layer, part, untouched).iter().all(|&b| b == 0));
            }
        }
    }
    drop(consumer);
    drop(producer);
}

#[test]
fn memory_an_agent_cannot_describe_is_refused_at_creation() {
    let mem = BlockMajor::new(0);
    // A region reaching past every allocation.
    let e = mem
        .agent_with("short", |_, allocations| allocations[0].len -= 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("lies in no allocation"), "{e}");
    // K and V at different strides: the handshake has one stride per layer.
    let e = mem
        .agent_with("strides", |layers, _| layers[1].v.block_stride *= 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("different strides"), "{e}");
}
