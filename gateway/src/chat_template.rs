//! Rendering chat messages into a prompt with the model's Jinja chat template
//! (`tokenizer_config.json`), as transformers' `apply_chat_template` does.
//!
//! The environment matches the one transformers uses: `trim_blocks` and `lstrip_blocks` on,
//! Python string and dict methods (`.strip()`, `.items()`, ...) through minijinja-contrib's
//! pycompat, `raise_exception(message)`, `strftime_now(format)`, and transformers' own `tojson`
//! filter (Python's `json.dumps`: `", "` and `": "` separators, keys in the order given, no
//! HTML escaping), so that tools and call arguments reach the model as it saw them in training.
//!
//! The template also says what family the model is ([`OutputFamily`]: how it writes tool calls,
//! whether it thinks aloud) and how it takes tools ([`ToolsInput`]); both are read once, here.

use std::io::{self, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

pub(crate) use self::kwargs::TemplateKwargs;
use crate::error::GatewayError;
use crate::openai::family::OutputFamily;

#[path = "chat_template_kwargs.rs"]
mod kwargs;

const TEMPLATE_NAME: &str = "chat_template";

/// One message as the template sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's calls, with arguments as objects (what templates `tojson`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn's answer to this call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning, which thinking models' templates write back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// A system turn's tools as a JSON text, where the template reads them (Phi-4-mini; see
    /// [`ToolsInput`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<String>,
}

/// A compiled chat template with the special tokens it renders.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Why the template is a stand-in, for a model never trained on chats
    /// (`fission_chat_template_stand_in` in `tokenizer_config.json`).
    stand_in: Option<String>,
    family: OutputFamily,
    tools_input: ToolsInput,
}

#[derive(Serialize)]
struct TemplateContext<'a> {
    messages: &'a [ChatMessage],
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
    /// Absent (undefined in the template) without tools, as transformers leaves it.
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a [serde_json::Value]>,
    /// The request's `chat_template_kwargs`, whose names never collide with the above.
    #[serde(flatten)]
    kwargs: &'a TemplateKwargs,
}

impl ChatTemplate {
    /// Reads `chat_template`, `bos_token` and `eos_token` from a `tokenizer_config.json`.
    /// `Ok(None)` when the file has no chat template.
    pub(crate) fn load(path: &Path) -> Result<Option<Self>, GatewayError> {
        let load_error = |message: String| GatewayError::Load {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| load_error(e.to_string()))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| load_error(e.to_string()))?;
        let Some(template) = template_source(config.get("chat_template")) else {
            return Ok(None);
        };
        let bos_token = token_text(config.get("bos_token")).unwrap_or_default();
        let eos_token = token_text(config.get("eos_token")).unwrap_or_default();
        let stand_in = config
            .get("fission_chat_template_stand_in")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        Self::new(template, bos_token, eos_token)
            .map(|t| Some(Self { stand_in, ..t }))
            .map_err(|e| load_error(e.to_string()))
    }

    /// Why this template is a stand-in, if it is one.
    pub(crate) fn stand_in(&self) -> Option<&str> {
        self.stand_in.as_deref()
    }

    /// Compiles `source`; a syntax error is a [`GatewayError::Template`].
    pub(crate) fn new(
        source: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<Self, GatewayError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let tools_input = ToolsInput::of_template(&source);
        let family_source = source.clone();
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(template_error)?;
        let mut template = Self {
            env,
            bos_token,
            eos_token,
            stand_in: None,
            family: OutputFamily::default(),
            tools_input,
        };
        // Whether the generation prompt opens a `<think>` block: from one user message's.
        let probe = ChatMessage {
            role: "user".into(),
            content: "Hello".into(),
            ..ChatMessage::default()
        };
        let probe = template.apply_with_tools(&[probe], &[]).ok();
        template.family = OutputFamily::of_template(&family_source, probe.as_deref());
        Ok(template)
    }

    /// The model's output family, as its template shows it.
    pub(crate) fn family(&self) -> OutputFamily {
        self.family
    }

    /// The prompt for `messages`, ending with the assistant's turn opened
    /// (`add_generation_prompt=true`).
    #[cfg(test)]
    pub(crate) fn apply(&self, messages: &[ChatMessage]) -> Result<String, GatewayError> {
        self.apply_with_tools(messages, &[])
    }

    /// Like [`ChatTemplate::apply`], with `tools` (OpenAI's `tools` list) in the context as
    /// transformers passes them; an empty list leaves `tools` undefined.
    pub(crate) fn apply_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
    ) -> Result<String, GatewayError> {
        self.apply_with(messages, tools, &TemplateKwargs::default())
    }

    /// Like [`ChatTemplate::apply_with_tools`], with the request's own template variables
    /// (`chat_template_kwargs`) in the context too.
    pub(crate) fn apply_with(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        kwargs: &TemplateKwargs,
    ) -> Result<String, GatewayError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("the template was added under this name in new()");
        let (messages, tools) = self.tools_input.prepare(messages, tools);
        template
            .render(TemplateContext {
                messages: &messages,
                add_generation_prompt: true,
                bos_token: &self.bos_token,
                eos_token: &self.eos_token,
                tools,
                kwargs,
            })
            .map_err(template_error)
    }
}

fn template_error(error: minijinja::Error) -> GatewayError {
    // A template's own `raise_exception` message is the useful part; keep it alone.
    let message = match (error.kind(), error.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) => detail.to_string(),
        _ => error.to_string(),
    };
    GatewayError::Template { message }
}

/// `chat_template` is a string, or a list of `{"name", "template"}` of which `default` is used.
fn template_source(value: Option<&serde_json::Value>) -> Option<String> {
    match value? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// Special tokens appear either as a string or as `{"content": "..."}`.
fn token_text(value: Option<&serde_json::Value>) -> Option<String> {
    match value? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

fn raise_exception(message: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`:
/// Python's `json.dumps` with those keyword arguments.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let invalid = |message: String| minijinja::Error::new(ErrorKind::InvalidOperation, message);
    let (item_sep, key_sep) = match separators.as_deref() {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some([item, key]) => (item.clone(), key.clone()),
        Some(other) => {
            return Err(invalid(format!(
                "tojson: separators must be two strings, given {other:?}"
            )))
        }
    };
    let mut json = serde_json::to_value(value)
        .map_err(|e| invalid(format!("tojson: cannot serialize to JSON: {e}")))?;
    if sort_keys == Some(true) {
        sort_keys_deep(&mut json);
    }
    let mut out = Vec::new();
    let formatter = PyFormatter {
        indent: indent.map(|n| " ".repeat(n)),
        item_sep,
        key_sep,
        level: 0,
        has_value: false,
    };
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    json.serialize(&mut serializer)
        .map_err(|e| invalid(format!("tojson: cannot serialize to JSON: {e}")))?;
    let mut text = String::from_utf8(out).expect("serde_json writes UTF-8");
    if ensure_ascii == Some(true) {
        text = text
            .encode_utf16()
            .fold(String::with_capacity(text.len()), |mut ascii, unit| {
                match char::from_u32(u32::from(unit)).filter(char::is_ascii) {
                    Some(c) => ascii.push(c),
                    None => ascii.push_str(&format!("\\u{unit:04x}")),
                }
                ascii
            });
    }
    Ok(Value::from_safe_string(text))
}

/// What a template reads of the tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ToolsInput {
    /// The `tools` list in the context.
    Context,
    /// A JSON text in the system message's `tools` field (Phi-4-mini).
    SystemMessage,
    /// Nothing: the gateway describes them in the last user message.
    Instructions,
}

impl ToolsInput {
    pub(crate) fn of_template(source: &str) -> Self {
        if source.contains("message['tools']") || source.contains("message.tools") {
            ToolsInput::SystemMessage
        } else if source.contains("tools") {
            ToolsInput::Context
        } else {
            ToolsInput::Instructions
        }
    }
}

/// `value` as Python's `json.dumps(value, ensure_ascii=False)` writes it.
pub(crate) fn python_json(value: &serde_json::Value) -> String {
    let mut out = Vec::new();
    let formatter = PyFormatter {
        indent: None,
        item_sep: ", ".into(),
        key_sep: ": ".into(),
        level: 0,
        has_value: false,
    };
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    value
        .serialize(&mut serializer)
        .expect("a JSON value serializes");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

fn sort_keys_deep(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.sort_keys();
            map.values_mut().for_each(sort_keys_deep);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(sort_keys_deep),
        _ => {}
    }
}

/// Writes JSON as Python's `json.dumps` does: `item_sep` between items, `key_sep` after keys,
/// and with an indent, each item on its own line (empty containers stay `[]` and `{}`).
struct PyFormatter {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    level: usize,
    has_value: bool,
}

impl PyFormatter {
    fn open<W: ?Sized + Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        writer.write_all(bracket)
    }

    fn close<W: ?Sized + Write>(&mut self, writer: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(writer)?;
        }
        writer.write_all(bracket)
    }

    fn item<W: ?Sized + Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if !first {
            writer.write_all(self.item_sep.as_bytes())?;
        }
        self.newline(writer)
    }

    fn newline<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        if let Some(indent) = &self.indent {
            writer.write_all(b"\n")?;
            for _ in 0..self.level {
                writer.write_all(indent.as_bytes())?;
            }
        }
        Ok(())
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"[")
    }

    fn end_array<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"]")
    }

    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.item(writer, first)
    }

    fn end_array_value<W: ?Sized + Write>(&mut self, _: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open(writer, b"{")
    }

    fn end_object<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.close(writer, b"}")
    }

    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.item(writer, first)
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(self.key_sep.as_bytes())
    }

    fn end_object_value<W: ?Sized + Write>(&mut self, _: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// Python's `datetime.now().strftime(format)` in UTC, for `%Y %m %d %e %b %B %H %M %S %y %%`;
/// other directives pass through unchanged.
fn strftime_now(format: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

fn strftime(format: &str, unix_secs: u64) -> String {
    let (year, month, day) = civil_from_days((unix_secs / 86_400) as i64);
    let secs_of_day = unix_secs % 86_400;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::with_capacity(format.len() + 8);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('H') => out.push_str(&format!("{:02}", secs_of_day / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs_of_day / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs_of_day % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
#[path = "chat_template_families.rs"]
mod families;

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str =
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + \
                          message['content'].strip() + '<|im_end|>' + '\n' }}{% endfor %}\
                          {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn user(content: &str) -> ChatMessage {
        ChatMessage {
            role: "user".into(),
            content: content.into(),
            name: None,
            ..Default::default()
        }
    }

    #[test]
    fn renders_chatml_with_python_methods() {
        let template = ChatTemplate::new(CHATML.into(), "<s>".into(), "</s>".into()).unwrap();
        let prompt = template.apply(&[user("  hi  ")]).unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_becomes_a_template_error_with_its_message() {
        let source = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}";
        let template = ChatTemplate::new(source.into(), String::new(), String::new()).unwrap();
        match template.apply(&[user("x")]) {
            Err(GatewayError::Template { message }) => assert_eq!(message, "system first"),
            other => panic!("expected a template error, got {other:?}"),
        }
    }

    #[test]
    fn bos_token_and_loops_render_like_llama2() {
        let source = "{{ bos_token }}{% for m in messages %}{% if loop.first %}[INST] {% endif %}\
                      {{ m.content }}{% endfor %}";
        let template = ChatTemplate::new(source.into(), "<s>".into(), "</s>".into()).unwrap();
        assert_eq!(template.apply(&[user("a")]).unwrap(), "<s>[INST] a");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %B %%", 1_709_211_909),
            "29 Feb 2024 13:05:09 February %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
    }

    /// Qwen2.5-Instruct's real template (`fuzz/harness/fixtures/qwen2.5.json`).
    fn qwen25() -> ChatTemplate {
        let fixture: serde_json::Value =
            serde_json::from_str(include_str!("../../fuzz/harness/fixtures/qwen2.5.json")).unwrap();
        let source = fixture["chat_template"].as_str().unwrap().to_string();
        ChatTemplate::new(source, "<s>".into(), "</s>".into()).unwrap()
    }

    #[test]
    fn qwen25_renders_tools_and_calls_as_transformers_does() {
        let tools = [
            serde_json::json!({"type": "function", "function": {"name": "get_weather",
                "description": "Weather in a city, in °C & <km/h>",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}),
            serde_json::json!({"type": "function", "function": {"name": "get_time",
                "description": "Local time", "parameters": {"type": "object", "properties": {}}}}),
        ];
        let call = serde_json::json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]);
        let messages = [
            user("Weather in Paris?"),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(crate::openai::tools::template_tool_calls(call)),
                ..Default::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "18".into(),
                tool_call_id: Some("call_1".into()),
                ..Default::default()
            },
        ];
        // transformers' rendering (its Jinja environment and `tojson`, through jinja2 3.1.6) of
        // the same messages and tools.
        let expected = r#"<|im_start|>system
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, in °C & <km/h>", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
{"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {}}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
18
</tool_response><|im_end|>
<|im_start|>assistant
"#;
        let prompt = qwen25().apply_with_tools(&messages, &tools).unwrap();
        assert_eq!(prompt, expected);
        // Without tools the template renders none.
        let plain = qwen25().apply(&messages[..1]).unwrap();
        assert!(
            !plain.contains("<tools>") && !plain.contains("get_weather"),
            "{plain}"
        );
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let env = ChatTemplate::new(String::new(), String::new(), String::new())
            .unwrap()
            .env;
        let value = serde_json::json!({"b": [1, {}, []], "a": "é<&>\u{2028}",
            "c": {"x": null, "y": 1.5}});
        let render = |source: &str, value: &serde_json::Value| {
            env.render_str(source, minijinja::context! { v => value })
                .unwrap()
        };
        assert_eq!(
            render("{{ v | tojson }}", &value),
            "{\"b\": [1, {}, []], \"a\": \"é<&>\u{2028}\", \"c\": {\"x\": null, \"y\": 1.5}}"
        );
        assert_eq!(
            render("{{ v | tojson(indent=4) }}", &value),
            "{\n    \"b\": [\n        1,\n        {},\n        []\n    ],\n    \"a\": \"é<&>\u{2028}\",\n    \"c\": {\n        \"x\": null,\n        \"y\": 1.5\n    }\n}"
        );
        assert_eq!(
            render(
                "{{ v | tojson(ensure_ascii=true, sort_keys=true, separators=[',', ':']) }}",
                &value
            ),
            r#"{"a":"\u00e9<&>\u2028","b":[1,{},[]],"c":{"x":null,"y":1.5}}"#
        );
        assert_eq!(
            render(
                "{{ v | tojson(ensure_ascii=true) }}",
                &serde_json::json!("😀")
            ),
            r#""\ud83d\ude00""#
        );
    }

    #[test]
    fn named_template_lists_use_default() {
        let value = serde_json::json!([
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"}
        ]);
        assert_eq!(template_source(Some(&value)).as_deref(), Some("D"));
        let value = serde_json::json!({"content": "<s>", "lstrip": false});
        assert_eq!(token_text(Some(&value)).as_deref(), Some("<s>"));
    }
}
