//! The `tandem` binary: `serve` (one instance), `proxy` (the P/D front), `kv-checksum` (the
//! checksum definition, from outside), `health` (a probe for container healthchecks).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tandem_server::config::{apply_toml_file, ServeArgs};

#[derive(Parser, Debug)]
#[command(
    name = "tandem",
    version,
    about = "An LLM inference server with verified prefill/decode disaggregation"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as text (colours only on a terminal, never with NO_COLOR set) or as one JSON
    /// object per line. The level and filters come from RUST_LOG (default `info`).
    #[arg(long, global = true, env = "TANDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve {
        /// A TOML file whose keys are `serve`'s flags (command line and environment win).
        #[arg(long, env = "TANDEM_CONFIG")]
        config: Option<PathBuf>,
        #[command(flatten)]
        args: Box<ServeArgs>,
    },
    /// Route requests to prefill and decode instances.
    Proxy {
        /// A TOML file whose keys are `proxy`'s flags (command line and environment win).
        #[arg(long, env = "TANDEM_PROXY_CONFIG")]
        config: Option<PathBuf>,
        #[command(flatten)]
        args: tandem_proxy::ProxyArgs,
    },
    /// Measure TTFT, inter-token latency and throughput of a running endpoint.
    Bench {
        #[command(flatten)]
        args: tandem_server::bench::BenchArgs,
    },
    /// Exit 0 if `GET URL` answers 2xx in time, else print why and exit 1 (container healthchecks).
    Health {
        #[command(flatten)]
        args: tandem_server::probe::HealthArgs,
    },
    /// Write a Hugging Face tokenizer directory for a model (what guidellm and aiperf load to
    /// count tokens offline): tokenizer.json, tokenizer_config.json, special_tokens_map.json.
    ExportTokenizer {
        /// The model, as `serve --model` takes it.
        #[arg(long, default_value = "smollm2-135m")]
        model: String,
        /// The directory to write (created if missing).
        dir: PathBuf,
    },
    /// Print the KV checksums of KV held in a safetensors file, as JSON.
    KvChecksum {
        /// safetensors with `layers.{L}.k` / `layers.{L}.v`, each [tokens, kv_heads, head_dim].
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        block_size: usize,
        /// Position of the file's first token in the request.
        #[arg(long, default_value_t = 0)]
        start_token: usize,
        /// Tokens of the request the checksums cover (default: all in the file).
        #[arg(long)]
        num_tokens: Option<usize>,
    },
}

/// Applies `--config FILE` (or its env var) before clap reads the environment.
fn preload_config_file() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let sub = args.get(1).map(String::as_str).unwrap_or("");
    let (env_var, prefix) = match sub {
        "serve" => ("TANDEM_CONFIG", "TANDEM_"),
        "proxy" => ("TANDEM_PROXY_CONFIG", "TANDEM_PROXY_"),
        _ => return Ok(()),
    };
    let mut path = std::env::var_os(env_var).map(PathBuf::from);
    for (i, a) in args.iter().enumerate() {
        if a == "--config" {
            path = args.get(i + 1).map(PathBuf::from);
        } else if let Some(p) = a.strip_prefix("--config=") {
            path = Some(PathBuf::from(p));
        }
    }
    if let Some(p) = path {
        apply_toml_file(&p, prefix).map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// Logs go to stdout; ANSI colours only when stdout is a terminal and `NO_COLOR` is unset or
/// empty (<https://no-color.org>).
fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let ansi = std::io::stdout().is_terminal() && !no_color;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    match format {
        LogFormat::Text => builder.with_ansi(ansi).init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}

/// KV in GPU memory moves over UCX's CUDA IPC transport between processes on one host. UCX
/// turns its zero-copy GETs (NIXL READs, pull mode) off where it sees no NVLink (one GPU, PCIe)
/// and falls back to TCP at ~0.5 GB/s; READs then need `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`, which
/// Tandem sets unless the environment says otherwise (the NIXL agent logs the value in use).
fn gpu_transport_env() {
    const VAR: &str = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY";
    if std::env::var_os(VAR).is_none() {
        // Before any thread exists (main's first steps): no concurrent getenv.
        std::env::set_var(VAR, "y");
    }
}

fn main() -> anyhow::Result<()> {
    // Before any thread exists: the config file becomes environment variables.
    preload_config_file()?;
    let cli = Cli::parse();
    // Also before any thread: `auto` becomes the address a producer advertises, and a GPU
    // instance gets the UCX settings its KV transfers need.
    let advertised = match &cli.command {
        Command::Serve { args, .. } => {
            if args.device.starts_with("cuda") {
                gpu_transport_env();
            }
            tandem_server::advertise::resolve_auto()?
        }
        _ => None,
    };
    match cli.command {
        Command::KvChecksum {
            input,
            block_size,
            start_token,
            num_tokens,
        } => {
            let json = tandem_kv_checksum::checksum_safetensors_file(
                &input,
                block_size,
                start_token,
                num_tokens,
            )?;
            println!("{}", serde_json::to_string_pretty(&json)?);
            Ok(())
        }
        Command::ExportTokenizer { model, dir } => {
            let opts = tandem_models::LoadOptions::default();
            let (name, tokenizer, max_len) = tandem_models::load_tokenizer(&model, &opts)?;
            for f in tokenizer.export_hf_dir(&dir, max_len)? {
                println!("{}", f.display());
            }
            eprintln!("tokenizer of {name} written to {}", dir.display());
            Ok(())
        }
        Command::Serve { args, .. } => {
            init_tracing(cli.log_format);
            if let Some(a) = advertised {
                tracing::info!(ip = %a.ip, ucx_net_devices = ?a.ucx_net_device,
                    "side channel host: auto resolved to this machine's address");
            }
            tandem_server::launch::preload(&args)?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            rt.block_on(tandem_server::launch::serve(*args))
        }
        Command::Health { args } => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            if let Err(e) = rt.block_on(tandem_server::probe::run(args)) {
                eprintln!("unhealthy: {e:#}");
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Bench { args } => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            rt.block_on(tandem_server::bench::run(args))
        }
        Command::Proxy { args, .. } => {
            init_tracing(cli.log_format);
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            rt.block_on(tandem_proxy::serve(args))
                .map_err(|e| anyhow::anyhow!("{e}"))
        }
    }
}
