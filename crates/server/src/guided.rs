//! Structured outputs at the API edge: which request field asks for which grammar, compiled
//! against the served vocabulary before the request reaches the engine.
//!
//! A request names at most one grammar: OpenAI's `response_format` (`json_object`,
//! `json_schema`), vLLM's `guided_json`, `guided_regex`, `guided_choice`, or its newer
//! `structured_outputs` (`json`, `regex`, `choice`), or on chat a `tool_choice` that forces a
//! call ([`crate::tools`]). `response_format: {"type": "text"}` and `null` ask for nothing.
//! Invariant: a grammar that cannot be used is a 400 naming the field the client sent; no
//! request asking for one runs without it.

use serde_json::Value;
use tandem_structured::{GuideSpec, GuidedDecoder};

use crate::error::ApiError;
use crate::protocol::CommonParams;
use crate::state::AppState;

/// A grammar a request asks for, and the field that asked.
#[derive(Debug, Clone, PartialEq)]
pub struct Requested {
    pub param: &'static str,
    pub spec: GuideSpec,
}

/// A 400 naming `param`.
pub(crate) fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad_request(Some(param), message)
}

/// A JSON schema given as an object, or as a string holding one (vLLM takes both).
fn schema(param: &'static str, v: &Value) -> Result<GuideSpec, ApiError> {
    let v = match v {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| bad(param, format!("{param} is not a JSON schema: {e}")))?,
        other => other.clone(),
    };
    if !v.is_object() {
        return Err(bad(param, format!("{param} must be a JSON schema object")));
    }
    Ok(GuideSpec::JsonSchema(v))
}

fn response_format(v: &Value) -> Result<Option<GuideSpec>, ApiError> {
    const P: &str = "response_format";
    if v.is_null() {
        return Ok(None);
    }
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GuideSpec::JsonObject)),
        Some("json_schema") => {
            let s = v
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| bad(P, "response_format json_schema needs json_schema.schema"))?;
            schema(P, s).map(Some)
        }
        other => Err(bad(
            P,
            format!(
                "response_format type must be text, json_object or json_schema, got {}",
                other.map_or("none".into(), |t| format!("{t:?}"))
            ),
        )),
    }
}

fn structured_outputs(v: &Value) -> Result<Option<GuideSpec>, ApiError> {
    const P: &str = "structured_outputs";
    let Some(o) = v.as_object() else {
        return if v.is_null() {
            Ok(None)
        } else {
            Err(bad(P, "structured_outputs must be an object"))
        };
    };
    let mut found = Vec::new();
    for (k, x) in o.iter().filter(|(_, x)| !x.is_null()) {
        found.push(match k.as_str() {
            "json" => schema(P, x)?,
            "regex" => GuideSpec::Regex(
                x.as_str()
                    .ok_or_else(|| bad(P, "structured_outputs.regex must be a string"))?
                    .to_owned(),
            ),
            "choice" => GuideSpec::Choice(
                serde_json::from_value(x.clone())
                    .map_err(|_| bad(P, "structured_outputs.choice must be a list of strings"))?,
            ),
            "json_object" if x == &Value::Bool(true) => GuideSpec::JsonObject,
            other => {
                return Err(bad(
                    P,
                    format!(
                        "structured_outputs.{other} is not supported (json, regex, choice and \
                         json_object are)"
                    ),
                ))
            }
        });
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(bad(
            P,
            "structured_outputs must name one of json, regex, choice",
        )),
    }
}

/// The grammar the request's own fields ask for (tools aside).
pub fn requested(c: &CommonParams) -> Result<Option<Requested>, ApiError> {
    let mut found: Vec<Requested> = Vec::new();
    let mut add = |param: &'static str, spec: Option<GuideSpec>| {
        if let Some(spec) = spec {
            found.push(Requested { param, spec });
        }
    };
    if let Some(v) = &c.response_format {
        add("response_format", response_format(v)?);
    }
    if let Some(v) = c.guided_json.as_ref().filter(|v| !v.is_null()) {
        add("guided_json", Some(schema("guided_json", v)?));
    }
    add("guided_regex", c.guided_regex.clone().map(GuideSpec::Regex));
    add(
        "guided_choice",
        c.guided_choice.clone().map(GuideSpec::Choice),
    );
    if let Some(v) = &c.structured_outputs {
        add("structured_outputs", structured_outputs(v)?);
    }
    one_of(found)
}

/// At most one grammar per request.
pub fn one_of(mut found: Vec<Requested>) -> Result<Option<Requested>, ApiError> {
    if found.len() > 1 {
        return Err(bad(
            found[1].param,
            format!(
                "only one structured output may be asked for; got {} and {}",
                found[0].param, found[1].param
            ),
        ));
    }
    Ok(found.pop())
}

/// Compiles a request's grammar for the engine.
pub fn compile(state: &AppState, r: &Requested) -> Result<GuidedDecoder, ApiError> {
    let guidance = state
        .guidance
        .as_ref()
        .map_err(|e| bad(r.param, format!("structured outputs are unavailable: {e}")))?;
    guidance
        .compile(&r.spec)
        .map_err(|e| bad(r.param, format!("{}: {e}", r.param)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<Requested>, ApiError> {
        let c: CommonParams = serde_json::from_value(v).unwrap();
        requested(&c)
    }

    fn param_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::BadRequest { param, .. } => param,
            _ => None,
        }
    }

    #[test]
    fn each_form_maps_to_its_grammar() {
        let s = json!({"type": "object"});
        for (v, want) in [
            (
                json!({"response_format": {"type": "json_object"}}),
                GuideSpec::JsonObject,
            ),
            (
                json!({"response_format": {"type": "json_schema",
                       "json_schema": {"name": "x", "schema": s}}}),
                GuideSpec::JsonSchema(s.clone()),
            ),
            (json!({"guided_json": s}), GuideSpec::JsonSchema(s.clone())),
            (
                json!({"guided_json": s.to_string()}),
                GuideSpec::JsonSchema(s.clone()),
            ),
            (
                json!({"guided_regex": "[a-z]+"}),
                GuideSpec::Regex("[a-z]+".into()),
            ),
            (
                json!({"guided_choice": ["a", "b"]}),
                GuideSpec::Choice(vec!["a".into(), "b".into()]),
            ),
            (
                json!({"structured_outputs": {"choice": ["a"]}}),
                GuideSpec::Choice(vec!["a".into()]),
            ),
        ] {
            assert_eq!(parse(v.clone()).unwrap().unwrap().spec, want, "{v}");
        }
        for v in [
            json!({"response_format": {"type": "text"}}),
            json!({"response_format": null, "guided_json": null}),
        ] {
            assert!(parse(v).unwrap().is_none());
        }
    }

    #[test]
    fn bad_or_several_grammars_are_refused_by_name() {
        for (v, param) in [
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_json": [1]}), "guided_json"),
            (
                json!({"structured_outputs": {"grammar": "x"}}),
                "structured_outputs",
            ),
            (
                json!({"guided_regex": "a", "guided_choice": ["a"]}),
                "guided_choice",
            ),
        ] {
            assert_eq!(
                param_of(parse(v.clone()).unwrap_err()).as_deref(),
                Some(param),
                "{v}"
            );
        }
    }
}
