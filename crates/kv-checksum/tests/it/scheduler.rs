//! The scheduler side end to end over simulated producer and consumer instances: selection,
//! worker records, merge, payload, comparison; every verdict and unverified reason.

use tandem_kv_cache::{BlockLayout, CacheDtype, KvCacheSpec, LayoutOrder};
use tandem_kv_checksum::*;

use crate::common::*;

fn model(seed: u64, layers: usize, heads: usize, tokens: usize) -> Model {
    let names = Model::names(layers);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    Model::random(&mut Rng(seed), &refs, heads, 8, CacheDtype::Bf16, tokens)
}

fn instance(m: &Model, tp: u32, pp: u32, bs: usize, seed: u64) -> Cluster {
    Cluster::new(&mut Rng(seed), m, ClusterConfig::new(tp, pp, bs, m.tokens))
}

fn encoded(c: &Cluster, num_tokens: usize) -> String {
    c.payload(num_tokens).encode().unwrap()
}

fn unverified(v: &Verdict) -> UnverifiedReason {
    match v {
        Verdict::Unverified { reason, .. } => *reason,
        other => panic!("expected unverified, got {other:?}"),
    }
}

fn mismatch(v: &Verdict) -> &[GroupMismatch] {
    match v {
        Verdict::Mismatch { groups, .. } => groups,
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

/// Flips a byte of token `t`'s K row (local head 0, first layer) on one worker.
fn corrupt(c: &mut Cluster, worker: usize, t: usize) {
    let table = c.table.clone();
    c.workers[worker].2.k_row_mut(0, &table, t, 0)[1] ^= 0x10;
}

#[test]
fn correct_loads_verify_for_every_tp_pp_pair() {
    // (producer TP, PP), (consumer TP, PP), KV heads
    let pairs = [
        ((1, 1), (1, 1), 4),
        ((2, 1), (1, 1), 4),
        ((1, 1), (2, 1), 4),
        ((1, 2), (1, 1), 4),
        ((1, 1), (2, 2), 4),
        ((2, 2), (4, 3), 4),
        // 2 KV heads: TP4 replicates each head on 2 ranks
        ((1, 1), (4, 1), 2),
        ((4, 1), (1, 1), 2),
        ((4, 2), (2, 1), 2),
    ];
    for (i, ((ptp, ppp), (ctp, cpp), heads)) in pairs.into_iter().enumerate() {
        let m = model(i as u64, 6, heads, 70);
        let p = instance(&m, ptp, ppp, 16, 100 + i as u64);
        let c = instance(&m, ctp, cpp, 16, 200 + i as u64);
        let v = c.verdict(&encoded(&p, 70), 0, 70);
        assert_eq!(
            v,
            Verdict::Verified {
                groups: vec![GROUP]
            },
            "pair {i}"
        );
    }
}

#[test]
fn a_corrupted_byte_is_a_mismatch_at_its_block() {
    let m = model(1, 4, 2, 70);
    let p = instance(&m, 1, 1, 16, 2);
    let mut c = instance(&m, 2, 2, 16, 3);
    corrupt(&mut c, 3, 37); // TP rank 1 of PP stage 1
    let v = c.verdict(&encoded(&p, 70), 0, 70);
    let g = mismatch(&v);
    assert_eq!(g.len(), 1);
    assert_eq!(g[0].block_positions, vec![2]);
    assert_eq!(v.mismatched_blocks(), 1);
    assert_eq!(v.label(), "mismatch");
}

#[test]
fn a_corrupted_replica_is_a_mismatch_even_if_another_copy_is_intact() {
    // 2 KV heads on TP4: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1.
    let m = model(5, 2, 2, 40);
    let p = instance(&m, 1, 1, 16, 6);
    let payload = encoded(&p, 40);
    for (rank, check) in [(0usize, 0usize), (1, 1), (2, 0), (3, 1)] {
        let mut c = instance(&m, 4, 1, 16, 7);
        corrupt(&mut c, rank, 20);
        let v = c.verdict(&payload, 0, 40);
        let g = mismatch(&v);
        assert_eq!(g[0].block_positions, vec![1], "rank {rank}");
        assert_eq!(g[0].replica_checks, vec![check], "rank {rank}");
    }
    // Every rank holds every head (MLA-like): a copy on rank 1 is checked too.
    let mut cfg = ClusterConfig::new(2, 1, 16, 40);
    cfg.heads = Heads::Replicated;
    let mut c = Cluster::new(&mut Rng(8), &m, cfg);
    assert!(c.verdict(&payload, 0, 40).is_verified());
    corrupt(&mut c, 1, 0);
    assert_eq!(
        mismatch(&c.verdict(&payload, 0, 40))[0].replica_checks,
        vec![1]
    );
}

#[test]
fn a_replicated_producer_sums_replica_zero_only() {
    let m = model(9, 2, 2, 40);
    let p = instance(&m, 4, 1, 16, 10);
    let req = p.request(0, 40);
    let records = p.records(Role::Producer, &req);
    // ranks 1 and 3 hold replica 1: they report the request, with no values
    for r in &records {
        let GroupOutcome::Computed(v) = &r.groups[0].outcome else {
            panic!("not computed")
        };
        assert_eq!(v.parts.is_empty(), r.worker.tp_rank % 2 == 1);
    }
    assert_eq!(
        p.payload(40).groups[0].values,
        naive_blocks(&m, 0, 3, 16, 0, 40)
    );
}

#[test]
fn missing_malformed_and_other_versions_are_unverified() {
    let m = model(11, 2, 2, 20);
    let c = instance(&m, 1, 1, 16, 12);
    let merged = c.merged(Role::Consumer, &c.request(0, 20));
    assert_eq!(
        unverified(&verify(None, Ok(&merged))),
        UnverifiedReason::Missing
    );
    for bad in ["", "not base64!", "AAAA", "kZM="] {
        assert_eq!(
            unverified(&verify(Some(bad), Ok(&merged))),
            UnverifiedReason::Malformed,
            "{bad:?}"
        );
    }
    let v2 = rmp_serde::to_vec(&(2u32, 1u32, 20u64, Vec::<u8>::new())).unwrap();
    use base64::Engine as _;
    let v2 = base64::engine::general_purpose::STANDARD.encode(v2);
    assert_eq!(
        unverified(&verify(Some(&v2), Ok(&merged))),
        UnverifiedReason::Version
    );
}

#[test]
fn nothing_is_sent_or_compared_until_every_worker_reported() {
    let m = model(13, 4, 4, 40);
    let p = instance(&m, 2, 2, 16, 14);
    let req = p.request(0, 40);
    let mut merger = RecordMerger::new(2, 2, req.clone());
    let records = p.records(Role::Producer, &req);
    for r in records.iter().take(3) {
        merger.add(r.clone()).unwrap();
    }
    assert!(!merger.is_complete());
    assert_eq!(
        merger.missing(),
        vec![WorkerId {
            tp_rank: 1,
            pp_rank: 1
        }]
    );
    assert_eq!(
        merger.finish().unwrap_err(),
        UnverifiedReason::NotAllWorkersReported
    );
    assert!(matches!(
        merger.add(records[0].clone()),
        Err(KvChecksumError::DuplicateRecord(_))
    ));
    let mut stranger = records[3].clone();
    stranger.worker.pp_rank = 2;
    assert!(matches!(
        merger.add(stranger),
        Err(KvChecksumError::UnknownWorker { .. })
    ));
    merger.add(records[3].clone()).unwrap();
    assert!(merger.finish().is_ok());
    let payload = encoded(&p, 40);
    assert_eq!(
        unverified(&verify(
            Some(&payload),
            Err(UnverifiedReason::NotAllWorkersReported)
        )),
        UnverifiedReason::NotAllWorkersReported
    );
}

#[test]
fn other_layers_are_a_fingerprint_difference() {
    let m = model(15, 2, 2, 40);
    let p = instance(&m, 1, 1, 16, 16);
    let mut renamed = m.clone();
    for l in &mut renamed.layers {
        l.name = l.name.replace("self_attn", "attn");
    }
    let c = instance(&renamed, 1, 1, 16, 17);
    assert_eq!(
        unverified(&c.verdict(&encoded(&p, 40), 0, 40)),
        UnverifiedReason::FingerprintDiffers
    );
}

#[test]
fn different_block_sizes_compare_chunks() {
    for (pb, cb) in [(16, 32), (32, 16), (16, 64), (64, 16), (8, 8)] {
        for n in [100usize, 96, 7] {
            let m = model(17, 3, 2, n);
            let p = instance(&m, 1, 1, pb, 18);
            let mut c = instance(&m, 2, 1, cb, 19);
            let payload = encoded(&p, n);
            assert!(
                c.verdict(&payload, 0, n).is_verified(),
                "{pb}/{cb}, {n} tokens"
            );
            corrupt(&mut c, 1, n - 1);
            let v = c.verdict(&payload, 0, n);
            if n % pb.max(cb) == 0 || pb == cb {
                // a mismatch localized to the consumer's block(s) of the larger block
                let want: Vec<usize> = if cb >= pb {
                    vec![(n - 1) / cb]
                } else {
                    let r = pb / cb;
                    let q = (n - 1) / pb;
                    (q * r..((q + 1) * r).min(n.div_ceil(cb))).collect()
                };
                assert_eq!(mismatch(&v)[0].block_positions, want, "{pb}/{cb}, {n}");
            } else {
                // the last chunk is partial on both sides and still compared
                assert_eq!(v.label(), "mismatch", "{pb}/{cb}, {n}");
            }
        }
    }
}

/// The verified prefix a mismatch reports (where a partial recompute resumes): every consumer
/// block before it compared equal, it never passes the first bad block, and with different block
/// sizes it ends at the start of the larger block holding the corruption.
#[test]
fn a_mismatch_reports_the_verified_prefix_of_the_load() {
    let prefix_end = |v: &Verdict| mismatch(v)[0].verified_prefix_end;
    // same block size, 100 tokens = 7 blocks: a corruption in block k leaves k good blocks
    let m = model(31, 3, 2, 100);
    let p = instance(&m, 1, 1, 16, 32);
    let payload = encoded(&p, 100);
    for (token, want) in [(0usize, 0usize), (5, 0), (16, 1), (50, 3), (99, 6)] {
        let mut c = instance(&m, 2, 1, 16, 33);
        corrupt(&mut c, 1, token);
        assert_eq!(
            prefix_end(&c.verdict(&payload, 0, 100)),
            want,
            "token {token}"
        );
    }
    // two corruptions: the earlier one ends the prefix, whichever worker holds it
    let mut c = instance(&m, 2, 1, 16, 34);
    corrupt(&mut c, 0, 70);
    corrupt(&mut c, 1, 40);
    let v = c.verdict(&payload, 0, 100);
    assert_eq!(mismatch(&v)[0].block_positions, vec![2, 4]);
    assert_eq!(prefix_end(&v), 2);
    // a local prefix hit of 32 tokens: the prefix starts at the first loaded block
    let mut c = consumer_loading_from(&m, 1, 16, 32, 35);
    corrupt(&mut c, 0, 33);
    assert_eq!(prefix_end(&c.verdict(&payload, 32, 100)), 2);
    let mut c = consumer_loading_from(&m, 1, 16, 32, 36);
    corrupt(&mut c, 0, 70);
    assert_eq!(prefix_end(&c.verdict(&payload, 32, 100)), 4);
    // a corrupted replica (2 KV heads on TP 4) ends the prefix too
    let mut c = instance(&m, 4, 1, 16, 37);
    corrupt(&mut c, 3, 60);
    assert_eq!(prefix_end(&c.verdict(&payload, 0, 100)), 3);
    // producer blocks of 32, consumer blocks of 16: token 50 lies in chunk [32, 64), blocks 2, 3
    let p32 = instance(&m, 1, 1, 32, 38);
    let mut c = instance(&m, 1, 1, 16, 39);
    corrupt(&mut c, 0, 50);
    let v = c.verdict(&encoded(&p32, 100), 0, 100);
    assert_eq!(mismatch(&v)[0].block_positions, vec![2, 3]);
    assert_eq!(prefix_end(&v), 2);
    // producer blocks of 16, consumer blocks of 32: token 70 lies in consumer block 2
    let mut c = instance(&m, 1, 1, 32, 40);
    corrupt(&mut c, 0, 70);
    let v = c.verdict(&payload, 0, 100);
    assert_eq!(mismatch(&v)[0].block_positions, vec![2]);
    assert_eq!(prefix_end(&v), 2);
}

#[test]
fn block_sizes_that_are_not_multiples_are_unverified() {
    let m = model(19, 2, 2, 48);
    let p = instance(&m, 1, 1, 16, 20);
    let c = instance(&m, 1, 1, 24, 21);
    assert_eq!(
        unverified(&c.verdict(&encoded(&p, 48), 0, 48)),
        UnverifiedReason::BlockSizeNotMultiple
    );
}

/// A consumer whose tokens before `from` are its own (a local prefix hit), junk here.
fn consumer_loading_from(m: &Model, tp: u32, bs: usize, from: usize, seed: u64) -> Cluster {
    let mut cfg = ClusterConfig::new(tp, 1, bs, m.tokens);
    cfg.from = from;
    Cluster::new(&mut Rng(seed), m, cfg)
}

#[test]
fn a_local_prefix_hit_compares_only_the_loaded_blocks() {
    let m = model(21, 3, 2, 90);
    let p = instance(&m, 1, 1, 16, 22);
    let payload = encoded(&p, 90);
    let mut c = consumer_loading_from(&m, 1, 16, 32, 23);
    let v = c.verdict(&payload, 32, 90);
    assert!(v.is_verified(), "{v:?}");
    // checksumming the load from block 0 would compare the local blocks and fail
    let from_zero = c.verdict(&payload, 0, 90);
    assert_eq!(mismatch(&from_zero)[0].block_positions, vec![0, 1]);
    corrupt(&mut c, 0, 50);
    assert_eq!(
        mismatch(&c.verdict(&payload, 32, 90))[0].block_positions,
        vec![3]
    );
}

#[test]
fn a_load_starting_inside_a_producer_block_is_unverified() {
    let m = model(23, 2, 2, 90);
    let p = instance(&m, 1, 1, 32, 24);
    let payload = encoded(&p, 90);
    let c = consumer_loading_from(&m, 1, 16, 16, 25);
    assert_eq!(
        unverified(&c.verdict(&payload, 16, 90)),
        UnverifiedReason::UnalignedFirstBlock
    );
    // aligned to the producer's blocks: verified
    let c = consumer_loading_from(&m, 1, 16, 32, 26);
    assert!(c.verdict(&payload, 32, 90).is_verified());
}

#[test]
fn the_last_block_is_compared_only_with_the_same_tokens() {
    let m = model(25, 2, 2, 40);
    let p = instance(&m, 1, 1, 16, 26);
    let payload = encoded(&p, 40);
    let mut c = instance(&m, 1, 1, 16, 27);
    // the consumer holds 39 tokens: block 2 has 7 tokens, the producer's 8; blocks 0, 1 compared
    assert!(c.verdict(&payload, 0, 39).is_verified());
    corrupt(&mut c, 0, 17);
    assert_eq!(
        mismatch(&c.verdict(&payload, 0, 39))[0].block_positions,
        vec![1]
    );
    // a single block with different token counts: nothing in common
    let p = instance(&m, 1, 1, 16, 28);
    let c = instance(&m, 1, 1, 16, 29);
    assert_eq!(
        unverified(&c.verdict(&encoded(&p, 10), 0, 9)),
        UnverifiedReason::NoCommonPosition
    );
}

#[test]
fn sliding_window_groups_keep_their_last_blocks() {
    // window 20, block 8: cdiv(20, 8) + 1 = 4 blocks; 60 tokens -> positions 4..8
    let m = model(27, 2, 2, 60);
    let mut table: Vec<Option<usize>> = (0..8).map(|i| Some(i + 2)).collect();
    for b in table.iter_mut().take(3) {
        *b = None; // out of the window, freed
    }
    let side = |tp, seed| {
        let mut cfg = ClusterConfig::new(tp, 1, 8, 60);
        cfg.window = Some(20);
        cfg.table = Some(table.clone());
        Cluster::new(&mut Rng(seed), &m, cfg)
    };
    let p = side(1, 28);
    let payload = p.payload(60);
    assert_eq!(payload.groups[0].start, 4);
    assert_eq!(payload.groups[0].values, naive_blocks(&m, 4, 4, 8, 0, 60));
    let mut c = side(2, 29);
    let encoded = payload.encode().unwrap();
    assert!(c.verdict(&encoded, 0, 60).is_verified());
    corrupt(&mut c, 0, 35);
    assert_eq!(
        mismatch(&c.verdict(&encoded, 0, 60))[0].block_positions,
        vec![4]
    );
    // a corruption before the window is not checksummed
    let mut c = side(2, 29);
    corrupt(&mut c, 0, 27);
    assert!(c.verdict(&encoded, 0, 60).is_verified());
}

/// One request over two groups of two clusters with the same TP x PP grid.
fn two_groups(a: &Cluster, b: &Cluster, role: Role, first: usize, n: usize) -> MergedChecksums {
    let (ra, rb) = (a.request(first, n), b.request(first, n));
    let mut req = ra.clone();
    req.groups.extend(rb.groups.iter().cloned());
    req.skipped.extend(rb.skipped.iter().cloned());
    let mut merger = RecordMerger::new(a.tp, a.pp, req.clone());
    for (mut x, y) in a.records(role, &ra).into_iter().zip(b.records(role, &rb)) {
        assert_eq!(x.worker, y.worker);
        x.groups.extend(y.groups);
        merger.add(x).unwrap();
    }
    merger.finish().unwrap()
}

fn group_cluster(
    m: &Model,
    bs: usize,
    group_id: usize,
    table: Option<Vec<Option<usize>>>,
    seed: u64,
) -> Cluster {
    let mut cfg = ClusterConfig::new(1, 1, bs, m.tokens);
    cfg.group_id = group_id;
    cfg.table = table;
    Cluster::new(&mut Rng(seed), m, cfg)
}

#[test]
fn skipped_groups_both_sides_are_ignored_one_side_unverified() {
    let m = model(31, 2, 2, 40);
    let broken_table = Some(vec![Some(0), None, Some(2)]);
    let good = |seed| group_cluster(&m, 16, 0, None, seed);
    let broken = |seed| group_cluster(&m, 16, 1, broken_table.clone(), seed);
    let fine = |seed| group_cluster(&m, 16, 1, None, seed);

    let p = Payload::from_merged(&two_groups(&good(1), &broken(2), Role::Producer, 0, 40)).unwrap();
    assert_eq!(
        p.groups.len(),
        1,
        "a skipped group is left out of the payload"
    );
    let enc = p.encode().unwrap();
    // skipped on both sides: the other group decides
    let c = two_groups(&good(3), &broken(4), Role::Consumer, 0, 40);
    assert_eq!(
        c.group(1),
        Some(&MergedState::Skipped(SkipReason::NullBlockAfterNonNull))
    );
    assert_eq!(
        verify(Some(&enc), Ok(&c)),
        Verdict::Verified { groups: vec![0] }
    );
    // skipped by the producer only
    let c = two_groups(&good(3), &fine(4), Role::Consumer, 0, 40);
    let v = verify(Some(&enc), Ok(&c));
    assert_eq!(unverified(&v), UnverifiedReason::SkippedOnOneSide);
    // skipped by the consumer only
    let p = Payload::from_merged(&two_groups(&good(1), &fine(2), Role::Producer, 0, 40)).unwrap();
    let c = two_groups(&good(3), &broken(4), Role::Consumer, 0, 40);
    let v = verify(Some(&p.encode().unwrap()), Ok(&c));
    assert_eq!(
        v,
        Verdict::Unverified {
            reason: UnverifiedReason::SkippedOnOneSide,
            groups: vec![(1, UnverifiedReason::SkippedOnOneSide)]
        }
    );
    // a mismatch wins over another group's unverified
    let mut bad = good(3);
    corrupt(&mut bad, 0, 3);
    let c = two_groups(&bad, &broken(4), Role::Consumer, 0, 40);
    match verify(Some(&p.encode().unwrap()), Ok(&c)) {
        Verdict::Mismatch { groups, unverified } => {
            assert_eq!(groups[0].group_id, 0);
            assert_eq!(unverified, vec![(1, UnverifiedReason::SkippedOnOneSide)]);
        }
        other => panic!("{other:?}"),
    }
    // only skipped groups: nothing to verify
    let p =
        Payload::from_merged(&broken(1).merged(Role::Producer, &broken(1).request(0, 40))).unwrap();
    let b = broken(2);
    let v = verify(
        Some(&p.encode().unwrap()),
        Ok(&b.merged(Role::Consumer, &b.request(0, 40))),
    );
    assert_eq!(unverified(&v), UnverifiedReason::NoCommonPosition);
}

#[test]
fn a_worker_that_checksummed_other_blocks_makes_the_group_unverified() {
    let m = model(33, 2, 2, 40);
    let c = instance(&m, 2, 1, 16, 34);
    let req = c.request(0, 40);
    let mut other = req.clone();
    other.groups[0].block_ids.swap(0, 1);
    let mut merger = RecordMerger::new(2, 1, req.clone());
    let mut records = c.records(Role::Consumer, &req);
    records[1] = c.records(Role::Consumer, &other).remove(1);
    for r in records {
        merger.add(r).unwrap();
    }
    let merged = merger.finish().unwrap();
    assert_eq!(
        merged.group(GROUP),
        Some(&MergedState::Unverified(
            UnverifiedReason::OtherBlocksThanScheduled
        ))
    );
    let p = instance(&m, 1, 1, 16, 35);
    assert_eq!(
        unverified(&verify(Some(&encoded(&p, 40)), Ok(&merged))),
        UnverifiedReason::OtherBlocksThanScheduled
    );
    // a producer in that state sends nothing
    assert_eq!(
        Payload::from_merged(&merged),
        Err(UnverifiedReason::OtherBlocksThanScheduled)
    );
    // a record without the group at all
    let mut merger = RecordMerger::new(2, 1, req.clone());
    let mut records = c.records(Role::Consumer, &req);
    records[0].groups.clear();
    for r in records {
        merger.add(r).unwrap();
    }
    assert_eq!(
        merger.finish().unwrap().group(GROUP),
        Some(&MergedState::Unverified(
            UnverifiedReason::OtherBlocksThanScheduled
        ))
    );
}

#[test]
fn tp_ranks_of_one_stage_must_agree_and_a_failed_worker_is_unverified() {
    let m = model(37, 2, 2, 40);
    let mut c = instance(&m, 2, 1, 16, 38);
    let req = c.request(0, 40);
    // rank 1 with other layer names
    let mut renamed = m.clone();
    renamed.layers[0].name = "model.layers.0.other".into();
    let other = instance(&renamed, 2, 1, 16, 38);
    c.workers[1].1 = other.workers[1].1.clone();
    let merged = c.merged(Role::Consumer, &req);
    assert_eq!(
        merged.group(GROUP),
        Some(&MergedState::Unverified(UnverifiedReason::WorkersDisagree))
    );

    // a backend that cannot find the memory: the group fails, never silently skipped
    let c = instance(&m, 1, 1, 16, 39);
    let empty: Vec<tandem_kv_cache::LayerKv<'_>> = Vec::new();
    let record = c.workers[0]
        .1
        .checksum(&CpuBackend::new(&empty), Role::Consumer, &req);
    assert!(matches!(record.groups[0].outcome, GroupOutcome::Failed(_)));
    let mut merger = RecordMerger::new(1, 1, req.clone());
    merger.add(record).unwrap();
    let merged = merger.finish().unwrap();
    let p = instance(&m, 1, 1, 16, 40);
    assert_eq!(
        unverified(&verify(Some(&encoded(&p, 40)), Ok(&merged))),
        UnverifiedReason::WorkerFailed
    );
}

fn one_group(
    name_heads: &[(&str, usize)],
    spec_heads: usize,
    head_dim: usize,
    dtype: CacheDtype,
    kbs: usize,
) -> WorkerChecksums {
    let spec = KvCacheSpec::FullAttention {
        block_size: 16,
        num_kv_heads: spec_heads,
        head_dim,
        dtype,
    };
    let layers = name_heads
        .iter()
        .enumerate()
        .map(|(i, (name, heads))| CacheLayer {
            source_index: i,
            name: name.to_string(),
            layout: BlockLayout {
                num_blocks: 4,
                block_size: 16,
                kernel_block_size: kbs,
                num_kv_heads: *heads,
                head_dim,
                dtype,
                order: LayoutOrder::TokenMajor,
            },
        })
        .collect();
    WorkerChecksums::new(
        WorkerId {
            tp_rank: 0,
            pp_rank: 0,
        },
        vec![WorkerGroup {
            group_id: 0,
            spec,
            layers,
            heads: HeadPlacement::single(spec_heads as u32),
        }],
    )
}

#[test]
fn groups_a_worker_cannot_checksum_are_skipped_with_a_reason() {
    let reason = |w: &WorkerChecksums| w.skipped_groups().next().map(|(_, r)| r.as_str());
    let ok = one_group(&[("layers.0", 2)], 2, 8, CacheDtype::F16, 16);
    assert_eq!(reason(&ok), None);
    assert_eq!(
        reason(&one_group(&[("layers.0", 2)], 2, 3, CacheDtype::F16, 16)),
        Some("not_whole_pieces")
    );
    assert_eq!(
        reason(&one_group(&[("layers.0", 2)], 2, 8, CacheDtype::F16, 6)),
        Some("kernel_blocks_do_not_tile")
    );
    assert_eq!(
        reason(&one_group(&[("lm_head", 2)], 2, 8, CacheDtype::F16, 16)),
        Some("layer_without_number")
    );
    assert_eq!(
        reason(&one_group(&[("layers.0", 3)], 2, 8, CacheDtype::F16, 16)),
        Some("layout_differs_from_spec")
    );
    assert_eq!(
        reason(&one_group(
            &[("model.layers.0.attn", 2), ("mtp.layers.0.attn", 2)],
            2,
            8,
            CacheDtype::F16,
            16
        )),
        Some("duplicate_layer_number")
    );
    assert_eq!(
        reason(&one_group(&[("layers.0", 2)], 2, 8, CacheDtype::F16, 16).clone()),
        None
    );
    let mut too_many = one_group(&[("layers.0", 2)], 2, 8, CacheDtype::F16, 16);
    too_many = WorkerChecksums::new(too_many.worker(), {
        let spec = KvCacheSpec::FullAttention {
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: CacheDtype::F16,
        };
        vec![WorkerGroup {
            group_id: 0,
            spec,
            layers: vec![CacheLayer {
                source_index: 0,
                name: "layers.0".into(),
                layout: BlockLayout::token_major(4, 16, 2, 8, CacheDtype::F16),
            }],
            heads: HeadPlacement {
                head_offset: 65535,
                global_kv_heads: 65537,
                replica: ReplicaKey::SINGLE,
            },
        }]
    });
    assert_eq!(reason(&too_many), Some("heads_out_of_range"));
    // the record says so, for every request
    let req = ChecksumRequest {
        num_tokens: 4,
        groups: vec![ScheduledGroup {
            group_id: 0,
            block_size: 16,
            start: 0,
            first_token: 0,
            block_ids: vec![1],
        }],
        skipped: vec![],
    };
    let empty: Vec<tandem_kv_cache::LayerKv<'_>> = Vec::new();
    let r = too_many.checksum(&CpuBackend::new(&empty), Role::Producer, &req);
    assert!(matches!(
        r.groups[0].outcome,
        GroupOutcome::Skipped(SkipReason::HeadsOutOfRange { .. })
    ));
}

#[test]
fn caches_of_one_layer_module_take_consecutive_heads() {
    // The model's layer 3 has 4 heads: heads 0..2 are the attention's cache, 2..4 the indexer's.
    let m = {
        let mut m = model(41, 1, 4, 20);
        m.layers[0].name = "model.layers.3.self_attn".into();
        m.layers[0].number = 3;
        m
    };
    let mut rng = Rng(42);
    let table = random_table(&mut rng, 2, 4);
    let attn = paged(
        &mut rng,
        &m,
        &[0],
        0,
        2,
        Physical::plain(16),
        4,
        &table,
        0,
        20,
    );
    let indexer = paged(
        &mut rng,
        &m,
        &[0],
        2,
        2,
        Physical::plain(16),
        4,
        &table,
        0,
        20,
    );
    let views = vec![attn.views()[0], indexer.views()[0]];
    let spec = spec_of(&m.layers[0], 16, 2, None);
    // listed indexer first: name order decides, not list order
    let layers = vec![
        CacheLayer {
            source_index: 1,
            name: "model.layers.3.self_attn.indexer".into(),
            layout: views[1].layout,
        },
        CacheLayer {
            source_index: 0,
            name: "model.layers.3.self_attn.attn".into(),
            layout: views[0].layout,
        },
    ];
    let w = WorkerChecksums::new(
        WorkerId {
            tp_rank: 0,
            pp_rank: 0,
        },
        vec![WorkerGroup {
            group_id: 0,
            spec,
            layers,
            heads: HeadPlacement::single(2),
        }],
    );
    let req = ChecksumRequest::for_send(
        20,
        &[GroupBlocks {
            group_id: 0,
            spec: &spec,
            first_position: 0,
            blocks: &table,
        }],
    );
    let r = w.checksum(&CpuBackend::new(&views), Role::Producer, &req);
    let GroupOutcome::Computed(v) = &r.groups[0].outcome else {
        panic!("{r:?}")
    };
    assert_eq!(v.parts[0].values, naive_blocks(&m, 0, 2, 16, 0, 20));
}

#[test]
fn verdict_labels_are_fixed() {
    let labels: Vec<&str> = UnverifiedReason::ALL.iter().map(|r| r.as_str()).collect();
    let mut unique = labels.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), labels.len());
    assert!(labels
        .iter()
        .all(|l| l.chars().all(|c| c.is_ascii_lowercase() || c == '_')));
}
