//! The collective operations of a sharded forward pass, and their CPU implementation.
//!
//! [`Collectives`] is what a rank's forward calls: a sum over its stage's TP group after each
//! row-parallel projection, a gather of the vocab-parallel logits, and the handoff of the
//! hidden states to the same TP rank of the next stage. [`SingleRank`] is the TP 1, PP 1 case
//! (nothing to exchange). [`CpuWorld`] connects workers that are threads of one process through
//! shared memory: one lock and condition variable for the whole world, a slot per rank for
//! reductions, an inbox per rank for stage handoffs.
//!
//! Invariants of [`CpuWorld`]:
//! - every rank of a group computes the reduction in the same order (rank 0, 1, …), so all ranks
//!   hold bit-identical results, and a run is deterministic;
//! - a reduction has two barriers: after every rank wrote its slot, and after every rank read
//!   them all, so a slot is never overwritten while another rank still reads it;
//! - [`Collectives::abort`] wakes every waiting rank with [`ParallelError::Aborted`], and every
//!   later collective fails the same way until [`CpuWorld::reset`], which the owner calls only
//!   when no rank is inside a collective (between steps).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::Instant;

use crate::error::ParallelError;
use crate::layout::{ParallelConfig, RankId};

/// The collectives one rank of a sharded forward pass calls. See the module docs.
pub trait Collectives: Send + Sync {
    fn rank(&self) -> RankId;
    fn config(&self) -> ParallelConfig;
    /// Element-wise sum of `buf` over the TP group of this rank's stage, in place on every rank.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), ParallelError>;
    /// Every TP rank's `local` of this stage, in rank order (lengths may differ per rank).
    fn all_gather(&self, local: &[f32]) -> Result<Vec<Vec<f32>>, ParallelError>;
    /// Hands `x` to the same TP rank of the next stage.
    fn send_to_next_stage(&self, x: Vec<f32>) -> Result<(), ParallelError>;
    /// What the same TP rank of the previous stage handed over, in order.
    fn recv_from_prev_stage(&self) -> Result<Vec<f32>, ParallelError>;
    /// Fails this step's collectives on every rank (called by a rank that failed).
    fn abort(&self, reason: &str);
}

/// The only rank of an instance (TP 1, PP 1): reductions and gathers are identities.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleRank;

impl Collectives for SingleRank {
    fn rank(&self) -> RankId {
        RankId {
            tp_rank: 0,
            pp_rank: 0,
        }
    }
    fn config(&self) -> ParallelConfig {
        ParallelConfig::default()
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<(), ParallelError> {
        Ok(())
    }
    fn all_gather(&self, local: &[f32]) -> Result<Vec<Vec<f32>>, ParallelError> {
        Ok(vec![local.to_vec()])
    }
    fn send_to_next_stage(&self, _x: Vec<f32>) -> Result<(), ParallelError> {
        Err(ParallelError::Mismatch(
            "a single rank has no next stage".into(),
        ))
    }
    fn recv_from_prev_stage(&self) -> Result<Vec<f32>, ParallelError> {
        Err(ParallelError::Mismatch(
            "a single rank has no previous stage".into(),
        ))
    }
    fn abort(&self, _reason: &str) {}
}

/// Barrier state of one stage's TP group.
#[derive(Debug, Default)]
struct Barrier {
    arrived: usize,
    generation: u64,
}

#[derive(Debug, Default)]
struct WorldState {
    aborted: Option<String>,
    barriers: Vec<Barrier>,
    inboxes: Vec<VecDeque<Vec<f32>>>,
}

#[derive(Debug)]
struct WorldShared {
    config: ParallelConfig,
    state: Mutex<WorldState>,
    wake: Condvar,
    /// One per rank (worker index): what it contributes to the current reduction or gather.
    slots: Vec<RwLock<Vec<f32>>>,
    /// One per rank: nanoseconds spent inside collectives, waiting included.
    nanos: Vec<AtomicU64>,
}

impl WorldShared {
    fn lock(&self) -> MutexGuard<'_, WorldState> {
        // A rank that panicked holding the lock left the state consistent (every update is a
        // single assignment): recover it rather than poison the world.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Workers that are threads of one process, connected through shared memory.
#[derive(Debug, Clone)]
pub struct CpuWorld {
    shared: Arc<WorldShared>,
}

impl CpuWorld {
    pub fn new(config: ParallelConfig) -> Self {
        let n = config.world_size();
        CpuWorld {
            shared: Arc::new(WorldShared {
                config,
                state: Mutex::new(WorldState {
                    aborted: None,
                    barriers: (0..config.pp).map(|_| Barrier::default()).collect(),
                    inboxes: (0..n).map(|_| VecDeque::new()).collect(),
                }),
                wake: Condvar::new(),
                slots: (0..n).map(|_| RwLock::new(Vec::new())).collect(),
                nanos: (0..n).map(|_| AtomicU64::new(0)).collect(),
            }),
        }
    }

    /// One handle per rank, in worker-index order.
    pub fn ranks(&self) -> Vec<Arc<dyn Collectives>> {
        self.shared
            .config
            .ranks()
            .map(|rank| {
                Arc::new(CpuRank {
                    shared: self.shared.clone(),
                    rank,
                    index: self.shared.config.index(rank),
                }) as Arc<dyn Collectives>
            })
            .collect()
    }

    /// Clears an abort, half-finished barriers and undelivered handoffs. Only between steps:
    /// no rank may be inside a collective.
    pub fn reset(&self) {
        let mut st = self.shared.lock();
        st.aborted = None;
        for b in &mut st.barriers {
            b.arrived = 0;
        }
        for inbox in &mut st.inboxes {
            inbox.clear();
        }
    }

    /// Fails the current step's collectives on every rank (a rank failed outside its forward).
    pub fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        if st.aborted.is_none() {
            st.aborted = Some(reason.to_owned());
        }
        self.shared.wake.notify_all();
    }

    /// Seconds each rank (worker index) spent inside collectives since the world was created,
    /// waiting for the other ranks included: on a CPU, where ranks share cores, the cost of
    /// splitting a step.
    pub fn seconds_in_collectives(&self) -> Vec<f64> {
        self.shared
            .nanos
            .iter()
            .map(|n| n.load(Ordering::Relaxed) as f64 * 1e-9)
            .collect()
    }

    /// Whether a rank aborted since the last reset, and why.
    pub fn aborted(&self) -> Option<String> {
        self.shared.lock().aborted.clone()
    }
}

/// One rank's handle on a [`CpuWorld`].
#[derive(Debug)]
struct CpuRank {
    shared: Arc<WorldShared>,
    rank: RankId,
    index: usize,
}

impl CpuRank {
    fn timed<T>(&self, f: impl FnOnce() -> Result<T, ParallelError>) -> Result<T, ParallelError> {
        let start = Instant::now();
        let out = f();
        self.shared.nanos[self.index]
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Waits until every TP rank of this stage arrived here.
    fn barrier(&self) -> Result<(), ParallelError> {
        let tp = self.shared.config.tp;
        if tp == 1 {
            return Ok(());
        }
        let stage = self.rank.pp_rank;
        let mut st = self.shared.lock();
        if let Some(why) = &st.aborted {
            return Err(ParallelError::Aborted(why.clone()));
        }
        let generation = st.barriers[stage].generation;
        st.barriers[stage].arrived += 1;
        if st.barriers[stage].arrived == tp {
            st.barriers[stage].arrived = 0;
            st.barriers[stage].generation += 1;
            self.shared.wake.notify_all();
            return Ok(());
        }
        loop {
            st = self.shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            if st.barriers[stage].generation != generation {
                return Ok(());
            }
            if let Some(why) = &st.aborted {
                return Err(ParallelError::Aborted(why.clone()));
            }
        }
    }

    /// Worker indices of this stage's TP group, in rank order.
    fn group(&self) -> std::ops::Range<usize> {
        let tp = self.shared.config.tp;
        let first = self.rank.pp_rank * tp;
        first..first + tp
    }

    fn publish(&self, local: &[f32]) {
        let mut slot = self.shared.slots[self.index]
            .write()
            .unwrap_or_else(|e| e.into_inner());
        slot.clear();
        slot.extend_from_slice(local);
    }

    fn fail(&self, err: ParallelError) -> ParallelError {
        self.abort(&err.to_string());
        err
    }
}

impl Collectives for CpuRank {
    fn rank(&self) -> RankId {
        self.rank
    }
    fn config(&self) -> ParallelConfig {
        self.shared.config
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), ParallelError> {
        if self.shared.config.tp == 1 {
            return Ok(());
        }
        self.timed(|| {
            self.publish(buf);
            self.barrier()?;
            let mut mismatch = None;
            for (n, i) in self.group().enumerate() {
                let slot = self.shared.slots[i]
                    .read()
                    .unwrap_or_else(|e| e.into_inner());
                if slot.len() != buf.len() {
                    mismatch = Some(format!(
                        "all-reduce of {} values on rank {:?}, {} on TP rank {n}",
                        buf.len(),
                        self.rank,
                        slot.len()
                    ));
                    break;
                }
                if n == 0 {
                    buf.copy_from_slice(&slot);
                } else {
                    for (b, s) in buf.iter_mut().zip(slot.iter()) {
                        *b += s;
                    }
                }
            }
            if let Some(m) = mismatch {
                return Err(self.fail(ParallelError::Mismatch(m)));
            }
            self.barrier()
        })
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<Vec<f32>>, ParallelError> {
        if self.shared.config.tp == 1 {
            return Ok(vec![local.to_vec()]);
        }
        self.timed(|| {
            self.publish(local);
            self.barrier()?;
            let parts = self
                .group()
                .map(|i| {
                    self.shared.slots[i]
                        .read()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone()
                })
                .collect();
            self.barrier()?;
            Ok(parts)
        })
    }

    fn send_to_next_stage(&self, x: Vec<f32>) -> Result<(), ParallelError> {
        let cfg = self.shared.config;
        if self.rank.pp_rank + 1 >= cfg.pp {
            return Err(self.fail(ParallelError::Mismatch(format!(
                "rank {:?} is in the last stage: no next stage",
                self.rank
            ))));
        }
        let to = cfg.index(RankId {
            tp_rank: self.rank.tp_rank,
            pp_rank: self.rank.pp_rank + 1,
        });
        let mut st = self.shared.lock();
        if let Some(why) = &st.aborted {
            return Err(ParallelError::Aborted(why.clone()));
        }
        st.inboxes[to].push_back(x);
        self.shared.wake.notify_all();
        Ok(())
    }

    fn recv_from_prev_stage(&self) -> Result<Vec<f32>, ParallelError> {
        if self.rank.pp_rank == 0 {
            return Err(self.fail(ParallelError::Mismatch(format!(
                "rank {:?} is in the first stage: no previous stage",
                self.rank
            ))));
        }
        self.timed(|| {
            let mut st = self.shared.lock();
            loop {
                if let Some(why) = &st.aborted {
                    return Err(ParallelError::Aborted(why.clone()));
                }
                if let Some(x) = st.inboxes[self.index].pop_front() {
                    return Ok(x);
                }
                st = self.shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        })
    }

    fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        if st.aborted.is_none() {
            st.aborted = Some(format!(
                "TP rank {} of stage {}: {reason}",
                self.rank.tp_rank, self.rank.pp_rank
            ));
        }
        self.shared.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send>(world: &CpuWorld, f: impl Fn(&dyn Collectives) -> T + Sync) -> Vec<T> {
        let ranks = world.ranks();
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|r| {
                    let f = &f;
                    s.spawn(move || f(r.as_ref()))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_within_each_stage_only() {
        let world = CpuWorld::new(ParallelConfig::new(3, 2).unwrap());
        let out = run(&world, |c| {
            let r = c.rank();
            let mut v: Vec<f32> = (0..5)
                .map(|i| (i + 10 * r.tp_rank + 100 * r.pp_rank) as f32)
                .collect();
            for _ in 0..50 {
                // repeated reductions reuse the slots: the second barrier keeps them apart
                let mut w = v.clone();
                c.all_reduce_sum(&mut w).unwrap();
                v = v.iter().map(|x| x + 0.0 * w[0]).collect();
            }
            c.all_reduce_sum(&mut v).unwrap();
            v
        });
        for (i, v) in out.iter().enumerate() {
            let stage = i / 3;
            let want: Vec<f32> = (0..5).map(|j| (3 * j + 30 + 300 * stage) as f32).collect();
            assert_eq!(v, &want, "rank {i}");
        }
    }

    #[test]
    fn gather_and_handoff_keep_rank_order() {
        let world = CpuWorld::new(ParallelConfig::new(2, 2).unwrap());
        let out = run(&world, |c| {
            let r = c.rank();
            let parts = c
                .all_gather(&vec![r.tp_rank as f32; r.tp_rank + 1])
                .unwrap();
            assert_eq!(parts, vec![vec![0.0], vec![1.0, 1.0]]);
            if r.pp_rank == 0 {
                c.send_to_next_stage(vec![r.tp_rank as f32, 7.0]).unwrap();
                c.send_to_next_stage(vec![8.0]).unwrap();
                Vec::new()
            } else {
                let mut got = c.recv_from_prev_stage().unwrap();
                got.extend(c.recv_from_prev_stage().unwrap());
                got
            }
        });
        assert_eq!(out[2], vec![0.0, 7.0, 8.0]);
        assert_eq!(out[3], vec![1.0, 7.0, 8.0]);
    }

    #[test]
    fn an_abort_wakes_every_waiting_rank_until_reset() {
        let world = CpuWorld::new(ParallelConfig::new(3, 2).unwrap());
        let out = run(&world, |c| {
            let r = c.rank();
            if r == (RankId {
                tp_rank: 1,
                pp_rank: 0,
            }) {
                c.abort("out of memory");
                return Err(ParallelError::Aborted("self".into()));
            }
            if r.pp_rank == 1 {
                // would wait for the first stage forever without the abort
                return c.recv_from_prev_stage().map(|_| ());
            }
            let mut v = vec![1.0];
            c.all_reduce_sum(&mut v)
        });
        for (i, r) in out.iter().enumerate() {
            let e = r.as_ref().unwrap_err().to_string();
            if i != 1 {
                assert!(e.contains("TP rank 1 of stage 0: out of memory"), "{e}");
            }
        }
        assert!(world.aborted().is_some());
        world.reset();
        assert!(world.aborted().is_none());
        let sums = run(&world, |c| {
            let mut v = vec![2.0];
            c.all_reduce_sum(&mut v).unwrap();
            v[0]
        });
        assert_eq!(sums, vec![6.0; 6]);
    }

    #[test]
    fn mismatched_lengths_fail_every_rank() {
        let world = CpuWorld::new(ParallelConfig::new(2, 1).unwrap());
        let out = run(&world, |c| {
            let mut v = vec![1.0; 2 + c.rank().tp_rank];
            c.all_reduce_sum(&mut v)
        });
        assert!(out.iter().all(|r| r.is_err()), "{out:?}");
        assert!(world.aborted().unwrap().contains("all-reduce"));
    }
}
