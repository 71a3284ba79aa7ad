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
/// Label `reason`: `signature`, `expired`, `producer_not_allowed`, `lease`, `peer_auth`.
pub const KV_TRANSFER_REFUSED_TOTAL: &str = "tandem:kv_transfer_refused_total";

// KV checksums.
pub const KV_CHECKSUM_LOADS_TOTAL: &str = "tandem:kv_checksum_loads_total";
pub const KV_CHECKSUM_UNVERIFIED_TOTAL: &str = "tandem:kv_checksum_unverified_total";
pub const KV_CHECKSUM_MISMATCHED_BLOCKS_TOTAL: &str = "tandem:kv_checksum_mismatched_blocks_total";
pub const KV_CHECKSUM_SENDS_TOTAL: &str = "tandem:kv_checksum_sends_total";
pub const KV_CHECKSUM_COMPUTE_SECONDS: &str = "tandem:kv_checksum_compute_seconds";

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
        "Fraction of KV cache blocks in use (0-1)."
    );
    describe_gauge!(
        KV_CACHE_FREE_BLOCKS,
        "KV cache blocks not held by any request."
    );
    describe_gauge!(KV_CACHE_TOTAL_BLOCKS, "KV cache blocks in the pool.");
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
}
