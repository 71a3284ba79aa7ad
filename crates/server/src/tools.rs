//! Tool calls on chat: the `tools` a request offers and its `tool_choice`, turned into a
//! grammar that forces a call, and the forced output turned back into OpenAI's `tool_calls`.
//!
//! - `none`, or no tools: plain content.
//! - `auto` (the default with tools): plain content. The chat templates of the models Tandem
//!   serves define no tool-call format, so nothing in the output is a call.
//! - `required`: the output is a JSON array of one or more `{"name", "parameters"}` objects,
//!   each naming an offered function, its parameters valid under that function's schema.
//! - a named function (`{"type": "function", "function": {"name": …}}`): the output is that
//!   function's arguments, valid under its schema.
//!
//! Invariant: an answer carries `tool_calls` only when its output parses as the grammar says;
//! an output cut short (by `max_tokens`) is returned as content, with its finish reason.

use serde_json::{json, Value};
use tandem_structured::GuideSpec;

use crate::error::ApiError;
use crate::guided::{bad, Requested};

/// How a forced call is read back from the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolMode {
    /// The output is the arguments of this function.
    Named(String),
    /// The output is a list of calls.
    Required,
}

/// A tool choice that forces a call: how to read it back, and the grammar that forces it.
#[derive(Debug, Clone, PartialEq)]
pub struct Forcing {
    pub mode: ToolMode,
    pub guide: Requested,
}

/// Longest function name OpenAI accepts.
const MAX_NAME_LEN: usize = 64;

/// The offered functions: (name, parameter schema).
fn functions(tools: &[Value]) -> Result<Vec<(String, Value)>, ApiError> {
    let mut out: Vec<(String, Value)> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                "tools",
                format!("tools[{i}].type must be \"function\""),
            ));
        }
        let f = t.get("function");
        let name = f
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .filter(|n| {
                !n.is_empty()
                    && n.len() <= MAX_NAME_LEN
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            })
            .ok_or_else(|| {
                bad(
                    "tools",
                    format!(
                        "tools[{i}].function.name must be 1 to {MAX_NAME_LEN} letters, digits, \
                         _ or -"
                    ),
                )
            })?;
        if out.iter().any(|(n, _)| n == name) {
            return Err(bad(
                "tools",
                format!("tools[{i}]: function {name} is offered twice"),
            ));
        }
        let params = match f.and_then(|f| f.get("parameters")) {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => {
                return Err(bad(
                    "tools",
                    format!("tools[{i}].function.parameters must be a JSON schema object"),
                ))
            }
        };
        out.push((name.to_owned(), params));
    }
    Ok(out)
}

/// What `tools` and `tool_choice` ask for: `None` for plain content.
pub fn forcing(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
) -> Result<Option<Forcing>, ApiError> {
    let offered = functions(tools.unwrap_or_default())?;
    let choice = match choice {
        None | Some(Value::Null) => return Ok(None), // auto, or none without tools
        Some(c) => c,
    };
    match choice.as_str() {
        Some("none") | Some("auto") => return Ok(None),
        Some("required") => {
            if offered.is_empty() {
                return Err(bad("tool_choice", "tool_choice required needs tools"));
            }
            let calls: Vec<Value> = offered
                .iter()
                .map(|(name, params)| {
                    json!({"type": "object",
                        "properties": {"name": {"const": name}, "parameters": params},
                        "required": ["name", "parameters"], "additionalProperties": false})
                })
                .collect();
            let schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
            return Ok(Some(Forcing {
                mode: ToolMode::Required,
                guide: Requested {
                    param: "tool_choice",
                    spec: GuideSpec::JsonSchema(schema),
                },
            }));
        }
        Some(other) => {
            return Err(bad(
                "tool_choice",
                format!("tool_choice must be none, auto, required or a function, got {other:?}"),
            ))
        }
        None => {}
    }
    let name = choice
        .get("function")
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .filter(|_| choice.get("type").and_then(Value::as_str) == Some("function"))
        .ok_or_else(|| {
            bad(
                "tool_choice",
                "tool_choice must be none, auto, required or {\"type\": \"function\", \
                 \"function\": {\"name\": …}}",
            )
        })?;
    let (_, params) = offered.iter().find(|(n, _)| n == name).ok_or_else(|| {
        bad(
            "tool_choice",
            format!("tool_choice names {name}, which tools do not offer"),
        )
    })?;
    Ok(Some(Forcing {
        mode: ToolMode::Named(name.to_owned()),
        guide: Requested {
            param: "tool_choice",
            spec: GuideSpec::JsonSchema(params.clone()),
        },
    }))
}

/// OpenAI's `tool_calls` read from a forced output, or `None` when it does not parse (cut
/// short). Ids are `call_{request_id}_{choice}_{k}`.
pub fn calls(mode: &ToolMode, text: &str, request_id: &str, choice: usize) -> Option<Vec<Value>> {
    let out: Value = serde_json::from_str(text).ok()?;
    let pairs: Vec<(String, Value)> = match mode {
        ToolMode::Named(name) => vec![(name.clone(), out)],
        ToolMode::Required => out
            .as_array()?
            .iter()
            .map(|c| {
                Some((
                    c.get("name")?.as_str()?.to_owned(),
                    c.get("parameters")?.clone(),
                ))
            })
            .collect::<Option<_>>()?,
    };
    Some(
        pairs
            .into_iter()
            .enumerate()
            .map(|(k, (name, args))| {
                json!({"id": format!("call_{request_id}_{choice}_{k}"), "type": "function",
                       "function": {"name": name, "arguments": args.to_string()}})
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "now"}}),
        ]
    }

    #[test]
    fn choices_map_to_modes_and_outputs_to_calls() {
        let t = tools();
        assert_eq!(forcing(Some(&t), None).unwrap(), None);
        assert_eq!(forcing(Some(&t), Some(&json!("auto"))).unwrap(), None);
        let f = forcing(
            Some(&t),
            Some(&json!({"type": "function", "function": {"name": "get_weather"}})),
        )
        .unwrap()
        .unwrap();
        assert_eq!(f.mode, ToolMode::Named("get_weather".into()));
        let c = calls(&f.mode, r#"{"city": "Paris"}"#, "r1", 0).unwrap();
        assert_eq!(c[0]["function"]["name"], "get_weather");
        assert_eq!(c[0]["function"]["arguments"], r#"{"city":"Paris"}"#);
        let f = forcing(Some(&t), Some(&json!("required")))
            .unwrap()
            .unwrap();
        let c = calls(
            &f.mode,
            r#"[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]"#,
            "r1",
            1,
        )
        .unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[1]["id"], "call_r1_1_1");
        assert!(
            calls(&f.mode, r#"[{"name": "now""#, "r1", 0).is_none(),
            "cut short"
        );
    }

    #[test]
    fn bad_tools_and_choices_are_refused_by_name() {
        let t = tools();
        for (tools, choice, want) in [
            (vec![json!({"type": "retrieval"})], json!("auto"), "tools"),
            (
                vec![json!({"type": "function", "function": {"name": "a b"}})],
                json!("auto"),
                "tools",
            ),
            (vec![t[1].clone(), t[1].clone()], json!("auto"), "tools"),
            (t.clone(), json!("sometimes"), "tool_choice"),
            (
                t.clone(),
                json!({"type": "function", "function": {"name": "nope"}}),
                "tool_choice",
            ),
            (vec![], json!("required"), "tool_choice"),
        ] {
            match forcing(Some(&tools), Some(&choice)) {
                Err(ApiError::BadRequest { param, .. }) => {
                    assert_eq!(param.as_deref(), Some(want), "{choice}")
                }
                other => panic!("{choice}: {other:?}"),
            }
        }
    }
}
