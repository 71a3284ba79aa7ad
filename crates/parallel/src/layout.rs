//! Which worker holds what: the TP x PP grid of an instance's workers, each worker's layers
//! (pipeline stages) and its slice of the split dimensions (tensor parallelism), as vLLM splits
//! them.
//!
//! Invariants: a [`ParallelConfig`] has `tp >= 1` and `pp >= 1`; workers are numbered
//! stage-major (`index = pp_rank * tp + tp_rank`); the slices of a dimension are contiguous,
//! in rank order, and cover it exactly once, except KV heads when TP exceeds them (each head is
//! then held by `tp / kv_heads` consecutive ranks, its replicas).

use std::ops::Range;

use crate::error::ParallelError;

/// Tensor- and pipeline-parallel sizes of one instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ParallelConfig {
    pub tp: usize,
    pub pp: usize,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig { tp: 1, pp: 1 }
    }
}

/// One worker: a TP rank inside one pipeline stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RankId {
    pub tp_rank: usize,
    pub pp_rank: usize,
}

/// Where one rank's KV heads sit among the model's KV heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvHeadSlice {
    /// Global index of the rank's first KV head.
    pub first: usize,
    /// KV heads the rank holds.
    pub count: usize,
    /// Ranks holding each of these heads (1 unless TP exceeds the KV heads).
    pub replicas: usize,
    /// Which of those copies this rank holds (`0..replicas`).
    pub replica_index: usize,
}

impl ParallelConfig {
    /// A layout of `tp` x `pp` workers; both at least 1.
    pub fn new(tp: usize, pp: usize) -> Result<Self, ParallelError> {
        if tp == 0 || pp == 0 {
            return Err(ParallelError::Layout(format!(
                "tensor- and pipeline-parallel sizes must be at least 1, got TP {tp}, PP {pp}"
            )));
        }
        Ok(ParallelConfig { tp, pp })
    }

    pub fn world_size(&self) -> usize {
        self.tp * self.pp
    }
    pub fn is_single(&self) -> bool {
        self.world_size() == 1
    }
    /// Every rank, in worker-index order.
    pub fn ranks(&self) -> impl Iterator<Item = RankId> + '_ {
        (0..self.pp)
            .flat_map(move |pp_rank| (0..self.tp).map(move |tp_rank| RankId { tp_rank, pp_rank }))
    }
    /// The worker index of `rank` (stage-major).
    pub fn index(&self, rank: RankId) -> usize {
        rank.pp_rank * self.tp + rank.tp_rank
    }
    /// The rank that samples: TP rank 0 of the last stage.
    pub fn driver(&self) -> RankId {
        RankId {
            tp_rank: 0,
            pp_rank: self.pp - 1,
        }
    }

    /// The layers of stage `pp_rank`: `num_layers / pp` each, the first `num_layers % pp`
    /// stages one more.
    pub fn layers(&self, num_layers: usize, pp_rank: usize) -> Range<usize> {
        let base = num_layers / self.pp;
        let extra = num_layers % self.pp;
        let start = pp_rank * base + pp_rank.min(extra);
        start..start + base + usize::from(pp_rank < extra)
    }

    /// Rank `tp_rank`'s slice of a dimension of `total` split evenly (`what` names it in the
    /// error when it does not split).
    pub fn split(
        &self,
        total: usize,
        tp_rank: usize,
        what: &str,
    ) -> Result<Range<usize>, ParallelError> {
        if !total.is_multiple_of(self.tp) {
            return Err(ParallelError::Layout(format!(
                "{what} ({total}) must be divisible by the tensor parallel size ({})",
                self.tp
            )));
        }
        let n = total / self.tp;
        Ok(tp_rank * n..(tp_rank + 1) * n)
    }

    /// Rank `tp_rank`'s rows of a vocabulary of `vocab` (vocab-parallel output layer):
    /// `ceil(vocab / tp)` each, the last rank fewer.
    pub fn vocab_rows(&self, vocab: usize, tp_rank: usize) -> Range<usize> {
        let n = vocab.div_ceil(self.tp);
        (tp_rank * n).min(vocab)..((tp_rank + 1) * n).min(vocab)
    }

    /// Rank `tp_rank`'s KV heads of `kv_heads`: split when TP divides them, replicated on
    /// `tp / kv_heads` consecutive ranks when they divide TP, refused otherwise.
    pub fn kv_heads(&self, kv_heads: usize, tp_rank: usize) -> Result<KvHeadSlice, ParallelError> {
        if kv_heads == 0 {
            return Err(ParallelError::Layout("the model has no KV heads".into()));
        }
        if kv_heads >= self.tp {
            let r = self.split(kv_heads, tp_rank, "the number of KV heads")?;
            Ok(KvHeadSlice {
                first: r.start,
                count: r.len(),
                replicas: 1,
                replica_index: 0,
            })
        } else if self.tp.is_multiple_of(kv_heads) {
            let replicas = self.tp / kv_heads;
            Ok(KvHeadSlice {
                first: tp_rank / replicas,
                count: 1,
                replicas,
                replica_index: tp_rank % replicas,
            })
        } else {
            Err(ParallelError::Layout(format!(
                "the tensor parallel size ({}) must be a multiple of the number of KV heads \
                 ({kv_heads}) when it exceeds them",
                self.tp
            )))
        }
    }

    /// Checks that a transformer of this shape splits: attention heads and MLP width divisible
    /// by TP, KV heads dividing or divided by TP, at least one layer per stage.
    pub fn check_model(
        &self,
        num_layers: usize,
        num_heads: usize,
        num_kv_heads: usize,
        intermediate_size: usize,
    ) -> Result<(), ParallelError> {
        self.split(num_heads, 0, "the number of attention heads")?;
        self.split(intermediate_size, 0, "the MLP width (intermediate_size)")?;
        self.kv_heads(num_kv_heads, 0)?;
        if num_layers < self.pp {
            return Err(ParallelError::Layout(format!(
                "{num_layers} layers cannot fill {} pipeline stages",
                self.pp
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_cover_every_layer_once_in_order() {
        for pp in 1..=5 {
            let c = ParallelConfig::new(1, pp).unwrap();
            let ranges: Vec<_> = (0..pp).map(|s| c.layers(30, s)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[pp - 1].end, 30);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].len().abs_diff(w[1].len()) <= 1);
            }
        }
        assert_eq!(ParallelConfig::new(1, 4).unwrap().layers(30, 0), 0..8);
        assert_eq!(ParallelConfig::new(1, 4).unwrap().layers(30, 3), 23..30);
    }

    #[test]
    fn kv_heads_split_or_replicate() {
        let tp4 = ParallelConfig::new(4, 1).unwrap();
        let slices: Vec<_> = (0..4).map(|r| tp4.kv_heads(2, r).unwrap()).collect();
        assert_eq!(
            slices
                .iter()
                .map(|s| (s.first, s.replica_index))
                .collect::<Vec<_>>(),
            [(0, 0), (0, 1), (1, 0), (1, 1)]
        );
        assert!(slices.iter().all(|s| s.count == 1 && s.replicas == 2));
        let tp3 = ParallelConfig::new(3, 1).unwrap();
        let s = tp3.kv_heads(3, 2).unwrap();
        assert_eq!((s.first, s.count, s.replicas), (2, 1, 1));
        assert!(tp4.kv_heads(3, 0).is_err());
        assert!(ParallelConfig::new(2, 1).unwrap().kv_heads(3, 0).is_err());
    }

    #[test]
    fn shapes_that_do_not_split_are_named() {
        let tp2 = ParallelConfig::new(2, 1).unwrap();
        let e = tp2.check_model(30, 9, 3, 1536).unwrap_err().to_string();
        assert!(
            e.contains("attention heads (9)") && e.contains("(2)"),
            "{e}"
        );
        let e = ParallelConfig::new(4, 1)
            .unwrap()
            .check_model(30, 8, 2, 1538)
            .unwrap_err();
        assert!(e.to_string().contains("intermediate_size"), "{e}");
        let e = ParallelConfig::new(1, 4)
            .unwrap()
            .check_model(3, 8, 2, 64)
            .unwrap_err();
        assert!(e.to_string().contains("pipeline stages"), "{e}");
        ParallelConfig::new(3, 2)
            .unwrap()
            .check_model(30, 9, 3, 1536)
            .unwrap();
        assert!(ParallelConfig::new(0, 1).is_err());
    }

    #[test]
    fn vocab_rows_cover_the_vocabulary() {
        let c = ParallelConfig::new(3, 1).unwrap();
        let rows: Vec<_> = (0..3).map(|r| c.vocab_rows(100, r)).collect();
        assert_eq!(rows, [0..34, 34..68, 68..100]);
        let ranks: Vec<_> = ParallelConfig::new(2, 2).unwrap().ranks().collect();
        assert_eq!(
            ranks[1],
            RankId {
                tp_rank: 1,
                pp_rank: 0
            }
        );
        assert_eq!(ParallelConfig::new(2, 2).unwrap().index(ranks[3]), 3);
    }
}
