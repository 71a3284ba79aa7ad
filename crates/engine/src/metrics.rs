//! Every Prometheus metric name of an instance, in one place (the README's metrics table lists them).
//!
//! Names follow vLLM's with the `tandem:` prefix. Labels carry fixed values only, never
//! request data or error messages.

// Requests and tokens.
pub const NUM_REQUESTS_RUNNING: &str = "tandem:num_requests_running";
pub const NUM_REQUESTS_WAITING: &str = "tandem:num_requests_waiting";
pub const NUM_REQUESTS_WAITING_FOR_REMOTE_KV: &str = "tandem:num_requests_waiting_for_remote_kv";
pub const KV_CACHE_USAGE_PERC: &str = "tandem:kv_cache_usage_perc";
pub const KV_CACHE_FREE_BLOCKS: &str = "tandem:kv_cache_free_blocks";
pub const KV_CACHE_TOTAL_BLOCKS: &str = "tandem:kv_cache_total_blocks";
/// Per KV cache group (label `group`), for hybrid models whose groups have pools of their own.
pub const KV_CACHE_GROUP_USAGE_PERC: &str = "tandem:kv_cache_group_usage_perc";
pub const KV_CACHE_GROUP_FREE_BLOCKS: &str = "tandem:kv_cache_group_free_blocks";
pub const KV_CACHE_GROUP_TOTAL_BLOCKS: &str = "tandem:kv_cache_group_total_blocks";
pub const PROMPT_TOKENS_TOTAL: &str = "tandem:prompt_tokens_total";
pub const GENERATION_TOKENS_TOTAL: &str = "tandem:generation_tokens_total";
pub const REQUEST_SUCCESS_TOTAL: &str = "tandem:request_success_total";
pub const NUM_PREEMPTIONS_TOTAL: &str = "tandem:num_preemptions_total";
pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "tandem:prefix_cache_queries_total";
pub const PREFIX_CACHE_HITS_TOTAL: &str = "tandem:prefix_cache_hits_total";
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "tandem:time_to_first_token_seconds";
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "tandem:inter_token_latency_seconds";
pub const E2E_REQUEST_LATENCY_SECONDS: &str = "tandem:e2e_request_latency_seconds";
pub const ENGINE_STEP_SECONDS: &str = "tandem:engine_step_seconds";
/// Seconds each rank of a TP/PP instance spent in collectives so far (waiting for the others
/// included): a gauge that only grows (the exporter's counters are integers).
pub const PARALLEL_COLLECTIVE_SECONDS: &str = "tandem:parallel_collective_seconds";

// Per request, as vLLM names them (histograms observed once per finished request).
/// Arrival to first scheduled.
pub const REQUEST_QUEUE_TIME_SECONDS: &str = "tandem:request_queue_time_seconds";
/// First scheduled to first token.
pub const REQUEST_PREFILL_TIME_SECONDS: &str = "tandem:request_prefill_time_seconds";
/// First token to finish.
pub const REQUEST_DECODE_TIME_SECONDS: &str = "tandem:request_decode_time_seconds";
/// First scheduled to finish.
pub const REQUEST_INFERENCE_TIME_SECONDS: &str = "tandem:request_inference_time_seconds";
pub const REQUEST_PROMPT_TOKENS: &str = "tandem:request_prompt_tokens";
pub const REQUEST_GENERATION_TOKENS: &str = "tandem:request_generation_tokens";
/// Tokens scheduled per engine step (histogram).
pub const ITERATION_TOKENS_TOTAL: &str = "tandem:iteration_tokens_total";
/// Gauge 1 with the KV cache's configuration as labels.
pub const CACHE_CONFIG_INFO: &str = "tandem:cache_config_info";

// KV transfer.
pub const KV_TRANSFER_BYTES_TOTAL: &str = "tandem:kv_transfer_bytes_total";
pub const KV_TRANSFER_DESCRIPTORS_TOTAL: &str = "tandem:kv_transfer_descriptors_total";
pub const KV_TRANSFER_SECONDS: &str = "tandem:kv_transfer_seconds";
pub const KV_TRANSFER_FAILURES_TOTAL: &str = "tandem:kv_transfer_failures_total";
pub const KV_LEASE_EXPIRED_TOTAL: &str = "tandem:kv_lease_expired_total";
/// Notifications of the connector's protocol that did not decode (push: a completion
/// notification with a bad checksum payload); their loads end by timeout.
pub const KV_TRANSFER_FAILED_NOTIFICATIONS_TOTAL: &str =
    "tandem:kv_transfer_failed_notifications_total";
pub const KV_LOAD_FAILURES_TOTAL: &str = "tandem:kv_load_failures_total";
/// Prompt tokens a consumer computes again after failed loads (policy `recompute`), and the
/// prompt lengths of those loads: their ratio is the share of prompts recomputed.
pub const KV_LOAD_RECOMPUTED_TOKENS_TOTAL: &str = "tandem:kv_load_recomputed_tokens_total";
pub const KV_LOAD_RECOMPUTE_PROMPT_TOKENS_TOTAL: &str =
    "tandem:kv_load_recompute_prompt_tokens_total";
/// Label `reason`: see [`REFUSAL_REASONS`].
pub const KV_TRANSFER_REFUSED_TOTAL: &str = "tandem:kv_transfer_refused_total";
/// The values of `reason` on [`KV_TRANSFER_REFUSED_TOTAL`].
pub const REFUSAL_REASONS: [&str; 5] = [
    "unauthorized",
    "expired",
    "producer_not_allowed",
    "lease",
    "malformed",
];

// NIXL transfers in vLLM's shapes (one observation per READ or WRITE).
pub const NIXL_XFER_TIME_SECONDS: &str = "tandem:nixl_xfer_time_seconds";
pub const NIXL_POST_TIME_SECONDS: &str = "tandem:nixl_post_time_seconds";
pub const NIXL_BYTES_TRANSFERRED: &str = "tandem:nixl_bytes_transferred";
pub const NIXL_NUM_DESCRIPTORS: &str = "tandem:nixl_num_descriptors";
pub const NIXL_NUM_FAILED_TRANSFERS: &str = "tandem:nixl_num_failed_transfers";
pub const NIXL_NUM_FAILED_NOTIFICATIONS: &str = "tandem:nixl_num_failed_notifications";
pub const NIXL_NUM_KV_EXPIRED_REQS: &str = "tandem:nixl_num_kv_expired_reqs";

// KV checksums.
pub const KV_CHECKSUM_LOADS_TOTAL: &str = "tandem:kv_checksum_loads_total";
pub const KV_CHECKSUM_UNVERIFIED_TOTAL: &str = "tandem:kv_checksum_unverified_total";
pub const KV_CHECKSUM_MISMATCHED_BLOCKS_TOTAL: &str = "tandem:kv_checksum_mismatched_blocks_total";
pub const KV_CHECKSUM_SENDS_TOTAL: &str = "tandem:kv_checksum_sends_total";
pub const KV_CHECKSUM_COMPUTE_SECONDS: &str = "tandem:kv_checksum_compute_seconds";
pub const KV_CHECKSUM_LOAD_WAIT_SECONDS: &str = "tandem:kv_checksum_load_wait_seconds";

/// Registers descriptions, so that `/metrics` documents every series.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(NUM_REQUESTS_RUNNING, "Requests in the running batch.");
    describe_counter!(
        KV_TRANSFER_REFUSED_TOTAL,
        "KV transfers refused before anything moved (unsigned or expired params, a producer \
         outside allowed_producers, a lease claim refused, an unsigned peer request), by reason."
    );
    describe_gauge!(NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.");
    describe_gauge!(
        NUM_REQUESTS_WAITING_FOR_REMOTE_KV,
        "Requests waiting for their KV cache from a remote instance."
    );
    describe_gauge!(
        KV_CACHE_USAGE_PERC,
        "Fraction of KV cache blocks in use (0-1); of the fullest pool when KV cache groups have pools of their own."
    );
    describe_gauge!(
        KV_CACHE_FREE_BLOCKS,
        "KV cache blocks not held by any request (summed over the groups' pools)."
    );
    describe_gauge!(
        KV_CACHE_TOTAL_BLOCKS,
        "KV cache blocks in the pool (summed over the groups' pools)."
    );
    describe_gauge!(
        KV_CACHE_GROUP_USAGE_PERC,
        "Fraction of a KV cache group's pool in use (0-1)."
    );
    describe_gauge!(
        KV_CACHE_GROUP_FREE_BLOCKS,
        "Blocks of a KV cache group's pool not held by any request."
    );
    describe_gauge!(
        KV_CACHE_GROUP_TOTAL_BLOCKS,
        "Blocks of a KV cache group's pool."
    );
    describe_gauge!(
        PARALLEL_COLLECTIVE_SECONDS,
        Unit::Seconds,
        "Seconds so far each rank (tp_rank, pp_rank) of a tensor- or pipeline-parallel instance spent in \
         collectives (all-reduce, gather, stage handoff), waiting for the other ranks included."
    );
    describe_counter!(PROMPT_TOKENS_TOTAL, "Prompt tokens processed.");
    describe_counter!(GENERATION_TOKENS_TOTAL, "Tokens generated.");
    describe_counter!(
        REQUEST_SUCCESS_TOTAL,
        "Finished requests, by finish reason."
    );
    describe_counter!(
        NUM_PREEMPTIONS_TOTAL,
        "Requests preempted (recomputed) for lack of blocks."
    );
    describe_counter!(
        PREFIX_CACHE_QUERIES_TOTAL,
        "Prompt tokens looked up in the prefix cache."
    );
    describe_counter!(
        PREFIX_CACHE_HITS_TOTAL,
        "Prompt tokens found in the prefix cache."
    );
    describe_histogram!(
        TIME_TO_FIRST_TOKEN_SECONDS,
        Unit::Seconds,
        "Time to first token."
    );
    describe_histogram!(
        INTER_TOKEN_LATENCY_SECONDS,
        Unit::Seconds,
        "Time between tokens."
    );
    describe_histogram!(
        E2E_REQUEST_LATENCY_SECONDS,
        Unit::Seconds,
        "Arrival to finish."
    );
    describe_histogram!(
        ENGINE_STEP_SECONDS,
        Unit::Seconds,
        "Duration of one engine step."
    );
    describe_counter!(
        KV_TRANSFER_BYTES_TOTAL,
        "Bytes of KV moved between instances."
    );
    describe_counter!(KV_TRANSFER_DESCRIPTORS_TOTAL, "NIXL descriptors posted.");
    describe_histogram!(
        KV_TRANSFER_SECONDS,
        Unit::Seconds,
        "Duration of one KV transfer."
    );
    describe_counter!(KV_TRANSFER_FAILURES_TOTAL, "KV transfers that failed.");
    describe_counter!(
        KV_LEASE_EXPIRED_TOTAL,
        "Producer blocks freed because their lease expired."
    );
    describe_counter!(
        KV_TRANSFER_FAILED_NOTIFICATIONS_TOTAL,
        "KV transfer notifications that did not decode (dropped)."
    );
    describe_counter!(
        KV_LOAD_FAILURES_TOTAL,
        "KV loads that failed, by the policy applied."
    );
    describe_counter!(
        KV_LOAD_RECOMPUTED_TOKENS_TOTAL,
        "Prompt tokens computed locally again after failed KV loads (from the first bad block \
         when the checksums localize the damage)."
    );
    describe_counter!(
        KV_LOAD_RECOMPUTE_PROMPT_TOKENS_TOTAL,
        "Prompt tokens of the requests whose failed KV loads were recomputed."
    );
    describe_counter!(KV_CHECKSUM_LOADS_TOTAL, "Checked KV loads, by verdict.");
    describe_counter!(
        KV_CHECKSUM_UNVERIFIED_TOTAL,
        "Unverified KV loads, by reason."
    );
    describe_counter!(
        KV_CHECKSUM_MISMATCHED_BLOCKS_TOTAL,
        "KV blocks whose checksum differed."
    );
    describe_counter!(
        KV_CHECKSUM_SENDS_TOTAL,
        "Requests whose KV checksums were sent."
    );
    describe_histogram!(
        KV_CHECKSUM_COMPUTE_SECONDS,
        Unit::Seconds,
        "Worker time spent computing KV checksums per step."
    );
    describe_histogram!(
        KV_CHECKSUM_LOAD_WAIT_SECONDS,
        Unit::Seconds,
        "Per load and worker: time spent checksumming after the load's last byte landed (what \
         its request waits for; chunks checksummed while later ones moved are not in it)."
    );
    describe_histogram!(
        REQUEST_QUEUE_TIME_SECONDS,
        Unit::Seconds,
        "Per request: arrival to first scheduled."
    );
    describe_histogram!(
        REQUEST_PREFILL_TIME_SECONDS,
        Unit::Seconds,
        "Per request: first scheduled to first token."
    );
    describe_histogram!(
        REQUEST_DECODE_TIME_SECONDS,
        Unit::Seconds,
        "Per request: first token to finish."
    );
    describe_histogram!(
        REQUEST_INFERENCE_TIME_SECONDS,
        Unit::Seconds,
        "Per request: first scheduled to finish."
    );
    describe_histogram!(REQUEST_PROMPT_TOKENS, "Per request: prompt tokens.");
    describe_histogram!(REQUEST_GENERATION_TOKENS, "Per request: generated tokens.");
    describe_histogram!(ITERATION_TOKENS_TOTAL, "Tokens scheduled per engine step.");
    describe_gauge!(
        CACHE_CONFIG_INFO,
        "The KV cache's configuration, as labels (value 1)."
    );
    describe_histogram!(
        NIXL_XFER_TIME_SECONDS,
        Unit::Seconds,
        "One NIXL READ or WRITE, post to completion."
    );
    describe_histogram!(
        NIXL_POST_TIME_SECONDS,
        Unit::Seconds,
        "Creating and posting one NIXL transfer."
    );
    describe_histogram!(
        NIXL_BYTES_TRANSFERRED,
        Unit::Bytes,
        "Bytes of one NIXL transfer."
    );
    describe_histogram!(
        NIXL_NUM_DESCRIPTORS,
        "Descriptors of one NIXL transfer (after merging consecutive blocks)."
    );
    describe_counter!(NIXL_NUM_FAILED_TRANSFERS, "NIXL transfers that failed.");
    describe_counter!(
        NIXL_NUM_FAILED_NOTIFICATIONS,
        "NIXL notifications that did not decode."
    );
    describe_counter!(
        NIXL_NUM_KV_EXPIRED_REQS,
        "Requests whose held KV expired before a consumer took it."
    );
}

/// Registers every counter at 0, with each of its known label values, so that `rate()` and
/// alerts see a zero instead of an absent series from startup.
pub fn register_zeros() {
    for name in [
        PROMPT_TOKENS_TOTAL,
        GENERATION_TOKENS_TOTAL,
        NUM_PREEMPTIONS_TOTAL,
        PREFIX_CACHE_QUERIES_TOTAL,
        PREFIX_CACHE_HITS_TOTAL,
        KV_TRANSFER_BYTES_TOTAL,
        KV_TRANSFER_DESCRIPTORS_TOTAL,
        KV_TRANSFER_FAILURES_TOTAL,
        KV_LEASE_EXPIRED_TOTAL,
        KV_TRANSFER_FAILED_NOTIFICATIONS_TOTAL,
        KV_LOAD_RECOMPUTED_TOKENS_TOTAL,
        KV_LOAD_RECOMPUTE_PROMPT_TOKENS_TOTAL,
        KV_CHECKSUM_MISMATCHED_BLOCKS_TOTAL,
        KV_CHECKSUM_SENDS_TOTAL,
        NIXL_NUM_FAILED_TRANSFERS,
        NIXL_NUM_FAILED_NOTIFICATIONS,
        NIXL_NUM_KV_EXPIRED_REQS,
    ] {
        metrics::counter!(name).increment(0);
    }
    for reason in ["stop", "length", "abort", "error"] {
        metrics::counter!(REQUEST_SUCCESS_TOTAL, "finished_reason" => reason).increment(0);
    }
    for policy in ["fail", "recompute"] {
        metrics::counter!(KV_LOAD_FAILURES_TOTAL, "policy" => policy).increment(0);
    }
    for reason in REFUSAL_REASONS {
        metrics::counter!(KV_TRANSFER_REFUSED_TOTAL, "reason" => reason).increment(0);
    }
    for verdict in ["verified", "mismatch", "unverified"] {
        metrics::counter!(KV_CHECKSUM_LOADS_TOTAL, "verdict" => verdict).increment(0);
    }
    for reason in tandem_kv_checksum::UnverifiedReason::ALL {
        metrics::counter!(KV_CHECKSUM_UNVERIFIED_TOTAL, "reason" => reason.as_str()).increment(0);
    }
}
