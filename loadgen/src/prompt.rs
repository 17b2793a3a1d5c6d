//! Prompt text of a controlled token length.
//!
//! Two styles. `Extra` is exact: random benchmark models pad their tokenizer with `<extra_N>`
//! added tokens, each of which tokenizes to exactly one token, so N of them are N tokens on
//! any server that loads that tokenizer. `Words` works on any model: it strings together
//! common English words that are one token each, with their leading space, in the byte-level
//! BPEs of GPT-2/SmolLM/Llama 3/Qwen and in SentencePiece Llama vocabularies (checked against
//! stories260K's 512-token vocabulary, the smallest this project serves). It is approximate on
//! other tokenizers; servers that report `usage.prompt_tokens` let the report show the real
//! count next to the asked one.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "style")]
pub enum PromptStyle {
    Words,
    Extra { first_extra_id: usize, vocab: usize },
}

/// One token each (with the leading space) in every tokenizer named in the module doc.
const WORDS: [&str; 40] = [
    "the", "to", "and", "was", "he", "she", "it", "in", "with", "said", "play", "they", "his",
    "her", "up", "that", "on", "you", "big", "of", "friend", "little", "time", "had", "we",
    "there", "so", "for", "want", "happy", "saw", "named", "but", "very", "do", "day", "be", "mom",
    "Lily", "Tim",
];

/// Builds a prompt from segments of known token length, so a shared prefix and a unique
/// suffix can be joined without a token merging across the seam.
#[derive(Debug, Clone)]
pub struct PromptBuilder {
    style: PromptStyle,
    text: String,
    num_tokens: usize,
}

impl PromptBuilder {
    pub fn new(style: PromptStyle) -> Self {
        Self {
            style,
            text: String::new(),
            num_tokens: 0,
        }
    }

    /// Appends `num_tokens` tokens that depend on `seed`: two seeds differ from their first
    /// few tokens on, so a prefix cache cannot serve one from the other.
    pub fn push(&mut self, num_tokens: usize, seed: u64) -> &mut Self {
        match self.style {
            PromptStyle::Extra {
                first_extra_id,
                vocab,
            } => self.text.push_str(&exact_prompt(
                num_tokens,
                seed as usize,
                first_extra_id,
                vocab,
            )),
            PromptStyle::Words => {
                let mut state = splitmix(seed);
                for _ in 0..num_tokens {
                    // A leading space makes the word one token; the prompt's very first word
                    // goes without, since SentencePiece adds its own.
                    if !self.text.is_empty() {
                        self.text.push(' ');
                    }
                    state = splitmix(state);
                    self.text
                        .push_str(WORDS[(state % WORDS.len() as u64) as usize]);
                }
            }
        }
        self.num_tokens += num_tokens;
        self
    }

    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    pub fn build(self) -> String {
        self.text
    }
}

/// A well-mixed 64-bit step (SplitMix64), so consecutive seeds give unrelated words.
pub(crate) fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A prompt of `num_tokens` `<extra_N>` tokens (BOS is added by the tokenizer on top),
/// different per `seed` so prefix caching cannot serve it.
pub fn exact_prompt(num_tokens: usize, seed: usize, first_extra_id: usize, vocab: usize) -> String {
    let span = vocab.saturating_sub(first_extra_id).max(1);
    (0..num_tokens)
        .map(|i| {
            format!(
                "<extra_{}>",
                first_extra_id + (i * 7919 + seed * 104_729) % span
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_prompts_have_the_asked_number_of_words() {
        let mut b = PromptBuilder::new(PromptStyle::Words);
        b.push(100, 1).push(28, 2);
        assert_eq!(b.num_tokens(), 128);
        let text = b.build();
        assert_eq!(text.split(' ').count(), 128);
        assert!(!text.starts_with(' '));
        assert!(text.split(' ').all(|w| WORDS.contains(&w)));
    }

    #[test]
    fn different_seeds_differ_early_and_equal_seeds_repeat() {
        let one = |seed| {
            let mut b = PromptBuilder::new(PromptStyle::Words);
            b.push(64, seed);
            b.build()
        };
        assert_eq!(one(5), one(5));
        let (a, b) = (one(5), one(6));
        let common = a
            .split(' ')
            .zip(b.split(' '))
            .take_while(|(x, y)| x == y)
            .count();
        assert!(common < 8, "{common} words in common");
    }

    #[test]
    fn extra_prompts_are_exact() {
        let p = exact_prompt(5, 3, 512, 49152);
        assert_eq!(p.matches("<extra_").count(), 5);
        let mut b = PromptBuilder::new(PromptStyle::Extra {
            first_extra_id: 512,
            vocab: 49152,
        });
        b.push(3, 1).push(2, 2);
        assert_eq!(b.build().matches("<extra_").count(), 5);
    }
}
