//! `tandem health URL`: a liveness probe for container healthchecks, so an image needs no curl.
//!
//! One `GET URL` with a bounded timeout; success is a 2xx answer. It prints nothing on success
//! and one line on stderr otherwise, and never follows redirects (a probe that lands somewhere
//! else has not checked the service it names).

use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;

/// Flags of `tandem health`.
#[derive(Args, Debug, Clone)]
pub struct HealthArgs {
    /// The URL to check, e.g. `http://127.0.0.1:8000/health` (a URL without a path gets `/health`).
    #[arg(
        env = "TANDEM_HEALTH_URL",
        default_value = "http://127.0.0.1:8000/health"
    )]
    pub url: String,
    /// Seconds the whole check may take.
    #[arg(long, env = "TANDEM_HEALTH_TIMEOUT_SECS", default_value_t = 3.0)]
    pub timeout_secs: f64,
}

/// The URL to probe: `url`, with `/health` as its path when it names none.
pub fn probe_url(url: &str) -> anyhow::Result<reqwest::Url> {
    let mut parsed = reqwest::Url::parse(url).with_context(|| format!("{url:?} is not a URL"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        bail!("{url:?} is not an http(s) URL");
    }
    if parsed.path() == "/" && !url.ends_with('/') {
        parsed.set_path("/health");
    }
    Ok(parsed)
}

/// Runs the probe: `Ok` for a 2xx answer within the timeout, an error saying why otherwise.
pub async fn run(args: HealthArgs) -> anyhow::Result<()> {
    let url = probe_url(&args.url)?;
    let timeout = Duration::try_from_secs_f64(args.timeout_secs)
        .ok()
        .filter(|t| !t.is_zero())
        .with_context(|| {
            format!(
                "--timeout-secs {} is not a positive duration",
                args.timeout_secs
            )
        })?;
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .context("building the HTTP client")?;
    let response = client
        .get(url.clone())
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = response.status();
    if !status.is_success() {
        bail!("GET {url}: {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_without_a_path_probes_health() {
        assert_eq!(
            probe_url("http://decode:8200").unwrap().as_str(),
            "http://decode:8200/health"
        );
        assert_eq!(
            probe_url("http://127.0.0.1:9090/-/ready").unwrap().as_str(),
            "http://127.0.0.1:9090/-/ready"
        );
        assert_eq!(
            probe_url("http://127.0.0.1:8000/").unwrap().as_str(),
            "http://127.0.0.1:8000/"
        );
        assert!(probe_url("ftp://x/").is_err());
        assert!(probe_url("not a url").is_err());
    }
}
