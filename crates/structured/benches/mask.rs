//! What a structured output costs a decode step: one token mask over SmolLM2's 49,152-token
//! vocabulary, against a log-softmax over the same logits (what `logprobs` costs per token), side
//! by side in one run.
//!
//! States measured: inside a JSON schema's string value (the widest mask: almost every token),
//! after an object key (few tokens), and a `guided_choice` start. Building the vocabulary's
//! token trie and parser factory (once per server start) is timed too.
//!
//! Run: `cargo bench -p tandem-structured --bench mask` (needs `scripts/setup.sh`'s model).

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use serde_json::json;
use tandem_models::loader::{resolve_model, LoadOptions};
use tandem_models::TextTokenizer;
use tandem_structured::{Guidance, GuideSpec, GuidedDecoder};

fn tokenizer() -> TextTokenizer {
    let (_, source) = resolve_model("smollm2-135m", &LoadOptions::default())
        .expect("the default model: run scripts/setup.sh");
    let gguf = tandem_models::gguf::GgufFile::open(source.path()).unwrap();
    TextTokenizer::from_gguf(&gguf).unwrap()
}

fn log_softmax(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
    logits[0] - lse
}

/// A decoder advanced over `text` (tokenized greedily over the vocabulary).
fn at(g: &Guidance, spec: &GuideSpec, text: &str) -> GuidedDecoder {
    let mut d = g.compile(spec).unwrap();
    for t in g.tokenize_bytes(text.as_bytes()) {
        d.accept(t);
    }
    assert!(d.error().is_none(), "{text}: {:?}", d.error());
    d
}

fn bench(c: &mut Criterion) {
    let tok = tokenizer();
    let bytes = tok.token_bytes();
    let started = Instant::now();
    let g = Guidance::new(&bytes, tok.eos_token_ids()[0]).unwrap();
    println!(
        "vocabulary of {} tokens ready in {:.1} ms",
        bytes.len(),
        started.elapsed().as_secs_f64() * 1e3
    );
    let schema = GuideSpec::JsonSchema(json!({"type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": false}));
    let states = [
        ("json_in_string", at(&g, &schema, r#"{"city": "Par"#)),
        (
            "json_after_key",
            at(&g, &schema, r#"{"city": "Paris", "population""#),
        ),
        (
            "choice_start",
            at(&g, &GuideSpec::Choice(vec!["yes".into(), "no".into()]), ""),
        ),
    ];
    let logits: Vec<f32> = (0..bytes.len())
        .map(|i| ((i * 7919) % 1000) as f32 * 0.01)
        .collect();
    let mut group = c.benchmark_group("mask");
    group.bench_function("log_softmax_reference", |b| {
        b.iter(|| black_box(log_softmax(black_box(&logits))))
    });
    for (name, d) in &states {
        group.bench_function(*name, |b| {
            b.iter_batched_ref(
                || (d.clone(), logits.clone()),
                |(d, l)| d.mask(l),
                criterion::BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
