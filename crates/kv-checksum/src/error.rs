//! The one error type of the KV checksum crate.
//!
//! Errors are for callers' mistakes (a bad job, an unknown worker, an unreadable file). What a
//! checksum comparison concludes is never an error: it is a [`crate::Verdict`], and a group a
//! worker cannot checksum is a [`crate::SkipReason`] in its record.

use std::path::PathBuf;

use crate::record::WorkerId;

/// Errors of the KV checksum crate.
#[derive(Debug, thiserror::Error)]
pub enum KvChecksumError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A safetensors file that does not hold what the checksum CLI expects.
    #[error("invalid checksum input: {0}")]
    InvalidInput(String),
    /// A checksum job that does not fit the KV memory it names (out-of-range block or slot,
    /// layout that differs from the memory's, output of the wrong size).
    #[error("invalid checksum job: {0}")]
    InvalidJob(String),
    /// A backend that runs the job elsewhere (a GPU) failed to run it.
    #[error("checksum backend failed: {0}")]
    Backend(String),
    /// The KV source has no layer with this index.
    #[error("the KV source has no layer {0}")]
    MissingLayer(usize),
    /// A head placement that cannot describe a TP rank.
    #[error("invalid head placement: {0}")]
    InvalidPlacement(String),
    /// A record from a worker outside the TP x PP grid of the request.
    #[error("worker {worker:?} is outside TP {tp_size} x PP {pp_size}")]
    UnknownWorker {
        worker: WorkerId,
        tp_size: u32,
        pp_size: u32,
    },
    /// A second record from one worker for one request.
    #[error("worker {0:?} already reported this request")]
    DuplicateRecord(WorkerId),
    /// A payload that cannot be encoded (sizes beyond the wire format's integers).
    #[error("cannot encode checksum payload: {0}")]
    Encode(String),
}
