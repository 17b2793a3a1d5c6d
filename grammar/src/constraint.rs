//! One sequence's grammar state: the mask before each draw and the advance after it.

use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

use crate::{GrammarError, Result};

/// A compiled grammar following one sequence. Call [`Constraint::mask_logits`] before each
/// draw and [`Constraint::accept`] with the drawn token; the output is complete when
/// [`Constraint::is_complete`] says so.
///
/// The mask depends only on the tokens accepted so far, so a seeded request stays
/// deterministic: the same tokens give the same masks on every node and in every batch.
pub struct Constraint {
    matcher: Matcher,
    vocab_size: usize,
    /// Why the matcher failed, once it has: every later mask and token is refused, so a row
    /// sampled without a mask can never pass for grammar output.
    failed: Option<String>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("vocab_size", &self.vocab_size)
            .field("complete", &self.is_complete())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    pub(crate) fn new(matcher: Matcher, vocab_size: usize) -> Result<Self> {
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Matcher(e));
        }
        Ok(Constraint {
            matcher,
            vocab_size,
            failed: None,
        })
    }

    /// The tokens the grammar admits next: one bit per token id, with the end-of-sequence
    /// tokens set once the output so far is complete. Fails when the matcher fails or admits
    /// nothing at all (a grammar whose language is empty): the constraint is then spent.
    pub fn allowed_tokens(&mut self) -> Result<SimpleVob> {
        if let Some(why) = &self.failed {
            return Err(GrammarError::Matcher(why.clone()));
        }
        let result = match self.matcher.compute_mask_or_eos() {
            Ok(mask) if mask.is_zero() => Err("the grammar admits no token here".to_string()),
            Ok(mask) => Ok(mask),
            Err(e) => Err(first_line(&e.to_string())),
        };
        result.map_err(|why| {
            self.failed = Some(why.clone());
            GrammarError::Matcher(why)
        })
    }

    /// Sets every logit the grammar does not admit next to `-inf`. `also_when_complete` are
    /// tokens that end this request (its stop ids): they are admitted wherever the grammar
    /// admits its own end tokens, that is once the output so far is a complete match.
    pub fn mask_logits(&mut self, logits: &mut [f32], also_when_complete: &[u32]) -> Result<()> {
        let mask = self.allowed_tokens()?;
        let may_end = also_when_complete
            .iter()
            .any(|&id| (id as usize) < mask.len() && mask.is_allowed(id));
        let kept: Vec<(usize, f32)> = if may_end {
            also_when_complete
                .iter()
                .filter_map(|&id| logits.get(id as usize).map(|&x| (id as usize, x)))
                .collect()
        } else {
            Vec::new()
        };
        apply_mask(mask.as_slice(), logits);
        for (id, x) in kept {
            logits[id] = x;
        }
        Ok(())
    }

    /// Advances past `token_id`, which must have been admitted by the last mask.
    pub fn accept(&mut self, token_id: u32) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(GrammarError::Matcher(why.clone()));
        }
        self.matcher.consume_token(token_id).map_err(|e| {
            let why = first_line(&e.to_string());
            self.failed = Some(why.clone());
            GrammarError::Matcher(why)
        })
    }

    /// The output is a complete match and the grammar admits nothing more: the sequence ends.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The output so far is a complete match (more may follow).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// llguidance's errors end with a dump of the parser's state, dozens of lines long: the first
/// line says what went wrong, and is what logs and clients get.
fn first_line(message: &str) -> String {
    message.lines().next().unwrap_or(message).trim().to_string()
}

/// `-inf` over every logit whose bit is clear, and over logits past the mask. Whole words of
/// 32 tokens are skipped or filled at once: a grammar usually admits a few tokens or most.
fn apply_mask(words: &[u32], logits: &mut [f32]) {
    let covered = (words.len() * 32).min(logits.len());
    let (masked, beyond) = logits.split_at_mut(covered);
    beyond.fill(f32::NEG_INFINITY);
    for (&word, chunk) in words.iter().zip(masked.chunks_mut(32)) {
        match word {
            u32::MAX => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            _ => {
                for (bit, logit) in chunk.iter_mut().enumerate() {
                    if word & (1 << bit) == 0 {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_mask_keeps_set_bits_only() {
        let mut logits = vec![1.0f32; 70];
        // Word 0 allows ids 0 and 5, word 1 allows all, word 2 (ids 64..96) allows none.
        apply_mask(&[0b10_0001, u32::MAX, 0], &mut logits);
        for (id, &x) in logits.iter().enumerate() {
            let allowed = id == 0 || id == 5 || (32..64).contains(&id);
            assert_eq!(x.is_finite(), allowed, "id {id}");
        }
    }

    #[test]
    fn logits_past_the_mask_are_masked() {
        let mut logits = vec![1.0f32; 40];
        apply_mask(&[u32::MAX], &mut logits);
        assert!(logits[..32].iter().all(|x| x.is_finite()));
        assert!(logits[32..].iter().all(|x| *x == f32::NEG_INFINITY));
    }
}
