//! The tokenizer built from the GGUF metadata against transformers' ids for the same file
//! (fixture from scripts/reference/make_fixture.py), the chat template, the special ids and
//! the incremental detokenizer.

mod common;

use common::{fixture, ids};
use tandem_models::{ChatMessage, IncrementalDetokenizer, WeightMode};

/// Every golden string encodes to transformers' ids and decodes back to its text, and every
/// golden chat renders to transformers' text.
fn check_golden(tok: &tandem_models::TextTokenizer, g: &serde_json::Value) {
    let bytes = tok.token_bytes();
    assert_eq!(bytes.len(), tok.vocab_size());
    for e in g["encode"].as_array().unwrap() {
        let text = e["text"].as_str().unwrap();
        let want = ids(&e["ids"]);
        // Each token's bytes (what structured outputs mask by) spell the decoded text.
        let spelled: Vec<u8> = want
            .iter()
            .filter(|&&id| !tok.is_special(id))
            .flat_map(|&id| bytes[id as usize].clone())
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&spelled),
            tok.decode(&want, true).unwrap(),
            "token bytes of {text:?}"
        );
        assert_eq!(tok.encode(text, true).unwrap(), want, "encode {text:?}");
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            e["decoded"].as_str().unwrap(),
            "decode {text:?}"
        );
    }
    for c in g["chat"].as_array().unwrap() {
        let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let add = c["add_generation_prompt"].as_bool().unwrap();
        assert_eq!(
            tok.apply_chat_template(&msgs, add).unwrap(),
            c["text"].as_str().unwrap()
        );
    }
}

#[test]
fn gguf_tokenizer_matches_transformers() {
    let Some(m) = common::load(WeightMode::Q8_0) else {
        return;
    };
    let tok = &m.tokenizer;
    let g = fixture("tokenizer_golden.json");
    check_golden(tok, &g);
    assert_eq!(
        tok.bos_token_id(),
        Some(g["bos_token_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(
        tok.eos_token_ids(),
        &[g["eos_token_id"].as_u64().unwrap() as u32]
    );
    // <|im_end|> (2) is the EOS; <|endoftext|> (0) also ends generation
    assert_eq!(tok.stop_token_ids(), &[2, 0]);
    assert!(!tok.adds_bos());
    assert!(tok.is_special(1) && !tok.is_special(19556));
    // special tokens are skipped on request
    assert_eq!(
        tok.decode(&[1, 4093, 198, 26843, 2], true).unwrap(),
        "user\nHi"
    );
}

/// Gemma 3's SentencePiece tokenizer, built from the GGUF's pieces and scores, against
/// transformers' for the same file; its chat template (built in: the GGUF has none) rendered
/// as transformers renders the same template.
#[test]
fn gemma3_gguf_tokenizer_matches_transformers() {
    let Some(m) = common::load_named("gemma3-270m", WeightMode::Q8_0) else {
        return;
    };
    let tok = &m.tokenizer;
    let g = fixture("gemma3_tokenizer_golden.json");
    check_golden(tok, &g);
    assert_eq!(
        tok.bos_token_id(),
        Some(g["bos_token_id"].as_u64().unwrap() as u32)
    );
    assert!(tok.adds_bos());
    assert!(tok
        .eos_token_ids()
        .contains(&(g["eos_token_id"].as_u64().unwrap() as u32)));
    // a turn ends generation
    let end_of_turn = tok.token_to_id("<end_of_turn>").expect("<end_of_turn>");
    assert!(
        tok.stop_token_ids().contains(&end_of_turn),
        "{:?}",
        tok.stop_token_ids()
    );
}

#[test]
fn incremental_detokenizer_streams_exactly_the_decoded_text() {
    let Some(m) = common::load(WeightMode::Q8_0) else {
        return;
    };
    let tok = &m.tokenizer;
    let mut texts: Vec<String> = fixture("tokenizer_golden.json")["encode"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["text"].as_str().unwrap().to_owned())
        .collect();
    texts.push("emoji 🦀🦀 then 中文 and é".into());
    for text in texts {
        let ids = tok.encode(&text, false).unwrap();
        for skip in [false, true] {
            let mut d = IncrementalDetokenizer::new(skip);
            let mut out = String::new();
            for &id in &ids {
                if let Some(piece) = d.push(tok, id).unwrap() {
                    assert!(
                        !piece.contains('\u{FFFD}'),
                        "{text:?}: partial UTF-8 emitted"
                    );
                    out.push_str(&piece);
                }
            }
            if let Some(rest) = d.flush(tok).unwrap() {
                out.push_str(&rest);
            }
            assert_eq!(out, tok.decode(&ids, skip).unwrap(), "{text:?} skip={skip}");
        }
    }
    // a token that is half of a multi-byte character is held back until the character is complete
    let crab = tok.encode("🦀", false).unwrap();
    assert!(crab.len() > 1, "the crab is several byte tokens");
    let mut d = IncrementalDetokenizer::new(false);
    assert_eq!(d.push(tok, crab[0]).unwrap(), None);
}
