//! The real templates of Qwen3, Mistral Nemo, Mistral Small 3.2, Gemma 2, Gemma 3 and
//! Phi-4-mini (`tests/fixtures/templates/`, with their provenance) render exactly as
//! transformers renders them: `expected.json` holds transformers' own renderings
//! (`render_expected.py`), with the date Mistral Small writes as `<DATE>`.

use serde::Deserialize;

use super::*;

#[derive(Deserialize)]
struct Case {
    template: String,
    case: String,
    bos_token: String,
    eos_token: String,
    messages: Vec<ChatMessage>,
    tools: Vec<serde_json::Value>,
    expected: String,
}

fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates")
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn template(case: &Case) -> ChatTemplate {
    let source =
        std::fs::read_to_string(fixtures().join(format!("{}.jinja", case.template))).unwrap();
    ChatTemplate::new(source, case.bos_token.clone(), case.eos_token.clone()).unwrap()
}

fn today() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime("%Y-%m-%d", secs)
}

#[test]
fn each_family_renders_as_transformers_does() {
    let cases = cases();
    assert!(cases.len() >= 12);
    for case in &cases {
        let prompt = template(case)
            .apply_with_tools(&case.messages, &case.tools)
            .unwrap_or_else(|e| panic!("{} {}: {e}", case.template, case.case));
        assert_eq!(
            prompt.replace(&today(), "<DATE>"),
            case.expected,
            "{} {}",
            case.template,
            case.case
        );
    }
}

/// OpenAI's `tools` reach Phi-4-mini's template in its system message, as its model card
/// writes them: the same prompt as transformers' with the tools put there by hand.
#[test]
fn phi_4_mini_takes_openai_tools_in_its_system_message() {
    let cases = cases();
    let case = cases
        .iter()
        .find(|c| c.template == "phi-4-mini" && c.case == "tools_in_system")
        .unwrap();
    let mut messages = case.messages.clone();
    messages[0].tools = None;
    let tools: Vec<serde_json::Value> = serde_json::from_str(
        r#"[{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, in °C", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {}}}}]"#,
    )
    .unwrap();
    let prompt = template(case).apply_with_tools(&messages, &tools).unwrap();
    assert_eq!(prompt, case.expected);
    // Without a system message the gateway writes the model card's.
    let prompt = template(case)
        .apply_with_tools(&messages[1..], &tools)
        .unwrap();
    assert_eq!(prompt, case.expected);
}

/// Gemma 3 has no tool tokens and its template ignores tools: they reach the model in the
/// last user turn, and a tool round keeps the roles alternating as the template demands.
#[test]
fn gemma_3_gets_tools_in_the_user_turn_and_keeps_alternating() {
    let cases = cases();
    let case = cases.iter().find(|c| c.template == "gemma-3").unwrap();
    let tools = [serde_json::json!({"type": "function", "function": {"name": "get_time"}})];
    let call = ChatMessage {
        role: "assistant".into(),
        tool_calls: Some(serde_json::json!([{"id": "c1", "type": "function",
            "function": {"name": "get_time", "arguments": {}}}])),
        ..ChatMessage::default()
    };
    let messages = [
        ChatMessage {
            role: "user".into(),
            content: "Time?".into(),
            ..ChatMessage::default()
        },
        call,
        ChatMessage {
            role: "tool".into(),
            content: "12:00".into(),
            tool_call_id: Some("c1".into()),
            ..ChatMessage::default()
        },
    ];
    let prompt = template(case).apply_with_tools(&messages, &tools).unwrap();
    assert!(
        prompt.starts_with("<bos><start_of_turn>user\nTime?<end_of_turn>\n"),
        "{prompt}"
    );
    // Before the tool round, the user's turn carries them.
    let prompt = template(case)
        .apply_with_tools(&messages[..1], &tools)
        .unwrap();
    assert!(
        prompt.starts_with("<bos><start_of_turn>user\nTime?\n\nYou can call functions."),
        "{prompt}"
    );
    let prompt = template(case).apply_with_tools(&messages, &tools).unwrap();
    assert!(
        prompt.contains(
            "<start_of_turn>model\n[{\"name\": \"get_time\", \"arguments\": {}}]<end_of_turn>\n\
             <start_of_turn>user\nTool result:\n12:00\n\nYou can call functions."
        ),
        "{prompt}"
    );
    assert!(prompt.ends_with("<start_of_turn>model\n"), "{prompt}");
}

#[test]
fn families_come_from_the_templates() {
    use crate::openai::family::{ThinkStart, ToolSyntax};
    for case in cases() {
        let family = template(&case).family();
        let expected = match case.template.as_str() {
            "qwen3" => (ToolSyntax::Hermes, Some(ThinkStart::MayOpen)),
            "mistral-nemo" | "mistral-small-3.2" => (ToolSyntax::Mistral, None),
            "phi-4-mini" => (ToolSyntax::Phi4Mini, None),
            _ => (ToolSyntax::Json, None),
        };
        assert_eq!(
            (family.tools, family.reasoning),
            expected,
            "{}",
            case.template
        );
    }
}
