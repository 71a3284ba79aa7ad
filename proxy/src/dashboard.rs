//! `/dashboard`: a live page of the deployment, and `/dashboard/summary`, the JSON it polls.
//!
//! The summary is built per call: every instance in the pools (health and outstanding requests
//! as the proxy sees them) plus a few series scraped from its `/metrics` (running and waiting
//! requests, those waiting for remote KV, successes, TTFT sum and count, KV bytes moved and failed transfers, checksum verdicts and sends, load
//! failures, free and total KV blocks), and the proxy's own request counters. Counters are
//! totals; the page turns them into rates between two polls. The page is one embedded HTML file
//! with inline script and style, no external asset, served with a CSP that allows nothing else.
//!
//! Invariants: a scrape is bounded by the health-check timeout and a failed one marks only that
//! instance (`scraped: false`); series are read by name from the text format, so an instance
//! without a series reports 0; nothing a client sends reaches an upstream call.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::pool::Role;
use crate::state::ProxyState;
use crate::telemetry;

/// The page, served as is.
const PAGE: &str = include_str!("dashboard.html");

/// Only the page's own inline script and style, and calls back to this origin.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'";

/// A label name and the value a sample must have for it.
type Label = (&'static str, &'static str);

/// The instance series the summary reports: (summary key, metric name, label filter).
/// Names are the instances' (`tandem_engine::metrics`); a series with labels is summed over
/// those that match the filter.
const INSTANCE_SERIES: &[(&str, &str, Option<Label>)] = &[
    ("running", "tandem:num_requests_running", None),
    ("waiting", "tandem:num_requests_waiting", None),
    (
        "waiting_remote_kv",
        "tandem:num_requests_waiting_for_remote_kv",
        None,
    ),
    ("requests_ok", "tandem:request_success_total", None),
    ("ttft_sum", "tandem:time_to_first_token_seconds_sum", None),
    (
        "ttft_count",
        "tandem:time_to_first_token_seconds_count",
        None,
    ),
    ("kv_bytes", "tandem:kv_transfer_bytes_total", None),
    (
        "kv_transfer_failures",
        "tandem:kv_transfer_failures_total",
        None,
    ),
    ("kv_sends", "tandem:kv_checksum_sends_total", None),
    (
        "loads_verified",
        "tandem:kv_checksum_loads_total",
        Some(("verdict", "verified")),
    ),
    (
        "loads_mismatch",
        "tandem:kv_checksum_loads_total",
        Some(("verdict", "mismatch")),
    ),
    (
        "loads_unverified",
        "tandem:kv_checksum_loads_total",
        Some(("verdict", "unverified")),
    ),
    (
        "load_failures_fail",
        "tandem:kv_load_failures_total",
        Some(("policy", "fail")),
    ),
    (
        "load_failures_recompute",
        "tandem:kv_load_failures_total",
        Some(("policy", "recompute")),
    ),
    ("kv_free_blocks", "tandem:kv_cache_free_blocks", None),
    ("kv_total_blocks", "tandem:kv_cache_total_blocks", None),
];

/// One instance as the summary shows it.
#[derive(Debug, Serialize)]
pub(crate) struct InstanceSummary {
    role: Role,
    url: String,
    /// In the proxy's rotation.
    healthy: bool,
    /// Requests in flight on it through this proxy.
    outstanding: usize,
    /// Whether its `/metrics` answered.
    scraped: bool,
    /// [`INSTANCE_SERIES`] by key (empty when not scraped).
    metrics: BTreeMap<&'static str, f64>,
}

/// The JSON of `/dashboard/summary`.
#[derive(Debug, Serialize)]
pub(crate) struct Summary {
    /// When it was taken, Unix milliseconds.
    unix_ms: u128,
    /// The proxy's own totals: `requests_ok`, `requests_failed`, `ttfc_sum`, `ttfc_count`.
    proxy: BTreeMap<&'static str, f64>,
    instances: Vec<InstanceSummary>,
}

/// `GET /dashboard`.
pub(crate) async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /dashboard/summary`.
pub(crate) async fn summary(State(state): State<ProxyState>) -> Response {
    let summary = build(&state).await;
    ([(header::CACHE_CONTROL, "no-store")], Json(summary)).into_response()
}

async fn build(state: &ProxyState) -> Summary {
    let timeout = state.settings().health_check_timeout;
    let instances: Vec<_> = [Role::Prefill, Role::Decode]
        .into_iter()
        .flat_map(|role| state.pool(role).instances())
        .collect();
    let scrapes = instances.iter().map(|instance| async move {
        let url = format!("{}/metrics", instance.url());
        let request = state.upstream(state.client().get(&url)).timeout(timeout);
        let text = match request.send().await {
            Ok(response) if response.status().is_success() => response.text().await.ok(),
            Ok(response) => {
                tracing::debug!(%url, status = %response.status(), "metrics scrape refused");
                None
            }
            Err(e) => {
                tracing::debug!(%url, error = %e, "metrics scrape failed");
                None
            }
        };
        let metrics = text
            .as_deref()
            .map(|text| {
                let samples = parse(text);
                INSTANCE_SERIES
                    .iter()
                    .map(|(key, name, filter)| (*key, sum(&samples, name, *filter)))
                    .collect()
            })
            .unwrap_or_default();
        InstanceSummary {
            role: instance.role(),
            url: instance.url().to_owned(),
            healthy: instance.is_healthy(),
            outstanding: instance.outstanding(),
            scraped: text.is_some(),
            metrics,
        }
    });
    let instances = futures::future::join_all(scrapes).await;
    let proxy = state
        .prometheus()
        .map(|handle| {
            let text = handle.render();
            let samples = parse(&text);
            let total = sum(&samples, telemetry::REQUESTS_TOTAL, None);
            let ok = sum(
                &samples,
                telemetry::REQUESTS_TOTAL,
                Some(("outcome", telemetry::OUTCOME_OK)),
            );
            let ttfc = telemetry::TIME_TO_FIRST_CHUNK_SECONDS;
            BTreeMap::from([
                ("requests_ok", ok),
                ("requests_failed", total - ok),
                ("ttfc_sum", sum(&samples, &format!("{ttfc}_sum"), None)),
                ("ttfc_count", sum(&samples, &format!("{ttfc}_count"), None)),
            ])
        })
        .unwrap_or_default();
    Summary {
        unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0),
        proxy,
        instances,
    }
}

/// One sample of the Prometheus text format.
#[derive(Debug, PartialEq)]
struct Sample<'a> {
    name: &'a str,
    /// The raw text between `{` and `}` (empty without labels).
    labels: &'a str,
    value: f64,
}

/// The samples of a Prometheus text exposition; comments and lines that do not parse are skipped.
fn parse(text: &str) -> Vec<Sample<'_>> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                return None;
            }
            let (series, rest) = match line.find('{') {
                Some(open) => {
                    let close = open + line[open..].find('}')?;
                    ((&line[..open], &line[open + 1..close]), &line[close + 1..])
                }
                None => {
                    let space = line.find(char::is_whitespace)?;
                    ((&line[..space], ""), &line[space..])
                }
            };
            let value = rest.split_whitespace().next()?.parse().ok()?;
            Some(Sample {
                name: series.0,
                labels: series.1,
                value,
            })
        })
        .collect()
}

/// The sum of the samples named `name` whose labels include `filter` (all of them without one).
fn sum(samples: &[Sample<'_>], name: &str, filter: Option<(&str, &str)>) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| match filter {
            None => true,
            Some((key, value)) => has_label(s.labels, key, value),
        })
        .map(|s| s.value)
        .filter(|v| v.is_finite())
        .fold(0.0, |acc, v| acc + v)
}

/// Whether `labels` (`a="x",b="y"`) holds `key="value"`; values with escaped quotes never match
/// the fixed values asked for here, so a plain split is enough.
fn has_label(labels: &str, key: &str, value: &str) -> bool {
    labels.split(',').any(|pair| {
        pair.split_once('=')
            .is_some_and(|(k, v)| k.trim() == key && v.trim().trim_matches('"') == value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP tandem:kv_checksum_loads_total Loads by verdict
# TYPE tandem:kv_checksum_loads_total counter
tandem:kv_checksum_loads_total{verdict="verified"} 7
tandem:kv_checksum_loads_total{verdict="mismatch"} 2
tandem:kv_cache_free_blocks 4093
tandem:time_to_first_token_seconds_bucket{le="0.5"} 3
tandem:time_to_first_token_seconds_sum 1.5
tandem:time_to_first_token_seconds_count 3
tandem:kv_load_failures_total{policy="recompute",reason="x"} 1
garbage line
"#;

    #[test]
    fn parses_samples_and_sums_by_label() {
        let samples = parse(TEXT);
        assert_eq!(samples.len(), 7);
        let loads = "tandem:kv_checksum_loads_total";
        assert_eq!(sum(&samples, loads, None), 9.0);
        assert_eq!(sum(&samples, loads, Some(("verdict", "verified"))), 7.0);
        assert_eq!(sum(&samples, loads, Some(("verdict", "unverified"))), 0.0);
        assert_eq!(sum(&samples, "tandem:kv_cache_free_blocks", None), 4093.0);
        assert_eq!(
            sum(&samples, "tandem:time_to_first_token_seconds_count", None),
            3.0
        );
        assert_eq!(
            sum(
                &samples,
                "tandem:kv_load_failures_total",
                Some(("policy", "recompute"))
            ),
            1.0
        );
    }

    #[test]
    fn the_page_is_self_contained() {
        for external in ["src=\"http", "href=\"http", "@import", "<link", "src=\"//"] {
            assert!(!PAGE.contains(external), "{external}");
        }
        assert!(PAGE.contains("dashboard/summary"));
    }
}
