//! [`IncrementalChecksum`]: a request checksummed in parts, as a load's chunks land, gives the
//! record of the whole, computes each position once, and fails a group whose part failed.

use std::cell::Cell;

use proptest::prelude::*;
use tandem_kv_cache::CacheDtype;
use tandem_kv_checksum::*;

use crate::common::*;

/// A backend that counts the block positions it was asked for and can refuse the n-th job.
struct Counting<'a> {
    inner: &'a dyn ChecksumBackend,
    blocks: Cell<usize>,
    jobs: Cell<usize>,
    refuse_job: Option<usize>,
}

impl ChecksumBackend for Counting<'_> {
    fn checksum(&self, job: &GroupJob<'_>, out: &mut [u64]) -> Result<(), KvChecksumError> {
        let n = self.jobs.get();
        self.jobs.set(n + 1);
        if self.refuse_job == Some(n) {
            return Err(KvChecksumError::Backend("refused for the test".into()));
        }
        self.blocks.set(self.blocks.get() + job.blocks.len());
        self.inner.checksum(job, out)
    }
}

fn cluster(seed: u64, tp: u32, heads: Heads, tokens: usize, bs: usize) -> Cluster {
    let names = Model::names(3);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let m = Model::random(&mut Rng(seed), &refs, 2, 8, CacheDtype::Bf16, tokens);
    let mut cfg = ClusterConfig::new(tp, 1, bs, tokens);
    cfg.heads = heads;
    Cluster::new(&mut Rng(seed ^ 7), &m, cfg)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn chunks_in_any_order_give_the_whole_record(
        tokens in 1..90usize,
        bs in prop::sample::select(vec![4usize, 16]),
        first in 0..40usize,
        tp in 1..3u32,
        replicated in any::<bool>(),
        consumer in any::<bool>(),
        chunks in 1..6usize,
        seed in any::<u64>(),
    ) {
        let heads = if replicated { Heads::Replicated } else { Heads::Sharded };
        let c = cluster(seed, tp, heads, tokens, bs);
        let first = (first / bs * bs).min((tokens - 1) / bs * bs);
        let request = c.request(first, tokens);
        let role = if consumer { Role::Consumer } else { Role::Producer };
        // The request's blocks in a random order, cut into `chunks` parts, plus ids it does
        // not hold (a landing report names every block of a chunk, other groups' too).
        let mut ids: Vec<usize> = request.groups.iter().flat_map(|g| g.block_ids.clone()).collect();
        let mut rng = Rng(seed);
        rng.shuffle(&mut ids);
        let per = ids.len().div_ceil(chunks).max(1);
        for (_, setup, mem) in &c.workers {
            let views = mem.views();
            let cpu = CpuBackend::new(&views);
            let whole = setup.checksum(&cpu, role, &request);
            let counting = Counting { inner: &cpu, blocks: Cell::new(0), jobs: Cell::new(0), refuse_job: None };
            let mut inc = IncrementalChecksum::new(setup, role, &request);
            let total = inc.remaining();
            let mut computed = 0;
            for part in ids.chunks(per) {
                let landed: Vec<usize> = part.iter().copied().chain([usize::MAX - 1]).collect();
                computed += inc.add_ready(&counting, |_, b| landed.contains(&b));
                // The same blocks again compute nothing.
                prop_assert_eq!(inc.add_ready(&counting, |_, b| landed.contains(&b)), 0);
            }
            prop_assert_eq!(computed, total);
            prop_assert_eq!(inc.remaining(), 0);
            let record = inc.finish(&counting);
            prop_assert_eq!(counting.blocks.get(), total, "each position computed once");
            prop_assert_eq!(record, whole);
        }
    }
}

#[test]
fn a_refused_part_fails_its_group_and_no_value_is_reported() {
    let c = cluster(3, 1, Heads::Sharded, 64, 16);
    let request = c.request(0, 64);
    let (_, setup, mem) = &c.workers[0];
    let views = mem.views();
    let cpu = CpuBackend::new(&views);
    let counting = Counting {
        inner: &cpu,
        blocks: Cell::new(0),
        jobs: Cell::new(0),
        refuse_job: Some(1),
    };
    let ids = request.groups[0].block_ids.clone();
    let mut inc = IncrementalChecksum::new(setup, Role::Consumer, &request);
    assert_eq!(inc.add_ready(&counting, |_, b| b == ids[0]), 1);
    // The second part is refused: the group fails, later parts compute nothing.
    assert_eq!(inc.add_ready(&counting, |_, b| b == ids[1]), 0);
    assert_eq!(inc.remaining(), 0);
    let record = inc.finish(&counting);
    match &record.groups[0].outcome {
        GroupOutcome::Failed(why) => assert!(why.contains("refused for the test"), "{why}"),
        other => panic!("expected a failed group, got {other:?}"),
    }
}

#[test]
fn positions_not_reported_ready_are_computed_at_finish_from_the_memory_then() {
    let mut c = cluster(5, 1, Heads::Sharded, 64, 16);
    let request = c.request(0, 64);
    let ids = request.groups[0].block_ids.clone();
    let before = {
        let (_, setup, mem) = &c.workers[0];
        let views = mem.views();
        let mut inc = IncrementalChecksum::new(setup, Role::Consumer, &request);
        inc.add_ready(&CpuBackend::new(&views), |_, b| b == ids[0]);
        inc
    };
    // Token 40 (position 2) changes after position 0 was computed: finish sees the change,
    // position 0 keeps its value.
    let table = c.table.clone();
    c.workers[0].2.k_row_mut(0, &table, 40, 0)[0] ^= 1;
    let (_, setup, mem) = &c.workers[0];
    let views = mem.views();
    let got = before.finish(&CpuBackend::new(&views));
    let now = setup.checksum(&CpuBackend::new(&views), Role::Consumer, &request);
    assert_eq!(got, now);
}
