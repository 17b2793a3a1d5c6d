//! Building SSE events. Error events are [`crate::GatewayError::to_sse_event`]'s (TGI) and
//! `to_openai_sse_event`'s (OpenAI) alone.

use axum::response::sse::Event;
use serde::Serialize;

use crate::error::GatewayError;

/// An event whose data is `value` as JSON.
pub(crate) fn json_event(value: &impl Serialize) -> Event {
    Event::default().json_data(value).unwrap_or_else(|e| {
        GatewayError::Internal {
            message: format!("serializing an event: {e}"),
        }
        .to_sse_event()
    })
}
