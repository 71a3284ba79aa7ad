//! The two loaders agree: a tiny random Llama written as a Hugging Face directory
//! (config.json + safetensors + tokenizer.json) and as a GGUF file (llama.cpp's names, metadata
//! and Q/K row permutation) loads to the same model, bit for bit, whether named by path or by
//! `org/name` in an offline hf-hub cache.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use tandem_kv_cache::CacheDtype;
use tandem_models::{load_model, ChatMessage, LoadOptions, LoadedModel, WeightMode};

const HIDDEN: usize = 64;
const INTER: usize = 128;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;
const VOCAB: usize = 300;

fn random(seed: &mut u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
}

/// HF tensors of a tiny Llama: name -> (shape, values).
fn tiny_llama() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut s = 42;
    let mut t = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, one_plus: bool| {
        let n = shape.iter().product();
        let mut v = random(&mut s, n, scale);
        if one_plus {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        t.push((name, shape, v));
    };
    add(
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        1.0,
        false,
    );
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        add(
            format!("{p}.input_layernorm.weight"),
            vec![HIDDEN],
            0.2,
            true,
        );
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![HIDDEN],
            0.2,
            true,
        );
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![HIDDEN, HIDDEN],
            0.2,
            false,
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![KV_HEADS * HEAD_DIM, HIDDEN],
            0.2,
            false,
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![KV_HEADS * HEAD_DIM, HIDDEN],
            0.2,
            false,
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![HIDDEN, HIDDEN],
            0.2,
            false,
        );
        add(
            format!("{p}.mlp.gate_proj.weight"),
            vec![INTER, HIDDEN],
            0.2,
            false,
        );
        add(
            format!("{p}.mlp.up_proj.weight"),
            vec![INTER, HIDDEN],
            0.2,
            false,
        );
        add(
            format!("{p}.mlp.down_proj.weight"),
            vec![HIDDEN, INTER],
            0.2,
            false,
        );
    }
    add("model.norm.weight".into(), vec![HIDDEN], 0.2, true);
    add("lm_head.weight".into(), vec![VOCAB, HIDDEN], 0.5, false);
    t
}

fn token(i: usize) -> String {
    match i {
        0 => "<unk>".into(),
        1 => "<s>".into(),
        2 => "</s>".into(),
        _ => format!("t{i}"),
    }
}

const TEMPLATE: &str = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";

fn write_hf_dir(dir: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    std::fs::create_dir_all(dir).unwrap();
    let map: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, shape, v)| {
            let t = Tensor::from_vec(v.clone(), shape.as_slice(), &Device::Cpu).unwrap();
            (n.clone(), t)
        })
        .collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let vocab: serde_json::Map<String, serde_json::Value> = (0..VOCAB)
        .map(|i| (token(i), serde_json::json!(i)))
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let tcfg =
        serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE});
    std::fs::write(dir.join("tokenizer_config.json"), tcfg.to_string()).unwrap();
}

/// llama.cpp's permutation of Q/K rows: GGUF row `h*hd + 2i + j` holds HF row `h*hd + j*hd/2 + i`.
fn permute_rows(v: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = vec![0f32; v.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let (dst, src) = (h * hd + 2 * i + j, h * hd + j * hd / 2 + i);
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&v[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn write_gguf(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let gguf_name = |hf: &str| -> String {
        if let Some(rest) = hf.strip_prefix("model.layers.") {
            let (l, tail) = rest.split_once('.').unwrap();
            let t = match tail {
                "input_layernorm.weight" => "attn_norm",
                "post_attention_layernorm.weight" => "ffn_norm",
                "self_attn.q_proj.weight" => "attn_q",
                "self_attn.k_proj.weight" => "attn_k",
                "self_attn.v_proj.weight" => "attn_v",
                "self_attn.o_proj.weight" => "attn_output",
                "mlp.gate_proj.weight" => "ffn_gate",
                "mlp.up_proj.weight" => "ffn_up",
                "mlp.down_proj.weight" => "ffn_down",
                other => panic!("{other}"),
            };
            return format!("blk.{l}.{t}.weight");
        }
        match hf {
            "model.embed_tokens.weight" => "token_embd.weight",
            "model.norm.weight" => "output_norm.weight",
            "lm_head.weight" => "output.weight",
            other => panic!("{other}"),
        }
        .into()
    };
    let qtensors: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, shape, v)| {
            let v = if n.ends_with("q_proj.weight") {
                permute_rows(v, shape[0], shape[1], HEADS)
            } else if n.ends_with("k_proj.weight") {
                permute_rows(v, shape[0], shape[1], KV_HEADS)
            } else {
                v.clone()
            };
            let t = Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap();
            (gguf_name(n), QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    let u32v = |x: usize| Value::U32(x as u32);
    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", u32v(LAYERS)),
        ("llama.context_length", u32v(256)),
        ("llama.embedding_length", u32v(HIDDEN)),
        ("llama.feed_forward_length", u32v(INTER)),
        ("llama.attention.head_count", u32v(HEADS)),
        ("llama.attention.head_count_kv", u32v(KV_HEADS)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array((0..VOCAB).map(|i| Value::String(token(i))).collect()),
        ),
        ("tokenizer.ggml.merges", Value::Array(vec![])),
        (
            "tokenizer.ggml.token_type",
            Value::Array(
                (0..VOCAB)
                    .map(|i| Value::I32(if i < 3 { 3 } else { 1 }))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.bos_token_id", u32v(1)),
        ("tokenizer.ggml.eos_token_id", u32v(2)),
        ("tokenizer.chat_template", Value::String(TEMPLATE.into())),
    ];
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = qtensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md, &ts).unwrap();
}

fn logits(m: &LoadedModel) -> Vec<Vec<f32>> {
    let mut cache = common::Cache::new(m.model(), 4, 32, CacheDtype::F32);
    let prompts = vec![vec![5u32, 17, 200, 3, 9, 42, 7], vec![11u32, 12]];
    let (_, logits) = common::greedy_batched(m.model(), &mut cache, &prompts, 4, 3);
    logits.into_iter().flatten().collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-loaders-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn hf_directory_gguf_file_and_hub_id_load_the_same_model() {
    let tensors = tiny_llama();
    let root = temp_dir("all");
    let hf = root.join("tiny-llama");
    write_hf_dir(&hf, &tensors);
    let gguf = root.join("tiny-llama.gguf");
    write_gguf(&gguf, &tensors);
    // an offline hf-hub cache holding the same directory as `org/tiny-llama`
    let hub = root.join("hub");
    let repo = hub.join("models--org--tiny-llama");
    let snap = repo.join("snapshots/0123abc");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abc").unwrap();
    write_hf_dir(&snap, &tensors);
    std::env::set_var("HF_HUB_CACHE", &hub);

    let f32_opts = LoadOptions {
        weights: Some(WeightMode::F32),
        ..Default::default()
    };
    let a = load_model(hf.to_str().unwrap(), &f32_opts).unwrap();
    let b = load_model(gguf.to_str().unwrap(), &f32_opts).unwrap();
    let c = load_model("org/tiny-llama", &f32_opts).unwrap();
    assert_eq!(a.name, "tiny-llama");
    assert_eq!(b.name, "tiny-llama");
    assert_eq!(c.name, "org/tiny-llama");
    assert_eq!(a.info, b.info);
    assert_eq!(a.info, c.info);
    assert_eq!(
        (a.info.num_layers, a.info.num_kv_heads, a.info.head_dim),
        (2, 2, 16)
    );
    assert!(!a.info.tie_word_embeddings);

    let (la, lb, lc) = (logits(&a), logits(&b), logits(&c));
    let max_diff = |x: &[Vec<f32>], y: &[Vec<f32>]| {
        x.iter()
            .flatten()
            .zip(y.iter().flatten())
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()))
    };
    assert!(
        la == lb,
        "HF and GGUF loads differ by {}",
        max_diff(&la, &lb)
    );
    assert!(
        la == lc,
        "path and hub-id loads differ by {}",
        max_diff(&la, &lc)
    );

    // tokenizers and chat templates from both sources
    for m in [&a, &b] {
        let msgs = [ChatMessage::new("user", "t5 t6")];
        let text = m.tokenizer.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(text, "<user>t5 t6</s><assistant>");
        assert_eq!(m.tokenizer.eos_token_ids(), &[2]);
        assert_eq!(m.tokenizer.bos_token_id(), Some(1));
    }
    assert_eq!(
        a.tokenizer.encode("t5 t6 </s>", false).unwrap(),
        vec![5, 6, 2]
    );

    // the quantized mode loads from safetensors too and stays close
    let q = load_model(
        hf.to_str().unwrap(),
        &LoadOptions {
            weights: Some(WeightMode::Q8_0),
            ..Default::default()
        },
    )
    .unwrap();
    let lq = logits(&q);
    let scale = la[0].iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = la[0]
        .iter()
        .zip(&lq[0])
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff < 0.05 * scale,
        "q8_0 first-step logits off by {diff} (scale {scale})"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
