//! `EdgeError`: the settings of the edge that cannot be honoured.
//!
//! Invariant: the edge's only runtime failure mode is I/O (`serve` returns `io::Result`); every
//! other error is a configuration one, raised before anything listens.

/// A setting of the HTTP edge that cannot be honoured.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EdgeError {
    /// `max_connections` is zero or larger than the edge can count.
    #[error("max_connections must be between 1 and {max}, got {value}")]
    MaxConnections { value: usize, max: usize },
    /// A duration is not a positive, finite number of seconds.
    #[error("{name} must be a positive number of seconds, got {value}")]
    Seconds { name: &'static str, value: f64 },
    /// An API key is empty or holds characters a header cannot carry.
    #[error("an API key must be non-empty visible ASCII (no spaces)")]
    InvalidApiKey,
}
