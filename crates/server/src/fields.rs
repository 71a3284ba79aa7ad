//! Request fields beyond the ones Tandem implements: what happens to each.
//!
//! A client that sends a field expecting it to change the output must never get HTTP 200 with
//! the field silently ignored. So every field outside [`crate::protocol`]'s structs is one of:
//! - **refused**: a field of the OpenAI or vLLM API that would change the output and that Tandem
//!   does not implement; a 400 names it (`param`), unless its value is the one that changes
//!   nothing (`best_of: 1`, `tool_choice: "none"`, `null`, …);
//! - **accepted**: fields that change nothing about the output (`user`, `metadata`, `store`, …);
//! - **unknown**: anything else is accepted, as vLLM does, with one warning per field name in the
//!   log (at most [`MAX_WARNED_NAMES`] names are remembered, so hostile clients cannot grow it).
//!
//! Invariant: a field listed as refused never passes with a value that changes the output.

use std::collections::HashSet;
use std::sync::Mutex;

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Fields that change nothing about the output: accepted without a word.
const NO_OP_FIELDS: [&str; 5] = [
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
];

/// Unknown field names remembered for the once-per-name warning.
pub const MAX_WARNED_NAMES: usize = 1024;

/// Whether `value` of the refused field `name` asks for nothing (so it may pass).
fn asks_for_nothing(name: &str, value: &Value) -> bool {
    let number_is = |want: f64| value.as_f64() == Some(want);
    match value {
        Value::Null => return true,
        Value::Array(a) if a.is_empty() => return true,
        Value::Object(o) if o.is_empty() => return true,
        _ => {}
    }
    match name {
        "length_penalty" => number_is(1.0),
        "best_of" => number_is(1.0),
        "use_beam_search" | "echo" | "continue_final_message" => value == &Value::Bool(false),
        "spaces_between_special_tokens" => value == &Value::Bool(true),
        "priority" => number_is(0.0),
        "guided_decoding_backend" => {
            matches!(value.as_str(), Some("auto" | "llguidance" | "guidance"))
        }
        "tool_choice" | "function_call" => value.as_str() == Some("none"),
        "modalities" => value == &serde_json::json!(["text"]),
        "suffix" => value.as_str() == Some(""),
        _ => false,
    }
}

/// Fields of the OpenAI or vLLM API that change the output and are not implemented, with what
/// the client should know.
fn refusal(name: &str) -> Option<&'static str> {
    Some(match name {
        "allowed_token_ids" | "bad_words" | "logits_processors" => "token masks are not supported",
        "guided_grammar" => {
            "guided_grammar is not supported; use guided_json, guided_regex or guided_choice"
        }
        "guided_decoding_backend" => "llguidance is the only structured-output backend",
        "guided_whitespace_pattern" => "guided_whitespace_pattern is not supported",
        "tools" | "tool_choice" => "tool calls are supported on /v1/chat/completions only",
        "functions" | "function_call" => "the legacy functions API is not supported; use tools",
        "typical_p" | "top_a" => "this sampling control is not supported",
        "best_of" => "best_of is supported on /v1/completions only",
        "use_beam_search" | "length_penalty" => "beam search is not supported",
        "echo" => "echo is supported on /v1/completions only",
        "suffix" => "suffix (insertion) is not supported",
        "truncate_prompt_tokens" => "prompt truncation is not supported; send a prompt that fits",
        "continue_final_message" | "chat_template" | "chat_template_kwargs" | "documents" => {
            "only the model's own chat template is supported"
        }
        "spaces_between_special_tokens" => "detokenization options are not supported",
        "priority" => "priority scheduling is not supported",
        "cache_salt" => "prefix-cache isolation (cache_salt) is not supported",
        "modalities" | "audio" | "prediction" | "reasoning_effort" | "web_search_options" => {
            "only text completions are supported"
        }
        _ => return None,
    })
}

/// Checks the fields no struct claimed: refuses the output-changing ones Tandem does not
/// implement, warns once per unknown name.
pub fn check_extra_fields(extra: &Map<String, Value>) -> Result<(), ApiError> {
    for (name, value) in extra {
        if NO_OP_FIELDS.contains(&name.as_str()) {
            continue;
        }
        match refusal(name) {
            Some(why) if !asks_for_nothing(name, value) => {
                return Err(ApiError::bad_request(
                    Some(name),
                    format!("{name}: {why}; remove the field (or send its neutral value)"),
                ));
            }
            Some(_) => {}
            None => warn_unknown(name),
        }
    }
    Ok(())
}

static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

fn warn_unknown(name: &str) {
    let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    let warned = warned.get_or_insert_with(HashSet::new);
    if warned.len() < MAX_WARNED_NAMES && !warned.contains(name) {
        let shown: String = name.chars().take(64).collect();
        tracing::warn!(
            field = %shown,
            "the request field {shown:?} is not known to Tandem and is ignored (logged once \
             per field name)"
        );
        warned.insert(name.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(v: Value) -> Result<(), ApiError> {
        check_extra_fields(v.as_object().unwrap())
    }

    fn refused_param(v: Value) -> String {
        match check(v.clone()) {
            Err(ApiError::BadRequest { param, .. }) => param.unwrap(),
            other => panic!("{v}: expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn output_changing_fields_are_refused_by_name() {
        for (field, value) in [
            ("allowed_token_ids", json!([1, 2])),
            ("guided_grammar", json!("root ::= \"a\"")),
            ("guided_decoding_backend", json!("xgrammar")),
            (
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            ),
            ("tool_choice", json!("required")),
            ("typical_p", json!(0.9)),
            ("best_of", json!(3)),
            ("use_beam_search", json!(true)),
            ("cache_salt", json!("tenant-a")),
        ] {
            assert_eq!(refused_param(json!({ field: value })), field);
        }
    }

    #[test]
    fn neutral_values_and_no_op_fields_pass() {
        for v in [
            json!({"length_penalty": 1.0, "best_of": 1, "allowed_token_ids": []}),
            json!({"tools": [], "tool_choice": "none", "guided_decoding_backend": "auto"}),
            json!({"use_beam_search": false, "guided_grammar": null}),
            json!({"user": "u1", "metadata": {"k": "v"}, "store": true, "service_tier": "auto"}),
            json!({"some_new_field": 1, "another": "x"}),
        ] {
            assert!(check(v.clone()).is_ok(), "{v}");
        }
    }

    #[test]
    fn unknown_names_are_remembered_once_and_bounded() {
        for i in 0..(MAX_WARNED_NAMES + 50) {
            warn_unknown(&format!("field_{i}"));
            warn_unknown(&format!("field_{i}"));
        }
        let n = WARNED.lock().unwrap().as_ref().map_or(0, HashSet::len);
        assert!(n <= MAX_WARNED_NAMES, "{n} names remembered");
    }
}
