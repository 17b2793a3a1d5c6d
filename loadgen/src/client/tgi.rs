//! TGI's `/generate_stream`: one event per token, the last with `generated_text` (and
//! `details`). TGI's API has no `ignore_eos`, so an output may end early at EOS; the report
//! shows the tokens received next to the tokens asked for.

use serde_json::{json, Value};

use super::{error_type, EventMeaning};
use crate::client::sse::SseEvent;
use crate::workload::RequestSpec;

pub fn body(spec: &RequestSpec) -> Value {
    json!({
        "inputs": spec.prompt,
        "parameters": {"max_new_tokens": spec.output_len, "details": true},
    })
}

pub fn interpret(event: &SseEvent) -> Result<EventMeaning, serde_json::Error> {
    let v: Value = serde_json::from_str(event.data.trim())?;
    if event.event.as_deref() == Some("error") || v.get("error").is_some_and(|e| !e.is_null()) {
        return Ok(EventMeaning::error(error_type(&v)));
    }
    let details = v.get("details").filter(|d| !d.is_null());
    Ok(EventMeaning {
        tokens: usize::from(v.get("token").is_some_and(Value::is_object)),
        finished: v.get("generated_text").is_some_and(|t| !t.is_null()) || details.is_some(),
        completion_tokens: details
            .and_then(|d| d.get("generated_tokens"))
            .and_then(Value::as_u64)
            .map(|n| n as usize),
        ..EventMeaning::default()
    })
}
