//! A thinking model's output split into `reasoning_content` (its `<think>` block) and
//! `content` (the rest), as vLLM and DeepSeek's API return them.
//!
//! The same splitter serves the streamed and the whole answer, so that both say the same
//! however the output is cut into tokens: text that may be the start of a marker waits for
//! the next token. The reasoning loses the whitespace around it and the content the
//! whitespace after `</think>` (Qwen3 writes `<think>\n...\n</think>\n\n`), as Qwen3's own
//! template strips them when the turn comes back.

use super::family::{ThinkStart, THINK_CLOSE, THINK_OPEN};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace or a part of `<think>` so far.
    Start,
    /// Inside the block; `begun` once its first non-whitespace went out.
    Reasoning { begun: bool },
    /// After `</think>`: whitespace is dropped until the content starts.
    AfterThink,
    /// Plain content from here on.
    Content,
}

/// Splits one sequence's output; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct ThinkSplitter {
    state: State,
    /// Text held back: the start of the output (in `Start`) or the block's tail (in
    /// `Reasoning`) that may still turn out to be a marker or trailing whitespace.
    held: String,
}

/// What one piece of output adds to each field.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Split {
    pub reasoning: String,
    pub content: String,
}

impl ThinkSplitter {
    pub(crate) fn new(start: ThinkStart) -> Self {
        let state = match start {
            ThinkStart::MayOpen => State::Start,
            ThinkStart::Inside => State::Reasoning { begun: false },
        };
        ThinkSplitter {
            state,
            held: String::new(),
        }
    }

    /// The whole of an output, split.
    pub(crate) fn split_all(start: ThinkStart, text: &str) -> Split {
        ThinkSplitter::new(start).push(text, true)
    }

    /// What `text`, the next piece of output, releases; `at_end` releases everything held.
    pub(crate) fn push(&mut self, text: &str, at_end: bool) -> Split {
        let mut out = Split::default();
        let mut input = std::mem::take(&mut self.held);
        input.push_str(text);
        let mut rest = input.as_str();
        loop {
            match self.state {
                State::Content => {
                    out.content.push_str(rest);
                    return out;
                }
                State::AfterThink => {
                    let trimmed = rest.trim_start();
                    if trimmed.is_empty() {
                        return out;
                    }
                    self.state = State::Content;
                    rest = trimmed;
                }
                State::Start => {
                    let trimmed = rest.trim_start();
                    if let Some(after) = trimmed.strip_prefix(THINK_OPEN) {
                        self.state = State::Reasoning { begun: false };
                        rest = after;
                    } else if THINK_OPEN.starts_with(trimmed) && !at_end {
                        self.held = rest.to_string();
                        return out;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning { begun } => {
                    let text = if begun { rest } else { rest.trim_start() };
                    if let Some(close) = text.find(THINK_CLOSE) {
                        out.reasoning.push_str(text[..close].trim_end());
                        self.state = State::AfterThink;
                        rest = &text[close + THINK_CLOSE.len()..];
                        continue;
                    }
                    // Cut off while thinking: all of it was reasoning.
                    let keep = if at_end {
                        text.trim_end().len()
                    } else {
                        text[..partial_marker_start(text, THINK_CLOSE)]
                            .trim_end()
                            .len()
                    };
                    out.reasoning.push_str(&text[..keep]);
                    self.held = text[keep..].to_string();
                    self.state = State::Reasoning {
                        begun: begun || keep > 0,
                    };
                    return out;
                }
            }
        }
    }
}

/// Where an end of `text` that may be the start of `marker` begins (`text.len()` if none).
pub(crate) fn partial_marker_start(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&k| text.ends_with(&marker[..k]))
        .map_or(text.len(), |k| text.len() - k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(start: ThinkStart, text: &str) -> (String, String) {
        let s = ThinkSplitter::split_all(start, text);
        (s.reasoning, s.content)
    }

    #[test]
    fn qwen3_blocks_split_and_trim() {
        let text = "<think>\nThe user greets.\n\nGreet back.\n</think>\n\nHello!";
        assert_eq!(
            split(ThinkStart::MayOpen, text),
            ("The user greets.\n\nGreet back.".into(), "Hello!".into())
        );
        // Without a block it is all content, whitespace and all.
        assert_eq!(
            split(ThinkStart::MayOpen, " Hi <think>"),
            (String::new(), " Hi <think>".into())
        );
        // Cut off while thinking: all reasoning.
        assert_eq!(
            split(ThinkStart::MayOpen, "<think>\nHmm, so"),
            ("Hmm, so".into(), String::new())
        );
        // A generation prompt that opened the block.
        assert_eq!(
            split(ThinkStart::Inside, "\nok\n</think>\n\nDone"),
            ("ok".into(), "Done".into())
        );
        // An empty block (Qwen3 with thinking off writes one itself sometimes).
        assert_eq!(
            split(ThinkStart::MayOpen, "<think>\n\n</think>\n\nHi"),
            (String::new(), "Hi".into())
        );
    }

    #[test]
    fn any_cut_into_pieces_says_the_same() {
        let texts = [
            "<think>\nA < b, and </thin is not the end.\n</think>\n\n<tool_call>x</tool_call>",
            "  <think>x</think>y",
            "<thinking>not a block",
            "<think>\nunfinished  \n",
            "plain answer\n",
            "<",
        ];
        for text in texts {
            for start in [ThinkStart::MayOpen, ThinkStart::Inside] {
                let whole = ThinkSplitter::split_all(start, text);
                for size in 1..6 {
                    let chars: Vec<char> = text.chars().collect();
                    let pieces: Vec<String> =
                        chars.chunks(size).map(|c| c.iter().collect()).collect();
                    let mut splitter = ThinkSplitter::new(start);
                    let mut got = Split::default();
                    for (i, piece) in pieces.iter().enumerate() {
                        let part = splitter.push(piece, i + 1 == pieces.len());
                        got.reasoning.push_str(&part.reasoning);
                        got.content.push_str(&part.content);
                    }
                    assert_eq!(got, whole, "{text:?} {start:?} in pieces of {size}");
                }
            }
        }
    }
}
