//! Sampling parameters, their validation, and the sampler that turns logits into a token.
//!
//! Invariants: greedy sampling (temperature 0) is a pure argmax (lowest id on ties) of the logits
//! after the request's own bias and penalties, so it does not depend on the batch; random sampling draws from the request's own RNG (seeded by `seed` when
//! given), so a seeded request's output does not depend on other requests either.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use tandem_structured::GuidedDecoder;

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
    /// Number of top log-probabilities to return per prompt token, besides the prompt token's
    /// own (None: none). The request skips the prefix cache: every prompt position is computed.
    pub prompt_logprobs: Option<usize>,
    pub skip_special_tokens: bool,
    /// Subtracted from the logit of every token the output already holds (OpenAI's, [-2, 2]).
    pub presence_penalty: f32,
    /// Subtracted once per occurrence in the output so far ([-2, 2]).
    pub frequency_penalty: f32,
    /// Divides positive and multiplies negative logits of tokens in the prompt or the output
    /// (vLLM's; 1 is off, > 0).
    pub repetition_penalty: f32,
    /// Drops tokens whose probability is under `min_p` times the most likely one's ([0, 1]).
    pub min_p: f32,
    /// Added to the logits of these token ids before anything else ([-100, 100] each).
    pub logit_bias: Vec<(u32, f32)>,
    /// A grammar the output must follow (structured outputs): tokens it refuses are never
    /// sampled; once it is complete only its EOS is.
    pub guide: Option<GuidedDecoder>,
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
            prompt_logprobs: None,
            skip_special_tokens: true,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            guide: None,
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
        if self.guide.is_some() {
            for (name, set) in [
                ("ignore_eos", self.ignore_eos),
                ("min_tokens", self.min_tokens > 0),
            ] {
                if set {
                    return Err(invalid(
                        name,
                        format!(
                            "{name} cannot be combined with structured outputs: a complete \
                             output ends with EOS"
                        ),
                    ));
                }
            }
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
        for (name, n) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(n) = n.filter(|&n| n > MAX_LOGPROBS) {
                return Err(invalid(
                    name,
                    format!("at most {MAX_LOGPROBS} {name} may be requested, got {n}"),
                ));
            }
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                return Err(invalid(name, format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        if !self.repetition_penalty.is_finite()
            || self.repetition_penalty <= 0.0
            || self.repetition_penalty > 10.0
        {
            return Err(invalid(
                "repetition_penalty",
                format!(
                    "repetition_penalty must be in (0, 10], got {}",
                    self.repetition_penalty
                ),
            ));
        }
        if !self.min_p.is_finite() || !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid(
                "min_p",
                format!("min_p must be in [0, 1], got {}", self.min_p),
            ));
        }
        for &(t, b) in &self.logit_bias {
            if t as usize >= vocab_size {
                return Err(invalid(
                    "logit_bias",
                    format!("logit_bias token id {t} is out of the vocabulary (size {vocab_size})"),
                ));
            }
            if !b.is_finite() || !(-100.0..=100.0).contains(&b) {
                return Err(invalid(
                    "logit_bias",
                    format!("logit_bias of token {t} must be in [-100, 100], got {b}"),
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

    /// Whether the logits are changed before sampling (biases or penalties).
    fn adjusts_logits(&self) -> bool {
        !self.logit_bias.is_empty() || self.penalizes()
    }

    fn penalizes(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }
}

/// One token's log-probability and its top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// 1 + the number of tokens more likely than this one.
    pub rank: usize,
    /// The `n` most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// The sampling state of one request: its parameters, its RNG, and what the penalties need (the
/// tokens the request's context held when the sampler was made, and the tokens it sampled).
///
/// Order, as vLLM applies them: logit bias, repetition penalty (context and output tokens),
/// frequency and presence penalties (output tokens), then temperature, top-k, min-p, top-p.
/// Logprobs are those of the model's raw logits.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Tokens of the context (prompt) for the repetition penalty; empty when it is off.
    context: HashSet<u32>,
    /// Occurrences of each token this sampler produced, when a penalty is on.
    output_counts: HashMap<u32, u32>,
    /// The request's grammar state (taken out of `params`), advanced with each sampled token.
    guide: Option<GuidedDecoder>,
}

impl Sampler {
    /// A sampler for a request whose context so far is `context` (its prompt; used only by the
    /// repetition penalty).
    pub fn new(mut params: SamplingParams, context: &[u32]) -> Self {
        let guide = params.guide.take();
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let context = if params.repetition_penalty != 1.0 {
            context.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Sampler {
            params,
            rng,
            context,
            output_counts: HashMap::new(),
            guide,
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> (u32, Option<TokenLogprob>) {
        let mut adjusted = self.params.adjusts_logits().then(|| self.adjust(logits));
        if let Some(guide) = self.guide.as_mut() {
            guide.mask(adjusted.get_or_insert_with(|| logits.to_vec()));
        }
        let row = adjusted.as_deref().unwrap_or(logits);
        let token = if self.params.is_greedy() {
            argmax(row)
        } else {
            self.sample_random(row)
        };
        if self.params.penalizes() {
            *self.output_counts.entry(token).or_insert(0) += 1;
        }
        if let Some(guide) = self.guide.as_mut() {
            guide.accept(token);
        }
        let lp = self.params.logprobs.map(|n| logprobs_of(logits, token, n));
        (token, lp)
    }

    /// The logits after the bias and the penalties.
    fn adjust(&self, logits: &[f32]) -> Vec<f32> {
        let p = &self.params;
        let mut l = logits.to_vec();
        for &(t, b) in &p.logit_bias {
            if let Some(v) = l.get_mut(t as usize) {
                *v += b;
            }
        }
        if p.repetition_penalty != 1.0 {
            // each seen token once: the context, then output tokens the context lacks
            let output_only = self
                .output_counts
                .keys()
                .filter(|t| !self.context.contains(t));
            for &t in self.context.iter().chain(output_only) {
                if let Some(v) = l.get_mut(t as usize) {
                    *v = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    };
                }
            }
        }
        for (&t, &c) in &self.output_counts {
            if let Some(v) = l.get_mut(t as usize) {
                *v -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
        l
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
        if self.params.min_p > 0.0 {
            // probs are sorted: the most likely is first, and the kept ones are a prefix
            let floor = self.params.min_p * probs[0];
            let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
            probs.truncate(keep);
            cand.truncate(keep);
            let s: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= s);
        }
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
    let own = logits[token as usize];
    // One pass for the normalizer and the rank (how many tokens are more likely).
    let (sum, above) = logits.iter().fold((0.0f32, 0usize), |(sum, above), &l| {
        (sum + (l - max).exp(), above + usize::from(l > own))
    });
    let lse = max + sum.ln();
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
        logprob: own - lse,
        rank: 1 + above,
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
        let mut s = Sampler::new(params(0.0, 0, 1.0, 1), &[]);
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).0, 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 3, 1.0, seed), &[]);
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
        let mut s = Sampler::new(params(1.0, 0, 0.5, 3), &[]);
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
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: f32::NAN,
                    ..Default::default()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(100, 1.0)],
                    ..Default::default()
                },
                "logit_bias",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(3, 101.0)],
                    ..Default::default()
                },
                "logit_bias",
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

    fn greedy_with(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = params(0.0, 0, 1.0, 1);
        f(&mut p);
        p
    }

    #[test]
    fn logit_bias_moves_the_greedy_choice() {
        let logits = [0.0, 5.0, 1.0, 0.0];
        let mut s = Sampler::new(greedy_with(|p| p.logit_bias = vec![(2, 4.5)]), &[]);
        assert_eq!(s.sample(&logits).0, 2);
        let mut s = Sampler::new(greedy_with(|p| p.logit_bias = vec![(1, -100.0)]), &[]);
        assert_eq!(s.sample(&logits).0, 2);
        // logprobs stay those of the model
        let mut s = Sampler::new(
            greedy_with(|p| {
                p.logit_bias = vec![(2, 4.5)];
                p.logprobs = Some(1);
            }),
            &[],
        );
        let (t, lp) = s.sample(&logits);
        assert_eq!(lp.unwrap().top[0].0, 1, "top logprob of token {t}");
    }

    #[test]
    fn frequency_and_presence_penalties_count_the_output() {
        // token 0 leads token 1 by 0.5
        let logits = [5.0, 4.5, 0.0];
        let run = |f: f32, pres: f32| {
            let mut s = Sampler::new(
                greedy_with(|p| {
                    p.frequency_penalty = f;
                    p.presence_penalty = pres;
                }),
                &[],
            );
            (0..4).map(|_| s.sample(&logits).0).collect::<Vec<_>>()
        };
        assert_eq!(run(0.0, 0.0), vec![0, 0, 0, 0]);
        // frequency 0.3: token 0 wins while 5.0 - 0.3 k > 4.5 - 0.3 j
        assert_eq!(run(0.3, 0.0), vec![0, 0, 1, 0]);
        // presence 1.0: once both occurred, each is down by exactly 1, so token 0 again
        assert_eq!(run(0.0, 1.0), vec![0, 1, 0, 0]);
        // negative penalties reward repetition
        assert_eq!(run(-2.0, 0.0), vec![0, 0, 0, 0]);
    }

    #[test]
    fn repetition_penalty_covers_the_prompt_and_the_output() {
        let logits = [3.0, 2.0, -1.0, -1.5];
        let rep = |r: f32, prompt: &[u32]| {
            let mut s = Sampler::new(greedy_with(|p| p.repetition_penalty = r), prompt);
            (0..3).map(|_| s.sample(&logits).0).collect::<Vec<_>>()
        };
        assert_eq!(rep(1.0, &[0]), vec![0, 0, 0]);
        // token 0 is in the prompt: 3 / 2 = 1.5 < 2, token 1 wins, then both are penalized (1.5 > 1)
        assert_eq!(rep(2.0, &[0]), vec![1, 0, 0]);
        // negative logits are multiplied: token 2 seen goes to -4 (below token 3's -1.5)
        let mut s = Sampler::new(greedy_with(|p| p.repetition_penalty = 4.0), &[0, 1, 2]);
        // 0.75, 0.5, -4.0, -1.5: token 0
        assert_eq!(s.sample(&logits).0, 0);
        let mut s = Sampler::new(greedy_with(|p| p.repetition_penalty = 4.0), &[]);
        assert_eq!(s.sample(&[-1.0, -1.5]).0, 0);
        let mut s = Sampler::new(greedy_with(|p| p.repetition_penalty = 4.0), &[0]);
        assert_eq!(s.sample(&[-1.0, -1.5]).0, 1);
    }

    #[test]
    fn min_p_drops_the_unlikely_tail() {
        // probabilities about 0.67, 0.24, 0.09: min_p 0.2 keeps the first two only
        let logits = [2.0, 1.0, 0.0];
        let draw = |min_p: f32| {
            let mut p = params(1.0, 0, 1.0, 11);
            p.min_p = min_p;
            let mut s = Sampler::new(p, &[]);
            (0..400)
                .map(|_| s.sample(&logits).0)
                .collect::<HashSet<_>>()
        };
        assert_eq!(draw(0.0), HashSet::from([0, 1, 2]));
        assert_eq!(draw(0.2), HashSet::from([0, 1]));
        assert_eq!(draw(0.5), HashSet::from([0]));
    }
}
