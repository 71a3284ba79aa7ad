//! Tensor and pipeline parallelism: the layout of an instance's workers and the collective
//! operations their sharded forward pass needs.
//!
//! - [`layout`]: [`ParallelConfig`] (TP x PP) and [`RankId`]: which worker is which, which layers
//!   and which slice of a dimension each one holds. Shapes that do not split are refused here.
//! - [`collectives`]: the [`Collectives`] interface (all-reduce and all-gather inside a stage's TP
//!   group, the hidden-state handoff between stages) and its CPU implementation for workers that
//!   are threads of one process ([`CpuWorld`]). A GPU implementation (NCCL through cudarc) stands
//!   behind the same trait.
//!
//! Invariant: every rank of a TP group calls the same collectives in the same order with
//! buffers of the same length; a rank that fails calls [`Collectives::abort`], so that no other
//! rank waits forever.

pub mod collectives;
pub mod error;
pub mod layout;

pub use collectives::{Collectives, CpuWorld, SingleRank};
pub use error::ParallelError;
pub use layout::{KvHeadSlice, ParallelConfig, RankId};
