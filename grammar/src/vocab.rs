//! A model's vocabulary as llguidance sees it: the bytes of every token id, in a token trie,
//! with the parser factory that compiles grammars against it. Built once per model.

use std::sync::Arc;

use llguidance::api::ParserLimits;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::ParserFactory;

use crate::{Constraint, GrammarError, GrammarSpec, Result};

/// Compiles grammars against one vocabulary. Cheap to share behind an `Arc`; building it walks
/// the whole vocabulary (tens of milliseconds for 150k tokens), so do it once per model.
pub struct Vocabulary {
    factory: ParserFactory,
    vocab_size: usize,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl Vocabulary {
    /// The vocabulary of `tokenizer`, padded (or cut) to the model's `vocab_size` logits.
    /// Padding ids and ids the tokenizer lacks become special tokens no grammar admits.
    /// `eos_ids` are the tokens a grammar admits once it is complete.
    pub fn from_tokenizer(
        tokenizer: &tokenizers::Tokenizer,
        vocab_size: usize,
        eos_ids: &[u32],
    ) -> Result<Self> {
        let json = tokenizer
            .to_string(false)
            .map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let json: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        // llguidance's reader panics on some malformed vocabularies rather than failing.
        let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| GrammarError::Tokenizer("reading the vocabulary panicked".into()))?
            .map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        Self::from_token_bytes(words, vocab_size, eos_ids)
    }

    /// A vocabulary of the 256 single bytes and an end token: enough to check that a grammar
    /// compiles, without a model (what the gateway does before routing).
    pub fn bytes_only() -> Result<Self> {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(special_name("</s>"));
        Self::from_token_bytes(words, 257, &[256])
    }

    /// A vocabulary given as the bytes of each token id (special tokens start with
    /// `TokTrie::SPECIAL_TOKEN_MARKER`, 0xff), padded or cut to `vocab_size`.
    pub fn from_token_bytes(
        mut words: Vec<Vec<u8>>,
        vocab_size: usize,
        eos_ids: &[u32],
    ) -> Result<Self> {
        words.resize_with(vocab_size, Vec::new);
        for (id, word) in words.iter_mut().enumerate() {
            if word.is_empty() {
                *word = special_name(&format!("<[{id}]>"));
            }
        }
        let eos: Vec<TokenId> = eos_ids
            .iter()
            .copied()
            .filter(|&id| (id as usize) < vocab_size)
            .collect();
        let first_eos = *eos.first().ok_or_else(|| {
            GrammarError::Tokenizer(format!(
                "no end-of-sequence token below vocab size {vocab_size}"
            ))
        })?;
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(&eos);
        }
        let env: TokEnv = Arc::new(TrieEnv { trie });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        // llguidance logs to stderr by default; errors come back as values instead.
        factory.quiet();
        *factory.limits_mut() = ParserLimits::default();
        Ok(Vocabulary {
            factory,
            vocab_size,
        })
    }

    /// Logits per row this vocabulary masks.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A fresh constraint for one sequence, positioned before its first generated token.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(spec.to_llguidance())
            .map_err(|e| GrammarError::Invalid {
                kind: spec.kind(),
                message: e.to_string(),
            })?;
        Constraint::new(llguidance::Matcher::new(Ok(parser)), self.vocab_size)
    }

    /// Whether `spec` compiles and admits a first token: the gateway's check, with
    /// [`Vocabulary::bytes_only`]. Over single bytes, a grammar that matches any text admits
    /// its first byte (or the end token, for the empty text), so a first mask that admits
    /// nothing means its language is empty; refused here, it could only fail mid-stream.
    pub fn check(&self, spec: &GrammarSpec) -> Result<()> {
        let mut constraint = self.compile(spec)?;
        match constraint.allowed_tokens() {
            Ok(_) => Ok(()),
            Err(GrammarError::Matcher(_)) => Err(GrammarError::Empty { kind: spec.kind() }),
            Err(e) => Err(e),
        }
    }
}

fn special_name(name: &str) -> Vec<u8> {
    let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    bytes.extend_from_slice(name.as_bytes());
    bytes
}

/// The token environment llguidance needs: the trie, and a tokenizer for the few places it
/// turns text into tokens (forced tokens, which this crate does not use); greedy matching on
/// the trie is enough there.
struct TrieEnv {
    trie: TokTrie,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
}
