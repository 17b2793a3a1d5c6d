//! Incremental detokenization for streaming, and stop strings on the streamed text.
//!
//! Decoding one token at a time is wrong: sentencepiece tokenizers drop the leading space of the
//! first token of a decode, and a character split over byte tokens decodes to U+FFFD until its
//! last byte arrives. So, as in vLLM and TGI, each step decodes a small window of recent tokens and
//! emits only what the window's text gained past what was already emitted, and the window slides
//! forward once its text is complete.
//!
//! Two rules keep emitted text final:
//! - Text ending in U+FFFD is held back: the next tokens may complete the character.
//! - With a `ByteFallback` decoder (Llama 2, Mistral v0.1, Gemma), a run of byte tokens is decoded
//!   as a whole: if any byte of the run is invalid UTF-8, every byte of it becomes U+FFFD, even
//!   bytes that formed a valid character on their own. So text is held while the run may still
//!   grow, that is until a token that is not a byte token arrives, or the stream ends. This costs
//!   one token of latency for characters spelled in bytes, and guarantees that the concatenated
//!   deltas equal `tokenizer.decode(output_ids)` for any output, however invalid.

use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::error::{EngineError, Result};

/// Prompt tokens decoded ahead of the output, so the first output token gets its leading space.
const CONTEXT_TOKENS: usize = 5;

const REPLACEMENT: char = '\u{FFFD}';

/// How a token takes part in decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenKind {
    /// `<0xNN>` under a `ByteFallback` decoder: joins the run of bytes around it.
    Byte,
    /// Left out of the decode: a skipped special token, or an id the tokenizer does not know.
    Dropped,
    /// Anything else: ends a run of bytes.
    Text,
}

/// Turns a stream of output token ids into text deltas. See the module docs.
pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    /// The decoder has a `ByteFallback` step.
    byte_fallback: bool,
    /// Up to [`CONTEXT_TOKENS`] prompt ids, then every output id.
    ids: Vec<u32>,
    /// Where the decoding window starts.
    prefix_offset: usize,
    /// Where the window stood when its text was last complete; the window moves here next.
    read_offset: usize,
    /// The text of `ids[prefix_offset..]` already emitted (or, at first, the prompt context's).
    emitted: String,
    /// The last token that takes part in decoding was a byte token: the run may still grow.
    in_byte_run: bool,
}

impl IncrementalDetokenizer {
    /// Starts a stream after `prompt_ids`. The last few prompt ids are decoded as context, so the
    /// first output token's leading space is kept where the prompt's text continues; after a
    /// prompt of only special tokens (just BOS) the deltas add up to `decode(output_ids)`.
    pub fn new(tokenizer: Arc<Tokenizer>, prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        let byte_fallback = tokenizer
            .get_decoder()
            .and_then(|decoder| serde_json::to_string(decoder).ok())
            .is_some_and(|json| json.contains("\"ByteFallback\""));
        let mut detokenizer = Self {
            tokenizer,
            skip_special_tokens,
            byte_fallback,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            emitted: String::new(),
            in_byte_run: false,
        };
        let start = prompt_ids.len().saturating_sub(CONTEXT_TOKENS);
        let mut context = prompt_ids[start..].to_vec();
        // A run of bytes at the end of the prompt would fuse with bytes of the output.
        if byte_fallback {
            while let Some(&last) = context.last() {
                if detokenizer.kind(last) == TokenKind::Text {
                    break;
                }
                context.pop();
            }
        }
        // So would a character the prompt leaves incomplete.
        let text = loop {
            match detokenizer.decode(&context) {
                Ok(text) if !text.ends_with(REPLACEMENT) => break text,
                Ok(_) => {
                    context.pop();
                }
                Err(_) => {
                    // The output will not decode either; report it from `push`.
                    context.clear();
                    break String::new();
                }
            }
        };
        detokenizer.read_offset = context.len();
        detokenizer.ids = context;
        detokenizer.emitted = text;
        detokenizer
    }

    /// Adds one output token and returns the text it completes, possibly empty.
    pub fn push(&mut self, token_id: u32) -> Result<String> {
        self.ids.push(token_id);
        match self.kind(token_id) {
            TokenKind::Byte => self.in_byte_run = true,
            TokenKind::Text => self.in_byte_run = false,
            TokenKind::Dropped => {}
        }
        if self.in_byte_run {
            return Ok(String::new());
        }
        let text = self.decode(&self.ids[self.prefix_offset..])?;
        let ready = text.trim_end_matches(REPLACEMENT);
        let delta = new_suffix(&self.emitted, ready).to_owned();
        if delta.is_empty() {
            return Ok(delta);
        }
        if ready.len() == text.len() {
            // Complete: slide the window up to here.
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            self.emitted = self.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        } else {
            self.emitted = ready.to_owned();
        }
        Ok(delta)
    }

    /// Ends the stream: returns whatever was held back, which ends in U+FFFD if the output really
    /// stopped in the middle of a character.
    pub fn flush(&mut self) -> Result<String> {
        self.in_byte_run = false;
        let text = self.decode(&self.ids[self.prefix_offset..])?;
        let delta = new_suffix(&self.emitted, &text).to_owned();
        self.emitted = text;
        Ok(delta)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, self.skip_special_tokens)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    fn kind(&self, id: u32) -> TokenKind {
        match self.tokenizer.id_to_token(id) {
            None => TokenKind::Dropped,
            Some(token)
                if self.skip_special_tokens
                    && self
                        .tokenizer
                        .get_added_vocabulary()
                        .is_special_token(&token) =>
            {
                TokenKind::Dropped
            }
            Some(token) if self.byte_fallback && is_byte_token(&token) => TokenKind::Byte,
            Some(_) => TokenKind::Text,
        }
    }
}

/// The `ByteFallback` decoder's test for a byte token: `<0xNN>`.
fn is_byte_token(token: &str) -> bool {
    token.len() == 6
        && token.starts_with("<0x")
        && token.ends_with('>')
        && u8::from_str_radix(&token[3..5], 16).is_ok()
}

/// What `text` adds to `emitted`. Should a decoder ever rewrite text already emitted, that text
/// cannot be taken back: skip as many characters as were emitted, as vLLM does.
fn new_suffix<'t>(emitted: &str, text: &'t str) -> &'t str {
    if let Some(rest) = text.strip_prefix(emitted) {
        return rest;
    }
    let skip = emitted.chars().count();
    text.char_indices()
        .nth(skip)
        .map_or("", |(at, _)| &text[at..])
}

/// Text released by a [`StopStringStream`] step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextDelta {
    pub text: String,
    /// A stop string completed: `text` ends right before it, and nothing follows.
    pub stopped: bool,
}

/// Wraps a detokenizer with stop strings that may span several tokens. Text that could still be
/// the start of a stop string is held back; when a stop string completes, output is truncated right
/// before it (the stop string is not emitted) and `stopped` is set.
pub struct StopStringStream {
    detokenizer: IncrementalDetokenizer,
    matcher: StopMatcher,
}

impl StopStringStream {
    /// Empty stop strings are ignored ([`crate::stopping::StoppingCriteria::validate`] rejects
    /// them).
    pub fn new(detokenizer: IncrementalDetokenizer, stop_strings: Vec<String>) -> Self {
        Self {
            detokenizer,
            matcher: StopMatcher::new(stop_strings),
        }
    }

    /// Adds one output token. Once stopped, further tokens are ignored and give empty deltas.
    pub fn push(&mut self, token_id: u32) -> Result<TextDelta> {
        if self.matcher.stopped {
            return Ok(self.matcher.push(""));
        }
        let text = self.detokenizer.push(token_id)?;
        Ok(self.matcher.push(&text))
    }

    /// Ends the stream: returns the held-back text, cut before a stop string if one completes.
    pub fn flush(&mut self) -> Result<String> {
        if self.matcher.stopped {
            return Ok(String::new());
        }
        let text = self.detokenizer.flush()?;
        Ok(self.matcher.finish(&text).text)
    }

    /// Whether a stop string has completed, in `push` or in `flush`.
    pub fn stopped(&self) -> bool {
        self.matcher.stopped
    }
}

/// Stop-string matching on a stream of text.
#[derive(Debug)]
struct StopMatcher {
    stop_strings: Vec<String>,
    /// Text not released yet: its end could be the start of a stop string.
    pending: String,
    stopped: bool,
}

impl StopMatcher {
    fn new(mut stop_strings: Vec<String>) -> Self {
        stop_strings.retain(|s| !s.is_empty());
        Self {
            stop_strings,
            pending: String::new(),
            stopped: false,
        }
    }

    fn push(&mut self, text: &str) -> TextDelta {
        self.release(text, false)
    }

    fn finish(&mut self, text: &str) -> TextDelta {
        self.release(text, true)
    }

    fn release(&mut self, text: &str, end: bool) -> TextDelta {
        if self.stopped {
            return TextDelta {
                text: String::new(),
                stopped: true,
            };
        }
        self.pending.push_str(text);
        // Released text never ends with the start of a stop string, so a stop string that
        // completes lies wholly in `pending`; the one that starts first wins.
        let first_match = self
            .stop_strings
            .iter()
            .filter_map(|stop| self.pending.find(stop.as_str()))
            .min();
        if let Some(at) = first_match {
            self.pending.truncate(at);
            self.stopped = true;
            return TextDelta {
                text: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        let hold = if end { 0 } else { self.partial_match_len() };
        let held = self.pending.split_off(self.pending.len() - hold);
        TextDelta {
            text: std::mem::replace(&mut self.pending, held),
            stopped: false,
        }
    }

    /// The length of the longest end of `pending` that starts some stop string.
    fn partial_match_len(&self) -> usize {
        let longest = self
            .stop_strings
            .iter()
            .map(|s| s.len() - 1)
            .max()
            .unwrap_or(0)
            .min(self.pending.len());
        let first = self.pending.len() - longest;
        (first..self.pending.len())
            .filter(|&start| self.pending.is_char_boundary(start))
            .map(|start| &self.pending[start..])
            .find(|tail| self.stop_strings.iter().any(|s| s.starts_with(tail)))
            .map_or(0, str::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    const BOS: u32 = 1;
    const EOS: u32 = 2;

    fn tokenizer() -> Arc<Tokenizer> {
        static TOKENIZER: OnceLock<Arc<Tokenizer>> = OnceLock::new();
        TOKENIZER
            .get_or_init(|| {
                let path = concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../../shared/models/stories260K/tokenizer.json"
                );
                Arc::new(Tokenizer::from_file(path).expect("stories260K tokenizer.json"))
            })
            .clone()
    }

    fn id(token: &str) -> u32 {
        tokenizer()
            .token_to_id(token)
            .unwrap_or_else(|| panic!("{token} is not in the vocabulary"))
    }

    /// The byte-fallback ids spelling `text` in UTF-8.
    fn byte_ids(text: &str) -> Vec<u32> {
        text.bytes().map(|b| id(&format!("<0x{b:02X}>"))).collect()
    }

    fn encode(text: &str) -> Vec<u32> {
        tokenizer()
            .encode(text, true)
            .expect("encode")
            .get_ids()
            .to_vec()
    }

    /// Pushes every id, checking that no delta holds a character that a later token changes.
    fn stream(prompt: &[u32], output: &[u32]) -> (Vec<String>, String) {
        let mut detokenizer = IncrementalDetokenizer::new(tokenizer(), prompt, true);
        let deltas: Vec<String> = output
            .iter()
            .map(|&id| detokenizer.push(id).expect("push"))
            .collect();
        let tail = detokenizer.flush().expect("flush");
        (deltas, tail)
    }

    fn decode(ids: &[u32]) -> String {
        tokenizer().decode(ids, true).expect("decode")
    }

    #[test]
    fn words_stream_with_their_spaces() {
        let output = [id("▁Once"), id("▁upon"), id("▁a"), id("▁time"), id(".")];
        let (deltas, tail) = stream(&[BOS], &output);
        assert_eq!(deltas, vec!["Once", " upon", " a", " time", "."]);
        assert_eq!(tail, "");
        assert_eq!(deltas.concat(), decode(&output));
    }

    #[test]
    fn the_first_token_keeps_its_space_after_a_prompt() {
        let prompt = encode("Once upon a");
        let (deltas, _) = stream(&prompt, &[id("▁time")]);
        assert_eq!(deltas, vec![" time"]);
        let (deltas, _) = stream(&prompt, &[id("s"), id("▁day")]);
        assert_eq!(deltas, vec!["s", " day"]);
    }

    #[test]
    fn a_character_in_byte_tokens_is_never_emitted_broken() {
        // "—" is E2 80 94: three byte tokens, each U+FFFD on its own.
        let dash = byte_ids("—");
        assert_eq!(dash.len(), 3);
        let output: Vec<u32> = [vec![id("▁He"), id("▁said")], dash, vec![id("▁happy")]].concat();
        let (deltas, tail) = stream(&[BOS], &output);
        for delta in &deltas {
            assert!(
                !delta.contains(REPLACEMENT),
                "broken character in {deltas:?}"
            );
        }
        assert_eq!(deltas.concat() + &tail, "He said— happy");
        assert_eq!(deltas.concat() + &tail, decode(&output));
    }

    #[test]
    fn consecutive_emoji_in_one_byte_run() {
        let output: Vec<u32> = [
            vec![id("▁Lily")],
            byte_ids("😀🎉"),
            vec![id("!")],
            byte_ids("é"),
        ]
        .concat();
        let (deltas, tail) = stream(&[BOS], &output);
        assert!(
            deltas.iter().all(|d| !d.contains(REPLACEMENT)),
            "{deltas:?}"
        );
        assert_eq!(deltas.concat(), "Lily😀🎉!");
        // The stream ends inside a byte run: the held character comes out on flush.
        assert_eq!(tail, "é");
        assert_eq!(deltas.concat() + &tail, decode(&output));
    }

    #[test]
    fn an_unfinished_character_flushes_as_replacement() {
        let dash = byte_ids("—");
        let output = [id("▁Tim"), dash[0], dash[1]];
        let (deltas, tail) = stream(&[BOS], &output);
        assert_eq!(deltas.concat(), "Tim");
        assert_eq!(tail, "\u{FFFD}\u{FFFD}");
        assert_eq!(deltas.concat() + &tail, decode(&output));
    }

    #[test]
    fn special_tokens_are_skipped() {
        let output = [id("▁Once"), EOS, id("▁upon"), BOS, 0];
        let (deltas, tail) = stream(&[BOS], &output);
        assert_eq!(deltas.concat() + &tail, decode(&output));
        assert_eq!(deltas.concat(), "Once upon");
    }

    #[test]
    fn a_prompt_ending_in_bytes_does_not_fuse_with_the_output() {
        let prompt: Vec<u32> = [vec![BOS, id("▁Tim")], byte_ids("—")].concat();
        // A stray continuation byte: decoded alone it is one U+FFFD.
        let output = [byte_ids("—")[1], id("▁He")];
        let (deltas, tail) = stream(&prompt, &output);
        assert_eq!(deltas.concat() + &tail, "\u{FFFD} He");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn deltas_add_up_to_the_decode(
            output in prop::collection::vec(prop_oneof![0u32..512, 3u32..259], 0..40),
            with_bos: bool,
        ) {
            let prompt: &[u32] = if with_bos { &[BOS] } else { &[] };
            let (deltas, tail) = stream(prompt, &output);
            prop_assert_eq!(deltas.concat() + &tail, decode(&output));
        }

        #[test]
        fn deltas_continue_the_prompt(
            words in prop::collection::vec(
                prop::sample::select(vec!["Once", "upon", "a", "time", "Lily", "said", "the"]),
                1..6,
            ),
            output in prop::collection::vec(0u32..512, 0..30),
        ) {
            let prompt = encode(&words.join(" "));
            let prompt_text = decode(&prompt);
            let full = decode(&[prompt.clone(), output.clone()].concat());
            prop_assert!(full.starts_with(&prompt_text));
            let (deltas, tail) = stream(&prompt, &output);
            prop_assert_eq!(deltas.concat() + &tail, &full[prompt_text.len()..]);
        }
    }

    fn stop_stream(stop_strings: &[&str]) -> StopStringStream {
        StopStringStream::new(
            IncrementalDetokenizer::new(tokenizer(), &[BOS], true),
            stop_strings.iter().map(|s| s.to_string()).collect(),
        )
    }

    #[test]
    fn a_stop_string_spanning_three_tokens() {
        let mut stream = stop_stream(&["upon a time"]);
        let mut text = String::new();
        for token in ["▁Once", "▁upon", "▁a"] {
            let delta = stream.push(id(token)).unwrap();
            assert!(!delta.stopped);
            text += &delta.text;
        }
        // " upon a" could still become the stop string: held back.
        assert_eq!(text, "Once ");
        let delta = stream.push(id("▁time")).unwrap();
        assert_eq!(
            delta,
            TextDelta {
                text: String::new(),
                stopped: true
            }
        );
        assert!(stream.stopped());
        assert_eq!(stream.push(id("▁Lily")).unwrap().text, "");
        assert_eq!(stream.flush().unwrap(), "");
    }

    #[test]
    fn a_stop_string_at_the_first_token() {
        let mut stream = stop_stream(&["Once"]);
        let delta = stream.push(id("▁Once")).unwrap();
        assert_eq!(delta.text, "");
        assert!(delta.stopped);
    }

    #[test]
    fn held_text_is_released_when_the_stop_string_fails() {
        let mut stream = stop_stream(&["upon a time"]);
        let mut text = String::new();
        for token in ["▁Once", "▁upon", "▁a", "▁day"] {
            let delta = stream.push(id(token)).unwrap();
            assert!(!delta.stopped);
            text += &delta.text;
        }
        assert_eq!(text, "Once upon a day");
        assert_eq!(stream.flush().unwrap(), "");
        assert!(!stream.stopped());
    }

    #[test]
    fn a_stop_string_in_the_flushed_text() {
        let mut stream = stop_stream(&["é!"]);
        let mut text = String::new();
        for &token in [id("▁Tim")].iter().chain(&byte_ids("é")) {
            text += &stream.push(token).unwrap().text;
        }
        text += &stream.push(id("!")).unwrap().text;
        assert_eq!(text, "Tim");
        assert!(stream.stopped());
    }

    #[test]
    fn overlapping_stop_strings() {
        // "ab" completes first, though "abc" was also under way.
        let mut matcher = StopMatcher::new(vec!["abc".into(), "ab".into()]);
        assert_eq!(matcher.push("xa").text, "x");
        assert_eq!(
            matcher.push("bc"),
            TextDelta {
                text: String::new(),
                stopped: true
            }
        );

        // "abc" fails at "d"; "bd" then completes, starting inside the held "ab".
        let mut matcher = StopMatcher::new(vec!["abc".into(), "bd".into()]);
        assert_eq!(matcher.push("ab").text, "");
        assert_eq!(
            matcher.push("d"),
            TextDelta {
                text: "a".into(),
                stopped: true
            }
        );

        // Of two stop strings completing in one delta, the one starting first wins.
        let mut matcher = StopMatcher::new(vec!["cd".into(), "bcde".into()]);
        assert_eq!(matcher.push("abcdef").text, "a");
    }

    #[test]
    fn partial_matches_respect_character_boundaries() {
        let mut matcher = StopMatcher::new(vec!["é!".into(), String::new()]);
        assert_eq!(matcher.push("café").text, "caf");
        assert_eq!(matcher.push("s").text, "és");
        assert_eq!(matcher.finish("é").text, "é");
    }

    #[test]
    fn no_stop_strings_pass_everything() {
        let mut matcher = StopMatcher::new(Vec::new());
        assert_eq!(matcher.push("abc").text, "abc");
        assert_eq!(matcher.finish("").text, "");
    }
}
