//! The consumer's comparison: the producer's payload against the consumer's merged checksums of
//! a load, per group, into one [`Verdict`].
//!
//! Per group:
//! - skipped on both sides (or absent from the payload and skipped here): left out;
//! - checksummed on one side only: unverified ([`UnverifiedReason::SkippedOnOneSide`]);
//! - fingerprints differ: unverified;
//! - block sizes: `L` is the larger, which must be a multiple of the smaller; each side's blocks
//!   are summed into chunks of `L` tokens. The consumer's first loaded token must start a chunk
//!   (else [`UnverifiedReason::UnalignedFirstBlock`]): that chunk would hold tokens it did not
//!   load. A chunk is compared only where both sides cover it whole (from its first token to
//!   the side's last token, blocks past the last token counting as zero) and hold the same number
//!   of tokens in it; none compared is unverified ([`UnverifiedReason::NoCommonPosition`]);
//! - every replica check of the consumer is compared with the producer's value, so a corrupted
//!   copy is a mismatch even if another copy is intact.
//!
//! The load's verdict: a mismatch if any group mismatched (even if others are unverified), else
//! unverified if any group is, else verified if some group was compared. Invariant: no input
//! panics; a verdict of `Verified` means at least one chunk was compared and every compared
//! chunk of every check was equal.

use serde::{Deserialize, Serialize};

use crate::merge::{GroupChecks, MergedChecksums, MergedState};
use crate::wire::{Payload, PayloadGroup};

/// Why a load (or one group of it) could not be verified. A fixed set: its labels are metric
/// label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum UnverifiedReason {
    /// The producer sent no checksums (or they never arrived).
    Missing,
    /// The checksums do not decode.
    Malformed,
    /// The checksums are of another payload version.
    Version,
    /// Not every worker of the TP x PP grid reported the request.
    NotAllWorkersReported,
    /// The group's layers (names, spec type, dtype) differ between the sides.
    FingerprintDiffers,
    /// Neither block size is a multiple of the other.
    BlockSizeNotMultiple,
    /// The consumer's first loaded block starts inside a (larger) producer block.
    UnalignedFirstBlock,
    /// No block position is checksummed whole by both sides.
    NoCommonPosition,
    /// The group is checksummed by one side only.
    SkippedOnOneSide,
    /// A worker checksummed other blocks than the scheduler asked for.
    OtherBlocksThanScheduled,
    /// TP ranks of one PP stage report different fingerprints.
    WorkersDisagree,
    /// A worker's checksum backend refused the job.
    WorkerFailed,
}

impl UnverifiedReason {
    pub const ALL: [UnverifiedReason; 12] = [
        UnverifiedReason::Missing,
        UnverifiedReason::Malformed,
        UnverifiedReason::Version,
        UnverifiedReason::NotAllWorkersReported,
        UnverifiedReason::FingerprintDiffers,
        UnverifiedReason::BlockSizeNotMultiple,
        UnverifiedReason::UnalignedFirstBlock,
        UnverifiedReason::NoCommonPosition,
        UnverifiedReason::SkippedOnOneSide,
        UnverifiedReason::OtherBlocksThanScheduled,
        UnverifiedReason::WorkersDisagree,
        UnverifiedReason::WorkerFailed,
    ];

    /// The metric label (`tandem:kv_checksum_unverified_total{reason=…}`).
    pub fn as_str(self) -> &'static str {
        match self {
            UnverifiedReason::Missing => "missing",
            UnverifiedReason::Malformed => "malformed",
            UnverifiedReason::Version => "version",
            UnverifiedReason::NotAllWorkersReported => "not_all_workers_reported",
            UnverifiedReason::FingerprintDiffers => "fingerprint_differs",
            UnverifiedReason::BlockSizeNotMultiple => "block_size_not_multiple",
            UnverifiedReason::UnalignedFirstBlock => "unaligned_first_block",
            UnverifiedReason::NoCommonPosition => "no_common_position",
            UnverifiedReason::SkippedOnOneSide => "skipped_on_one_side",
            UnverifiedReason::OtherBlocksThanScheduled => "other_blocks_than_scheduled",
            UnverifiedReason::WorkersDisagree => "workers_disagree",
            UnverifiedReason::WorkerFailed => "worker_failed",
        }
    }
}

impl std::fmt::Display for UnverifiedReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The consumer's block positions of one group whose chunks differ from the producer's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMismatch {
    pub group_id: usize,
    /// Consumer block positions, ascending.
    pub block_positions: Vec<usize>,
    /// Replica checks that differ (0 when the group is not replicated).
    pub replica_checks: Vec<usize>,
    /// The end of the load's verified prefix, a consumer block position: every consumer block
    /// from the load's first one up to (not including) this one lies in chunks that were
    /// compared, for every check, and equal. The blocks from here on are not known to be good.
    pub verified_prefix_end: usize,
}

/// The outcome of checking one load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// Every compared chunk matched; `groups` were compared.
    Verified { groups: Vec<usize> },
    /// Some chunks differ. `unverified` lists groups that could not be compared besides.
    Mismatch {
        groups: Vec<GroupMismatch>,
        unverified: Vec<(usize, UnverifiedReason)>,
    },
    /// The load could not be verified: `reason` for the load (the first group's reason when
    /// groups are the cause, listed in `groups`).
    Unverified {
        reason: UnverifiedReason,
        groups: Vec<(usize, UnverifiedReason)>,
    },
}

impl Verdict {
    /// A whole load unverified for `reason`.
    pub fn unverified(reason: UnverifiedReason) -> Verdict {
        Verdict::Unverified {
            reason,
            groups: Vec::new(),
        }
    }

    /// The metric label (`tandem:kv_checksum_loads_total{verdict=…}`).
    pub fn label(&self) -> &'static str {
        match self {
            Verdict::Verified { .. } => "verified",
            Verdict::Mismatch { .. } => "mismatch",
            Verdict::Unverified { .. } => "unverified",
        }
    }

    pub fn is_verified(&self) -> bool {
        matches!(self, Verdict::Verified { .. })
    }

    /// Mismatched block positions over all groups.
    pub fn mismatched_blocks(&self) -> usize {
        match self {
            Verdict::Mismatch { groups, .. } => {
                groups.iter().map(|g| g.block_positions.len()).sum()
            }
            _ => 0,
        }
    }
}

/// Checks a load: `kv_checksums` is what the carrier delivered (`None`: nothing), `loaded` the
/// consumer's merge (or why there is none).
pub fn verify(
    kv_checksums: Option<&str>,
    loaded: Result<&MergedChecksums, UnverifiedReason>,
) -> Verdict {
    let Some(s) = kv_checksums else {
        return Verdict::unverified(UnverifiedReason::Missing);
    };
    let expected = match Payload::decode(s) {
        Ok(p) => p,
        Err(r) => return Verdict::unverified(r),
    };
    match loaded {
        Ok(m) => compare(&expected, m),
        Err(r) => Verdict::unverified(r),
    }
}

/// Compares a decoded payload with the consumer's merged checksums (module docs).
pub fn compare(expected: &Payload, loaded: &MergedChecksums) -> Verdict {
    let mut verified = Vec::new();
    let mut mismatched = Vec::new();
    let mut unverified = Vec::new();
    for g in &loaded.groups {
        let producer = expected.group(g.group_id);
        let result = match (&g.state, producer) {
            (MergedState::Skipped(_), None) => continue,
            (MergedState::Skipped(_), Some(_)) | (MergedState::Computed(_), None) => {
                Err(UnverifiedReason::SkippedOnOneSide)
            }
            (MergedState::Unverified(r), _) => Err(*r),
            (MergedState::Computed(c), Some(p)) => compare_group(p, expected.num_tokens, c),
        };
        match result {
            Ok(None) => verified.push(g.group_id),
            Ok(Some(m)) => mismatched.push(GroupMismatch {
                group_id: g.group_id,
                block_positions: m.block_positions,
                replica_checks: m.replica_checks,
                verified_prefix_end: m.verified_prefix_end,
            }),
            Err(r) => unverified.push((g.group_id, r)),
        }
    }
    if !mismatched.is_empty() {
        Verdict::Mismatch {
            groups: mismatched,
            unverified,
        }
    } else if let Some(&(_, reason)) = unverified.first() {
        Verdict::Unverified {
            reason,
            groups: unverified,
        }
    } else if verified.is_empty() {
        Verdict::unverified(UnverifiedReason::NoCommonPosition)
    } else {
        Verdict::Verified { groups: verified }
    }
}

/// One side's blocks of a group, seen as chunks of `chunk` tokens.
struct Side<'a> {
    block_size: usize,
    start: usize,
    first_token: usize,
    num_tokens: usize,
    values: &'a [u64],
}

impl Side<'_> {
    /// Chunk indices this side could cover: those holding its blocks.
    fn chunk_range(&self, chunk: usize) -> std::ops::Range<usize> {
        let r = chunk / self.block_size;
        let end = self.start.saturating_add(self.values.len());
        self.start / r..end.div_ceil(r)
    }

    /// Tokens of chunk `q` this side's request holds.
    fn tokens_in(&self, q: usize, chunk: usize) -> usize {
        let lo = q.saturating_mul(chunk);
        self.num_tokens.saturating_sub(lo).min(chunk)
    }

    /// The sum of chunk `q`, if this side covers it whole.
    fn chunk_sum(&self, q: usize, chunk: usize) -> Option<u64> {
        let r = chunk / self.block_size;
        let lo = q.checked_mul(chunk)?;
        if self.first_token > lo {
            return None;
        }
        let end = self.start.checked_add(self.values.len())?;
        let mut sum = 0u64;
        for b in q.checked_mul(r)?..q.checked_add(1)?.checked_mul(r)? {
            if b.checked_mul(self.block_size)? >= self.num_tokens {
                break; // past the last token: counts as zero
            }
            if b < self.start || b >= end {
                return None;
            }
            sum = sum.wrapping_add(self.values[b - self.start]);
        }
        Some(sum)
    }
}

/// A group's mismatch, before it is labelled with its group id.
struct Mismatched {
    block_positions: Vec<usize>,
    replica_checks: Vec<usize>,
    verified_prefix_end: usize,
}

type GroupResult = Result<Option<Mismatched>, UnverifiedReason>;

/// `Ok(None)`: verified; `Ok(Some(_))`: mismatch; `Err`: unverified.
fn compare_group(p: &PayloadGroup, p_num_tokens: usize, c: &GroupChecks) -> GroupResult {
    if p.fingerprint != c.fingerprint {
        return Err(UnverifiedReason::FingerprintDiffers);
    }
    let (bp, bc) = (p.block_size, c.block_size);
    if bp == 0 || bc == 0 {
        return Err(UnverifiedReason::BlockSizeNotMultiple);
    }
    let chunk = bp.max(bc);
    if chunk % bp.min(bc) != 0 {
        return Err(UnverifiedReason::BlockSizeNotMultiple);
    }
    if !c.first_token.is_multiple_of(chunk) {
        return Err(UnverifiedReason::UnalignedFirstBlock);
    }
    let producer = Side {
        block_size: bp,
        start: p.start,
        first_token: p.start.saturating_mul(bp),
        num_tokens: p_num_tokens,
        values: &p.values,
    };
    let mut positions = Vec::new();
    let mut bad_checks = Vec::new();
    let mut compared = false;
    let rc = chunk / bc;
    // The first chunk not known to be good, over every check.
    let mut prefix_end_chunk = usize::MAX;
    for (k, check) in c.checks.iter().enumerate() {
        let consumer = Side {
            block_size: bc,
            start: c.start,
            first_token: c.first_token,
            num_tokens: c.num_tokens,
            values: check,
        };
        let (pr, cr) = (producer.chunk_range(chunk), consumer.chunk_range(chunk));
        // This check's verified prefix: consecutive chunks from the load's first, compared equal.
        let mut good_until = cr.start;
        for q in pr.start.max(cr.start)..pr.end.min(cr.end) {
            let tokens = consumer.tokens_in(q, chunk);
            if tokens == 0 || tokens != producer.tokens_in(q, chunk) {
                continue;
            }
            let (Some(want), Some(got)) =
                (producer.chunk_sum(q, chunk), consumer.chunk_sum(q, chunk))
            else {
                continue;
            };
            compared = true;
            if want == got && q == good_until {
                good_until = q + 1;
            }
            if want != got {
                if !bad_checks.contains(&k) {
                    bad_checks.push(k);
                }
                let end = c.start + check.len();
                positions.extend((q * rc).max(c.start)..((q + 1) * rc).min(end));
            }
        }
        prefix_end_chunk = prefix_end_chunk.min(good_until);
    }
    if !compared {
        return Err(UnverifiedReason::NoCommonPosition);
    }
    if positions.is_empty() {
        Ok(None)
    } else {
        positions.sort_unstable();
        positions.dedup();
        // In consumer blocks, never past the first mismatched one.
        let verified_prefix_end = prefix_end_chunk
            .saturating_mul(rc)
            .clamp(c.start, positions[0].max(c.start));
        Ok(Some(Mismatched {
            block_positions: positions,
            replica_checks: bad_checks,
            verified_prefix_end,
        }))
    }
}
