//! Structured output in the engine: each constrained sequence carries a
//! [`grammar::Constraint`], whose mask is applied to its logits row before the draw and which
//! advances with every token the sequence keeps, wherever that token was sampled (here, on a
//! prefill node, or before a resume).

use std::sync::Arc;

use grammar::{Constraint, GrammarSpec, Vocabulary};

use super::Engine;
use crate::error::{EngineError, Result};
use crate::sampling::{sample, SampledToken, SamplingParams};

impl Engine {
    /// The model's vocabulary as grammars see it, built on the first constrained request: it
    /// walks the whole vocabulary, which unconstrained serving never needs.
    fn grammar_vocab(&mut self) -> Result<Arc<Vocabulary>> {
        if let Some(v) = &self.grammar_vocab {
            return Ok(Arc::clone(v));
        }
        let mut eos = self.model.generation.stop_token_ids();
        if eos.is_empty() {
            eos = self.model.config().eos_token_ids.clone();
        }
        let vocab =
            Vocabulary::from_tokenizer(&self.model.tokenizer, self.model.config().vocab_size, &eos)
                .map_err(|e| grammar_error("tokenizer cannot be constrained", e))?;
        let vocab = Arc::new(vocab);
        self.grammar_vocab = Some(Arc::clone(&vocab));
        Ok(vocab)
    }

    /// A constraint for `spec`, advanced past `generated` (tokens a resumed request already
    /// produced, or the first token a prefill node sampled).
    pub(super) fn compile_grammar(
        &mut self,
        spec: &GrammarSpec,
        generated: &[u32],
    ) -> Result<Constraint> {
        let mut constraint = self
            .grammar_vocab()?
            .compile(spec)
            .map_err(|e| grammar_error("does not compile", e))?;
        for &token_id in generated {
            constraint
                .accept(token_id)
                .map_err(|e| grammar_error("does not admit the tokens generated so far", e))?;
        }
        Ok(constraint)
    }
}

/// Samples from `logits` under `constraint` when there is one: the row is copied into
/// `scratch` and masked there. Without a constraint the row is sampled as it is, so
/// unconstrained output stays bit-identical.
///
/// A matcher that fails (a parser limit on a pathological grammar, a language with no text)
/// must not fail the whole batch: the row is then sampled unmasked, but the spent constraint
/// refuses that token, so [`Engine`]'s emit fails the sequence and the token goes nowhere.
pub(super) fn sample_constrained(
    logits: &[f32],
    constraint: Option<&mut Constraint>,
    stop_token_ids: &[u32],
    scratch: &mut Vec<f32>,
    params: &SamplingParams,
    context_ids: &[u32],
    position: u64,
) -> SampledToken {
    let Some(constraint) = constraint else {
        return sample(logits, params, context_ids, position);
    };
    scratch.clear();
    scratch.extend_from_slice(logits);
    match constraint.mask_logits(scratch, stop_token_ids) {
        Ok(()) => sample(scratch, params, context_ids, position),
        Err(e) => {
            tracing::warn!(error = %e, "grammar mask failed; the sequence ends");
            sample(logits, params, context_ids, position)
        }
    }
}

fn grammar_error(reason: &str, e: grammar::GrammarError) -> EngineError {
    EngineError::InvalidParameter {
        field: "grammar",
        reason: reason.into(),
        given: e.to_string(),
    }
}
