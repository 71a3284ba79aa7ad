//! The proxy's Prometheus metrics: every name is a constant here, with its labels and help text,
//! and the helpers that record them.
//!
//! Invariants: label values come from fixed sets (`route`, `role`, `outcome` = `ProxyError::code`
//! or `ok`/`client_disconnected`/`stream_error`/`decode_failed_mid_stream`; KV releases:
//! `ok`/`not_found`/`failed`) or from the operator's own `--prefill`/`--decode`
//! URLs (`instance`); nothing a client sends becomes a label. Outstanding gauges move only through
//! `pool::Lease` (increment on acquire, decrement on drop), so they return to zero with the leases.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::error::ProxyError;

/// Client requests by route (`completions`, `chat_completions`, `models`) and how they ended.
pub const REQUESTS_TOTAL: &str = "tandem:proxy_requests_total";
/// Calls to upstream instances by role (`prefill`, `decode`) and how they ended.
pub const UPSTREAM_REQUESTS_TOTAL: &str = "tandem:proxy_upstream_requests_total";
/// Retries on another instance after a failed connect, by role.
pub const UPSTREAM_RETRIES_TOTAL: &str = "tandem:proxy_upstream_retries_total";
/// Requests in flight on each upstream instance (`role`, `instance`).
pub const UPSTREAM_OUTSTANDING: &str = "tandem:proxy_upstream_outstanding";
/// 1 while an upstream instance is in rotation, 0 while it is out (`role`, `instance`).
pub const UPSTREAM_HEALTHY: &str = "tandem:proxy_upstream_healthy";
/// Releases of a producer's blocks after a failed decode call (`POST /v1/kv/release`), by outcome
/// (`ok`, `not_found` for an instance without the endpoint, `failed`).
pub const KV_RELEASES_TOTAL: &str = "tandem:proxy_kv_releases_total";
/// Seconds of a successful prefill round trip (retries included).
pub const PREFILL_SECONDS: &str = "tandem:proxy_prefill_duration_seconds";
/// Seconds from the client's request to the first body chunk of the decode instance.
pub const TIME_TO_FIRST_CHUNK_SECONDS: &str = "tandem:proxy_time_to_first_chunk_seconds";

/// Outcome label of a request that completed.
pub const OUTCOME_OK: &str = "ok";
/// Outcome label of a streamed response whose client went away before the end.
pub const OUTCOME_CLIENT_DISCONNECTED: &str = "client_disconnected";
/// Outcome label of a response cut by an upstream error or idle timeout (the client sees a
/// truncated body).
pub const OUTCOME_STREAM_ERROR: &str = "stream_error";
/// Outcome label of an SSE response whose decode instance failed mid-stream, ended for the
/// client with an error event and `[DONE]`.
pub const OUTCOME_DECODE_FAILED_MID_STREAM: &str = "decode_failed_mid_stream";
/// Outcome label of a KV release the prefill instance does not know (an older instance: 404).
pub const OUTCOME_NOT_FOUND: &str = "not_found";
/// Outcome label of a KV release that could not be delivered or was refused.
pub const OUTCOME_FAILED: &str = "failed";

const SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Registers help texts (harmless to call more than once).
pub(crate) fn describe() {
    describe_counter!(
        REQUESTS_TOTAL,
        "Client requests through the proxy, by route and outcome"
    );
    describe_counter!(
        UPSTREAM_REQUESTS_TOTAL,
        "Calls to prefill and decode instances, by role and outcome"
    );
    describe_counter!(
        UPSTREAM_RETRIES_TOTAL,
        "Retries on another instance after a failed connect"
    );
    describe_counter!(
        KV_RELEASES_TOTAL,
        "Early releases of a producer's KV blocks after a failed decode call, by outcome"
    );
    describe_gauge!(
        UPSTREAM_OUTSTANDING,
        "Requests in flight on each upstream instance"
    );
    describe_gauge!(
        UPSTREAM_HEALTHY,
        "1 if the upstream instance is in rotation, 0 if taken out"
    );
    describe_histogram!(
        PREFILL_SECONDS,
        "Seconds of a successful prefill round trip"
    );
    describe_histogram!(
        TIME_TO_FIRST_CHUNK_SECONDS,
        "Seconds from the client's request to the decode instance's first body chunk"
    );
}

/// A Prometheus recorder (with the proxy's histogram buckets) that is not installed globally;
/// install it with `metrics::set_global_recorder` and give its handle to `ProxyState::new`.
pub fn prometheus_recorder() -> metrics_exporter_prometheus::PrometheusRecorder {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Prefix("tandem:proxy_".into()), SECONDS_BUCKETS)
        .expect("the bucket list is not empty")
        .build_recorder()
}

/// Installs [`prometheus_recorder`] as the process's global recorder and returns its handle.
pub fn install_prometheus_recorder() -> Result<PrometheusHandle, ProxyError> {
    let recorder = prometheus_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)
        .map_err(|e| ProxyError::MetricsRecorder(e.to_string()))?;
    Ok(handle)
}

pub(crate) fn request_finished(route: &'static str, outcome: &'static str) {
    counter!(REQUESTS_TOTAL, "route" => route, "outcome" => outcome).increment(1);
}

pub(crate) fn upstream_finished(role: &'static str, outcome: &'static str) {
    counter!(UPSTREAM_REQUESTS_TOTAL, "role" => role, "outcome" => outcome).increment(1);
}

pub(crate) fn kv_release_finished(outcome: &'static str) {
    counter!(KV_RELEASES_TOTAL, "outcome" => outcome).increment(1);
}

pub(crate) fn upstream_retried(role: &'static str) {
    counter!(UPSTREAM_RETRIES_TOTAL, "role" => role).increment(1);
}

pub(crate) fn outstanding_changed(role: &'static str, instance: &str, delta: f64) {
    gauge!(UPSTREAM_OUTSTANDING, "role" => role, "instance" => instance.to_owned())
        .increment(delta);
}

pub(crate) fn health_set(role: &'static str, instance: &str, healthy: bool) {
    gauge!(UPSTREAM_HEALTHY, "role" => role, "instance" => instance.to_owned()).set(if healthy {
        1.0
    } else {
        0.0
    });
}

pub(crate) fn prefill_took(seconds: f64) {
    histogram!(PREFILL_SECONDS).record(seconds);
}

pub(crate) fn first_chunk_after(seconds: f64) {
    histogram!(TIME_TO_FIRST_CHUNK_SECONDS).record(seconds);
}
