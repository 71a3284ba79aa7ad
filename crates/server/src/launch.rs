//! Starting one instance: load the model, size and allocate the KV cache, start the engine thread,
//! bind the HTTP server, and stop cleanly on ctrl-c or SIGTERM.

use std::sync::Arc;

use anyhow::{bail, Context};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tandem_engine::debug_fault::ENGINE_FAULT_ENV;
use tandem_engine::detokenizer::Detokenize;
use tandem_engine::model_worker::{ModelWorker, RankWorker};
use tandem_engine::ParallelWorker;
use tandem_engine::{
    EngineFault, EngineHandle, FaultyWorker, KvChecksumConfig, KvLoadFailurePolicy, Scheduler,
    SchedulerConfig, Worker, WorkerGrid,
};
use tandem_kv_cache::{CacheDtype, KvCacheConfig, KvCacheManager, KvStorage, LayoutOrder};
use tandem_kv_connector::auth::{TransferAuth, SECRET_ENV};
use tandem_kv_connector::base::{KvConnectorScheduler, KvConnectorWorker, NoopConnector};
use tandem_kv_connector::config::{KvMode, KvTransferConfig, LoadFailurePolicy};
use tandem_kv_connector::pull::{nixl_pull_connector, KvAdmission, KvPeerService};
use tandem_kv_connector::push::nixl_push_connector;
use tandem_models::{
    load_model, LoadFormat, LoadOptions, ParallelConfig, TextTokenizer, WeightMode,
};

use crate::config::{parse_bytes, ServeArgs, DEFAULT_MODEL};
use crate::state::{ApiTokenizer, AppState};

/// Installs the process-wide Prometheus recorder with latency buckets suited to LLM serving,
/// every series labelled `model_name` (the first served name, as vLLM labels its metrics), and
/// every counter with known labels registered at 0.
pub fn install_prometheus(model_name: &str) -> anyhow::Result<PrometheusHandle> {
    let latency = [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ];
    let tokens = [
        1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
    ];
    let bytes = [
        4096.0,
        65536.0,
        1048576.0,
        4194304.0,
        16777216.0,
        67108864.0,
        268435456.0,
        1073741824.0,
    ];
    let handle = PrometheusBuilder::new()
        .add_global_label("model_name", model_name)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &latency)?
        .set_buckets_for_metric(Matcher::Suffix("_tokens".into()), &tokens)?
        .set_buckets_for_metric(Matcher::Suffix("_tokens_total".into()), &tokens)?
        .set_buckets_for_metric(
            Matcher::Full(tandem_engine::metrics::NIXL_NUM_DESCRIPTORS.into()),
            &tokens,
        )?
        .set_buckets_for_metric(
            Matcher::Full(tandem_engine::metrics::NIXL_BYTES_TRANSFERRED.into()),
            &bytes,
        )?
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    tandem_engine::metrics::describe();
    tandem_engine::metrics::register_zeros();
    tandem_http_edge::metrics::describe();
    Ok(handle)
}

/// Adapts the model's tokenizer to what the engine and the API need.
struct Tokenizer(Arc<TextTokenizer>);

impl Detokenize for Tokenizer {
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        self.0.decode(ids, skip_special_tokens).unwrap_or_default()
    }
}

impl ApiTokenizer for Tokenizer {
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, String> {
        self.0.encode(text, true).map_err(|e| e.to_string())
    }
    fn encode_chat(
        &self,
        messages: &[(String, String)],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, String> {
        let msgs: Vec<tandem_models::ChatMessage> = messages
            .iter()
            .map(|(role, content)| tandem_models::ChatMessage {
                role: role.clone(),
                content: content.clone(),
            })
            .collect();
        let text = self
            .0
            .apply_chat_template(&msgs, add_generation_prompt)
            .map_err(|e| e.to_string())?;
        self.0.encode(&text, false).map_err(|e| e.to_string())
    }
    fn token_text(&self, id: u32) -> String {
        self.0.decode(&[id], false).unwrap_or_default()
    }
    fn decode(&self, ids: &[u32]) -> String {
        self.0.decode(ids, false).unwrap_or_default()
    }
}

/// The connector's two sides and, for P/D, its KV routes and admission check.
type ConnectorParts = (
    Box<dyn KvConnectorScheduler>,
    Box<dyn KvConnectorWorker>,
    Option<(KvPeerService, KvAdmission)>,
);

/// Everything `serve` builds before it listens, so tests can build it without a socket.
pub struct Instance {
    pub state: AppState,
    pub engine: EngineHandle,
}

/// Loads the model and starts the engine.
pub fn build_instance(
    args: &ServeArgs,
    prometheus: Option<PrometheusHandle>,
) -> anyhow::Result<Instance> {
    let transfer = parse_transfer_config(args)?;
    let fault = EngineFault::from_env()?;
    let device = ModelDevice::parse(&args.device)?;
    let cache_dtype = match (args.kv_cache_dtype.as_str(), device) {
        ("auto", ModelDevice::Cpu) => CacheDtype::F32,
        ("auto", ModelDevice::Cuda(_)) => CacheDtype::Bf16,
        (other, _) => CacheDtype::parse(other).with_context(|| {
            format!("--kv-cache-dtype `{other}`: expected auto, f32, f16 or bf16")
        })?,
    };
    let weights = match args.dtype.as_str() {
        "auto" => None,
        other => Some(WeightMode::parse(other).with_context(|| {
            format!("--dtype `{other}`: expected auto, f32, q8_0, native, native-i8, native-amx or bf16")
        })?),
    };
    if args.block_size == 0 || args.block_size > 1024 {
        bail!(
            "--block-size must be between 1 and 1024, got {}",
            args.block_size
        );
    }
    let kv_order = match args.kv_cache_layout.as_str() {
        "token_major" => LayoutOrder::TokenMajor,
        "head_major" => LayoutOrder::HeadMajor,
        other => bail!("--kv-cache-layout `{other}`: expected token_major or head_major"),
    };
    let parallel = ParallelConfig::new(args.tensor_parallel_size, args.pipeline_parallel_size)
        .context("--tensor-parallel-size / --pipeline-parallel-size")?;
    if transfer
        .as_ref()
        .is_some_and(|t| t.kv_mode() == KvMode::Push)
        && !parallel.is_single()
    {
        bail!(
            "push mode (NixlPushConnector) with --tensor-parallel-size or \
             --pipeline-parallel-size above 1 is not supported: use pull mode (NixlConnector), \
             which pairs any TP and PP layouts"
        );
    }
    let (format, spec) = load_format(args)?;
    let started = std::time::Instant::now();
    let opts = LoadOptions {
        weights,
        format,
        parallel,
        ..Default::default()
    };
    let loaded = load_for_device(device, &spec, &opts, args, cache_dtype)
        .with_context(|| format!("loading model `{spec}`"))?;
    let loaded_path = loaded.path.display().to_string();
    let world = loaded.world;
    let info = loaded.info.clone();
    let rank_groups = loaded.rank_groups.clone();
    // Every rank holds every block id of a group (its layers and heads of it): a block costs
    // all of them.
    let groups_for_checksums = rank_groups[0].clone();
    // The step budget: as given, else the chunked default, else the whole context (a prompt
    // must fit one step without chunked prefill).
    let step_budget = |max_model_len: usize| {
        args.max_num_batched_tokens
            .unwrap_or(if args.enable_chunked_prefill {
                crate::config::DEFAULT_STEP_BUDGET
            } else {
                max_model_len
            })
            .max(1)
    };
    let pools = crate::kv_pools::size_pools(
        &rank_groups,
        crate::kv_pools::PoolLimits {
            num_blocks: args.num_kv_blocks,
            memory: parse_bytes(&args.kv_cache_memory).map_err(anyhow::Error::msg)?,
            block_size: args.block_size,
            // Pull moves a table per group; push still runs one table for every group.
            shared_tables: transfer
                .as_ref()
                .is_some_and(|t| t.kv_mode() == tandem_kv_connector::KvMode::Push),
            sliding_ratio: args.sliding_window_pool_ratio,
            max_num_seqs: args.max_num_seqs.max(1),
            max_num_batched_tokens: step_budget(
                args.max_model_len.unwrap_or(info.max_position_embeddings),
            ),
        },
    )
    .map_err(anyhow::Error::msg)?;
    let num_blocks = pools.blocks_of(0);
    let cache_tokens = pools.max_tokens(args.block_size);
    let max_model_len = args
        .max_model_len
        .unwrap_or(info.max_position_embeddings)
        .min(cache_tokens);
    if let Some(m) = args.max_model_len {
        if m > info.max_position_embeddings {
            bail!(
                "--max-model-len {m} exceeds the model's context ({})",
                info.max_position_embeddings
            );
        }
    }
    let group_blocks = |groups: &[tandem_kv_cache::KvCacheGroup]| -> Vec<usize> {
        groups.iter().map(|g| pools.blocks_of(g.group_id)).collect()
    };
    // A GPU instance's checksum kernel (the CPU computes them otherwise).
    #[allow(unused_mut)]
    let mut device_checksums: Option<tandem_kv_checksum::SharedBackend> = None;
    let (models, storages): (Vec<Arc<dyn tandem_models::CausalLm>>, Vec<Arc<KvStorage>>) =
        match loaded.ranks {
            Ranks::Cpu(models) => {
                let storages = rank_groups
                    .into_iter()
                    .map(|groups| {
                        let blocks = group_blocks(&groups);
                        let config = KvCacheConfig { num_blocks, groups };
                        KvStorage::with_group_blocks(&config, kv_order, &blocks).map(Arc::new)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                (models, storages)
            }
            #[cfg(feature = "cuda")]
            Ranks::Gpu(files, gpu) => {
                if kv_order != LayoutOrder::TokenMajor {
                    bail!("--device cuda keeps its KV cache token_major");
                }
                let groups = rank_groups.into_iter().next().unwrap_or_default();
                let blocks = group_blocks(&groups);
                let model = files.upload(
                    &gpu,
                    tandem_models::cuda::GpuCacheOptions {
                        num_blocks,
                        block_size: args.block_size,
                        arrangement: tandem_kernels::cuda::KvArrangement::BlockMajor,
                        max_tokens: step_budget(max_model_len),
                    },
                )?;
                let config = KvCacheConfig { num_blocks, groups };
                // The engine's storage describes the device cache and reaches it (NIXL
                // registers its VRAM; fault injection copies blocks); the checksums run on the
                // GPU's kernel.
                let cache = model.decoder.cache().clone();
                let storage =
                    KvStorage::on_device(&config, kv_order, &blocks, Arc::new(cache.clone()))?;
                device_checksums =
                    Some(Arc::new(tandem_kernels::cuda::DeviceChecksums::new(cache)?));
                (vec![Arc::new(model)], vec![Arc::new(storage)])
            }
        };
    let kv_cache_bytes: usize = storages.iter().map(|s| s.total_bytes()).sum();
    metrics::gauge!(tandem_engine::metrics::CACHE_CONFIG_INFO,
        "block_size" => args.block_size.to_string(),
        "num_gpu_blocks" => num_blocks.to_string(),
        "cache_dtype" => cache_dtype.to_string(),
        "enable_prefix_caching" => args.enable_prefix_caching.to_string())
    .set(1.0);
    tracing::info!(
        model = %loaded.name,
        device = %args.device,
        weights = %info.weight_mode,
        kv_cache_dtype = %cache_dtype,
        num_blocks,
        group_blocks = ?pools.group_blocks,
        shared_block_table = pools.tables.len() == 1,
        block_size = args.block_size,
        kv_cache_mib = kv_cache_bytes >> 20,
        tp = parallel.tp,
        pp = parallel.pp,
        max_model_len,
        load_seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    let tokenizer = Arc::new(loaded.tokenizer);
    let tok = Arc::new(Tokenizer(tokenizer.clone()));
    let guidance = guidance(&tokenizer);
    let names = served_names(args, &spec);
    let auth = transfer_auth(args, transfer.as_ref())?;
    let (connector_sched, connector_worker, kv_routes): ConnectorParts = match &transfer {
        None => (Box::new(NoopConnector), Box::new(NoopConnector), None),
        Some(cfg) => {
            let (s, w, peer, admission) = match cfg.kv_mode() {
                KvMode::Pull => {
                    let mut parts =
                        nixl_pull_connector(cfg, &names[0], args.block_size, args.port, auth)
                            .context("--kv-transfer-config")?;
                    parts.scheduler.set_tp_size(parallel.tp);
                    parts.into_parts()
                }
                KvMode::Push => {
                    nixl_push_connector(cfg, &names[0], args.block_size, args.port, auth)
                        .context("--kv-transfer-config")?
                        .into_parts()
                }
            };
            (s, w, Some((peer, admission)))
        }
    };
    let (kv_peer, kv_admission) = kv_routes.unzip();
    let policy = match transfer.as_ref().map(|t| t.kv_load_failure_policy) {
        Some(LoadFailurePolicy::Fail) => KvLoadFailurePolicy::Fail,
        _ => KvLoadFailurePolicy::Recompute,
    };
    let sched_config = SchedulerConfig {
        max_num_batched_tokens: step_budget(max_model_len),
        max_num_seqs: args.max_num_seqs.max(1),
        max_model_len,
        enable_chunked_prefill: args.enable_chunked_prefill,
        long_prefill_token_threshold: args.long_prefill_token_threshold,
        kv_load_failure_policy: policy,
        kv_partial_recompute: transfer.as_ref().is_none_or(|t| t.kv_partial_recompute),
    };
    if !args.enable_chunked_prefill && sched_config.max_num_batched_tokens < max_model_len {
        bail!(
            "without chunked prefill, --max-num-batched-tokens ({}) must be at least the max model length ({max_model_len})",
            sched_config.max_num_batched_tokens
        );
    }
    let mut scheduler = Scheduler::new(
        sched_config,
        KvCacheManager::with_groups(&pools.tables, args.block_size, args.enable_prefix_caching),
        connector_sched,
        tok.clone(),
        tokenizer.stop_token_ids().to_vec(),
    );
    if let Some(cfg) = &transfer {
        let checksums =
            KvChecksumConfig::from_transfer_config(cfg).context("--kv-transfer-config")?;
        let on = scheduler
            .enable_kv_checksums(
                &checksums,
                &groups_for_checksums,
                WorkerGrid {
                    tp_size: parallel.tp as u32,
                    pp_size: parallel.pp as u32,
                },
            )
            .context("--kv-transfer-config")?;
        // The scheduler logs the settings when they are on.
        if !on {
            tracing::info!("KV checksums off (enable_kv_checksum is not set)");
        }
    }
    let mut worker: Box<dyn Worker> = match world {
        None => {
            let worker = ModelWorker::new(
                models[0].clone(),
                storages[0].clone(),
                args.block_size,
                connector_worker,
            )?;
            Box::new(match device_checksums {
                Some(backend) => worker.with_checksum_backend(backend),
                None => worker,
            })
        }
        Some(world) => {
            let ranks = models
                .into_iter()
                .zip(storages)
                .map(|(model, storage)| RankWorker::new(model, storage, args.block_size))
                .collect::<Result<Vec<_>, _>>()?;
            Box::new(ParallelWorker::new(
                parallel,
                ranks,
                world,
                connector_worker,
            )?)
        }
    };
    if let Some(fault) = fault {
        tracing::warn!(
            "{ENGINE_FAULT_ENV}={fault}: the engine will panic on purpose (testing only); \
             unset it for real traffic"
        );
        worker = Box::new(FaultyWorker::new(worker, fault));
    }
    let engine = EngineHandle::spawn(scheduler, worker, info.vocab_size)?;
    let state = AppState {
        engine: engine.clone(),
        tokenizer: tok,
        model_names: Arc::new(names),
        max_model_len,
        model_root: loaded_path,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        prometheus,
        max_body_bytes: args.max_request_body_bytes,
        kv_peer,
        kv_admission,
        guidance,
    };
    Ok(Instance { state, engine })
}

/// Where the model runs (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelDevice {
    Cpu,
    /// GPU ordinal.
    Cuda(usize),
}

impl ModelDevice {
    fn parse(s: &str) -> anyhow::Result<Self> {
        match s {
            "cpu" => Ok(ModelDevice::Cpu),
            "cuda" => Ok(ModelDevice::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(ModelDevice::Cuda(n)),
                _ => bail!("--device `{other}`: expected cpu, cuda or cuda:N"),
            },
        }
    }
}

/// The model as the engine gets it: CPU ranks ready to run, or a model read for a GPU that is
/// placed there once the KV cache is sized.
enum Ranks {
    Cpu(Vec<Arc<dyn tandem_models::CausalLm>>),
    #[cfg(feature = "cuda")]
    Gpu(
        Box<tandem_models::cuda::GpuModelFiles>,
        tandem_kernels::cuda::Device,
    ),
}

struct LoadedForEngine {
    name: String,
    path: std::path::PathBuf,
    tokenizer: TextTokenizer,
    info: tandem_models::ModelInfo,
    world: Option<tandem_parallel::CpuWorld>,
    /// Each rank's KV cache groups.
    rank_groups: Vec<Vec<tandem_kv_cache::KvCacheGroup>>,
    ranks: Ranks,
}

/// Loads the model for `device`: on the CPU every rank's shard; for a GPU the files, checked,
/// and the GPU opened (a GPU instance runs one whole model).
fn load_for_device(
    device: ModelDevice,
    spec: &str,
    opts: &LoadOptions,
    args: &ServeArgs,
    cache_dtype: CacheDtype,
) -> anyhow::Result<LoadedForEngine> {
    match device {
        ModelDevice::Cpu => {
            let mut loaded = load_model(spec, opts)?;
            let models: Vec<Arc<dyn tandem_models::CausalLm>> =
                loaded.ranks.drain(..).map(Arc::from).collect();
            let rank_groups = models
                .iter()
                .map(|m| m.kv_cache_groups(args.block_size, cache_dtype))
                .collect();
            Ok(LoadedForEngine {
                name: loaded.name,
                path: loaded.path,
                tokenizer: loaded.tokenizer,
                info: loaded.info,
                world: loaded.world,
                rank_groups,
                ranks: Ranks::Cpu(models),
            })
        }
        ModelDevice::Cuda(ordinal) => {
            if cache_dtype != CacheDtype::Bf16 {
                bail!("--device cuda keeps its KV cache in bf16 (--kv-cache-dtype auto or bf16)");
            }
            gpu_model(ordinal, spec, opts, args, cache_dtype)
        }
    }
}

#[cfg(feature = "cuda")]
fn gpu_model(
    ordinal: usize,
    spec: &str,
    opts: &LoadOptions,
    args: &ServeArgs,
    cache_dtype: CacheDtype,
) -> anyhow::Result<LoadedForEngine> {
    let gpu = tandem_kernels::cuda::Device::open(ordinal)?;
    let (files, tokenizer) = tandem_models::cuda::read_gpu_model(spec, opts)?;
    tracing::info!(gpu = %gpu.name().unwrap_or_default(), ordinal, "GPU opened");
    Ok(LoadedForEngine {
        name: files.name.clone(),
        path: files.path.clone(),
        tokenizer,
        info: files.info().clone(),
        world: None,
        rank_groups: vec![files.kv_cache_groups(args.block_size, cache_dtype)],
        ranks: Ranks::Gpu(Box::new(files), gpu),
    })
}

#[cfg(not(feature = "cuda"))]
fn gpu_model(
    _ordinal: usize,
    _spec: &str,
    _opts: &LoadOptions,
    _args: &ServeArgs,
    _cache_dtype: CacheDtype,
) -> anyhow::Result<LoadedForEngine> {
    bail!(
        "--device cuda needs a tandem built with the `cuda` feature (scripts/gpu_build.sh builds \
         one); this one runs on the CPU only"
    )
}

/// Structured outputs' view of the vocabulary: every token's bytes, ending on the first EOS.
fn guidance(tokenizer: &TextTokenizer) -> Result<tandem_structured::Guidance, String> {
    let started = std::time::Instant::now();
    let eos = *tokenizer
        .eos_token_ids()
        .first()
        .ok_or("the tokenizer has no EOS token")?;
    let g =
        tandem_structured::Guidance::new(&tokenizer.token_bytes(), eos).map_err(|e| e.to_string());
    match &g {
        Ok(_) => tracing::debug!(
            seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
            "structured outputs ready"
        ),
        Err(e) => tracing::warn!("structured outputs are unavailable: {e}"),
    }
    g
}

/// The names the API serves: `--served-model-name`, else the spec loaded (for dummy weights,
/// the config file's stem by default). Never empty.
fn served_names(args: &ServeArgs, spec: &str) -> Vec<String> {
    if args.served_model_name.is_empty() {
        vec![spec.to_string()]
    } else {
        args.served_model_name.clone()
    }
}

/// `--load-format` and `--model-config`, and the spec to load: for dummy weights `--model` is
/// only the name, and the default name gives way to the config file's stem.
fn load_format(args: &ServeArgs) -> anyhow::Result<(LoadFormat, String)> {
    match (args.load_format.as_str(), &args.model_config) {
        ("auto", None) => Ok((LoadFormat::Auto, args.model.clone())),
        ("auto", Some(_)) => bail!("--model-config is only used with --load-format dummy"),
        ("dummy", None) => bail!("--load-format dummy needs --model-config FILE.json"),
        ("dummy", Some(config)) => {
            let name = if args.model == DEFAULT_MODEL {
                config
                    .file_stem()
                    .map_or_else(|| "dummy".into(), |s| s.to_string_lossy().into_owned())
            } else {
                args.model.clone()
            };
            Ok((
                LoadFormat::Dummy {
                    config: config.clone(),
                },
                name,
            ))
        }
        (other, _) => bail!("--load-format `{other}`: expected auto or dummy"),
    }
}

/// Parses `--kv-transfer-config`; only the NIXL connector exists.
pub fn parse_transfer_config(args: &ServeArgs) -> anyhow::Result<Option<KvTransferConfig>> {
    match &args.kv_transfer_config {
        None => Ok(None),
        Some(json) if json.trim().is_empty() => Ok(None),
        Some(json) => {
            let cfg = KvTransferConfig::parse(json).context("--kv-transfer-config")?;
            Ok(Some(cfg))
        }
    }
}

/// The deployment's KV transfer secret (`--kv-transfer-secret-file`, else
/// `TANDEM_KV_TRANSFER_SECRET`); a secret for an instance that is not P/D is refused.
pub fn transfer_auth(
    args: &ServeArgs,
    transfer: Option<&KvTransferConfig>,
) -> anyhow::Result<Option<TransferAuth>> {
    let auth = TransferAuth::load(args.kv_transfer_secret_file.as_deref())
        .context("--kv-transfer-secret-file")?;
    if transfer.is_none() && auth.is_some() {
        if args.kv_transfer_secret_file.is_some() {
            bail!(
                "--kv-transfer-secret-file needs --kv-transfer-config: only P/D instances use it"
            );
        }
        tracing::warn!("{SECRET_ENV} is set but this instance is not P/D; it is not used");
        return Ok(None);
    }
    Ok(auth)
}

fn is_loopback(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Where `serve` listens. Protected by default: a P/D instance without a KV transfer secret
/// listens on loopback only (its KV memory would otherwise be readable by anyone who reaches it),
/// and a non-loopback `--host` is refused with how to set a secret.
pub fn listen_host(args: &ServeArgs) -> anyhow::Result<String> {
    let transfer = parse_transfer_config(args)?;
    let secret = transfer_auth(args, transfer.as_ref())?.is_some();
    match (&args.host, transfer.is_some() && !secret) {
        (Some(h), true) if !is_loopback(h) => bail!(
            "--host {h}: a P/D instance without a KV transfer secret listens on loopback only \
             (otherwise anyone who reaches it can read its KV cache). Give every P/D instance \
             the same secret: --kv-transfer-secret-file FILE (e.g. `head -c 32 /dev/urandom | \
             base64 > FILE`) or {SECRET_ENV}=...; or listen on 127.0.0.1"
        ),
        (Some(h), _) => Ok(h.clone()),
        (None, true) => {
            tracing::info!(
                "P/D without a KV transfer secret: listening on 127.0.0.1 only \
                 (set --kv-transfer-secret-file to serve other hosts)"
            );
            Ok("127.0.0.1".into())
        }
        (None, false) => Ok("0.0.0.0".into()),
    }
}

/// Work that must happen before any thread exists: loading NIXL (it may set UCX's environment).
pub fn preload(args: &ServeArgs) -> anyhow::Result<()> {
    if let Some(cfg) = parse_transfer_config(args)? {
        for note in &cfg.notes {
            tracing::warn!("{note}");
        }
        let lib = tandem_kv_connector::nixl::load_nixl(
            cfg.kv_connector_extra_config.nixl_lib_dir.as_deref(),
        )
        .context("--kv-transfer-config needs NIXL")?;
        tracing::info!(path = %lib.path.display(), "NIXL library loaded");
    }
    Ok(())
}

/// How long `serve` waits for the engine thread after the HTTP server stopped.
const ENGINE_STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `tandem serve`: runs until ctrl-c or SIGTERM.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let host = listen_host(&args)?;
    let limits =
        tandem_http_edge::EdgeLimits::new(args.max_connections, args.header_read_timeout_secs)
            .context("--max-connections / --header-read-timeout-secs")?;
    // Labelled with the first name the API serves, as vLLM labels its metrics.
    let model_name = served_names(&args, &load_format(&args)?.1).swap_remove(0);
    let prometheus = install_prometheus(&model_name)?;
    let instance = build_instance(&args, Some(prometheus))?;
    let addr = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{}", args.port)
    } else {
        format!("{host}:{}", args.port)
    };
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!("listening on http://{addr}");
    let app = tandem_http_edge::require_api_key(
        crate::app(instance.state),
        args.api_key.as_ref().map(|k| k.shared()),
        crate::routes::OPEN_PATHS,
    );
    tandem_http_edge::serve(listener, app, limits, tandem_proxy::shutdown_signal())
        .await
        .context("serving HTTP")?;
    // Tear the engine (and its NIXL agent) down before the process exits, never during exit.
    instance.engine.shutdown_and_wait(ENGINE_STOP_TIMEOUT);
    tracing::info!("stopped");
    Ok(())
}
