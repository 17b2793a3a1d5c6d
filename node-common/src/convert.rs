//! Conversions between engine types and wire types, in one place.

use engine::engine::{Request, TokenEvent};
use engine::ids::SeqId;
use engine::sampling::{SampledToken, SamplingParams};
use engine::stopping::{FinishReason, StoppingCriteria};
use grammar::GrammarSpec;
use proto::v1;

pub fn sampling(p: Option<&v1::SamplingParams>) -> SamplingParams {
    match p {
        Some(p) => SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
            repetition_penalty: if p.repetition_penalty == 0.0 {
                1.0
            } else {
                p.repetition_penalty
            },
            seed: p.seed,
            top_n_logprobs: p.top_n_logprobs as usize,
        },
        None => SamplingParams::greedy(),
    }
}

pub fn stopping(s: Option<&v1::StoppingCriteria>) -> StoppingCriteria {
    match s {
        Some(s) => StoppingCriteria {
            max_new_tokens: s.max_new_tokens as usize,
            stop_token_ids: s.stop_token_ids.clone(),
            stop_strings: s.stop_strings.clone(),
            ignore_eos: s.ignore_eos,
        },
        None => StoppingCriteria::default(),
    }
}

/// The engine request for `spec`, as sequence `seq_id`.
pub fn request(seq_id: SeqId, spec: v1::GenerationSpec) -> Request {
    Request {
        seq_id,
        num_generated: spec.num_generated as usize,
        prompt_ids: spec.prompt_ids,
        sampling: sampling(spec.sampling.as_ref()),
        stopping: stopping(spec.stopping.as_ref()),
        grammar: spec.grammar.as_ref().and_then(grammar),
        prompt_logprobs: spec.prompt_logprobs,
    }
}

/// The engine's grammar for a wire grammar; `None` when the message names no kind. A schema
/// that is not JSON stays a (non-object) schema so that compiling it fails with a clear
/// error instead of the constraint being dropped.
pub fn grammar(g: &v1::Grammar) -> Option<GrammarSpec> {
    use v1::grammar::Kind;
    Some(match g.kind.as_ref()? {
        Kind::JsonSchema(s) => GrammarSpec::JsonSchema(
            serde_json::from_str(s)
                .unwrap_or_else(|e| serde_json::Value::String(format!("not JSON: {e}"))),
        ),
        Kind::Regex(r) => GrammarSpec::Regex(r.clone()),
        Kind::Lark(l) => GrammarSpec::Lark(l.clone()),
    })
}

pub fn finish_reason(f: Option<FinishReason>) -> v1::FinishReason {
    match f {
        None => v1::FinishReason::Unspecified,
        Some(FinishReason::Length) => v1::FinishReason::Length,
        Some(FinishReason::Eos) => v1::FinishReason::Eos,
        Some(FinishReason::Stop) => v1::FinishReason::Stop,
    }
}

pub fn token(ev: &TokenEvent) -> v1::Token {
    v1::Token {
        token_id: ev.token.token_id,
        logprob: ev.token.logprob,
        top_logprobs: ev
            .token
            .top_logprobs
            .iter()
            .map(|&(token_id, logprob)| v1::TopLogprob { token_id, logprob })
            .collect(),
        text: ev.text.clone(),
        index: ev.index as u32,
        finish_reason: finish_reason(ev.finish) as i32,
        prompt_logprobs: ev.prompt_logprobs.clone(),
    }
}

pub fn sampled(t: &v1::Token) -> SampledToken {
    SampledToken {
        token_id: t.token_id,
        logprob: t.logprob,
        top_logprobs: t.top_logprob_pairs(),
    }
}
