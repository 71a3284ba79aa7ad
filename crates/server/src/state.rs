//! What every handler shares: the engine handle, the tokenizer, the model's name and limits.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;
use tandem_engine::EngineHandle;

/// Text <-> tokens as the API needs them; implemented by the model's tokenizer.
pub trait ApiTokenizer: Send + Sync {
    /// Token ids of a completion prompt (with the model's BOS if it adds one).
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, String>;
    /// The chat template applied to `messages` (role, content), tokenized.
    fn encode_chat(
        &self,
        messages: &[(String, String)],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, String>;
    /// The text of one token, special tokens included (for logprobs).
    fn token_text(&self, id: u32) -> String;
    /// Decodes token ids (for `echo`).
    fn decode(&self, ids: &[u32]) -> String;
}

/// Shared state of the HTTP server.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<dyn ApiTokenizer>,
    /// Names a request may use in `model` (the first is the one reported).
    pub model_names: Arc<Vec<String>>,
    pub max_model_len: usize,
    /// Where the model was loaded from (`root` in `/v1/models`).
    pub model_root: String,
    /// When the server started, Unix seconds (`created` in `/v1/models`).
    pub created: u64,
    pub prometheus: Option<PrometheusHandle>,
    pub max_body_bytes: usize,
    /// A P/D instance's KV routes (`/v1/kv/handshake`, `/v1/kv/claim`, `/v1/kv/release`).
    pub kv_peer: Option<tandem_kv_connector::pull::KvPeerService>,
    /// A P/D instance's check of a request's `kv_transfer_params` before the engine sees them.
    pub kv_admission: Option<tandem_kv_connector::pull::KvAdmission>,
    /// The vocabulary structured outputs compile against, or why there is none.
    pub guidance: Result<tandem_structured::Guidance, String>,
}

impl AppState {
    pub fn served_model_name(&self) -> &str {
        &self.model_names[0]
    }
}
