//! The CUDA checksum kernel against the CPU backend, on a GPU (run by `scripts/gpu_test.sh` on the
//! device machine; CI has no GPU and only builds this). Every case fills a device cache with random
//! bytes, copies the same bytes to host arrays, and compares the two backends' values bit for bit.
#![cfg(feature = "cuda")]

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tandem_kernels::cuda::testing::Testing;
use tandem_kernels::cuda::{
    CudaBackend, CudaChecksums, Device, DeviceKvCache, KvArrangement, MAX_BLOCKS_PER_LAUNCH,
};
use tandem_kernels::KernelError;
use tandem_kv_cache::{BlockLayout, CacheDtype, LayerKv, LayoutOrder};
use tandem_kv_checksum::{
    BlockJob, ChecksumBackend, CpuBackend, GroupJob, KvChecksumError, LayerJob,
};

fn device() -> Device {
    Device::open(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"))
}

/// A device cache and the same bytes on the host, per layer.
struct Twin {
    cache: DeviceKvCache,
    host: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Twin {
    fn random(
        dev: &Device,
        layout: BlockLayout,
        layers: usize,
        arrangement: KvArrangement,
        seed: u64,
    ) -> Twin {
        let cache = DeviceKvCache::new(dev, layout, layers, arrangement).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let total = layout.total_bytes();
        let bb = layout.block_bytes();
        let host: Vec<(Vec<u8>, Vec<u8>)> = (0..layers)
            .map(|_| {
                let mut k = vec![0u8; total];
                let mut v = vec![0u8; total];
                rng.fill(k.as_mut_slice());
                rng.fill(v.as_mut_slice());
                (k, v)
            })
            .collect();
        for (l, (k, v)) in host.iter().enumerate() {
            for b in 0..layout.num_blocks {
                let r = b * bb..(b + 1) * bb;
                cache.write_block(l, b, &k[r.clone()], &v[r]).unwrap();
            }
        }
        Twin { cache, host }
    }

    fn cpu_views(&self) -> Vec<LayerKv<'_>> {
        self.host
            .iter()
            .map(|(k, v)| LayerKv::new(k, v, *self.cache.layout()).unwrap())
            .collect()
    }
}

/// Layers numbered from `first_number`, heads from `head_base`, alternating over `columns`.
fn layer_jobs(
    layout: BlockLayout,
    layers: usize,
    first_number: u32,
    head_base: u32,
    columns: usize,
) -> Vec<LayerJob> {
    (0..layers)
        .map(|l| LayerJob {
            source_index: l,
            layout,
            layer_number: first_number + l as u32,
            head_base,
            column: l % columns,
        })
        .collect()
}

/// `count` block positions over random distinct blocks: whole blocks, one that starts mid-block,
/// a short last one and an empty one.
fn block_jobs(layout: &BlockLayout, count: usize, seed: u64) -> Vec<BlockJob> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids: Vec<usize> = (0..layout.num_blocks).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.random_range(0..=i));
    }
    let bs = layout.block_size;
    let mut token = 0usize;
    (0..count)
        .map(|i| {
            let (first_slot, n) = match i {
                0 if bs > 1 => (bs / 2, bs - bs / 2),
                _ if i == count - 1 => (0, (bs / 3).max(1)),
                _ if i == count / 2 => (0, 0),
                _ => (0, bs),
            };
            let job = BlockJob {
                block_id: ids[i % ids.len()],
                first_slot,
                token_begin: token,
                token_end: token + n,
            };
            token += n;
            job
        })
        .collect()
}

fn compare(twin: &Twin, checksums: &CudaChecksums, job: &GroupJob<'_>) -> Vec<u64> {
    let mut cpu = vec![0u64; job.columns * job.blocks.len()];
    let views = twin.cpu_views();
    CpuBackend::new(&views).checksum(job, &mut cpu).unwrap();
    let gpu = checksums
        .launch(&twin.cache, job, None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(gpu, cpu, "GPU and CPU checksums differ");
    // The trait form adds to what the output held.
    let mut added = vec![1u64; cpu.len()];
    CudaBackend {
        checksums,
        cache: &twin.cache,
    }
    .checksum(job, &mut added)
    .unwrap();
    assert!(added.iter().zip(&cpu).all(|(a, c)| *a == c.wrapping_add(1)));
    gpu
}

struct Case {
    name: &'static str,
    layout: BlockLayout,
    layers: usize,
    arrangement: KvArrangement,
    blocks: usize,
    columns: usize,
}

fn layout(
    num_blocks: usize,
    block_size: usize,
    kernel_block_size: usize,
    heads: usize,
    head_dim: usize,
    dtype: CacheDtype,
    order: LayoutOrder,
) -> BlockLayout {
    BlockLayout {
        num_blocks,
        block_size,
        kernel_block_size,
        num_kv_heads: heads,
        head_dim,
        dtype,
        order,
    }
}

#[test]
fn every_layout_and_dtype_matches_the_cpu_backend_bit_for_bit() {
    use CacheDtype::*;
    use KvArrangement::*;
    use LayoutOrder::*;
    let dev = device();
    let checksums = CudaChecksums::new(&dev).unwrap();
    let cases = [
        // SmolLM2's cache: bf16, 3 KV heads of 64 (16-byte loads).
        Case {
            name: "smollm2 bf16 token-major per-layer",
            layout: layout(40, 16, 16, 3, 64, Bf16, TokenMajor),
            layers: 4,
            arrangement: PerLayer,
            blocks: 12,
            columns: 1,
        },
        Case {
            name: "8B-like bf16 block-major",
            layout: layout(24, 16, 16, 8, 128, Bf16, TokenMajor),
            layers: 3,
            arrangement: BlockMajor,
            blocks: 10,
            columns: 1,
        },
        Case {
            name: "f32 head-major, kernel blocks of 4",
            layout: layout(20, 16, 4, 2, 64, F32, HeadMajor),
            layers: 3,
            arrangement: BlockMajor,
            blocks: 9,
            columns: 2,
        },
        Case {
            name: "f16 rows of 8 bytes (8-byte loads)",
            layout: layout(12, 8, 8, 5, 4, F16, TokenMajor),
            layers: 2,
            arrangement: PerLayer,
            blocks: 7,
            columns: 1,
        },
        Case {
            name: "f16 rows of 12 bytes: pieces straddle K and V",
            layout: layout(12, 8, 8, 3, 6, F16, TokenMajor),
            layers: 2,
            arrangement: PerLayer,
            blocks: 7,
            columns: 1,
        },
        Case {
            name: "f32 rows of 12 bytes, head-major split",
            layout: layout(12, 8, 2, 3, 3, F32, HeadMajor),
            layers: 2,
            arrangement: BlockMajor,
            blocks: 7,
            columns: 1,
        },
        Case {
            name: "bf16 head_dim 256 (Gemma 3), 1 head, blocks of 32",
            layout: layout(10, 32, 32, 1, 256, Bf16, TokenMajor),
            layers: 2,
            arrangement: PerLayer,
            blocks: 6,
            columns: 1,
        },
        Case {
            name: "more layers and blocks than one launch holds",
            layout: layout(MAX_BLOCKS_PER_LAUNCH + 60, 4, 4, 2, 8, Bf16, TokenMajor),
            layers: 40,
            arrangement: BlockMajor,
            blocks: MAX_BLOCKS_PER_LAUNCH + 44,
            columns: 3,
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        let twin = Twin::random(&dev, case.layout, case.layers, case.arrangement, i as u64);
        let layers = layer_jobs(case.layout, case.layers, 5, 7 * i as u32, case.columns);
        let blocks = block_jobs(&case.layout, case.blocks, 100 + i as u64);
        let job = GroupJob {
            layers: &layers,
            blocks: &blocks,
            columns: case.columns,
        };
        let values = compare(&twin, &checksums, &job);
        let nonzero = values.iter().filter(|v| **v != 0).count();
        assert!(
            nonzero * 2 > values.len(),
            "{}: values look empty",
            case.name
        );
        println!("{}: {} values equal the CPU's", case.name, values.len());
    }
}

#[test]
fn one_flipped_byte_changes_its_block_only() {
    let dev = device();
    let checksums = CudaChecksums::new(&dev).unwrap();
    let lay = layout(8, 16, 16, 2, 64, CacheDtype::Bf16, LayoutOrder::TokenMajor);
    let mut twin = Twin::random(&dev, lay, 2, KvArrangement::BlockMajor, 42);
    let layers = layer_jobs(lay, 2, 0, 0, 1);
    let blocks: Vec<BlockJob> = (0..4)
        .map(|b| BlockJob {
            block_id: b + 2,
            first_slot: 0,
            token_begin: 16 * b,
            token_end: 16 * (b + 1),
        })
        .collect();
    let job = GroupJob {
        layers: &layers,
        blocks: &blocks,
        columns: 1,
    };
    let before = compare(&twin, &checksums, &job);
    // One bit of layer 1's V in cache block 4 (block position 2).
    let bb = lay.block_bytes();
    twin.host[1].1[4 * bb + 77] ^= 0x10;
    let (k, v) = &twin.host[1];
    twin.cache
        .write_block(1, 4, &k[4 * bb..5 * bb], &v[4 * bb..5 * bb])
        .unwrap();
    let after = compare(&twin, &checksums, &job);
    for b in 0..4 {
        assert_eq!(before[b] != after[b], b == 2, "block position {b}");
    }
}

#[test]
fn bad_jobs_are_refused_before_anything_runs() {
    let dev = device();
    let checksums = CudaChecksums::new(&dev).unwrap();
    let lay = layout(4, 16, 16, 2, 64, CacheDtype::Bf16, LayoutOrder::TokenMajor);
    let cache = DeviceKvCache::new(&dev, lay, 1, KvArrangement::PerLayer).unwrap();
    let layers = layer_jobs(lay, 1, 0, 0, 1);
    let ok = BlockJob {
        block_id: 1,
        first_slot: 0,
        token_begin: 0,
        token_end: 16,
    };
    let cases: Vec<(Vec<LayerJob>, BlockJob)> = vec![
        // A block outside the pool.
        (layers.clone(), BlockJob { block_id: 4, ..ok }),
        // Slots past the block's end.
        (
            layers.clone(),
            BlockJob {
                first_slot: 8,
                ..ok
            },
        ),
        // A layer the cache does not have.
        (
            vec![LayerJob {
                source_index: 3,
                ..layers[0].clone()
            }],
            ok,
        ),
        // A layout other than the cache's.
        (
            vec![LayerJob {
                layout: BlockLayout {
                    head_dim: 32,
                    ..lay
                },
                ..layers[0].clone()
            }],
            ok,
        ),
        // Heads beyond the per-layer bound.
        (
            vec![LayerJob {
                head_base: 65535,
                ..layers[0].clone()
            }],
            ok,
        ),
    ];
    for (layers, block) in cases {
        let blocks = [block];
        let job = GroupJob {
            layers: &layers,
            blocks: &blocks,
            columns: 1,
        };
        let err = checksums.launch(&cache, &job, None).unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::Checksum(
                    KvChecksumError::InvalidJob(_) | KvChecksumError::MissingLayer(_)
                )
            ),
            "{err}"
        );
    }
}

#[test]
fn the_launch_never_waits_for_the_forward_and_the_forward_never_waits_for_it() {
    let dev = device();
    let testing = Testing::load(&dev).unwrap();
    let checksums = CudaChecksums::new(&dev).unwrap();
    let lay = layout(
        64,
        16,
        16,
        8,
        128,
        CacheDtype::Bf16,
        LayoutOrder::TokenMajor,
    );
    let twin = Twin::random(&dev, lay, 4, KvArrangement::BlockMajor, 7);
    let layers = layer_jobs(lay, 4, 0, 0, 1);
    let blocks = block_jobs(&lay, 32, 3);
    let job = GroupJob {
        layers: &layers,
        blocks: &blocks,
        columns: 1,
    };
    let mut cpu = vec![0u64; blocks.len()];
    CpuBackend::new(&twin.cpu_views())
        .checksum(&job, &mut cpu)
        .unwrap();
    // Warm up (module load, first pinned buffer).
    checksums
        .launch(&twin.cache, &job, None)
        .unwrap()
        .wait()
        .unwrap();

    // A 300 ms "forward" on the engine's stream, then the step launches its checksums after it.
    let forward = Duration::from_millis(300);
    testing
        .spin(dev.stream(), forward.as_nanos() as u64)
        .unwrap();
    let after_forward = dev.stream().record_event(None).unwrap();
    let t = Instant::now();
    let pending = checksums
        .launch(&twin.cache, &job, Some(&after_forward))
        .unwrap();
    let launch_time = t.elapsed();
    assert!(
        launch_time < Duration::from_millis(30),
        "launch blocked for {launch_time:?}"
    );
    assert!(!pending.is_ready().unwrap(), "ran before the forward ended");
    let values = pending.wait().unwrap();
    assert!(t.elapsed() >= forward - Duration::from_millis(30));
    assert_eq!(values, cpu);

    // The other way round: checksums stuck behind 300 ms of side-stream work do not hold up the
    // engine's stream.
    testing
        .spin(checksums.stream(), forward.as_nanos() as u64)
        .unwrap();
    let pending = checksums.launch(&twin.cache, &job, None).unwrap();
    let t = Instant::now();
    testing.spin(dev.stream(), 10_000_000).unwrap();
    dev.stream().synchronize().unwrap();
    let step = t.elapsed();
    assert!(
        step < Duration::from_millis(150),
        "the engine's stream waited {step:?} for the checksums"
    );
    assert!(!pending.is_ready().unwrap());
    assert_eq!(pending.wait().unwrap(), cpu);
    println!("launch {launch_time:?}, engine step while checksums pend {step:?}");
}
