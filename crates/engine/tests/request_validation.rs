//! Request validation over hostile values: [`SamplingParams::validate`] and
//! [`check_request_limits`] with sampling values and sizes drawn from the whole range (NaN and
//! infinities, `i32::MIN`, sizes near `2^64`), compared with the documented rules written out
//! once more here.
//!
//! This is the request-validation part of the fuzzing work: the engine crate pulls in candle and
//! the tokenizers through `tandem-models`, too heavy to build with fuzzing instrumentation on
//! this machine, so a property test covers it instead (the parsers live in `fuzz/`).
//!
//! Properties: neither function panics; `validate` accepts exactly the values in range;
//! `check_request_limits` accepts exactly the requests whose prompt is non-empty and whose prompt
//! plus `max_tokens` fits both the model length and the cache, never wrapping, and names the
//! limit it refuses.

use proptest::prelude::*;
use tandem_engine::core::check_request_limits;
use tandem_engine::request::NewRequest;
use tandem_engine::sampling::MAX_LOGPROBS;
use tandem_engine::{EngineError, SamplingParams, SchedulerConfig};

/// Sizes biased towards the edges: small, any, and within 1000 of `usize::MAX`.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..64,
        any::<usize>(),
        (0usize..1000).prop_map(|d| usize::MAX - d),
    ]
}

fn float() -> impl Strategy<Value = f32> {
    prop_oneof![
        -1.0f32..3.0,
        any::<f32>(),
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(0.0),
        Just(-0.0),
        Just(1.0),
        Just(2.0),
        Just(f32::MIN_POSITIVE),
        Just(1.0 + f32::EPSILON),
    ]
}

fn params() -> impl Strategy<Value = SamplingParams> {
    (
        (float(), float(), any::<i32>(), any::<Option<u64>>()),
        (size(), size(), proptest::option::of(size())),
        (
            proptest::collection::vec(".{0,3}", 0..3),
            proptest::collection::vec(any::<u32>(), 0..3),
        ),
    )
        .prop_map(
            |(
                (temperature, top_p, top_k, seed),
                (max_tokens, min_tokens, logprobs),
                (stop, ids),
            )| {
                SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    seed,
                    max_tokens,
                    min_tokens,
                    logprobs,
                    stop,
                    stop_token_ids: ids,
                    ..SamplingParams::default()
                }
            },
        )
}

/// The rules of `SamplingParams::validate`, written out independently.
fn in_range(p: &SamplingParams, vocab_size: usize) -> bool {
    (0.0..=2.0).contains(&p.temperature)
        && p.top_p > 0.0
        && p.top_p <= 1.0
        && p.top_k >= -1
        && p.max_tokens >= 1
        && p.min_tokens <= p.max_tokens
        && p.logprobs.is_none_or(|n| n <= MAX_LOGPROBS)
        && p.stop.iter().all(|s| !s.is_empty())
        && p.stop_token_ids.iter().all(|&t| (t as usize) < vocab_size)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn validate_accepts_exactly_the_values_in_range(p in params(), vocab_size in size()) {
        let verdict = p.validate(vocab_size);
        prop_assert_eq!(verdict.is_ok(), in_range(&p, vocab_size), "{:?}: {:?}", p, verdict);
        if let Err(e) = verdict {
            prop_assert!(matches!(e, EngineError::InvalidParam { .. }), "{:?}", e);
            prop_assert!(e.is_client_error());
        }
    }

    #[test]
    fn request_limits_never_wrap(
        prompt_len in 0usize..300,
        max_tokens in size(),
        max_model_len in size(),
        num_blocks in size(),
        block_size in 1usize..256,
    ) {
        let config = SchedulerConfig { max_model_len, ..SchedulerConfig::default() };
        let new = NewRequest {
            external_id: "r".into(),
            prompt_token_ids: vec![1; prompt_len],
            params: SamplingParams { max_tokens, ..SamplingParams::default() },
            kv_transfer_params: None,
        };
        let verdict = check_request_limits(&config, num_blocks, block_size, &new);
        let requested = prompt_len.checked_add(max_tokens);
        let fits = prompt_len > 0
            && requested.is_some_and(|r| r <= max_model_len && r.div_ceil(block_size) <= num_blocks);
        prop_assert_eq!(verdict.is_ok(), fits, "{:?}", verdict);
        match verdict {
            Ok(()) => {}
            Err(EngineError::InvalidParam { param, .. }) => {
                prop_assert!(
                    (param == "prompt" && prompt_len == 0)
                        || (param == "max_tokens" && requested.is_none()),
                    "{}", param
                );
            }
            Err(EngineError::ContextLengthExceeded { requested: r, prompt, max_tokens: m, .. }) => {
                prop_assert_eq!(Some(r), requested);
                prop_assert!(r > max_model_len);
                prop_assert_eq!((prompt, m), (prompt_len, max_tokens));
            }
            Err(EngineError::TooLargeForCache { needed, available }) => {
                prop_assert_eq!(available, num_blocks);
                prop_assert!(needed > num_blocks);
                prop_assert!(requested.is_some_and(|r| r <= max_model_len));
            }
            Err(other) => prop_assert!(false, "unexpected error {:?}", other),
        }
    }
}
