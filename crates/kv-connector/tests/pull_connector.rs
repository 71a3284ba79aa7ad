//! The NIXL pull connector over the real library: a producer and a consumer connector in one
//! process, each over its own `KvStorage`, driven as the engine drives them (scheduler side:
//! match, allocate, finish; each step `build_connector_meta` → `start_load_kv` → `get_finished`
//! → `update_connector_output`), the producer's handshake and lease claims served by a tiny HTTP responder.
//!
//! Every lifecycle test ends with both connectors idle: no load, no lease, nothing pending.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tandem_kv_cache::{BlockId, KvPart, KvStorage};
use tandem_kv_connector::auth::{TransferAuth, KV_AUTH_HEADER};
use tandem_kv_connector::base::{
    ConnectorOutput, ConnectorRequest, FinishKind, KvConnectorScheduler, KvConnectorWorker,
    MatchedTokens,
};
use tandem_kv_connector::nixl::{NixlAgentConfig, NixlHandshake};
use tandem_kv_connector::pull::{
    nixl_pull_connector, KvPeerService, NixlPullScheduler, NixlPullWorker, PullNotif, CLAIM_PATH,
    HANDSHAKE_PATH,
};
use tandem_kv_connector::{KvConnectorError, KvRole, KvTransferConfig, LoadFailurePolicy};

const BS: usize = 16;
const LAYERS: usize = 4;
const NUM_BLOCKS: usize = 32;
/// Bytes one block moves: every layer's K and V (3 heads of 64, bf16).
const BLOCK_MOVE_BYTES: u64 = (LAYERS * 2 * BS * 3 * 64 * 2) as u64;

// ---------------------------------------------------------------------------------------------
// The handshake responder: `GET /v1/kv/handshake` → the provider's JSON.

struct Responder {
    port: u16,
    stop: Arc<AtomicBool>,
    /// Handshakes served.
    served: Arc<AtomicUsize>,
    /// When set, every request gets this status and no body.
    status_override: Arc<Mutex<Option<u16>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Responder {
    fn start(listener: TcpListener, service: KvPeerService) -> Responder {
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicUsize::new(0));
        let status_override = Arc::new(Mutex::new(None));
        let thread = std::thread::spawn({
            let (stop, served, status_override) =
                (stop.clone(), served.clone(), status_override.clone());
            move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok((mut s, _)) = listener.accept() else {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    };
                    s.set_nonblocking(false).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    let mut req = Vec::new();
                    let mut buf = [0u8; 4096];
                    let head_end = loop {
                        if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                            break Some(i + 4);
                        }
                        match s.read(&mut buf) {
                            Ok(0) | Err(_) => break None,
                            Ok(n) => req.extend_from_slice(&buf[..n]),
                        }
                    };
                    let Some(head_end) = head_end else { continue };
                    let head = String::from_utf8_lossy(&req[..head_end]).to_string();
                    let header = |name: &str| {
                        head.lines().find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.trim()
                                .eq_ignore_ascii_case(name)
                                .then(|| v.trim().to_string())
                        })
                    };
                    let len: usize = header("content-length")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    while req.len() < head_end + len {
                        match s.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => req.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body = String::from_utf8_lossy(&req[head_end..]).to_string();
                    let forced = *status_override.lock().unwrap();
                    let answer = |r: Result<String, KvConnectorError>| match r {
                        Ok(b) => (200, b),
                        Err(e) => (
                            409,
                            json!({"error": {"message": e.to_string()}}).to_string(),
                        ),
                    };
                    let (status, body) = if let Some(code) = forced {
                        (code, String::new())
                    } else if head.starts_with(&format!("GET {HANDSHAKE_PATH} ")) {
                        match service.handshake(header(KV_AUTH_HEADER).as_deref()) {
                            Ok(None) => (503, String::new()),
                            Ok(Some(json)) => {
                                served.fetch_add(1, Ordering::Relaxed);
                                (200, json.to_string())
                            }
                            Err(e) => (
                                401,
                                json!({"error": {"message": e.to_string()}}).to_string(),
                            ),
                        }
                    } else if head.starts_with(&format!("POST {CLAIM_PATH} ")) {
                        let v: Value = serde_json::from_str(&body).unwrap_or_default();
                        answer(service.claim(&v).map(|()| "{}".to_string()))
                    } else {
                        (404, String::new())
                    };
                    let _ = write!(
                        s,
                        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                }
            }
        });
        Responder {
            port,
            stop,
            served,
            status_override,
            thread: Some(thread),
        }
    }

    /// Stops answering and closes the port.
    fn close(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.close();
    }
}

// ---------------------------------------------------------------------------------------------
// One instance: its connector's two sides, its KV memory, its HTTP port.

struct Node {
    sched: NixlPullScheduler,
    worker: Option<NixlPullWorker>,
    storage: Arc<KvStorage>,
    http: Responder,
    engine_id: String,
    /// Every step's output, merged.
    seen: ConnectorOutput,
}

fn config_json(role: &str, engine_id: &str, extra: Value) -> String {
    json!({"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
           "kv_connector_extra_config": extra})
    .to_string()
}

fn node_with(role: &str, engine_id: &str, extra: Value, seed: Option<u64>) -> Node {
    let config = KvTransferConfig::parse(&config_json(role, engine_id, extra)).unwrap();
    node_from(&config, seed)
}

fn node_from(config: &KvTransferConfig, seed: Option<u64>) -> Node {
    node_signed(config, seed, None)
}

fn node_signed(config: &KvTransferConfig, seed: Option<u64>, auth: Option<TransferAuth>) -> Node {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let c =
        nixl_pull_connector(config, MODEL, BS, port, auth).expect("connector (scripts/setup.sh?)");
    let storage = storage(LAYERS, NUM_BLOCKS, BS, tandem_kv_cache::CacheDtype::Bf16);
    if let Some(seed) = seed {
        fill_random(&storage, seed);
    }
    let mut worker = c.worker;
    assert!(
        c.handshake.json().is_none(),
        "published before registration"
    );
    worker.register_kv_caches(storage.clone()).unwrap();
    assert!(c.handshake.json().is_some());
    Node {
        sched: c.scheduler,
        worker: Some(worker),
        storage,
        http: Responder::start(listener, c.peer_service),
        engine_id: config.engine_id.clone(),
        seen: ConnectorOutput::default(),
    }
}

fn producer(seed: u64) -> Node {
    node_with("kv_producer", "prefill-0", json!({}), Some(seed))
}

fn consumer() -> Node {
    node_with("kv_consumer", "decode-0", json!({}), None)
}

impl Node {
    fn worker(&mut self) -> &mut NixlPullWorker {
        self.worker.as_mut().expect("worker alive")
    }

    /// One engine step of the connector (no model work).
    fn step(&mut self) -> ConnectorOutput {
        let meta = self.sched.build_connector_meta();
        let Some(worker) = self.worker.as_mut() else {
            return ConnectorOutput::default();
        };
        worker.start_load_kv(&meta).unwrap();
        let out = worker.get_finished();
        self.sched.update_connector_output(&out);
        self.seen.merge(out.clone());
        out
    }

    fn assert_idle(&self) {
        assert!(
            self.sched.is_idle(),
            "scheduler side: {:?}",
            self.sched.stats()
        );
        if let Some(w) = &self.worker {
            assert!(w.is_idle(), "worker side: {w:?}");
        }
    }
}

/// Steps every node until `until` holds, or panics after `timeout`.
fn drive(nodes: &mut [&mut Node], timeout: Duration, until: impl Fn(&[&mut Node]) -> bool) {
    let start = Instant::now();
    while !until(nodes) {
        assert!(
            start.elapsed() < timeout,
            "condition not reached within {timeout:?}; seen: {:?}",
            nodes.iter().map(|n| &n.seen).collect::<Vec<_>>()
        );
        for n in nodes.iter_mut() {
            n.step();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn request<'a>(id: u64, prompt: &'a [u32], params: Option<&'a Value>) -> ConnectorRequest<'a> {
    ConnectorRequest {
        request_id: id,
        external_id: "x-request-id",
        prompt_token_ids: prompt,
        kv_transfer_params: params,
    }
}

/// The producer prefills `prompt` into `blocks` (already holding its random KV) and finishes:
/// returns the params its response carries.
fn produce(p: &mut Node, id: u64, prompt: &[u32], blocks: &[BlockId]) -> Value {
    let ask = json!({"do_remote_decode": true});
    let r = request(id, prompt, Some(&ask));
    assert_eq!(
        p.sched.get_num_new_matched_tokens(&r, 0).unwrap(),
        MatchedTokens::default()
    );
    p.sched.update_state_after_alloc(&r, &[blocks.to_vec()], 0);
    let a = p
        .sched
        .request_finished(&r, &[blocks.to_vec()], FinishKind::Normal);
    assert!(a.delay_free, "a producer holds its blocks");
    a.kv_transfer_params.expect("a producer answers params")
}

/// The consumer admits a request with `params` and a local hit of `local` tokens, its table
/// being `table`; returns the external token count.
fn admit(
    c: &mut Node,
    id: u64,
    prompt: &[u32],
    params: &Value,
    local: usize,
    table: &[BlockId],
) -> usize {
    let r = request(id, prompt, Some(params));
    let m = c.sched.get_num_new_matched_tokens(&r, local).unwrap();
    assert!(m.load_async);
    assert_eq!(m.num_external_tokens, prompt.len() - local);
    c.sched
        .update_state_after_alloc(&r, &[table.to_vec()], m.num_external_tokens);
    m.num_external_tokens
}

/// Both sides finish request `cid` / `pid` of a completed P/D round trip.
fn finish_consumer(c: &mut Node, id: u64, prompt: &[u32], params: &Value, table: &[BlockId]) {
    let r = request(id, prompt, Some(params));
    let a = c
        .sched
        .request_finished(&r, &[table.to_vec()], FinishKind::Normal);
    assert!(!a.delay_free && a.kv_transfer_params.is_none());
}

/// The consumer finishes request `id` of a completed round trip; a few steps later both sides
/// are idle.
fn finish_and_settle(
    p: &mut Node,
    c: &mut Node,
    id: u64,
    prompt: &[u32],
    params: &Value,
    table: &[BlockId],
) {
    finish_consumer(c, id, prompt, params, table);
    for _ in 0..3 {
        p.step();
        c.step();
    }
    p.assert_idle();
    c.assert_idle();
}

fn pairs(remote: &[BlockId], local: &[BlockId]) -> Vec<(usize, usize)> {
    remote
        .iter()
        .zip(local)
        .map(|(&r, &l)| (r as usize, l as usize))
        .collect()
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|t| t * 7 + 1).collect()
}

const T: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------

fn round_trip(mut p: Node, mut c: Node) {
    let prompt = prompt(40); // 3 blocks, the last one partial
    let p_blocks: [BlockId; 3] = [17, 3, 29];
    let params = produce(&mut p, 1, &prompt, &p_blocks);
    assert_eq!(params["remote_block_ids"], json!(p_blocks));
    assert_eq!(params["remote_engine_id"], json!(p.engine_id));
    assert_eq!(params["remote_port"], json!(p.http.port));
    assert_eq!(params["remote_host"], json!("127.0.0.1"));
    assert_eq!(params["tp_size"], json!(1));
    assert_eq!(params["do_remote_prefill"], json!(true));

    let c_blocks: [BlockId; 3] = [8, 9, 0];
    let started = Instant::now();
    admit(&mut c, 7, &prompt, &params, 0, &c_blocks);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[1].seen.finished_recving.contains(&7) && n[0].seen.finished_sending.contains(&1)
    });
    assert!(
        c.seen.failed_recving.is_empty(),
        "{:?}",
        c.seen.failed_recving
    );
    assert_blocks_equal(&p.storage, &c.storage, &pairs(&p_blocks, &c_blocks));
    assert_blocks_zero(
        &c.storage,
        (0..NUM_BLOCKS).filter(|b| ![8, 9, 0].contains(b)),
    );
    // Freed by the done notification, long before the 30 s lease.
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(p.seen.stats.expired_leases, 0);
    assert_eq!(c.seen.stats.bytes, 3 * BLOCK_MOVE_BYTES);
    assert_eq!(c.seen.stats.transfers.len(), 1);
    let t = &c.seen.stats.transfers[0];
    assert!(
        t.post_seconds <= t.seconds,
        "a load's time covers its post: {t:?}"
    );
    assert_eq!(c.seen.stats.failures, 0);
    // 3 scattered blocks in 8 arrays.
    assert_eq!(c.seen.stats.descriptors, 3 * 8);
    assert!(c.seen.finished_sending.is_empty() && p.seen.finished_recving.is_empty());

    finish_and_settle(&mut p, &mut c, 7, &prompt, &params, &c_blocks);
}

#[test]
fn a_consumer_loads_the_producers_blocks_byte_for_byte_and_the_producer_frees_on_done() {
    round_trip(producer(11), consumer());
}

/// A READ larger than `read_chunk_bytes` moves chunk by chunk: each chunk's local blocks are
/// reported landed (holding the producer's bytes) while the rest is in flight, the load ends
/// once, and the producer frees once, on the done notification sent after the last chunk.
#[test]
fn a_read_larger_than_read_chunk_bytes_lands_chunk_by_chunk_then_frees_once() {
    let mut p = producer(31);
    let chunked = json!({ "read_chunk_bytes": BLOCK_MOVE_BYTES });
    let mut c = node_with("kv_consumer", "decode-0", chunked, None);
    let prompt = prompt(16 * 10 - 3); // 10 blocks
    let p_blocks: Vec<BlockId> = (12..22).collect();
    let c_blocks: Vec<BlockId> = (2..12).collect();
    let params = produce(&mut p, 1, &prompt, &p_blocks);
    admit(&mut c, 7, &prompt, &params, 0, &c_blocks);
    let all = pairs(&p_blocks, &c_blocks);
    let mut landed: Vec<BlockId> = Vec::new();
    let start = Instant::now();
    while !(c.seen.finished_recving.contains(&7) && p.seen.finished_sending.contains(&1)) {
        assert!(start.elapsed() < T, "{:?} / {:?}", c.seen, p.seen);
        p.step();
        let out = c.step();
        if let Some(lists) = out.landed_recving.get(&7) {
            assert_eq!(lists.len(), 1, "one table for every group");
            let blocks = &lists[0];
            assert!(
                !c.seen.finished_recving.contains(&7) || out.finished_recving.contains(&7),
                "nothing lands after the load ended"
            );
            let now: Vec<(usize, usize)> = all
                .iter()
                .copied()
                .filter(|(_, l)| blocks.contains(&(*l as BlockId)))
                .collect();
            assert_eq!(now.len(), blocks.len(), "landed {blocks:?}, not ours");
            assert_blocks_equal(&p.storage, &c.storage, &now);
            landed.extend(blocks);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    assert!(
        c.seen.failed_recving.is_empty(),
        "{:?}",
        c.seen.failed_recving
    );
    let mut unique = landed.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        landed.len(),
        "a block landed twice: {landed:?}"
    );
    // Ten one-block chunks, two in flight: every chunk but those completing with the last one
    // is reported as it lands.
    assert!(landed.len() >= 8, "{landed:?}");
    assert_blocks_equal(&p.storage, &c.storage, &all);
    assert_eq!(c.seen.stats.bytes, 10 * BLOCK_MOVE_BYTES);
    assert_eq!(c.seen.stats.transfers.len(), 1, "one load, one record");
    let t = &c.seen.stats.transfers[0];
    assert!(
        t.post_seconds <= t.seconds && t.seconds > 0.0,
        "a load's time covers its posts: {t:?}"
    );
    // Unsplit, the ten consecutive blocks are one run per array (8 descriptors); ten chunks
    // are ten runs per array.
    assert_eq!(c.seen.stats.descriptors, 10 * 8);
    assert_eq!(p.seen.stats.expired_leases, 0);
    finish_and_settle(&mut p, &mut c, 7, &prompt, &params, &c_blocks);

    // Every chunk posted at once (`read_chunks_in_flight`): the same bytes, one end, one free.
    let all_at_once = json!({ "read_chunk_bytes": BLOCK_MOVE_BYTES, "read_chunks_in_flight": 32 });
    let mut c = node_with("kv_consumer", "decode-1", all_at_once, None);
    let p_blocks: Vec<BlockId> = (0..10).collect();
    let params = produce(&mut p, 3, &prompt, &p_blocks);
    admit(&mut c, 9, &prompt, &params, 0, &c_blocks);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[1].seen.finished_recving.contains(&9) && n[0].seen.finished_sending.contains(&3)
    });
    assert!(
        c.seen.failed_recving.is_empty(),
        "{:?}",
        c.seen.failed_recving
    );
    assert_blocks_equal(&p.storage, &c.storage, &pairs(&p_blocks, &c_blocks));
    assert_eq!(c.seen.stats.descriptors, 10 * 8, "ten chunks");
    assert_eq!(p.seen.stats.expired_leases, 0);

    // The default chunk size (8 MiB into host memory) leaves this READ whole: one run per array.
    let mut c = consumer();
    let p_blocks: Vec<BlockId> = (22..32).collect();
    let params = produce(&mut p, 2, &prompt, &p_blocks);
    admit(&mut c, 8, &prompt, &params, 0, &c_blocks);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[1].seen.finished_recving.contains(&8) && n[0].seen.finished_sending.contains(&2)
    });
    assert!(c.seen.landed_recving.is_empty());
    assert_eq!(c.seen.stats.descriptors, 8);
    assert_blocks_equal(&p.storage, &c.storage, &pairs(&p_blocks, &c_blocks));
}

#[test]
fn kv_both_instances_do_both() {
    round_trip(
        node_with("kv_both", "both-a", json!({}), Some(12)),
        node_with("kv_both", "both-b", json!({}), None),
    );
}

#[test]
fn a_local_prefix_hit_loads_only_the_rest_and_peers_are_cached() {
    let mut p = producer(21);
    let mut c = consumer();
    // The consumer's locally cached block holds its own bytes, which must survive.
    fill_random(&c.storage, 99);
    let before_local = block(&c.storage, 2, KvPart::V, 4);
    let prompt = prompt(48); // exactly 3 blocks
    let p_blocks: [BlockId; 3] = [5, 6, 7];
    let c_blocks: [BlockId; 3] = [4, 20, 21];
    let params = produce(&mut p, 1, &prompt, &p_blocks);
    assert_eq!(admit(&mut c, 1, &prompt, &params, BS, &c_blocks), 32);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[1].seen.finished_recving.contains(&1) && n[0].seen.finished_sending.contains(&1)
    });
    assert!(
        c.seen.failed_recving.is_empty(),
        "{:?}",
        c.seen.failed_recving
    );
    assert_blocks_equal(&p.storage, &c.storage, &[(6, 20), (7, 21)]);
    assert_eq!(block(&c.storage, 2, KvPart::V, 4), before_local);
    assert_ne!(block(&p.storage, 2, KvPart::V, 5), before_local);
    assert_eq!(c.seen.stats.bytes, 2 * BLOCK_MOVE_BYTES);
    // Consecutive on both sides: one descriptor per array.
    assert_eq!(c.seen.stats.descriptors, 8);
    finish_consumer(&mut c, 1, &prompt, &params, &c_blocks);

    // A second request from the same producer reuses the peer: no second handshake.
    let params = produce(&mut p, 2, &prompt[..20], &[9, 10]);
    admit(&mut c, 2, &prompt[..20], &params, 0, &[30, 31]);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[1].seen.finished_recving.contains(&2) && n[0].seen.finished_sending.contains(&2)
    });
    assert!(
        c.seen.failed_recving.is_empty(),
        "{:?}",
        c.seen.failed_recving
    );
    assert_blocks_equal(&p.storage, &c.storage, &[(9, 30), (10, 31)]);
    assert_eq!(p.http.served.load(Ordering::Relaxed), 1);
    finish_consumer(&mut c, 2, &prompt[..20], &params, &[30, 31]);
    p.step();
    c.step();
    p.assert_idle();
    c.assert_idle();
}

#[test]
fn an_unread_lease_expires_frees_and_is_counted() {
    let mut p = node_with(
        "kv_producer",
        "prefill-lease",
        json!({"kv_lease_duration": 0.3}),
        Some(31),
    );
    let started = Instant::now();
    produce(&mut p, 4, &prompt(20), &[1, 2]);
    p.step();
    assert_eq!(p.worker().num_leases(), 1);
    drive(&mut [&mut p], T, |n| {
        n[0].seen.finished_sending.contains(&4)
    });
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300),
        "freed after {waited:?}"
    );
    assert!(waited < Duration::from_secs(5), "freed after {waited:?}");
    assert_eq!(p.seen.stats.expired_leases, 1);
    // Nothing is reported twice.
    for _ in 0..5 {
        let out = p.step();
        assert!(out.finished_sending.is_empty() && out.stats.expired_leases == 0);
    }
    p.assert_idle();
}

#[test]
fn renewals_keep_a_lease_alive_until_the_done_notification() {
    let mut p = node_with(
        "kv_producer",
        "prefill-renew",
        json!({"kv_lease_duration": 0.3}),
        Some(32),
    );
    let params = produce(&mut p, 5, &prompt(20), &[1, 2]);
    let rid = params["remote_request_id"].as_str().unwrap().to_string();
    // A bare consumer agent, as the loader would be, sends the notifications by hand.
    let consumer = agent("decode-renew", small_storage());
    let hs = NixlHandshake::from_json(p.worker().handshake().json().unwrap()).unwrap();
    let peer = consumer.add_peer(&hs).unwrap();
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(900) {
        consumer
            .send_notif(&peer, &PullNotif::Renew(&rid).encode())
            .unwrap();
        let until = Instant::now() + Duration::from_millis(100);
        while Instant::now() < until {
            assert!(
                p.step().finished_sending.is_empty(),
                "freed despite renewals"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    // Notifications of other requests or protocols change nothing.
    consumer
        .send_notif(&peer, &PullNotif::Done("5-forged").encode())
        .unwrap();
    consumer.send_notif(&peer, b"garbage").unwrap();
    consumer
        .send_notif(&peer, &PullNotif::Done(&rid).encode())
        .unwrap();
    drive(&mut [&mut p], T, |n| {
        n[0].seen.finished_sending.contains(&5)
    });
    assert_eq!(p.seen.stats.expired_leases, 0);
    p.assert_idle();
}

#[test]
fn a_done_that_beats_its_lease_to_the_worker_still_frees() {
    let mut p = producer(33);
    let params = produce(&mut p, 6, &prompt(20), &[1, 2]);
    let rid = params["remote_request_id"].as_str().unwrap().to_string();
    let consumer = agent("decode-early", small_storage());
    let hs = NixlHandshake::from_json(p.worker().handshake().json().unwrap()).unwrap();
    let peer = consumer.add_peer(&hs).unwrap();
    consumer
        .send_notif(&peer, &PullNotif::Done(&rid).encode())
        .unwrap();
    // The worker drains notifications before it learns of the lease.
    let meta = p.sched.build_connector_meta();
    let w = p.worker.as_mut().unwrap();
    let start = Instant::now();
    let mut early = ConnectorOutput::default();
    while start.elapsed() < Duration::from_millis(300) {
        early.merge(w.get_finished());
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(early.finished_sending.is_empty());
    w.start_load_kv(&meta).unwrap();
    let out = w.get_finished();
    assert!(out.finished_sending.contains(&6), "{out:?}");
    p.sched.update_connector_output(&out);
    p.assert_idle();
}

#[test]
fn a_dead_producer_fails_the_load_with_a_reason_and_never_hangs() {
    // 1. The producer's port is closed before the consumer ever shook hands with it.
    let mut p = producer(41);
    let mut c = consumer();
    let prompt = prompt(20);
    let params = produce(&mut p, 1, &prompt, &[1, 2]);
    p.http.close();
    let start = Instant::now();
    admit(&mut c, 1, &prompt, &params, 0, &[3, 4]);
    drive(&mut [&mut c], T, |n| {
        n[0].seen.finished_recving.contains(&1)
    });
    let reason = &c.seen.failed_recving[&1];
    assert!(reason.contains("unreachable"), "{reason}");
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(c.seen.stats.failures, 1);
    assert_blocks_zero(&c.storage, [3, 4]);

    // 2. The producer's agent dies after a successful handshake and load.
    let mut p = producer(42);
    let params = produce(&mut p, 2, &prompt, &[1, 2]);
    admit(&mut c, 2, &prompt, &params, 0, &[5, 6]);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[1].seen.finished_recving.contains(&2)
    });
    assert!(!c.seen.failed_recving.contains_key(&2));
    let params = produce(&mut p, 3, &prompt, &[7, 8]);
    p.step();
    drop(p.worker.take()); // the agent (and the producer's NIXL endpoint) is gone
    let start = Instant::now();
    admit(&mut c, 3, &prompt, &params, 0, &[9, 10]);
    drive(&mut [&mut c], Duration::from_secs(40), |n| {
        n[0].seen.finished_recving.contains(&3)
    });
    let reason = &c.seen.failed_recving[&3];
    assert!(
        reason.contains("unreachable") || reason.contains("failed"),
        "{reason}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(35),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(c.seen.stats.failures, 2);
    c.sched.request_finished(
        &request(1, &prompt, Some(&params)),
        &[vec![3, 4]],
        FinishKind::Aborted,
    );
    for id in [2, 3] {
        c.sched.request_finished(
            &request(id, &prompt, Some(&params)),
            &[],
            FinishKind::Normal,
        );
    }
    c.step();
    c.assert_idle();
}

#[test]
fn a_read_that_outlives_load_timeout_fails_and_releases() {
    // A producer without progress thread that nobody steps never answers the READ's flush.
    let mut p = node_with(
        "kv_producer",
        "prefill-slow",
        json!({"progress_thread": false}),
        Some(51),
    );
    let mut c = node_with(
        "kv_consumer",
        "decode-slow",
        json!({"load_timeout": 0.3}),
        None,
    );
    let prompt = prompt(20);
    let params = produce(&mut p, 1, &prompt, &[1, 2]);
    p.step(); // the lease reaches the worker
    admit(&mut c, 1, &prompt, &params, 0, &[3, 4]);
    let start = Instant::now();
    drive(&mut [&mut c], T, |n| {
        n[0].seen.finished_recving.contains(&1)
    });
    let reason = &c.seen.failed_recving[&1];
    assert!(reason.contains("did not complete within"), "{reason}");
    assert!(start.elapsed() < Duration::from_secs(5));
    // The consumer told the producer to free: once it runs again, it does, without expiry.
    drive(&mut [&mut p], T, |n| {
        n[0].seen.finished_sending.contains(&1)
    });
    assert_eq!(p.seen.stats.expired_leases, 0);
    c.sched.request_finished(
        &request(1, &prompt, Some(&params)),
        &[],
        FinishKind::Aborted,
    );
    c.step();
    p.assert_idle();
    c.assert_idle();
}

#[test]
fn handshake_refusals_and_engine_id_mismatches_fail_the_load() {
    let mut p = producer(61);
    let mut c = consumer();
    let prompt = prompt(20);
    let mut id = 0;
    let mut fail_with = |p: &mut Node, c: &mut Node, params: Value| -> String {
        id += 1;
        admit(c, id, &prompt, &params, 0, &[3, 4]);
        drive(&mut [c], T, |n| n[0].seen.finished_recving.contains(&id));
        let reason = c.seen.failed_recving[&id].clone();
        c.sched.request_finished(
            &request(id, &prompt, Some(&params)),
            &[],
            FinishKind::Aborted,
        );
        let _ = p;
        reason
    };

    let params = produce(&mut p, 1, &prompt, &[1, 2]);
    let mut wrong = params.clone();
    wrong["remote_engine_id"] = json!("someone-else");
    let reason = fail_with(&mut p, &mut c, wrong);
    assert!(reason.contains("engine id mismatch"), "{reason}");
    assert!(
        reason.contains("someone-else") && reason.contains("prefill-0"),
        "{reason}"
    );

    *p.http.status_override.lock().unwrap() = Some(503);
    let reason = fail_with(&mut p, &mut c, params.clone());
    assert!(reason.contains("refused: HTTP 503"), "{reason}");
    *p.http.status_override.lock().unwrap() = None;

    // Block ids the producer did not lease for these params (forged, yet well-formed: in its
    // range, or not) are refused by the claim before any READ: no other request's KV moves.
    for blocks in [json!([1, 999]), json!([2, 1]), json!([1, 5])] {
        let mut forged = params.clone();
        forged["remote_block_ids"] = blocks;
        let reason = fail_with(&mut p, &mut c, forged);
        assert!(
            reason.contains("refused the lease claim") && reason.contains("not the blocks"),
            "{reason}"
        );
    }
    // A lease id the producer never issued (a guess).
    let mut guessed = params.clone();
    guessed["remote_request_id"] = json!("1-00000000000000000000000000000000");
    let reason = fail_with(&mut p, &mut c, guessed);
    assert!(reason.contains("no live lease"), "{reason}");

    // A producer serving another model is refused by the compatibility check.
    let other = {
        let mut cfg =
            KvTransferConfig::parse(&config_json("kv_producer", "other", json!({}))).unwrap();
        cfg.engine_id = "other-model".into();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let conn = nixl_pull_connector(&cfg, "another-model", BS, port, None).unwrap();
        let mut w = conn.worker;
        w.register_kv_caches(small_storage()).unwrap();
        (w, Responder::start(listener, conn.peer_service), port)
    };
    let mut params_other = params.clone();
    params_other["remote_engine_id"] = json!("other-model");
    params_other["remote_port"] = json!(other.2);
    let reason = fail_with(&mut p, &mut c, params_other);
    assert!(reason.contains("different model"), "{reason}");
    drop(other);

    assert_eq!(c.seen.stats.failures, 7);
    assert_blocks_zero(&c.storage, [3, 4]);
    for _ in 0..50 {
        p.step();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        p.seen.finished_sending.is_empty(),
        "failed loads freed the lease"
    );
    // Nothing was read: the producer still holds its lease; the real consumer frees it.
    admit(&mut c, 100, &prompt, &params, 0, &[3, 4]);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[0].seen.finished_sending.contains(&1) && n[1].seen.finished_recving.contains(&100)
    });
    assert!(!c.seen.failed_recving.contains_key(&100));
    finish_consumer(&mut c, 100, &prompt, &params, &[3, 4]);
    c.step();
    p.assert_idle();
    c.assert_idle();
}

#[test]
fn malformed_or_forged_params_are_rejected_before_anything_moves() {
    let mut c = consumer();
    let prompt = prompt(40);
    let good = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "prefill-0", "remote_request_id": "1-abc",
        "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 8100,
        "tp_size": 1});
    let mut cases = Vec::new();
    for (key, val) in [
        ("remote_block_ids", json!([1, 2])),
        ("remote_block_ids", json!([1, 2, 3, 4])),
        ("remote_block_ids", json!(["1", 2, 3])),
        ("remote_block_ids", json!([1, 1, 3])),
        ("remote_host", json!("")),
        ("remote_host", json!("127.0.0.1/../../x")),
        ("remote_port", json!(70000)),
        ("remote_port", json!(0)),
        ("tp_size", json!(0)),
        ("remote_engine_id", json!(42)),
        ("remote_request_id", Value::Null),
        ("do_remote_decode", json!(true)),
        ("do_remote_prefill", json!("yes")),
    ] {
        let mut v = good.clone();
        v[key] = val;
        cases.push(v);
    }
    cases.push(json!("do_remote_prefill"));
    for (i, v) in cases.iter().enumerate() {
        match c
            .sched
            .get_num_new_matched_tokens(&request(i as u64, &prompt, Some(v)), 0)
        {
            Err(KvConnectorError::InvalidTransferParams(reason)) => assert!(!reason.is_empty()),
            other => panic!("{v}: expected a rejection, got {other:?}"),
        }
        // The engine then ends the request; nothing is left behind.
        c.sched.request_finished(
            &request(i as u64, &prompt, Some(v)),
            &[],
            FinishKind::Aborted,
        );
    }
    for _ in 0..3 {
        let out = c.step();
        assert!(out.finished_recving.is_empty() && out.finished_sending.is_empty());
    }
    c.assert_idle();
    assert_blocks_zero(&c.storage, 0..NUM_BLOCKS);
}

#[test]
fn ending_a_request_mid_load_or_before_it_releases_every_side() {
    let mut p = producer(71);
    let mut c = consumer();
    let prompt = prompt(40);

    // Ended right after its load was handed off (the cancel races the transfer thread).
    let params = produce(&mut p, 1, &prompt, &[1, 2, 3]);
    admit(&mut c, 1, &prompt, &params, 0, &[4, 5, 6]);
    c.step(); // the load reaches the transfer thread
    let a = c.sched.request_finished(
        &request(1, &prompt, Some(&params)),
        &[vec![4, 5, 6]],
        FinishKind::Aborted,
    );
    assert!(a.delay_free && a.kv_transfer_params.is_none());
    drive(&mut [&mut p, &mut c], T, |n| {
        n[1].seen.finished_sending.contains(&1) && n[0].seen.finished_sending.contains(&1)
    });
    assert!(
        !c.seen.finished_recving.contains(&1),
        "an ended request is not reported loaded"
    );

    // Ended while queued, before any block: the producer is released at once.
    let params = produce(&mut p, 2, &prompt, &[7, 8, 9]);
    let r = request(2, &prompt, Some(&params));
    c.sched.get_num_new_matched_tokens(&r, 0).unwrap();
    let a = c.sched.request_finished(&r, &[], FinishKind::Aborted);
    assert!(!a.delay_free);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[0].seen.finished_sending.contains(&2)
    });
    assert_eq!(p.seen.stats.expired_leases, 0);
    assert!(!c.seen.finished_recving.contains(&2) && !c.seen.finished_sending.contains(&2));
    p.assert_idle();
    c.assert_idle();
}

#[test]
fn a_request_ending_while_its_read_is_in_flight_keeps_its_blocks_until_it_stops() {
    // The producer has no progress thread and is not stepped: the READ cannot complete.
    let mut p = node_with(
        "kv_producer",
        "prefill-stuck",
        json!({"progress_thread": false}),
        Some(72),
    );
    let mut c = consumer();
    let prompt = prompt(40);
    let params = produce(&mut p, 1, &prompt, &[1, 2, 3]);
    p.step();
    admit(&mut c, 1, &prompt, &params, 0, &[4, 5, 6]);
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(500) {
        assert!(c.step().finished_recving.is_empty(), "the READ completed");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(p.http.served.load(Ordering::Relaxed), 1, "no handshake yet");
    assert_eq!(c.worker().num_jobs(), 1);
    let a = c.sched.request_finished(
        &request(1, &prompt, Some(&params)),
        &[vec![4, 5, 6]],
        FinishKind::Aborted,
    );
    assert!(a.delay_free);
    drive(&mut [&mut c], T, |n| {
        n[0].seen.finished_sending.contains(&1)
    });
    assert!(c.seen.finished_recving.is_empty() && c.seen.failed_recving.is_empty());
    // Once the producer runs again it gets the consumer's done and frees, without expiry.
    drive(&mut [&mut p], T, |n| {
        n[0].seen.finished_sending.contains(&1)
    });
    assert_eq!(p.seen.stats.expired_leases, 0);
    p.assert_idle();
    c.assert_idle();
}

#[test]
fn config_parsing_and_the_constructor() {
    let c = KvTransferConfig::parse(
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"fail",
            "kv_connector_extra_config":{"side_channel_host":"10.9.8.7","kv_lease_duration":12}}"#,
    )
    .unwrap();
    assert_eq!(c.kv_role, KvRole::Consumer);
    assert_eq!(c.kv_load_failure_policy, LoadFailurePolicy::Fail);
    assert!(!c.progress_thread());
    let e = KvTransferConfig::parse(
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_address":"1.2.3.4"}"#,
    )
    .unwrap_err();
    assert!(matches!(e, KvConnectorError::InvalidConfig(_)));
    assert!(
        e.to_string().contains("\"kv_address\"") && e.to_string().contains("known keys"),
        "{e}"
    );
    let e = KvTransferConfig::parse(r#"{"kv_connector":"NixlConnector","kv_role":"decode"}"#)
        .unwrap_err();
    assert!(e.to_string().contains("kv_role \"decode\""), "{e}");

    // The constructor carries the config into both sides.
    let p = nixl_pull_connector(&c, MODEL, BS, 8200, None).unwrap();
    assert_eq!(p.scheduler.config().side_channel_host, "10.9.8.7");
    assert_eq!(p.scheduler.config().http_port, 8200);
    assert_eq!(
        p.scheduler.config().kv_lease_duration,
        Duration::from_secs(12)
    );
    assert_eq!(p.scheduler.config().engine_id, c.engine_id);
    let agent: &NixlAgentConfig = &p.worker.config().agent;
    assert!(!agent.progress_thread);
    assert_eq!(agent.engine_id, c.engine_id);
    assert!(p.library.path.ends_with("libnixl_capi.so"));
    assert!(nixl_pull_connector(&c, MODEL, BS, 0, None).is_err());
    // A library directory without NIXL is a clear error, not an abort.
    let mut bad = c.clone();
    bad.kv_connector_extra_config.nixl_lib_dir = Some("/nonexistent/nixl".into());
    let e = nixl_pull_connector(&bad, MODEL, BS, 8200, None).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/nixl"), "{e}");
    // Boxed as the engine takes them.
    let (_s, _w, peer, _admission) = p.into_parts();
    assert!(peer.handshake(None).unwrap().is_none());
}

#[test]
fn replayed_params_and_peers_without_the_secret_are_refused() {
    let secret = TransferAuth::new(b"the-deployment-secret").unwrap();
    let cfg =
        |role: &str, id: &str| KvTransferConfig::parse(&config_json(role, id, json!({}))).unwrap();
    let mut p = node_signed(
        &cfg("kv_producer", "prefill-s"),
        Some(71),
        Some(secret.clone()),
    );
    let mut c = node_signed(&cfg("kv_consumer", "decode-s"), None, Some(secret.clone()));
    let mut stranger = node_from(&cfg("kv_consumer", "decode-x"), None);
    let prompt = prompt(20);
    let mut params = produce(&mut p, 1, &prompt, &[1, 2]);
    // What the engine does once the checksums are in: the producer signs.
    p.sched
        .seal_transfer_params(params.as_object_mut().unwrap());
    assert!(params["signature"].is_string() && params["expires_at"].is_u64());

    // A consumer without the secret cannot even fetch the handshake.
    admit(&mut stranger, 5, &prompt, &params, 0, &[3, 4]);
    drive(&mut [&mut stranger], T, |n| {
        n[0].seen.finished_recving.contains(&5)
    });
    let reason = &stranger.seen.failed_recving[&5];
    assert!(reason.contains("HTTP 401"), "{reason}");
    let r = request(5, &prompt, Some(&params));
    stranger
        .sched
        .request_finished(&r, &[vec![3, 4]], FinishKind::Aborted);

    // The real consumer loads byte for byte.
    admit(&mut c, 10, &prompt, &params, 0, &[3, 4]);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[0].seen.finished_sending.contains(&1) && n[1].seen.finished_recving.contains(&10)
    });
    assert!(
        !c.seen.failed_recving.contains_key(&10),
        "{:?}",
        c.seen.failed_recving
    );
    assert_blocks_equal(&p.storage, &c.storage, &pairs(&[1, 2], &[3, 4]));
    finish_consumer(&mut c, 10, &prompt, &params, &[3, 4]);

    // The same params again, once the producer may have reused the blocks: refused.
    admit(&mut c, 11, &prompt, &params, 0, &[5, 6]);
    drive(&mut [&mut p, &mut c], T, |n| {
        n[1].seen.finished_recving.contains(&11)
    });
    let reason = &c.seen.failed_recving[&11];
    assert!(reason.contains("no live lease"), "{reason}");
    assert_blocks_zero(&c.storage, [5, 6]);
    let r = request(11, &prompt, Some(&params));
    c.sched
        .request_finished(&r, &[vec![5, 6]], FinishKind::Aborted);
    c.step();
    stranger.step();
    p.assert_idle();
    c.assert_idle();
    stranger.assert_idle();
}
