//! Early release of a producer's KV blocks when the decode call of a request fails, so they do
//! not stay pinned until the producer's lease expires.
//!
//! Contract with the instance (`kv_producer`): `POST {prefill_url}/v1/kv/release` with
//! `{"kv_transfer_params": <the params that producer returned>}`, the proxy's upstream key and
//! the request's `X-Request-Id`. A 2xx means released; a 404 is an instance without the endpoint
//! (its lease frees the blocks later), which is fine.
//!
//! Invariants: fire-and-forget (a spawned task; the client's answer never waits for it), bounded
//! by `connect_timeout` for the whole exchange, logged and counted in `KV_RELEASES_TOTAL`, never
//! retried.

use serde_json::{json, Map, Value};
use tracing::Instrument;

use crate::request::{KV_TRANSFER_PARAMS, X_REQUEST_ID};
use crate::state::ProxyState;
use crate::telemetry;

/// The producer's release endpoint, relative to its base URL.
pub const RELEASE_PATH: &str = "/v1/kv/release";

/// Spawns the release of the blocks `params` name on the prefill instance at `prefill_url`.
pub(crate) fn spawn_release(
    state: &ProxyState,
    prefill_url: &str,
    request_id: &str,
    params: Map<String, Value>,
) {
    let url = format!("{prefill_url}{RELEASE_PATH}");
    let request = state
        .upstream(state.client().post(&url))
        .header(X_REQUEST_ID, request_id)
        .timeout(state.settings().connect_timeout)
        .json(&json!({ KV_TRANSFER_PARAMS: params }));
    let span = tracing::info_span!("kv_release", request_id, prefill = %prefill_url);
    tokio::spawn(
        async move {
            let outcome = match request.send().await {
                Ok(response) if response.status().is_success() => {
                    tracing::info!("released the producer's KV blocks after a failed decode");
                    telemetry::OUTCOME_OK
                }
                Ok(response) if response.status() == reqwest::StatusCode::NOT_FOUND => {
                    tracing::debug!("the prefill instance has no KV release endpoint; its lease will free the blocks");
                    telemetry::OUTCOME_NOT_FOUND
                }
                Ok(response) => {
                    tracing::warn!(status = %response.status(), "the prefill instance refused the KV release");
                    telemetry::OUTCOME_FAILED
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the KV release did not reach the prefill instance");
                    telemetry::OUTCOME_FAILED
                }
            };
            telemetry::kv_release_finished(outcome);
        }
        .instrument(span),
    );
}
