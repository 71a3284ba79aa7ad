//! `tandem serve`'s configuration: one clap struct, every flag also `TANDEM_<FLAG>` in the
//! environment and a key of a TOML file given with `--config`.
//!
//! Precedence: command line > environment > TOML file > default. The TOML file is applied by
//! exporting each of its keys as the flag's environment variable when that variable is unset
//! ([`apply_toml_file`]), so the three sources cannot disagree about names or parsing.

use std::path::Path;

use clap::{ArgAction, Args};

/// The model `tandem serve` runs without `--model`.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// The step budget with chunked prefill when `--max-num-batched-tokens` is not given. On a
/// 2-vCPU Xeon, 512 against vLLM's 2048 served 16 streams at 1.1x the rate with half the mean
/// TTFT and half the ITL p99, and prefilled one 1800-token prompt 4% faster (BENCHMARKS.md).
pub const DEFAULT_STEP_BUDGET: usize = 512;

/// Flags of `tandem serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Model: `smollm2-135m` (the embedded default), a GGUF file, a Hugging Face directory
    /// (config.json + *.safetensors + tokenizer.json), or an `org/name` in the local hf-hub cache.
    #[arg(long, env = "TANDEM_MODEL", default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Name(s) the API accepts and reports for the model (default: the `--model` value).
    #[arg(long, env = "TANDEM_SERVED_MODEL_NAME", value_delimiter = ',')]
    pub served_model_name: Vec<String>,
    /// Where to listen (default `0.0.0.0`; `127.0.0.1` for a P/D instance without a KV transfer
    /// secret, which may not listen anywhere else).
    #[arg(long, env = "TANDEM_HOST")]
    pub host: Option<String>,
    #[arg(long, env = "TANDEM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Weight mode: `auto` (the fastest measured for this CPU and file: `native-amx` for Q4_1
    /// files with AMX-INT8, else `q8_0` with AVX512-VNNI, `native-i8` for Q4_1 files on other
    /// AVX2 CPUs), `f32` (everything dequantized: the accuracy mode), `q8_0`, `native`,
    /// `native-i8`, `native-amx` (AMX CPUs only) or `bf16` (`--device cuda`).
    #[arg(long, env = "TANDEM_DTYPE", default_value = "auto")]
    pub dtype: String,
    /// Tensor-parallel size: workers (threads of this process) that each hold a slice of every
    /// layer's attention heads, KV heads and MLP, and sum their partial results.
    #[arg(long, env = "TANDEM_TENSOR_PARALLEL_SIZE", default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Pipeline-parallel size: stages that each hold a contiguous run of the layers.
    #[arg(long, env = "TANDEM_PIPELINE_PARALLEL_SIZE", default_value_t = 1)]
    pub pipeline_parallel_size: usize,
    /// Where weights come from: `auto` (the `--model` files) or `dummy` (deterministic random
    /// weights of the shapes in `--model-config`, with a byte-level tokenizer; `--model` is then
    /// only the served name).
    #[arg(long, env = "TANDEM_LOAD_FORMAT", default_value = "auto")]
    pub load_format: String,
    /// An HF-style `config.json` for `--load-format dummy` (hidden_size, intermediate_size,
    /// num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size, …).
    #[arg(long, env = "TANDEM_MODEL_CONFIG")]
    pub model_config: Option<std::path::PathBuf>,
    /// Where the model runs: `cpu`, or `cuda` / `cuda:N` (GPU N; a binary built with the `cuda`
    /// feature: `scripts/gpu_build.sh`). On a GPU the weights and the KV cache are bf16 in device
    /// memory, and `--kv-cache-memory` is device memory.
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Element type of the KV cache: `auto` (f32 on the CPU, bf16 on a GPU), f32, f16 or bf16.
    #[arg(long, env = "TANDEM_KV_CACHE_DTYPE", default_value = "auto")]
    pub kv_cache_dtype: String,
    /// Order inside a KV cache block: `token_major` (`[tokens, heads, head_dim]`) or
    /// `head_major` (`[heads, tokens, head_dim]`: each head's rows contiguous). P/D between
    /// instances that split the KV heads differently (another `--tensor-parallel-size`, or
    /// replicated heads) moves single heads, which needs `head_major` on both sides.
    #[arg(long, env = "TANDEM_KV_CACHE_LAYOUT", default_value = "token_major")]
    pub kv_cache_layout: String,
    /// Tokens per KV cache block.
    #[arg(long, env = "TANDEM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Number of KV cache blocks (overrides `--kv-cache-memory`).
    #[arg(long, env = "TANDEM_NUM_KV_BLOCKS")]
    pub num_kv_blocks: Option<usize>,
    /// Memory for the KV cache, e.g. `512MiB`, `2GiB` or bytes.
    #[arg(long, env = "TANDEM_KV_CACHE_MEMORY", default_value = "1GiB")]
    pub kv_cache_memory: String,
    /// A hybrid model's sliding-window KV pool, in blocks per full-attention block, when sized
    /// from `--kv-cache-memory` (capped at what `--max-num-seqs` windows need; SGLang's
    /// `--swa-full-tokens-ratio`).
    #[arg(long, env = "TANDEM_SLIDING_WINDOW_POOL_RATIO", default_value_t = 0.8)]
    pub sliding_window_pool_ratio: f64,
    /// Longest prompt + output (default: the model's context, bounded by the cache).
    #[arg(long, env = "TANDEM_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Token budget of one engine step; default [`DEFAULT_STEP_BUDGET`] with chunked prefill (on
    /// the CPU smaller chunks prefill faster and let decode steps run between them), the max
    /// model length without.
    #[arg(long, env = "TANDEM_MAX_NUM_BATCHED_TOKENS")]
    pub max_num_batched_tokens: Option<usize>,
    /// Most requests in the running batch.
    #[arg(long, env = "TANDEM_MAX_NUM_SEQS", default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Reuse KV blocks across requests that share a prefix.
    #[arg(long, env = "TANDEM_ENABLE_PREFIX_CACHING", default_value_t = true, action = ArgAction::Set)]
    pub enable_prefix_caching: bool,
    /// Split long prompts over several steps.
    #[arg(long, env = "TANDEM_ENABLE_CHUNKED_PREFILL", default_value_t = true, action = ArgAction::Set)]
    pub enable_chunked_prefill: bool,
    /// Most prompt tokens of one request per step (0: only the step budget limits it).
    #[arg(long, env = "TANDEM_LONG_PREFILL_TOKEN_THRESHOLD", default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// P/D disaggregation: a JSON object with vLLM's keys (`kv_connector`, `kv_role`, …).
    #[arg(long, env = "TANDEM_KV_TRANSFER_CONFIG")]
    pub kv_transfer_config: Option<String>,
    /// File holding the P/D deployment's shared secret (at least 16 bytes): producers sign the
    /// `kv_transfer_params` they answer, consumers accept only signed ones, and a producer
    /// serves its KV handshake only to signed requests. Or the secret itself in
    /// `TANDEM_KV_TRANSFER_SECRET`. Without one a P/D instance listens on loopback only.
    #[arg(long, env = "TANDEM_KV_TRANSFER_SECRET_FILE")]
    pub kv_transfer_secret_file: Option<std::path::PathBuf>,
    /// Key clients must send as `Authorization: Bearer <key>` on every route but `/health`,
    /// `/metrics` and the KV routes (`/v1/kv/*`, which check the KV transfer secret and signed
    /// params instead); a missing or wrong key answers 401. Unset: no key is asked for.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<tandem_http_edge::ApiKey>,
    /// Most client connections served at once; a connection over it is closed at once.
    #[arg(long, env = "TANDEM_MAX_CONNECTIONS", default_value_t = tandem_http_edge::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Seconds a connection may take to send its request headers (and may stay idle between two
    /// requests on a keep-alive connection), and to send a request's body once its headers
    /// arrived; past it the connection is closed (the request fails).
    #[arg(long, env = "TANDEM_HEADER_READ_TIMEOUT_SECS", default_value_t = tandem_http_edge::DEFAULT_HEADER_READ_TIMEOUT_SECS)]
    pub header_read_timeout_secs: f64,
    /// Largest request body accepted (bytes); larger ones get 413.
    #[arg(long, env = "TANDEM_MAX_REQUEST_BODY_BYTES", default_value_t = 32 << 20)]
    pub max_request_body_bytes: usize,
}

/// Parses `512MiB`, `2GiB`, `1.5GB`, `1000000` into bytes.
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 512MiB, 2GiB, 1000000)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        u => return Err(format!("unknown size unit `{u}` in `{s}`")),
    };
    Ok((n * mult) as usize)
}

/// Exports every key of a TOML file as `{prefix}{KEY}` unless that variable is set. Keys may use
/// `-` or `_`; arrays become comma-separated lists, tables become JSON (for
/// `kv_transfer_config`).
pub fn apply_toml_file(path: &Path, prefix: &str) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| format!("config file {} is not valid TOML: {e}", path.display()))?;
    let mut set = Vec::new();
    for (key, value) in table {
        let var = format!("{prefix}{}", key.replace('-', "_").to_ascii_uppercase());
        if std::env::var_os(&var).is_some() {
            continue;
        }
        let s = toml_value_to_env(&value)
            .map_err(|e| format!("config file {}: key `{key}`: {e}", path.display()))?;
        // SAFETY of set_var: called on the main thread before the runtime and any other thread
        // start (see main.rs), so no concurrent reader of the environment exists.
        unsafe { std::env::set_var(&var, s) };
        set.push(var);
    }
    Ok(set)
}

fn toml_value_to_env(v: &toml::Value) -> Result<String, String> {
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Array(a) => a
            .iter()
            .map(toml_value_to_env)
            .collect::<Result<Vec<_>, _>>()?
            .join(","),
        toml::Value::Table(t) => serde_json::to_string(t).map_err(|e| e.to_string())?,
        toml::Value::Datetime(d) => d.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert_eq!(parse_bytes("1.5 GB").unwrap(), 1_500_000_000);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("5 parsecs").is_err());
    }
}
