//! `tandem bench`: a load generator for any running Tandem endpoint (an instance or the proxy).
//!
//! For each concurrency level it keeps that many streamed completions in flight, each with a
//! fixed prompt of `--prompt-tokens` token ids and exactly `--max-tokens` output tokens
//! (`ignore_eos`), and reports time to first token, inter-token latency and throughput. With
//! `--kv-metrics-url` it also reads the decode instance's KV transfer counters and compares the
//! bandwidth of transfers inside P/D requests with a single-threaded memcpy and a
//! `process_vm_readv` of the same bytes from memory (caches evicted first), in the same run.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use futures::StreamExt;
use serde_json::{json, Value};

/// Flags of `tandem bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Base URL of the endpoint (an instance or the proxy).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Concurrency levels to run, e.g. `1,16`.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub concurrency: Vec<usize>,
    /// Requests per concurrency level (at least the concurrency).
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 200)]
    pub prompt_tokens: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// The instance whose KV transfer metrics to report (P/D runs): the one that moves the
    /// bytes, the decode instance in pull mode, the prefill instance in push mode.
    #[arg(long)]
    pub kv_metrics_url: Option<String>,
    /// Print one JSON object per level instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Default, Clone)]
struct RequestTiming {
    ttft: f64,
    itls: Vec<f64>,
    tokens: usize,
}

/// Token ids of the benchmark prompt: deterministic, distinct per request (no prefix-cache hits).
fn prompt_ids(n: usize, request: usize) -> Vec<u32> {
    (0..n)
        .map(|i| 1000 + ((i * 7919 + request * 104_729) % 20_000) as u32)
        .collect()
}

async fn one_request(
    client: &reqwest::Client,
    url: &str,
    args: &BenchArgs,
    request: usize,
) -> anyhow::Result<RequestTiming> {
    let body = json!({
        "prompt": prompt_ids(args.prompt_tokens, request),
        "max_tokens": args.max_tokens,
        "ignore_eos": true,
        "temperature": 0,
        "stream": true,
    });
    let start = Instant::now();
    let resp = client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await?;
    if !resp.status().is_success() {
        bail!(
            "HTTP {}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        );
    }
    let mut t = RequestTiming::default();
    let mut last = None::<Instant>;
    let mut buf = String::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            let Some(data) = ev.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data)?;
            if v.get("error").is_some() {
                bail!("stream error: {v}");
            }
            if !carries_a_token(&v) {
                continue;
            }
            let now = Instant::now();
            match last {
                None => t.ttft = (now - start).as_secs_f64(),
                Some(l) => t.itls.push((now - l).as_secs_f64()),
            }
            last = Some(now);
            t.tokens += 1;
        }
    }
    Ok(t)
}

/// Whether a streamed completion event carries an output token: text, or no finish reason yet
/// (a token whose bytes end inside a UTF-8 character streams empty text). A server that ends
/// with an empty event holding only the finish reason (llama-server) or only usage sends no
/// token in it.
fn carries_a_token(event: &Value) -> bool {
    let Some(choice) = event["choices"].get(0) else {
        return false;
    };
    choice["text"].as_str().is_some_and(|t| !t.is_empty()) || choice["finish_reason"].is_null()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

async fn scrape(client: &reqwest::Client, url: &str, name: &str) -> anyhow::Result<f64> {
    let text = client
        .get(format!("{url}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    // Every series of the name, whatever its labels (`model_name` at least).
    Ok(text
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum())
}

/// Writes over 64 MiB so that the next copy reads its source from memory, as a KV transfer
/// does (the producer's blocks are not in the consumer's cache), not from a warm cache.
fn evict_caches(scratch: &mut [u8]) {
    for (i, b) in scratch.iter_mut().enumerate().step_by(64) {
        *b = i as u8;
    }
    std::hint::black_box(&scratch);
}

const SCRATCH_BYTES: usize = 64 << 20;

/// GB/s of a single-threaded copy of `bytes` bytes from memory, best of a few runs.
fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut scratch = vec![0u8; SCRATCH_BYTES];
    let mut best = f64::MAX;
    for _ in 0..5 {
        evict_caches(&mut scratch);
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

/// GB/s of `process_vm_readv` of `bytes` bytes from this process, in 64 KiB pieces, from memory.
fn vm_readv_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut scratch = vec![0u8; SCRATCH_BYTES];
    let piece = 64 << 10;
    let pid = std::process::id() as libc::pid_t;
    let mut best = f64::MAX;
    for _ in 0..5 {
        evict_caches(&mut scratch);
        let t = Instant::now();
        let mut off = 0;
        while off < bytes {
            let n = piece.min(bytes - off);
            let local = libc::iovec {
                iov_base: dst[off..].as_mut_ptr().cast(),
                iov_len: n,
            };
            let remote = libc::iovec {
                iov_base: src[off..].as_ptr() as *mut libc::c_void,
                iov_len: n,
            };
            // SAFETY: both iovecs point into live buffers of at least n bytes.
            let r = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
            if r <= 0 {
                return f64::NAN;
            }
            off += r as usize;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

/// Runs the benchmark and prints its results.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    // A connection per request: servers that close kept-alive connections after a few requests
    // (llama-server) would otherwise race a reused one ("connection closed before message
    // completed"); a loopback connect costs far less than a time to first token.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .pool_max_idle_per_host(0)
        .build()?;
    let url = args.url.trim_end_matches('/').to_string();
    // Warm up (model pages, allocator) with one short request.
    one_request(
        &client,
        &url,
        &BenchArgs {
            max_tokens: 2,
            ..args.clone()
        },
        usize::MAX / 2,
    )
    .await
    .context("warm-up request")?;
    let kv_before = match &args.kv_metrics_url {
        Some(u) => Some((
            scrape(&client, u, "tandem:kv_transfer_bytes_total").await?,
            scrape(&client, u, "tandem:kv_transfer_seconds_sum").await?,
            scrape(&client, u, "tandem:kv_transfer_seconds_count").await?,
        )),
        None => None,
    };
    if !args.json {
        println!(
            "{:>5} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}",
            "conc", "reqs", "ttft_mean", "ttft_p50", "ttft_p99", "itl_mean", "itl_p99", "out_tok/s"
        );
    }
    let mut next_id = 0usize;
    for &c in &args.concurrency {
        let c = c.max(1);
        let total = args.requests.max(c);
        let start = Instant::now();
        let ids: Vec<usize> = (next_id..next_id + total).collect();
        next_id += total;
        let results: Vec<anyhow::Result<RequestTiming>> = futures::stream::iter(ids)
            .map(|id| {
                let client = &client;
                let url = &url;
                let args = &args;
                async move { one_request(client, url, args, id).await }
            })
            .buffer_unordered(c)
            .collect()
            .await;
        let elapsed = start.elapsed().as_secs_f64();
        let timings: Vec<RequestTiming> = results.into_iter().collect::<Result<_, _>>()?;
        let mut ttft: Vec<f64> = timings.iter().map(|t| t.ttft).collect();
        let mut itl: Vec<f64> = timings
            .iter()
            .flat_map(|t| t.itls.iter().copied())
            .collect();
        ttft.sort_by(f64::total_cmp);
        itl.sort_by(f64::total_cmp);
        let tokens: usize = timings.iter().map(|t| t.tokens).sum();
        let row = json!({
            "concurrency": c,
            "requests": total,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "ttft_mean_s": mean(&ttft),
            "ttft_p50_s": percentile(&ttft, 0.5),
            "ttft_p99_s": percentile(&ttft, 0.99),
            "itl_mean_s": mean(&itl),
            "itl_p99_s": percentile(&itl, 0.99),
            "output_tokens_per_s": tokens as f64 / elapsed,
            "requests_per_s": total as f64 / elapsed,
        });
        if args.json {
            println!("{row}");
        } else {
            println!(
                "{:>5} {:>6} {:>9.1}ms {:>9.1}ms {:>9.1}ms {:>9.1}ms {:>9.1}ms {:>12.1}",
                c,
                total,
                mean(&ttft) * 1e3,
                percentile(&ttft, 0.5) * 1e3,
                percentile(&ttft, 0.99) * 1e3,
                mean(&itl) * 1e3,
                percentile(&itl, 0.99) * 1e3,
                tokens as f64 / elapsed
            );
        }
    }
    if let (Some(u), Some((b0, s0, n0))) = (&args.kv_metrics_url, kv_before) {
        let bytes = scrape(&client, u, "tandem:kv_transfer_bytes_total").await? - b0;
        let secs = scrape(&client, u, "tandem:kv_transfer_seconds_sum").await? - s0;
        let n = scrape(&client, u, "tandem:kv_transfer_seconds_count").await? - n0;
        if n > 0.0 && secs > 0.0 {
            let per = (bytes / n) as usize;
            let nixl = bytes / secs / 1e9;
            let mc = memcpy_gbps(per);
            let vm = vm_readv_gbps(per);
            let row = json!({
                "kv_transfers": n, "bytes_per_transfer": per,
                "nixl_gbps": nixl, "memcpy_gbps": mc, "process_vm_readv_gbps": vm,
                "nixl_vs_memcpy": nixl / mc, "nixl_vs_process_vm_readv": nixl / vm,
            });
            if args.json {
                println!("{row}");
            } else {
                println!(
                    "KV transfers: {n} of {:.2} MB; NIXL {nixl:.2} GB/s, memcpy {mc:.2} GB/s, process_vm_readv {vm:.2} GB/s; NIXL/memcpy {:.2}, NIXL/process_vm_readv {:.2}",
                    per as f64 / 1e6,
                    nixl / mc,
                    nixl / vm
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finish_only_or_usage_only_event_is_not_a_token() {
        let ev = |text: &str, finish: Value| json!({"choices": [{"index": 0, "text": text, "finish_reason": finish}]});
        assert!(carries_a_token(&ev("ter", Value::Null)));
        assert!(
            carries_a_token(&ev(",", json!("length"))),
            "last token with its reason"
        );
        assert!(
            carries_a_token(&ev("", Value::Null)),
            "a token inside a character"
        );
        assert!(
            !carries_a_token(&ev("", json!("length"))),
            "llama-server's closing event"
        );
        assert!(!carries_a_token(&json!({"choices": [], "usage": {}})));
        assert!(!carries_a_token(&json!({"object": "text_completion"})));
    }
}
