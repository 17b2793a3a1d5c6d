//! Which family a model's output belongs to, read from its chat template: how it writes tool
//! calls and whether it thinks aloud in `<think>` blocks. The template is the model's own
//! statement of its format (it writes past calls and thoughts back into the prompt in that
//! format), so the parser follows it rather than a flag an operator could get wrong.
//!
//! | family | calls | template tells-tale |
//! |---|---|---|
//! | Qwen2.5/Qwen3, Hermes | `<tool_call>{json}</tool_call>` | `<tool_call>` |
//! | Mistral (Nemo, Small 3.x) | `[TOOL_CALLS][{json}, ...]` or `[TOOL_CALLS]name[ARGS]{json}` | `[TOOL_CALLS]` |
//! | Phi-4-mini | `<|tool_call|>[{json}, ...]<|/tool_call|>` | `<|tool|>` or `<|tool_call|>` |
//! | any other (Gemma 2/3, Llama) | the whole output as a call or a list of calls, bare or in a ```` ``` ```` fence | |
//!
//! Every family also takes the bare JSON form, which is what a forced `tool_choice` grammar
//! makes any model write. Reasoning: a template that mentions `<think>` (Qwen3, QwQ,
//! DeepSeek-R1) marks a model that writes `<think>...</think>` before its answer; when its
//! generation prompt already opens the block, the output starts inside it.

use std::collections::HashMap;

use crate::request::GeneratedToken;

/// How a family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ToolSyntax {
    /// `<tool_call>{"name", "arguments"}</tool_call>` blocks (Hermes, Qwen).
    #[default]
    Hermes,
    /// `[TOOL_CALLS]` then a JSON list, or `name[ARGS]{...}` per call (Mistral).
    Mistral,
    /// `<|tool_call|>` then a JSON list (or objects), then `<|/tool_call|>` (Phi-4-mini).
    Phi4Mini,
    /// No markers: the whole output is the call(s), possibly in a code fence (Gemma, Llama).
    Json,
}

impl ToolSyntax {
    /// The text that opens a family's calls inside an answer; `None` for the bare form.
    pub(crate) fn opening(self) -> Option<&'static str> {
        match self {
            ToolSyntax::Hermes => Some(HERMES_OPEN),
            ToolSyntax::Mistral => Some(MISTRAL_OPEN),
            ToolSyntax::Phi4Mini => Some(PHI_OPEN),
            ToolSyntax::Json => None,
        }
    }

    /// The family's markers, which the tokenizer may hold as special tokens (whose text the
    /// engine leaves out of the output: see [`Markers`]).
    fn markers(self) -> &'static [&'static str] {
        match self {
            ToolSyntax::Hermes => &[HERMES_OPEN, "</tool_call>"],
            ToolSyntax::Mistral => &[MISTRAL_OPEN, MISTRAL_ARGS, MISTRAL_CALL_ID],
            ToolSyntax::Phi4Mini => &[PHI_OPEN, PHI_CLOSE],
            ToolSyntax::Json => &[],
        }
    }
}

pub(crate) const HERMES_OPEN: &str = "<tool_call>";
pub(crate) const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
pub(crate) const MISTRAL_ARGS: &str = "[ARGS]";
pub(crate) const MISTRAL_CALL_ID: &str = "[CALL_ID]";
pub(crate) const PHI_OPEN: &str = "<|tool_call|>";
pub(crate) const PHI_CLOSE: &str = "<|/tool_call|>";
pub(crate) const THINK_OPEN: &str = "<think>";
pub(crate) const THINK_CLOSE: &str = "</think>";

/// What a template says about its model's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct OutputFamily {
    pub tools: ToolSyntax,
    /// `None`: the model does not write `<think>` blocks.
    pub reasoning: Option<ThinkStart>,
}

/// Where a thinking model's output starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ThinkStart {
    /// The model opens its own `<think>` block, or answers without one (Qwen3).
    MayOpen,
    /// The generation prompt opened the block: the output is reasoning up to `</think>`.
    Inside,
}

impl OutputFamily {
    /// The family of the template `source`, whose generation prompt for one user message is
    /// `probe` (when it renders one).
    pub(crate) fn of_template(source: &str, probe: Option<&str>) -> Self {
        let tools = if source.contains(MISTRAL_OPEN) {
            ToolSyntax::Mistral
        } else if source.contains(HERMES_OPEN) {
            ToolSyntax::Hermes
        } else if source.contains(PHI_OPEN) || source.contains("<|tool|>") {
            ToolSyntax::Phi4Mini
        } else {
            ToolSyntax::Json
        };
        let reasoning = source.contains(THINK_OPEN).then(|| {
            if probe.is_some_and(|p| p.trim_end().ends_with(THINK_OPEN)) {
                ThinkStart::Inside
            } else {
                ThinkStart::MayOpen
            }
        });
        OutputFamily { tools, reasoning }
    }

    /// Whether a completion's text is split into reasoning and content.
    pub(crate) fn thinks(&self) -> bool {
        self.reasoning.is_some()
    }

    /// The family's markers that are single tokens of `token_id`'s vocabulary.
    pub(crate) fn markers(&self, token_id: impl Fn(&str) -> Option<u32>) -> Markers {
        let think: &[&str] = if self.thinks() {
            &[THINK_OPEN, THINK_CLOSE]
        } else {
            &[]
        };
        let by_id = self
            .tools
            .markers()
            .iter()
            .chain(think)
            .filter_map(|&m| token_id(m).map(|id| (id, m)))
            .collect();
        Markers { by_id }
    }
}

/// The family's marker tokens by id. The engine decodes without special tokens, as a client
/// wants its text, so a marker the tokenizer marks special (Mistral's `[TOOL_CALLS]`,
/// Phi-4-mini's `<|tool_call|>`) reaches the gateway as a token with empty text; its id says
/// what it was, and the parsers get it back.
#[derive(Debug, Clone, Default)]
pub(crate) struct Markers {
    by_id: HashMap<u32, &'static str>,
}

impl Markers {
    /// Whether the vocabulary holds none of the family's markers as tokens.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The text `token` adds to the output as the parsers read it.
    pub(crate) fn text<'a>(&self, token: &'a GeneratedToken) -> &'a str {
        match self.by_id.get(&token.id) {
            Some(marker) if token.text.is_empty() => marker,
            _ => &token.text,
        }
    }

    /// The output of `tokens` as the parsers read it.
    pub(crate) fn output(&self, tokens: &[GeneratedToken]) -> String {
        tokens.iter().map(|t| self.text(t)).collect()
    }
}

/// A call id: Mistral's templates refuse any but 9 letters and digits when the call comes
/// back in the next request, so its family gets those; the others get OpenAI's `call_` ids.
/// Both are unique per request, choice and call.
pub(crate) fn call_id(syntax: ToolSyntax, request_id: &str, choice: usize, index: usize) -> String {
    let prefix = &request_id[..request_id.len().min(20)];
    if syntax != ToolSyntax::Mistral {
        return format!("call_{prefix}_{choice}_{index}");
    }
    const ALPHABET: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in format!("{request_id}/{choice}/{index}").bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (0..9)
        .map(|_| {
            let c = ALPHABET[(h % 62) as usize] as char;
            h /= 62;
            c
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        let path = format!(
            "{}/tests/fixtures/templates/{name}.jinja",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(path).unwrap()
    }

    #[test]
    fn families_are_read_from_the_real_templates() {
        for (name, tools, thinks) in [
            ("qwen3", ToolSyntax::Hermes, true),
            ("mistral-nemo", ToolSyntax::Mistral, false),
            ("mistral-small-3.2", ToolSyntax::Mistral, false),
            ("phi-4-mini", ToolSyntax::Phi4Mini, false),
            ("gemma-3", ToolSyntax::Json, false),
            ("gemma-2", ToolSyntax::Json, false),
        ] {
            let family = OutputFamily::of_template(&fixture(name), None);
            assert_eq!((family.tools, family.thinks()), (tools, thinks), "{name}");
        }
        let qwq = "{{ '<|im_start|>assistant\\n<think>\\n' }}";
        let family = OutputFamily::of_template(qwq, Some("<|im_start|>assistant\n<think>\n"));
        assert_eq!(family.reasoning, Some(ThinkStart::Inside));
    }

    #[test]
    fn mistral_call_ids_are_nine_alphanumerics_and_unique() {
        let mut seen = std::collections::HashSet::new();
        for choice in 0..4 {
            for index in 0..8 {
                let id = call_id(ToolSyntax::Mistral, "req-1", choice, index);
                assert_eq!(id.len(), 9, "{id}");
                assert!(id.bytes().all(|b| b.is_ascii_alphanumeric()), "{id}");
                assert!(seen.insert(id));
            }
        }
        assert_eq!(call_id(ToolSyntax::Hermes, "req", 1, 2), "call_req_1_2");
    }
}
