//! The gateway's requests and tokens in `fission.v1` form, and upstream statuses as gateway
//! errors: every conversion between the two sides of the node RPCs, in one place.

use proto::v1;
use proto::ErrorCode;

use crate::error::GatewayError;
use crate::request::{FinishReason, GeneratedToken, ValidRequest};

pub(crate) fn upstream(s: tonic::Status) -> GatewayError {
    GatewayError::backend(ErrorCode::from_grpc(s.code()), s.message().to_string())
}

pub(crate) fn sampling(r: &ValidRequest) -> v1::SamplingParams {
    v1::SamplingParams {
        temperature: r.sampling.temperature,
        top_k: r.sampling.top_k as u32,
        top_p: r.sampling.top_p,
        repetition_penalty: r.sampling.repetition_penalty,
        seed: r.sampling.seed,
        top_n_logprobs: r.sampling.top_n_logprobs as u32,
    }
}

pub(crate) fn stopping(r: &ValidRequest) -> v1::StoppingCriteria {
    v1::StoppingCriteria {
        max_new_tokens: r.stopping.max_new_tokens as u32,
        stop_token_ids: r.stopping.stop_token_ids.clone(),
        stop_strings: r.stopping.stop_strings.clone(),
        ignore_eos: r.stopping.ignore_eos,
    }
}

pub(crate) fn finish_reason(f: v1::FinishReason) -> Option<FinishReason> {
    match f {
        v1::FinishReason::Unspecified => None,
        v1::FinishReason::Length => Some(FinishReason::Length),
        v1::FinishReason::Eos => Some(FinishReason::Eos),
        v1::FinishReason::Stop => Some(FinishReason::Stop),
    }
}

/// What the nodes generate for `r`, resuming after the `emitted` tokens the client has.
pub(crate) fn spec(r: &ValidRequest, emitted: &[u32]) -> v1::GenerationSpec {
    let mut prompt_ids = r.prompt_ids.clone();
    prompt_ids.extend_from_slice(emitted);
    v1::GenerationSpec {
        request_id: r.request_id.to_string(),
        prompt_ids,
        num_generated: emitted.len() as u32,
        sampling: Some(sampling(r)),
        stopping: Some(stopping(r)),
        grammar: r.grammar.as_ref().map(grammar),
        // A resumed request has its prompt's logprobs from its first attempt.
        prompt_logprobs: r.prompt_logprobs && emitted.is_empty(),
    }
}

pub(crate) fn grammar(g: &grammar::GrammarSpec) -> v1::Grammar {
    use v1::grammar::Kind;
    let kind = match g {
        grammar::GrammarSpec::JsonSchema(schema) => Kind::JsonSchema(schema.to_string()),
        grammar::GrammarSpec::Regex(rx) => Kind::Regex(rx.clone()),
        grammar::GrammarSpec::Lark(lark) => Kind::Lark(lark.clone()),
    };
    v1::Grammar { kind: Some(kind) }
}

pub(crate) fn generated(t: v1::Token) -> GeneratedToken {
    GeneratedToken {
        id: t.token_id,
        logprob: t.logprob,
        top_logprobs: t.top_logprob_pairs(),
        index: t.index as usize,
        // An unknown code from a newer node reads as "not finished": the stream then ends
        // without a final token, which the gateway reports as an error.
        finish_reason: finish_reason(t.finish_reason()),
        text: t.text,
        prompt_logprobs: t.prompt_logprobs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_cross_as_enums() {
        let mut t = v1::Token {
            token_id: 5,
            text: "x".into(),
            index: 3,
            ..Default::default()
        };
        assert_eq!(generated(t.clone()).finish_reason, None);
        t.set_finish_reason(v1::FinishReason::Eos);
        let g = generated(t);
        assert_eq!(
            (g.id, g.index, g.finish_reason),
            (5, 3, Some(FinishReason::Eos))
        );
    }
}
