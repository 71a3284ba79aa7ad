//! The cost of signing and verifying `kv_transfer_params` per request, against serializing the
//! same params to JSON (what every producer answer and proxy hop already pays), in one run.
//!
//! Params of a 2048-token prompt in blocks of 16: 128 block ids and the `kv_checksums` of 128
//! blocks (1 KiB of checksums, base64 in msgpack), as a producer answers them.
//!
//! Run: `cargo bench -p tandem-kv-connector --bench auth`

use std::time::Duration;

use base64::Engine as _;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use serde_json::{json, Map, Value};
use tandem_kv_connector::auth::{unix_millis, TransferAuth};

fn params() -> Map<String, Value> {
    let checksums = base64::engine::general_purpose::STANDARD.encode(vec![0xA5u8; 128 * 8 + 32]);
    let blocks: Vec<u32> = (0..128).map(|i| i * 7 % 4096).collect();
    json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "5b0e6a2c-1a7e-4a58-9d1e-0f4c8e2d7b11",
        "remote_request_id": "42-0123456789abcdef0123456789abcdef",
        "remote_block_ids": blocks, "remote_host": "10.0.0.12", "remote_port": 8100,
        "tp_size": 1, "kv_checksums": checksums})
    .as_object()
    .unwrap()
    .clone()
}

fn bench(c: &mut Criterion) {
    let auth = TransferAuth::new(b"a-deployment-secret-of-32-bytes!").unwrap();
    let base = params();
    let mut signed = base.clone();
    auth.sign_params(&mut signed, unix_millis(), Duration::from_secs(30));
    let now = unix_millis();
    let mut g = c.benchmark_group("kv_transfer_params");
    g.bench_function("to_json (reference)", |b| {
        b.iter(|| serde_json::to_vec(black_box(&signed)).unwrap())
    });
    g.bench_function("sign", |b| {
        b.iter(|| {
            let mut p = base.clone();
            auth.sign_params(black_box(&mut p), now, Duration::from_secs(30));
            p
        })
    });
    g.bench_function("clone (sign's copy)", |b| {
        b.iter(|| black_box(&base).clone())
    });
    g.bench_function("verify", |b| {
        b.iter(|| auth.verify_params(black_box(&signed), now).unwrap())
    });
    g.bench_function("sign_request + verify_request", |b| {
        b.iter(|| {
            let h = auth.sign_request("GET", "/v1/kv/handshake");
            auth.verify_request("GET", "/v1/kv/handshake", Some(&h))
                .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
