//! From a `--model` argument to a ready model: resolution of the name, then loading of the
//! weights, tokenizer and chat template.
//!
//! A spec is resolved, in order, as:
//! 1. an embedded model name (`smollm2-135m`), looked up in the model cache directory:
//!    `LoadOptions::model_dir`, else `$TANDEM_MODEL_DIR`, else the first `.models` folder found
//!    walking up from the current directory and then from the executable's directory
//!    (`scripts/setup.sh` fills `<repo>/.models`);
//! 2. an existing path: a GGUF file, or a Hugging Face directory (`config.json` +
//!    `*.safetensors` + `tokenizer.json`), or a directory holding exactly one GGUF file;
//! 3. a Hugging Face id `org/name`, looked up offline in the hf-hub cache
//!    (`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`), snapshot of `refs/main`.
//!
//! Nothing is downloaded: a spec that resolves to nothing is a [`ModelError::NotFound`] that says
//! where it looked.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tandem_parallel::{Collectives, CpuWorld, ParallelConfig, SingleRank};

use crate::decoder::{DecoderConfig, DecoderWeights};
use crate::dummy::DummySource;
use crate::error::ModelError;
use crate::gguf::{is_gguf, GgufFile};
use crate::hf::SafetensorsSource;
use crate::model::{CausalLm, ModelInfo};
use crate::tokenizer::TextTokenizer;
use crate::weights::WeightMode;

/// Models known by name: (name, file in the model cache directory).
pub const EMBEDDED_MODELS: &[(&str, &str)] = &[
    ("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"),
];

/// The environment variable naming the model cache directory.
pub const MODEL_DIR_ENV: &str = "TANDEM_MODEL_DIR";

/// Where weights come from (`--load-format`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum LoadFormat {
    /// The model the spec resolves to (GGUF or safetensors).
    #[default]
    Auto,
    /// Deterministic random weights of the shapes of an HF-style `config.json` (`--model-config`),
    /// with a byte-level tokenizer: see [`crate::dummy`]. The spec is only the model's name.
    Dummy { config: PathBuf },
}

/// How to load a model.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// How weights are held in memory (`--dtype`); `None` (`auto`) picks the mode for this
    /// CPU and the file's matrices ([`WeightMode::auto_for`]).
    pub weights: Option<WeightMode>,
    /// The model cache directory; `None` resolves it as the module docs say.
    pub model_dir: Option<PathBuf>,
    pub format: LoadFormat,
    /// Tensor- and pipeline-parallel sizes: one shard per rank.
    pub parallel: ParallelConfig,
}

/// A loaded model with everything the engine and server need.
pub struct LoadedModel {
    /// The name the server reports (`/v1/models`): the spec for named models and HF ids,
    /// the file stem or directory name for paths.
    pub name: String,
    /// One shard per rank, in worker-index order (`pp_rank * tp + tp_rank`); one whole model
    /// for TP 1, PP 1.
    pub ranks: Vec<Box<dyn CausalLm>>,
    /// The shared-memory world the ranks' collectives run over (TP or PP above 1): its owner
    /// resets it between steps after a rank failed.
    pub world: Option<CpuWorld>,
    pub tokenizer: TextTokenizer,
    /// The whole model's shape (with rank 0's `weight_bytes`).
    pub info: ModelInfo,
    /// The file or directory the model was loaded from (the config file for dummy weights).
    pub path: PathBuf,
}

impl LoadedModel {
    /// The first rank's model: the whole model when TP and PP are 1.
    pub fn model(&self) -> &dyn CausalLm {
        self.ranks[0].as_ref()
    }
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("name", &self.name)
            .field("path", &self.path)
            .field("info", &self.info)
            .finish()
    }
}

/// Where a spec resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Gguf(PathBuf),
    HfDir(PathBuf),
}

impl ModelSource {
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Gguf(p) | ModelSource::HfDir(p) => p,
        }
    }
}

/// The model cache directory (see the module docs), if one exists.
pub fn model_cache_dir(opts: &LoadOptions) -> Option<PathBuf> {
    if let Some(d) = &opts.model_dir {
        return Some(d.clone());
    }
    if let Some(d) = std::env::var_os(MODEL_DIR_ENV).filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d));
    }
    let starts = [
        std::env::current_dir().ok(),
        std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf)),
    ];
    starts.into_iter().flatten().find_map(|start| {
        start
            .ancestors()
            .map(|a| a.join(".models"))
            .find(|d| d.is_dir())
    })
}

fn hf_hub_dirs() -> Vec<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let mut dirs = Vec::new();
    dirs.extend(env("HF_HUB_CACHE"));
    dirs.extend(env("HF_HOME").map(|h| h.join("hub")));
    dirs.extend(env("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")));
    dirs.extend(env("HOME").map(|h| h.join(".cache/huggingface/hub")));
    dirs
}

/// The snapshot of `org/name` in an hf-hub cache: `refs/main`'s revision, else the newest.
fn hf_snapshot(hub: &Path, id: &str) -> Option<PathBuf> {
    let repo = hub.join(format!("models--{}", id.replace('/', "--")));
    let snaps = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let p = snaps.join(rev.trim());
        if p.is_dir() {
            return Some(p);
        }
    }
    std::fs::read_dir(&snaps)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .map(|e| e.path())
}

/// What a directory holds: an HF model, or a single GGUF file.
fn classify_dir(dir: &Path) -> Option<ModelSource> {
    if dir.join("config.json").is_file() {
        return Some(ModelSource::HfDir(dir.to_owned()));
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    match &ggufs[..] {
        [one] => Some(ModelSource::Gguf(one.clone())),
        _ => None,
    }
}

/// Resolves `spec` to the served name and where the model lives (see the module docs).
pub fn resolve_model(spec: &str, opts: &LoadOptions) -> Result<(String, ModelSource), ModelError> {
    let not_found = |reason: String| ModelError::NotFound {
        spec: spec.to_owned(),
        reason,
    };
    if let Some((name, file)) = EMBEDDED_MODELS.iter().find(|(n, f)| {
        n.eq_ignore_ascii_case(spec) || f.trim_end_matches(".gguf").eq_ignore_ascii_case(spec)
    }) {
        let dir = model_cache_dir(opts).ok_or_else(|| {
            not_found(format!(
                "no model cache directory (set {MODEL_DIR_ENV} or run scripts/setup.sh to fill <repo>/.models)"
            ))
        })?;
        let path = dir.join(file);
        if !path.is_file() {
            return Err(not_found(format!(
                "{} does not exist (run scripts/setup.sh)",
                path.display()
            )));
        }
        return Ok((name.to_string(), ModelSource::Gguf(path)));
    }
    let path = Path::new(spec);
    if path.is_file() {
        if !is_gguf(path) {
            return Err(not_found(format!(
                "{} is not a GGUF file (pass a GGUF file or a model directory)",
                path.display()
            )));
        }
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| spec.to_owned());
        return Ok((name, ModelSource::Gguf(path.to_owned())));
    }
    if path.is_dir() {
        let name = path
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| spec.to_owned());
        return classify_dir(path).map(|s| (name, s)).ok_or_else(|| {
            not_found("the directory has neither config.json nor exactly one .gguf file".into())
        });
    }
    let looks_like_id = spec.split('/').count() == 2
        && !spec.starts_with('.')
        && spec.split('/').all(|p| !p.is_empty());
    if looks_like_id {
        let hubs = hf_hub_dirs();
        for hub in &hubs {
            if let Some(snap) = hf_snapshot(hub, spec) {
                if let Some(src) = classify_dir(&snap) {
                    return Ok((spec.to_owned(), src));
                }
            }
        }
        return Err(not_found(format!(
            "not in the hf-hub cache (looked in {}); models are not downloaded",
            hubs.iter()
                .map(|h| h.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Err(not_found(format!(
        "not a known model name ({}), an existing path, or a Hugging Face id",
        EMBEDDED_MODELS
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// Resolves and loads a model: weights in `opts.weights` mode (or the one `auto` picks), one
/// shard per rank of `opts.parallel`, tokenizer and chat template.
pub fn load_model(spec: &str, opts: &LoadOptions) -> Result<LoadedModel, ModelError> {
    let start = Instant::now();
    let (name, path, weights, tokenizer) = read_weights(spec, opts)?;
    let (comms, world): (Vec<Arc<dyn Collectives>>, _) = if opts.parallel.is_single() {
        (vec![Arc::new(SingleRank)], None)
    } else {
        let world = CpuWorld::new(opts.parallel);
        (world.ranks(), Some(world))
    };
    let mode = opts
        .weights
        .unwrap_or_else(|| WeightMode::auto_for(weights.layers_q4_1()));
    let ranks = comms
        .into_iter()
        .map(|comm| Ok(Box::new(weights.shard(mode, comm)?) as Box<dyn CausalLm>))
        .collect::<Result<Vec<_>, ModelError>>()?;
    let info = ranks[0].info().clone();
    tracing::info!(
        model = %name,
        path = %path.display(),
        arch = %info.architecture,
        layers = info.num_layers,
        weights = %info.weight_mode,
        tp = opts.parallel.tp,
        pp = opts.parallel.pp,
        weight_mib = info.weight_bytes / (1 << 20),
        cpu_kernels = crate::cpu::Isa::active().name(),
        cpu_best = crate::cpu::Isa::detected().name(),
        secs = start.elapsed().as_secs_f32(),
        "model loaded"
    );
    Ok(LoadedModel {
        name,
        ranks,
        world,
        tokenizer,
        info,
        path,
    })
}

/// Resolves `spec` and reads its weights and tokenizer: (name, path, weights, tokenizer).
pub(crate) fn read_weights(
    spec: &str,
    opts: &LoadOptions,
) -> Result<(String, PathBuf, DecoderWeights, TextTokenizer), ModelError> {
    Ok(match &opts.format {
        LoadFormat::Dummy { config } => {
            let cfg = dummy_config(config)?;
            let tokenizer = TextTokenizer::byte_level(cfg.vocab_size)?;
            let weights = DecoderWeights::read(&mut DummySource::new(&cfg), cfg)?;
            (spec.to_owned(), config.clone(), weights, tokenizer)
        }
        LoadFormat::Auto => {
            let (name, source) = resolve_model(spec, opts)?;
            let (weights, tokenizer) = match &source {
                ModelSource::Gguf(path) => {
                    let mut g = GgufFile::open(path)?;
                    let cfg = DecoderConfig::from_gguf(&mut g)?;
                    let tokenizer = TextTokenizer::from_gguf(&g)?;
                    (DecoderWeights::read(&mut g, cfg)?, tokenizer)
                }
                ModelSource::HfDir(dir) => {
                    let cfg = hf_config(dir)?;
                    let tokenizer = TextTokenizer::from_hf_dir(dir)?;
                    let mut src = SafetensorsSource::open(dir)?;
                    (DecoderWeights::read(&mut src, cfg)?, tokenizer)
                }
            };
            (name, source.path().to_owned(), weights, tokenizer)
        }
    })
}

/// The config of a dummy model: an HF-style `config.json` (`model_type` may be left out).
fn dummy_config(path: &Path) -> Result<DecoderConfig, ModelError> {
    let mut json = read_json(path)?;
    if let Some(obj) = json.as_object_mut() {
        obj.entry("model_type").or_insert("llama".into());
    }
    DecoderConfig::from_hf_json(&json)
        .map_err(|e| ModelError::format(format!("{}: {e}", path.display())))
}

fn read_json(path: &Path) -> Result<serde_json::Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::format(format!("{}: {e}", path.display())))
}

/// The model config of a Hugging Face directory (`config.json`).
fn hf_config(dir: &Path) -> Result<DecoderConfig, ModelError> {
    DecoderConfig::from_hf_json(&read_json(&dir.join("config.json"))?)
}

/// The tokenizer of a model, without its weights, and its context length.
pub fn load_tokenizer(
    spec: &str,
    opts: &LoadOptions,
) -> Result<(String, TextTokenizer, usize), ModelError> {
    if let LoadFormat::Dummy { config } = &opts.format {
        let cfg = dummy_config(config)?;
        let tokenizer = TextTokenizer::byte_level(cfg.vocab_size)?;
        return Ok((spec.to_owned(), tokenizer, cfg.max_position_embeddings));
    }
    let (name, source) = resolve_model(spec, opts)?;
    match &source {
        ModelSource::Gguf(path) => {
            let mut g = GgufFile::open(path)?;
            let cfg = DecoderConfig::from_gguf(&mut g)?;
            Ok((
                name,
                TextTokenizer::from_gguf(&g)?,
                cfg.max_position_embeddings,
            ))
        }
        ModelSource::HfDir(dir) => {
            let cfg = hf_config(dir)?;
            Ok((
                name,
                TextTokenizer::from_hf_dir(dir)?,
                cfg.max_position_embeddings,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_specs_say_why() {
        let opts = LoadOptions::default();
        let err = resolve_model("no-such-model", &opts).unwrap_err();
        assert!(matches!(err, ModelError::NotFound { .. }));
        assert!(err.to_string().contains("smollm2-135m"), "{err}");
        let err = resolve_model("some-org/some-model-that-is-not-cached", &opts).unwrap_err();
        assert!(err.to_string().contains("hf-hub cache"), "{err}");
    }

    #[test]
    fn embedded_name_resolves_in_the_given_dir_only() {
        let dir = std::env::temp_dir().join(format!("tandem-models-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let opts = LoadOptions {
            model_dir: Some(dir.clone()),
            ..Default::default()
        };
        let err = resolve_model("SmolLM2-135M", &opts).unwrap_err();
        assert!(err.to_string().contains("setup.sh"), "{err}");
        std::fs::write(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf"), b"GGUF").unwrap();
        let (name, src) = resolve_model("smollm2-135m", &opts).unwrap();
        assert_eq!(name, "smollm2-135m");
        assert_eq!(
            src,
            ModelSource::Gguf(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf"))
        );
        // a directory with one GGUF file
        let (_, src) = resolve_model(dir.to_str().unwrap(), &opts).unwrap();
        assert!(matches!(src, ModelSource::Gguf(_)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hf_ids_resolve_offline_to_the_main_snapshot() {
        let hub = std::env::temp_dir().join(format!("tandem-hub-test-{}", std::process::id()));
        let repo = hub.join("models--org--tiny");
        std::fs::create_dir_all(repo.join("snapshots/abc")).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "abc\n").unwrap();
        std::fs::write(repo.join("snapshots/abc/config.json"), "{}").unwrap();
        assert_eq!(
            hf_snapshot(&hub, "org/tiny"),
            Some(repo.join("snapshots/abc"))
        );
        assert!(matches!(
            classify_dir(&repo.join("snapshots/abc")),
            Some(ModelSource::HfDir(_))
        ));
        std::fs::remove_dir_all(&hub).unwrap();
    }
}
