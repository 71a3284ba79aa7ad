//! Sampling parameters, their validation, and the sampler that turns logits into a token.
//!
//! Invariants: greedy sampling (temperature 0) is a pure argmax (lowest id on ties), so it does not
//! depend on the batch; random sampling draws from the request's own RNG (seeded by `seed` when
//! given), so a seeded request's output does not depend on other requests either.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::EngineError;

/// Per-request sampling and stopping parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 or -1 disables top-k.
    pub top_k: i32,
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub include_stop_str_in_output: bool,
    /// Number of top log-probabilities to return per output token (None: no logprobs).
    pub logprobs: Option<usize>,
    pub skip_special_tokens: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            ignore_eos: false,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            include_stop_str_in_output: false,
            logprobs: None,
            skip_special_tokens: true,
        }
    }
}

/// Most log-probabilities a request may ask for per token.
pub const MAX_LOGPROBS: usize = 20;

fn invalid(param: &str, message: String) -> EngineError {
    EngineError::InvalidParam {
        param: param.to_string(),
        message,
    }
}

impl SamplingParams {
    /// Checks every value's range; `vocab_size` bounds token ids.
    pub fn validate(&self, vocab_size: usize) -> Result<(), EngineError> {
        if !self.temperature.is_finite() || !(0.0..=2.0).contains(&self.temperature) {
            return Err(invalid(
                "temperature",
                format!("temperature must be in [0, 2], got {}", self.temperature),
            ));
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {}", self.top_p),
            ));
        }
        if self.top_k < -1 {
            return Err(invalid(
                "top_k",
                format!(
                    "top_k must be -1 (disable), 0 (disable) or at least 1, got {}",
                    self.top_k
                ),
            ));
        }
        if self.max_tokens == 0 {
            return Err(invalid(
                "max_tokens",
                "max_tokens must be at least 1".into(),
            ));
        }
        if self.min_tokens > self.max_tokens {
            return Err(invalid(
                "min_tokens",
                format!(
                    "min_tokens ({}) must be at most max_tokens ({})",
                    self.min_tokens, self.max_tokens
                ),
            ));
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return Err(invalid(
                    "logprobs",
                    format!("at most {MAX_LOGPROBS} logprobs may be requested, got {n}"),
                ));
            }
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(invalid("stop", "stop strings must not be empty".into()));
        }
        if let Some(&t) = self
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= vocab_size)
        {
            return Err(invalid(
                "stop_token_ids",
                format!("stop token id {t} is out of the vocabulary (size {vocab_size})"),
            ));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// One token's log-probability and its top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// The `n` most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// The sampling state of one request: its parameters and its RNG.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler { params, rng }
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> (u32, Option<TokenLogprob>) {
        let token = if self.params.is_greedy() {
            argmax(logits)
        } else {
            self.sample_random(logits)
        };
        let lp = self.params.logprobs.map(|n| logprobs_of(logits, token, n));
        (token, lp)
    }

    fn sample_random(&mut self, logits: &[f32]) -> u32 {
        let t = self.params.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l / t))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        // descending by logit, ties by id: deterministic for a given RNG state
        let k = if self.params.top_k > 0 {
            (self.params.top_k as usize).min(cand.len())
        } else {
            cand.len()
        };
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            cand.truncate(k);
        }
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.params.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            cand.truncate(keep);
            let s: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= s);
        }
        let r: f32 = self.rng.random();
        let mut acc = 0.0;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[cand.len() - 1].0
    }
}

/// Index of the largest value, lowest index on ties; NaNs never win.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// Log-softmax of the raw logits at `token`, plus the top `n` entries.
pub fn logprobs_of(logits: &[f32], token: u32, n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
    let mut top: Vec<(u32, f32)> = Vec::new();
    if n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let n = n.min(idx.len());
        idx.select_nth_unstable_by(n - 1, |&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        idx.truncate(n);
        idx.sort_unstable_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        top = idx
            .into_iter()
            .map(|i| (i, logits[i as usize] - lse))
            .collect();
    }
    TokenLogprob {
        token_id: token,
        logprob: logits[token as usize] - lse,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: i32, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(params(0.0, 0, 1.0, 1));
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).0, 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 3, 1.0, seed));
            (0..40).map(|_| s.sample(&logits).0).collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert_ne!(a, run(8));
        // top-3 of logits are the ids with i % 7 == 6, lowest ids first: 6, 13, 20
        assert!(a.iter().all(|t| [6, 13, 20].contains(t)), "{a:?}");
    }

    #[test]
    fn top_p_keeps_the_nucleus_only() {
        let logits = [10.0, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(params(1.0, 0, 0.5, 3));
        for _ in 0..50 {
            assert_eq!(s.sample(&logits).0, 0);
        }
    }

    #[test]
    fn logprobs_are_normalized_and_sorted() {
        let lp = logprobs_of(&[1.0, 2.0, 3.0], 0, 2);
        let total: f32 = [1.0f32, 2.0, 3.0].iter().map(|l| (l - 3.0f32).exp()).sum();
        assert!((lp.logprob - (1.0 - 3.0 - total.ln())).abs() < 1e-5);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }

    #[test]
    fn invalid_values_are_rejected_with_their_name() {
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_k: -2,
                    ..Default::default()
                },
                "top_k",
            ),
            (
                SamplingParams {
                    max_tokens: 0,
                    ..Default::default()
                },
                "max_tokens",
            ),
            (
                SamplingParams {
                    min_tokens: 20,
                    max_tokens: 10,
                    ..Default::default()
                },
                "min_tokens",
            ),
            (
                SamplingParams {
                    logprobs: Some(21),
                    ..Default::default()
                },
                "logprobs",
            ),
            (
                SamplingParams {
                    stop: vec![String::new()],
                    ..Default::default()
                },
                "stop",
            ),
            (
                SamplingParams {
                    stop_token_ids: vec![100],
                    ..Default::default()
                },
                "stop_token_ids",
            ),
        ];
        for (p, name) in cases {
            match p.validate(100) {
                Err(EngineError::InvalidParam { param, .. }) => assert_eq!(param, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        SamplingParams::default().validate(100).unwrap();
    }
}
