//! The CPU checksum of a realistic block set against a single-threaded memcpy of the same bytes,
//! side by side in one run.
//!
//! Block set: 30 layers (and a 2-layer hot set), 3 KV heads, head_dim 64, 16-token blocks, a 1000-token request (63
//! blocks, the last one half full) scattered over a pool of 128 blocks, token-major, in f32 and
//! bf16. The memcpy copies exactly the bytes the checksum reads (each block's K and V, the last
//! block's valid tokens only) into one contiguous buffer.
//!
//! Run: `CARGO_TARGET_DIR=/work/target-checksum cargo bench -p tandem-kv-checksum --bench checksum`
//! Besides criterion's GB/s, it prints the ratio checksum / memcpy from an interleaved
//! measurement (target >= 0.7).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tandem_kv_cache::{BlockLayout, CacheDtype, KvCacheSpec, LayerKv};
use tandem_kv_checksum::{
    CacheLayer, ChecksumRequest, CpuBackend, GroupBlocks, HeadPlacement, Role, WorkerChecksums,
    WorkerGroup, WorkerId,
};

const HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const BLOCK: usize = 16;
const POOL: usize = 128;
const TOKENS: usize = 1000;

struct Setup {
    layers: usize,
    buffers: Vec<(Vec<u8>, Vec<u8>)>,
    layout: BlockLayout,
    spec: KvCacheSpec,
    table: Vec<Option<usize>>,
}

fn setup(dtype: CacheDtype, layers: usize) -> Setup {
    let layout = BlockLayout::token_major(POOL, BLOCK, HEADS, HEAD_DIM, dtype);
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut fill = |buf: &mut [u8]| {
        for chunk in buf.chunks_mut(8) {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
    };
    let buffers = (0..layers)
        .map(|_| {
            let mut k = vec![0u8; layout.total_bytes()];
            let mut v = vec![0u8; layout.total_bytes()];
            fill(&mut k);
            fill(&mut v);
            (k, v)
        })
        .collect();
    // A scattered block table: position p in block (p * 37 + 11) % POOL.
    let table = (0..TOKENS.div_ceil(BLOCK))
        .map(|p| Some((p * 37 + 11) % POOL))
        .collect();
    let spec = KvCacheSpec::FullAttention {
        block_size: BLOCK,
        num_kv_heads: HEADS,
        head_dim: HEAD_DIM,
        dtype,
    };
    Setup {
        layers,
        buffers,
        layout,
        spec,
        table,
    }
}

impl Setup {
    fn views(&self) -> Vec<LayerKv<'_>> {
        self.buffers
            .iter()
            .map(|(k, v)| LayerKv::new(k, v, self.layout).unwrap())
            .collect()
    }

    fn worker(&self) -> WorkerChecksums {
        let layers = (0..self.layers)
            .map(|i| CacheLayer {
                source_index: i,
                name: format!("model.layers.{i}.self_attn"),
                layout: self.layout,
            })
            .collect();
        WorkerChecksums::new(
            WorkerId {
                tp_rank: 0,
                pp_rank: 0,
            },
            vec![WorkerGroup {
                group_id: 0,
                spec: self.spec,
                layers,
                heads: HeadPlacement::single(HEADS as u32),
            }],
        )
    }

    fn request(&self) -> ChecksumRequest {
        ChecksumRequest::for_send(
            TOKENS,
            &[GroupBlocks {
                group_id: 0,
                spec: &self.spec,
                first_position: 0,
                blocks: &self.table,
            }],
        )
    }

    /// (source range, length) of every copy the memcpy makes: the bytes the checksum reads.
    fn copy_ranges(&self) -> Vec<(usize, usize)> {
        let bb = self.layout.block_bytes();
        let token_bytes = bb / BLOCK;
        self.table
            .iter()
            .enumerate()
            .map(|(p, b)| {
                let tokens = (TOKENS - p * BLOCK).min(BLOCK);
                (b.unwrap() * bb, tokens * token_bytes)
            })
            .collect()
    }

    fn bytes(&self) -> usize {
        2 * self.layers * self.copy_ranges().iter().map(|r| r.1).sum::<usize>()
    }
}

fn memcpy(setup: &Setup, ranges: &[(usize, usize)], dst: &mut [u8]) {
    let mut o = 0;
    for (k, v) in &setup.buffers {
        for &(src, len) in ranges {
            dst[o..o + len].copy_from_slice(&k[src..src + len]);
            o += len;
            dst[o..o + len].copy_from_slice(&v[src..src + len]);
            o += len;
        }
    }
}

fn bench(c: &mut Criterion) {
    // 30 layers: the realistic set (46 MB in f32, beyond the caches); 2 layers: a hot set that
    // stays in the last-level cache, to see the loop's own speed.
    for (dtype, layers) in [
        (CacheDtype::F32, 30),
        (CacheDtype::Bf16, 30),
        (CacheDtype::F32, 2),
    ] {
        let s = setup(dtype, layers);
        let name = format!("kv_checksum/{dtype}/{layers}_layers");
        let views = s.views();
        let backend = CpuBackend::new(&views);
        let worker = s.worker();
        let req = s.request();
        let ranges = s.copy_ranges();
        let bytes = s.bytes();
        let mut dst = vec![0u8; bytes];
        let checksum = || black_box(worker.checksum(&backend, Role::Producer, black_box(&req)));

        let mut g = c.benchmark_group(&name);
        g.throughput(Throughput::BytesDecimal(bytes as u64));
        g.sample_size(20);
        g.warm_up_time(Duration::from_millis(500));
        g.measurement_time(Duration::from_secs(3));
        g.bench_function("checksum", |b| b.iter(checksum));
        g.bench_function("memcpy", |b| {
            b.iter(|| memcpy(&s, &ranges, black_box(&mut dst)))
        });
        g.finish();

        // Interleaved, so both see the same machine state: median of 30 runs each.
        let (mut tc, mut tm) = (Vec::new(), Vec::new());
        for _ in 0..30 {
            let t = Instant::now();
            checksum();
            tc.push(t.elapsed());
            let t = Instant::now();
            memcpy(&s, &ranges, black_box(&mut dst));
            tm.push(t.elapsed());
        }
        tc.sort();
        tm.sort();
        let gbps = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
        let (c_gbps, m_gbps) = (gbps(tc[15]), gbps(tm[15]));
        println!(
            "{name}: {:.1} MB, checksum {c_gbps:.2} GB/s, memcpy {m_gbps:.2} GB/s, ratio {:.2}",
            bytes as f64 / 1e6,
            c_gbps / m_gbps
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
