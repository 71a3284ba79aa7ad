//! Structured outputs: token masks that keep a request's output inside a grammar.
//!
//! Owns the grammar forms a request may ask for ([`GuideSpec`]: any JSON object, a JSON schema,
//! a regular expression, one of a list of strings), their compilation with `llguidance` against
//! the served model's vocabulary ([`Guidance`], built once per tokenizer from every token's
//! bytes), and a request's [`GuidedDecoder`], which masks the logits of each step and advances
//! with each sampled token.
//!
//! Invariants: a spec that does not compile is refused before the request reaches the engine;
//! a masked step never lets a token the grammar refuses through (ids past the tokenizer's
//! vocabulary included); once the grammar is complete only EOS is allowed; an error inside the
//! matcher ends the output with EOS and is kept ([`GuidedDecoder::error`]), never followed by
//! unconstrained tokens.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

/// Why a grammar cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StructuredError {
    /// The vocabulary cannot back a grammar (no tokens, EOS out of range).
    #[error("structured outputs are unavailable for this tokenizer: {0}")]
    Vocabulary(String),
    /// The request's grammar is invalid or unsupported; the message says why.
    #[error("{0}")]
    Grammar(String),
}

/// What a request's output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum GuideSpec {
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// JSON valid under this schema (`json_schema`, `guided_json`, tool parameters).
    JsonSchema(Value),
    /// Text matching this regular expression in full (`guided_regex`).
    Regex(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
}

impl GuideSpec {
    fn grammar(&self) -> Result<TopLevelGrammar, StructuredError> {
        Ok(match self {
            GuideSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            GuideSpec::JsonSchema(schema) => {
                if !schema.is_object() {
                    return Err(StructuredError::Grammar(
                        "a JSON schema must be an object".into(),
                    ));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            GuideSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GuideSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(StructuredError::Grammar(
                        "a choice needs at least one string".into(),
                    ));
                }
                let alternatives: Vec<String> =
                    choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
        })
    }
}

/// JSON written as `json.dumps` writes it (`", "` and `": "`, no other whitespace), unless the
/// schema sets llguidance's own options (`x-guidance`). Free whitespace lets a small model
/// loop on newlines until `max_tokens` and never close the object.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"item_separator": ", ", "key_separator": ": ",
                               "whitespace_flexible": false})
        });
    }
    schema
}

/// The served model's vocabulary, ready to compile grammars against. Cheap to share.
#[derive(Clone)]
pub struct Guidance {
    factory: Arc<ParserFactory>,
    eos: u32,
    vocab_size: usize,
}

impl std::fmt::Debug for Guidance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guidance")
            .field("eos", &self.eos)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

/// The prefix `llguidance` expects on a special token's bytes (never part of generated text).
pub const SPECIAL_TOKEN_MARKER: u8 = TokTrie::SPECIAL_TOKEN_MARKER;

impl Guidance {
    /// `token_bytes[id]`: the bytes token `id` stands for in text, or [`SPECIAL_TOKEN_MARKER`]
    /// followed by its name for a special token. `eos`: the token that ends a guided output.
    pub fn new(token_bytes: &[Vec<u8>], eos: u32) -> Result<Self, StructuredError> {
        let vocab_size = token_bytes.len();
        if vocab_size == 0 || eos as usize >= vocab_size {
            return Err(StructuredError::Vocabulary(format!(
                "EOS id {eos} with {vocab_size} tokens"
            )));
        }
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let trie = TokTrie::from(&info, token_bytes);
        let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| StructuredError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Guidance {
            factory: Arc::new(factory),
            eos,
            vocab_size,
        })
    }

    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// Compiles `spec` for one request.
    pub fn compile(&self, spec: &GuideSpec) -> Result<GuidedDecoder, StructuredError> {
        let parser = self
            .factory
            .create_parser(spec.grammar()?)
            .map_err(|e| StructuredError::Grammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(StructuredError::Grammar(e));
        }
        Ok(GuidedDecoder {
            spec: spec.clone(),
            matcher,
            eos: self.eos,
            vocab_size: self.vocab_size,
            error: None,
        })
    }

    /// Greedy bytes-to-tokens over the vocabulary (for tests and tools).
    pub fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<u32> {
        self.factory.tok_env().tokenize_bytes(bytes)
    }
}

/// One request's grammar state: masks each step's logits, advances with each sampled token.
/// A clone is independent of the original (its parser state is copied, not shared).
pub struct GuidedDecoder {
    spec: GuideSpec,
    matcher: Matcher,
    eos: u32,
    vocab_size: usize,
    error: Option<String>,
}

impl Clone for GuidedDecoder {
    fn clone(&self) -> Self {
        GuidedDecoder {
            spec: self.spec.clone(),
            matcher: self.matcher.deep_clone(),
            eos: self.eos,
            vocab_size: self.vocab_size,
            error: self.error.clone(),
        }
    }
}

/// Two decoders are equal when they follow the same grammar and neither has failed.
impl PartialEq for GuidedDecoder {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec && self.error.is_none() && other.error.is_none()
    }
}

impl std::fmt::Debug for GuidedDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuidedDecoder")
            .field("spec", &self.spec)
            .field("stopped", &self.matcher.is_stopped())
            .field("error", &self.error)
            .finish()
    }
}

impl GuidedDecoder {
    pub fn spec(&self) -> &GuideSpec {
        &self.spec
    }

    /// Sets the logit of every token the grammar does not allow next to -inf. After an error,
    /// only EOS stays.
    pub fn mask(&mut self, logits: &mut [f32]) {
        let allowed = match self.matcher.compute_mask_or_eos() {
            Ok(m) if self.error.is_none() => Some(m),
            Ok(_) => None,
            Err(e) => {
                self.error.get_or_insert_with(|| e.to_string());
                None
            }
        };
        for (id, l) in logits.iter_mut().enumerate() {
            let ok = match &allowed {
                Some(m) => id < self.vocab_size && m.is_allowed(id as u32),
                None => id as u32 == self.eos,
            };
            if !ok {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Advances past the sampled `token` (EOS after the grammar completed is accepted).
    pub fn accept(&mut self, token: u32) {
        if self.error.is_some() || (token == self.eos && self.matcher.is_stopped()) {
            return;
        }
        if let Err(e) = self.matcher.consume_token(token) {
            self.error = Some(e.to_string());
        }
    }

    /// Whether the grammar is complete (only EOS may follow).
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The matcher's error, if one ended the output.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of every byte, some two-byte tokens, and EOS.
    fn vocab() -> (Vec<Vec<u8>>, u32) {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for w in ["ye", "no", "{\"", "\":", "\"}", "12"] {
            words.push(w.as_bytes().to_vec());
        }
        let mut eos = vec![SPECIAL_TOKEN_MARKER];
        eos.extend_from_slice(b"<eos>");
        words.push(eos);
        let n = words.len() as u32;
        (words, n - 1)
    }

    /// Greedy decoding under the mask with logits that prefer `preferred` bytes in order.
    fn run(spec: &GuideSpec, preferred: &[u8]) -> (String, bool) {
        let (words, eos) = vocab();
        let g = Guidance::new(&words, eos).unwrap();
        let mut d = g.compile(spec).unwrap();
        let mut out = Vec::new();
        for _ in 0..64 {
            let mut logits: Vec<f32> = (0..words.len())
                .map(|id| {
                    let w = &words[id];
                    preferred
                        .iter()
                        .position(|b| w.len() == 1 && w[0] == *b)
                        .map_or(0.0, |p| 100.0 - p as f32)
                })
                .collect();
            d.mask(&mut logits);
            let (best, _) = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap();
            assert!(logits[best].is_finite(), "no token allowed");
            d.accept(best as u32);
            if best as u32 == eos {
                return (String::from_utf8(out).unwrap(), d.is_complete());
            }
            out.extend_from_slice(&words[best]);
        }
        panic!(
            "no EOS within 64 tokens: {:?}",
            String::from_utf8_lossy(&out)
        );
    }

    #[test]
    fn choice_and_regex_outputs_match_and_end_with_eos() {
        let (text, done) = run(&GuideSpec::Choice(vec!["yes".into(), "no".into()]), b"xyzn");
        assert!(text == "yes" || text == "no", "{text}");
        assert!(done);
        let (text, _) = run(&GuideSpec::Regex("[0-9]{3}".into()), b"a9");
        assert_eq!(text, "999");
    }

    #[test]
    fn json_schema_output_parses_and_holds_the_required_field() {
        let schema = serde_json::json!({"type": "object",
            "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "additionalProperties": false});
        let (text, _) = run(&GuideSpec::JsonSchema(schema), b"}{\"n:7 ");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["n"].is_i64(), "{text}");
        let (text, _) = run(&GuideSpec::JsonObject, b"}{\"a:1 ");
        assert!(serde_json::from_str::<Value>(&text).unwrap().is_object());
    }

    #[test]
    fn bad_grammars_are_refused_and_tokens_past_the_vocabulary_are_masked() {
        let (words, eos) = vocab();
        let g = Guidance::new(&words, eos).unwrap();
        assert!(g.compile(&GuideSpec::Regex("(".into())).is_err());
        assert!(g.compile(&GuideSpec::Choice(vec![])).is_err());
        assert!(g
            .compile(&GuideSpec::JsonSchema(serde_json::json!([1])))
            .is_err());
        let mut d = g.compile(&GuideSpec::Regex("a".into())).unwrap();
        let mut logits = vec![1.0; words.len() + 5];
        d.mask(&mut logits);
        assert!(logits[words.len()..].iter().all(|l| l.is_infinite()));
        assert!(logits[b'a' as usize].is_finite() && logits[b'b' as usize].is_infinite());
        assert!(Guidance::new(&words, words.len() as u32).is_err());
    }

    #[test]
    fn a_clone_advances_on_its_own() {
        let (words, eos) = vocab();
        let g = Guidance::new(&words, eos).unwrap();
        let mut a = g.compile(&GuideSpec::Regex("ab|cd".into())).unwrap();
        let mut b = a.clone();
        a.accept(b'a' as u32);
        let mut logits = vec![0.0; words.len()];
        b.mask(&mut logits);
        assert!(logits[b'c' as usize].is_finite(), "b still at the start");
        let mut logits = vec![0.0; words.len()];
        a.mask(&mut logits);
        assert!(logits[b'c' as usize].is_infinite() && logits[b'b' as usize].is_finite());
    }
}
