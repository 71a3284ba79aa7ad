//! Text ↔ token ids: the model's tokenizer, its special ids, its chat template, and an
//! incremental detokenizer for streaming.
//!
//! Built with the `tokenizers` crate, either from a `tokenizer.json` or from GGUF metadata
//! (byte-level BPE: vocab, merges, control tokens as special tokens, the pre-tokenizer chosen by
//! `tokenizer.ggml.pre`). candle's `Tokenizer::from_gguf` is not used: it adds a prefix space
//! for SmolLM2 and gets ids wrong (research/candle-cpu.md).
//!
//! Invariants: `stop_token_ids` always contains the EOS ids; special tokens written in the text
//! (e.g. `<|im_start|>`) are always encoded as their ids, `add_special_tokens` only controls BOS;
//! the incremental detokenizer emits text only once it is stable (no partial UTF-8), and the
//! concatenation of everything it emits equals `decode` of all ids pushed.

use std::path::{Path, PathBuf};

use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::ModelError;
use crate::gguf::GgufFile;

/// Tokens that end a turn in common chat formats; when present as special tokens they are
/// stop ids in addition to the declared EOS.
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
];

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// A model's tokenizer with its special ids and chat template.
pub struct TextTokenizer {
    inner: Tokenizer,
    bos_id: Option<u32>,
    /// Prepend BOS when encoding with special tokens (GGUF; tokenizer.json has a post-processor).
    manual_bos: bool,
    eos_ids: Vec<u32>,
    stop_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("stop_ids", &self.stop_ids)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

/// The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names, as HF tokenizer.json files spell it.
fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex).into();
    let split = |re: &str| -> Result<PreTokenizerWrapper, ModelError> {
        Ok(Split::new(
            SplitPattern::Regex(re.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tok_err)?
        .into())
    };
    Ok(match pre {
        // SmolLM / StarCoder family: single digits, then GPT-2 byte level
        "smollm" | "starcoder" | "refact" => {
            Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into()
        }
        "llama3" | "llama-bpe" | "llama-v3" | "dbrx" | "smaug-bpe" => Sequence::new(vec![
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")?,
            byte_level(false),
        ])
        .into(),
        "qwen2" => Sequence::new(vec![
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")?,
            byte_level(false),
        ])
        .into(),
        _ => byte_level(true),
    })
}

/// GGUF `gpt2`: byte-level BPE with the file's merges and llama.cpp's pre-tokenizer.
fn byte_level_bpe(g: &GgufFile, tokens: &[String]) -> Result<Tokenizer, ModelError> {
    let merges: Vec<(String, String)> = g
        .str_array("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| ModelError::format(format!("bad merge `{m}`")))
        })
        .collect::<Result<_, _>>()?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let mut inner = Tokenizer::new(bpe);
    let pre = g.opt_str("tokenizer.ggml.pre").unwrap_or("default");
    inner.with_pre_tokenizer(Some(pre_tokenizer_for(pre)?));
    inner.with_decoder(Some(ByteLevel::default()));
    Ok(inner)
}

/// The SentencePiece word boundary, as pieces spell a space.
const SPIECE_SPACE: &str = "\u{2581}";

/// GGUF `llama` (SentencePiece BPE, e.g. Gemma): spaces become `▁`, pieces merge by the score of
/// the merged piece, unknown characters fall back to `<0xNN>` byte tokens; as transformers
/// builds it from the same metadata. The file has scores, not merges: every piece that splits
/// into two pieces of the vocabulary yields a merge, ranked by the whole piece's score (higher
/// first; among one piece's splits, by the two halves' scores), ties in vocabulary order.
fn sentencepiece_bpe(g: &GgufFile, tokens: &[String]) -> Result<Tokenizer, ModelError> {
    use std::cmp::Ordering;
    use std::collections::HashMap;
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence as DecoderSequence;
    use tokenizers::normalizers::replace::Replace;
    use tokenizers::DecoderWrapper;

    if g.opt_bool("tokenizer.ggml.add_space_prefix")
        .unwrap_or(false)
    {
        return Err(ModelError::Unsupported(
            "a SentencePiece GGUF tokenizer with add_space_prefix (Llama 2 style)".into(),
        ));
    }
    let scores = g.f32_array("tokenizer.ggml.scores")?;
    if scores.len() != tokens.len() {
        return Err(ModelError::format(format!(
            "{} tokenizer scores for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    let score_of: HashMap<&str, f32> = tokens
        .iter()
        .zip(&scores)
        .map(|(t, &s)| (t.as_str(), s))
        .collect();
    let desc = |a: f32, b: f32| b.partial_cmp(&a).unwrap_or(Ordering::Equal);
    // (whole piece's score, left score, right score, left, right)
    let mut merges: Vec<(f32, f32, f32, &str, &str)> = Vec::new();
    for (piece, &score) in tokens.iter().zip(&scores) {
        let start = merges.len();
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&sl), Some(&sr)) = (score_of.get(l), score_of.get(r)) {
                merges.push((score, sl, sr, l, r));
            }
        }
        merges[start..].sort_by(|a, b| desc(a.1, b.1).then(desc(a.2, b.2)));
    }
    // stable: ties keep vocabulary order, and within a piece the order above
    merges.sort_by(|a, b| desc(a.0, b.0));
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|m| (m.3.to_owned(), m.4.to_owned()))
        .collect();
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .fuse_unk(true)
        .byte_fallback(true);
    if let Some(unk) = g
        .opt_usize("tokenizer.ggml.unknown_token_id")
        .and_then(|i| tokens.get(i).cloned())
    {
        builder = builder.unk_token(unk);
    }
    let mut inner = Tokenizer::new(builder.build().map_err(tok_err)?);
    inner
        .with_normalizer(Some(Replace::new(" ", SPIECE_SPACE).map_err(tok_err)?))
        .map_err(tok_err)?;
    let decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPIECE_SPACE, " ").map_err(tok_err)?.into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ];
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

impl TextTokenizer {
    /// Builds the tokenizer from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelError> {
        let model = g.str("tokenizer.ggml.model")?;
        let tokens = g.str_array("tokenizer.ggml.tokens")?;
        let mut inner = match model {
            "gpt2" => byte_level_bpe(g, &tokens)?,
            "llama" => sentencepiece_bpe(g, &tokens)?,
            other => {
                return Err(ModelError::Unsupported(format!(
                    "GGUF tokenizer model `{other}` (built from GGUF metadata: byte-level BPE \
                     `gpt2` and SentencePiece `llama`; or use a Hugging Face directory with \
                     tokenizer.json)"
                )))
            }
        };
        let types = g
            .opt_int_array("tokenizer.ggml.token_type")
            .unwrap_or_else(|| vec![1; tokens.len()]);
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(special).map_err(tok_err)?;
        let user: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_TYPE_USER_DEFINED)
            .map(|(s, _)| AddedToken::from(s.clone(), false))
            .collect();
        inner.add_tokens(user).map_err(tok_err)?;

        let id = |key: &str| g.opt_usize(key).map(|x| x as u32);
        let bos_id = id("tokenizer.ggml.bos_token_id");
        let mut eos_ids: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            eos_ids.extend(id(key));
        }
        let add_bos = g.opt_bool("tokenizer.ggml.add_bos_token").unwrap_or(false);
        let name_of = |i: Option<u32>| {
            i.and_then(|i| tokens.get(i as usize).cloned())
                .unwrap_or_default()
        };
        // Gemma 3's GGUF has no template: its turn format is built in.
        let template = g.opt_str("tokenizer.chat_template").or_else(|| {
            (g.opt_str("general.architecture") == Some("gemma3"))
                .then_some(crate::gemma3::CHAT_TEMPLATE)
        });
        let chat_template = template
            .map(|src| ChatTemplate::new(src, &name_of(bos_id), &name_of(eos_ids.first().copied())))
            .transpose()?;
        Self::assemble(inner, bos_id, add_bos, eos_ids, chat_template)
    }

    /// Builds the tokenizer from a Hugging Face model directory: `tokenizer.json`, and the special
    /// ids and chat template from `tokenizer_config.json`, `generation_config.json`, `config.json`.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("tokenizer.json");
        let inner = Tokenizer::from_file(&path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        let read_json = |name: &str| -> Option<serde_json::Value> {
            let text = std::fs::read_to_string(dir.join(name)).ok()?;
            serde_json::from_str(&text).ok()
        };
        let tcfg = read_json("tokenizer_config.json").unwrap_or_default();
        let gen = read_json("generation_config.json").unwrap_or_default();
        let cfg = read_json("config.json").unwrap_or_default();
        let token_str = |v: &serde_json::Value| -> Option<String> {
            match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
                _ => None,
            }
        };
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            match v {
                serde_json::Value::Number(n) => n.as_u64().map(|x| x as u32).into_iter().collect(),
                serde_json::Value::Array(a) => a
                    .iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as u32)
                    .collect(),
                _ => Vec::new(),
            }
        };
        let bos_str = tcfg.get("bos_token").and_then(token_str);
        let eos_str = tcfg.get("eos_token").and_then(token_str);
        let bos_id = bos_str
            .as_deref()
            .and_then(|s| inner.token_to_id(s))
            .or_else(|| ids(&cfg["bos_token_id"]).first().copied());
        let mut eos_ids = ids(&gen["eos_token_id"]);
        eos_ids.extend(ids(&cfg["eos_token_id"]));
        eos_ids.extend(eos_str.as_deref().and_then(|s| inner.token_to_id(s)));
        let template_src = match tcfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_owned),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        let chat_template = template_src
            .map(|src| {
                ChatTemplate::new(
                    &src,
                    bos_str.as_deref().unwrap_or(""),
                    eos_str.as_deref().unwrap_or(""),
                )
            })
            .transpose()?;
        let mut t = Self::assemble(inner, bos_id, false, eos_ids, chat_template)?;
        t.manual_bos = false;
        Ok(t)
    }

    /// A byte-level tokenizer for models without one (`--load-format dummy`): ids 0..256 are
    /// the bytes (GPT-2's byte-to-character alphabet, in character order), 256 is `<|bos|>`
    /// (prepended), 257 is `<|eos|>`; a plain chat template of role lines. Needs
    /// `vocab_size >= 258`; the ids above 257 never come out of `encode`.
    pub fn byte_level(vocab_size: usize) -> Result<Self, ModelError> {
        const BOS: &str = "<|bos|>";
        const EOS: &str = "<|eos|>";
        if vocab_size < 258 {
            return Err(ModelError::Unsupported(format!(
                "a vocabulary of {vocab_size} tokens: the byte-level tokenizer needs at least 258"
            )));
        }
        let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .collect();
        alphabet.sort_unstable();
        let vocab: serde_json::Map<String, serde_json::Value> = alphabet
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), serde_json::json!(i)))
            .collect();
        let special = |id: usize, content: &str| {
            serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        };
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": false});
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [special(256, BOS), special(257, EOS)],
            "normalizer": null,
            "pre_tokenizer": byte_level,
            "post_processor": null,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []},
        });
        let inner: Tokenizer = json.to_string().parse().map_err(tok_err)?;
        let template = ChatTemplate::new(
            "{% for m in messages %}{{ bos_token }}{{ m.role }}\n{{ m.content }}{{ eos_token }}\n\
             {% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}",
            BOS,
            EOS,
        )?;
        Self::assemble(inner, Some(256), true, vec![257], Some(template))
    }

    fn assemble(
        inner: Tokenizer,
        bos_id: Option<u32>,
        add_bos: bool,
        mut eos_ids: Vec<u32>,
        chat_template: Option<ChatTemplate>,
    ) -> Result<Self, ModelError> {
        dedup(&mut eos_ids);
        if eos_ids.is_empty() {
            return Err(ModelError::Tokenizer(
                "the model declares no EOS token".into(),
            ));
        }
        let specials = inner.get_added_tokens_decoder();
        let mut stop_ids = eos_ids.clone();
        for name in END_OF_TURN_TOKENS {
            if let Some(id) = inner.token_to_id(name) {
                if specials.get(&id).is_some_and(|t| t.special) {
                    stop_ids.push(id);
                }
            }
        }
        dedup(&mut stop_ids);
        Ok(TextTokenizer {
            inner,
            bos_id,
            manual_bos: add_bos && bos_id.is_some(),
            eos_ids,
            stop_ids,
            chat_template,
        })
    }

    /// Writes a Hugging Face tokenizer directory for this tokenizer into `dir` (created if
    /// missing): `tokenizer.json` (with a post-processor that adds the BOS where this tokenizer
    /// prepends it, so `AutoTokenizer` encodes the same ids), `tokenizer_config.json` (special
    /// tokens, chat template, `model_max_length`) and `special_tokens_map.json`. What benchmark
    /// clients such as guidellm and aiperf load to count tokens offline. Returns the files.
    pub fn export_hf_dir(
        &self,
        dir: &Path,
        model_max_length: usize,
    ) -> Result<Vec<PathBuf>, ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let token = |id: Option<u32>| id.and_then(|i| self.inner.id_to_token(i));
        let bos = token(self.bos_id);
        let eos = token(self.eos_ids.first().copied());
        let mut inner = self.inner.clone();
        if let (true, Some(bos), Some(bos_id)) = (self.manual_bos, &bos, self.bos_id) {
            let template = TemplateProcessing::builder()
                .try_single(format!("{bos} $A:0"))
                .and_then(|b| b.try_pair(format!("{bos} $A:0 {bos} $B:1")))
                .map_err(tok_err)?
                .special_tokens(vec![(bos.clone(), bos_id)])
                .build()
                .map_err(tok_err)?;
            inner.with_post_processor(Some(template));
        }
        let tokenizer_json = dir.join("tokenizer.json");
        inner.save(&tokenizer_json, false).map_err(tok_err)?;
        let mut config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "add_bos_token": self.manual_bos,
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": false,
        });
        if let Some(t) = &self.chat_template {
            config["chat_template"] = serde_json::Value::String(t.source().to_owned());
        }
        let special = serde_json::json!({"bos_token": bos, "eos_token": eos});
        let mut files = vec![tokenizer_json];
        for (name, value) in [
            ("tokenizer_config.json", config),
            ("special_tokens_map.json", special),
        ] {
            let path = dir.join(name);
            let text = serde_json::to_string_pretty(&value).expect("JSON values serialize");
            std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
            files.push(path);
        }
        Ok(files)
    }

    /// Token ids of `text`. Special tokens written in the text are always recognized;
    /// `add_special_tokens` adds the BOS (or whatever the tokenizer's post-processor adds).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special_tokens && self.manual_bos {
            ids.extend(self.bos_id);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    /// Number of ids the tokenizer knows (vocabulary and added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }
    /// Whether `encode(.., true)` prepends BOS (for GGUF: `tokenizer.ggml.add_bos_token`).
    pub fn adds_bos(&self) -> bool {
        self.manual_bos
    }
    /// The declared EOS id(s), the primary one first.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }
    /// Every id that ends generation: EOS ids and the model's end-of-turn tokens
    /// (e.g. `<|im_end|>` and `<|endoftext|>` for SmolLM2).
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.stop_ids
    }
    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }
    /// Every token's bytes as they stand in text, by id (`vocab_size` entries): byte-level BPE
    /// symbols mapped back to their bytes, SentencePiece's `▁` as a space and `<0xNN>` as that
    /// byte; a special token as `0xFF` then its name (it never stands for text). What
    /// structured outputs build their token trie from.
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        let symbols = byte_level_symbols();
        // `get_added_tokens_decoder` clones the map: once, not per id.
        let added = self.inner.get_added_tokens_decoder();
        (0..self.vocab_size() as u32)
            .map(|id| {
                let Some(token) = self.inner.id_to_token(id) else {
                    return Vec::new();
                };
                if added.get(&id).is_some_and(|t| t.special) {
                    let mut b = vec![0xFF];
                    b.extend_from_slice(token.as_bytes());
                    return b;
                }
                if byte_level {
                    let bytes: Option<Vec<u8>> =
                        token.chars().map(|c| symbols.get(&c).copied()).collect();
                    // An added (non-special) token is its text as written.
                    return bytes.unwrap_or_else(|| token.into_bytes());
                }
                if let Some(b) = token
                    .strip_prefix("<0x")
                    .and_then(|t| t.strip_suffix('>'))
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    return vec![b];
                }
                token.replace(SPIECE_SPACE, " ").into_bytes()
            })
            .collect()
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Renders a conversation with the model's chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.chat_template
            .as_ref()
            .ok_or_else(|| ModelError::Template("the model has no chat template".into()))?
            .render(messages, add_generation_prompt)
    }
}

fn dedup(ids: &mut Vec<u32>) {
    let mut seen = std::collections::HashSet::new();
    ids.retain(|i| seen.insert(*i));
}

/// Byte-level BPE's printable stand-in for each byte (GPT-2's table), reversed: the bytes
/// 33..=126, 161..=172 and 174..=255 stand for themselves, the others for 256, 257, … in order.
fn byte_level_symbols() -> std::collections::HashMap<char, u8> {
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let own = matches!(b, 33..=126 | 161..=172 | 174..=255);
            let c = if own {
                b as u32
            } else {
                next += 1;
                next - 1
            };
            (char::from_u32(c).expect("a valid char"), b)
        })
        .collect()
}

/// Turns a stream of token ids into text pieces that are safe to send: a piece is emitted only
/// when the text decoded so far is stable (does not end in an incomplete UTF-8 sequence).
///
/// It keeps a short window of ids (from the last emitted boundary) and decodes it twice per
/// token, so its cost does not grow with the length of the output.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    /// Window start: ids before it were emitted and are dropped.
    prefix_offset: usize,
    /// Ids before this have been emitted as text.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDetokenizer {
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            skip_special_tokens,
        }
    }

    /// Adds one id; returns new text if it became stable.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<Option<String>, ModelError> {
        self.ids.push(id);
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let piece = full[prefix.len()..].to_owned();
            // keep the last emitted token as context for the next decode
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            if self.prefix_offset > 0 {
                self.ids.drain(..self.prefix_offset);
                self.read_offset -= self.prefix_offset;
                self.prefix_offset = 0;
            }
            return Ok(Some(piece));
        }
        Ok(None)
    }

    /// Text held back at the end of the stream (e.g. an incomplete UTF-8 sequence, decoded
    /// with replacement characters).
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<Option<String>, ModelError> {
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full
            .get(prefix.len()..)
            .filter(|s| !s.is_empty())
            .map(str::to_owned))
    }
}
