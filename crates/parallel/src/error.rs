//! The one error type of the parallel crate.

/// Errors of a parallel layout or of a collective operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParallelError {
    /// A model shape that the requested layout cannot split (refused at startup).
    #[error("{0}")]
    Layout(String),
    /// Another rank failed during this step; the collective was abandoned.
    #[error("collective aborted: {0}")]
    Aborted(String),
    /// Ranks disagreed about a collective (a bug: lengths or order differ).
    #[error("collective mismatch: {0}")]
    Mismatch(String),
}
