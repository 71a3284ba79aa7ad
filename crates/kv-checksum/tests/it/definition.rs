//! The fast path against the naive definition, on random data, over every layout, dtype,
//! head_dim, kernel-block split, TP/PP split, offset and partial last block.

use proptest::prelude::*;
use tandem_kv_cache::{CacheDtype, LayoutOrder};
use tandem_kv_checksum::*;

use crate::common::*;

const DTYPES: [CacheDtype; 3] = [CacheDtype::F32, CacheDtype::F16, CacheDtype::Bf16];

fn names(numbers: &[u32]) -> Vec<String> {
    numbers
        .iter()
        .map(|n| format!("model.layers.{n}.self_attn"))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// One worker (TP1, PP1), any physical layout: the record equals the naive definition.
    #[test]
    fn one_worker_matches_naive(
        dt in 0..3usize,
        head_dim in prop::sample::select(vec![1usize, 2, 3, 4, 5, 6, 8, 12, 16, 64, 128]),
        heads in 1..4usize,
        numbers in prop::collection::btree_set(0u32..200, 1..4),
        bs in prop::sample::select(vec![1usize, 2, 3, 4, 8, 16]),
        split in 0..4u32,
        head_major in any::<bool>(),
        num_tokens in 1..50usize,
        first in 0..50usize,
        seed in any::<u64>(),
    ) {
        let dtype = DTYPES[dt];
        prop_assume!(pieces_per_token(head_dim, dtype).is_some());
        let mut kbs = bs;
        for _ in 0..split {
            if kbs % 2 == 0 { kbs /= 2; }
        }
        let first = first % num_tokens;
        let mut rng = Rng(seed);
        let numbers: Vec<u32> = numbers.into_iter().collect();
        let names = names(&numbers);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let model = Model::random(&mut rng, &refs, heads, head_dim, dtype, num_tokens + 5);
        let mut cfg = ClusterConfig::new(1, 1, bs, num_tokens + 5);
        cfg.phys = Physical {
            block_size: bs,
            kernel_block_size: kbs,
            order: if head_major { LayoutOrder::HeadMajor } else { LayoutOrder::TokenMajor },
        };
        let cluster = Cluster::new(&mut rng, &model, cfg);
        let req = cluster.request(first, num_tokens);
        let merged = cluster.merged(Role::Producer, &req);
        let c = checks(&merged);
        prop_assert_eq!(c.first_token, first);
        prop_assert_eq!(c.start, first / bs);
        let want = naive_blocks(&model, c.start, c.checks[0].len(), bs, first, num_tokens);
        prop_assert_eq!(&c.checks[0], &want);
        prop_assert_eq!(c.checks[0].len(), num_tokens.div_ceil(bs) - first / bs);
    }

    /// Any TP x PP split, sharded or replicated heads, producer or consumer: the merged value
    /// of every check equals the whole model's naive value.
    #[test]
    fn every_split_sums_to_the_whole(
        tp in prop::sample::select(vec![1u32, 2, 4]),
        pp in 1..4u32,
        heads in prop::sample::select(vec![1usize, 2, 4, 8]),
        replicated in any::<bool>(),
        consumer in any::<bool>(),
        n_layers in 1..5usize,
        bs in prop::sample::select(vec![4usize, 16]),
        num_tokens in 1..40usize,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed);
        let names = Model::names(n_layers);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let model = Model::random(&mut rng, &refs, heads, 8, CacheDtype::Bf16, num_tokens);
        let mut cfg = ClusterConfig::new(tp, pp, bs, num_tokens);
        cfg.heads = if replicated { Heads::Replicated } else { Heads::Sharded };
        let cluster = Cluster::new(&mut rng, &model, cfg);
        let req = cluster.request(0, num_tokens);
        let role = if consumer { Role::Consumer } else { Role::Producer };
        let merged = cluster.merged(role, &req);
        let c = checks(&merged);
        let want = naive_blocks(&model, 0, num_tokens.div_ceil(bs), bs, 0, num_tokens);
        prop_assert_eq!(&c.checks[0], &want);
        if consumer {
            let replicas = if replicated { tp as usize } else { (tp as usize / heads).max(1) };
            prop_assert_eq!(c.checks.len(), replicas);
            for check in &c.checks {
                prop_assert_eq!(check, &want);
            }
        }
        // Fingerprints: the model's layers, whatever the PP split.
        let whole: u64 = model.layers.iter().fold(0u64, |f, l| {
            f.wrapping_add(layer_fingerprint(&l.name, "full_attention", l.dtype))
        });
        prop_assert_eq!(c.fingerprint, whole);
    }
}

#[test]
fn realistic_shapes_match_naive() {
    // The benchmark's shape (30 layers, 3 KV heads, head_dim 64) in both dtypes, with a partial
    // last block.
    for dtype in [CacheDtype::F32, CacheDtype::Bf16] {
        let mut rng = Rng(7);
        let names = Model::names(30);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let model = Model::random(&mut rng, &refs, 3, 64, dtype, 100);
        let cluster = Cluster::new(&mut rng, &model, ClusterConfig::new(1, 1, 16, 100));
        let merged = cluster.merged(Role::Producer, &cluster.request(0, 99));
        assert_eq!(
            checks(&merged).checks[0],
            naive_blocks(&model, 0, 7, 16, 0, 99)
        );
    }
}

#[test]
fn a_hand_computed_value() {
    // One layer (number 2), one head, head_dim 2, f32, one token at position 1 (block size 2):
    // the token's pieces are its K row and its V row: j = 1 * 2 + 0 and 1 * 2 + 1.
    let k_row: [f32; 2] = [1.0, -2.0];
    let v_row: [f32; 2] = [0.5, 3.0];
    let piece = |r: [f32; 2]| (r[0].to_bits() as u64) | ((r[1].to_bits() as u64) << 32);
    let s = piece(k_row)
        .wrapping_mul(2 * 2 + 1)
        .wrapping_add(piece(v_row).wrapping_mul(2 * 3 + 1));
    let m = 2 * (2 * 65536) + 1u64;
    let want = m.wrapping_mul(s);

    let mut model = Model::random(&mut Rng(1), &["layers.2"], 1, 2, CacheDtype::F32, 2);
    let l = &mut model.layers[0];
    let bytes = |r: [f32; 2]| [r[0].to_le_bytes(), r[1].to_le_bytes()].concat();
    l.k[8..16].copy_from_slice(&bytes(k_row));
    l.v[8..16].copy_from_slice(&bytes(v_row));
    assert_eq!(naive_block(&model, 0, 2, 1, 2), want);
    let cluster = Cluster::new(&mut Rng(2), &model, ClusterConfig::new(1, 1, 2, 2));
    let merged = cluster.merged(Role::Producer, &cluster.request(1, 2));
    assert_eq!(checks(&merged).checks[0], vec![want]);
}

#[test]
fn a_workers_kv_storage_is_checksummed_in_place() {
    use tandem_kv_cache::{KvCacheConfig, KvCacheGroup, KvCacheSpec, KvStorage};
    let spec = KvCacheSpec::FullAttention {
        block_size: 4,
        num_kv_heads: 2,
        head_dim: 8,
        dtype: CacheDtype::Bf16,
    };
    let names = ["model.layers.0.self_attn", "model.layers.5.self_attn"];
    let config = KvCacheConfig {
        num_blocks: 6,
        groups: vec![KvCacheGroup {
            group_id: 0,
            spec,
            layer_names: names.iter().map(|s| s.to_string()).collect(),
        }],
    };
    let storage = KvStorage::new(&config).unwrap();
    let table: Vec<Option<usize>> = vec![Some(4), Some(1), Some(3)];
    let tokens = 10;
    let mut rng = crate::common::Rng(9);
    let mut model = Model::random(&mut rng, &names, 2, 8, CacheDtype::Bf16, tokens);
    for (i, layer) in model.layers.iter_mut().enumerate() {
        let vals = |rng: &mut crate::common::Rng| -> Vec<f32> {
            (0..tokens * 16)
                .map(|_| (rng.next() % 2000) as f32 / 7.0 - 100.0)
                .collect()
        };
        let (k, v) = (vals(&mut rng), vals(&mut rng));
        let slots: Vec<usize> = (0..tokens)
            .map(|t| table[t / 4].unwrap() * 4 + t % 4)
            .collect();
        storage.write_slots(i, &slots, &k, &v).unwrap();
        CacheDtype::Bf16.encode(&k, &mut layer.k);
        CacheDtype::Bf16.encode(&v, &mut layer.v);
    }
    let worker = WorkerChecksums::single(&storage, &config);
    assert_eq!(worker.skipped_groups().count(), 0);
    let req = ChecksumRequest::for_send(
        tokens,
        &[GroupBlocks {
            group_id: 0,
            spec: &spec,
            first_position: 0,
            blocks: &table,
        }],
    );
    let record = worker.checksum(&CpuBackend::new(&storage), Role::Producer, &req);
    let GroupOutcome::Computed(v) = &record.groups[0].outcome else {
        panic!("{record:?}")
    };
    assert_eq!(v.parts[0].values, naive_blocks(&model, 0, 3, 4, 0, tokens));
}
