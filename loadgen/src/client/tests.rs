//! The stream meanings of each API, fed byte streams recorded from the servers (Fission's
//! gateway, llama.cpp's llama-server, TGI), cut into pieces at arbitrary places.

use super::*;

/// Decodes `stream` in `piece`-byte chunks, the n-th chunk seen at n ms.
fn tally(api: Api, stream: &str, piece: usize) -> StreamTally {
    let mut decoder = SseDecoder::new();
    let mut t = StreamTally::default();
    let mut live = true;
    for (n, chunk) in stream.as_bytes().chunks(piece).enumerate() {
        for e in decoder.push(chunk) {
            if live {
                live = t.observe_event(api, &e, n as f64 * 1e-3);
            }
        }
    }
    if let Some(e) = decoder.finish() {
        if live {
            t.observe_event(api, &e, 1.0);
        }
    }
    t
}

/// Fission, `/v1/completions` with `stream_options.include_usage`: one chunk a token, the
/// last token's with `finish_reason`, then a usage chunk and `[DONE]`.
const FISSION_COMPLETIONS: &str = concat!(
    "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"stories260K\",\"choices\":[{\"index\":0,\"text\":\" Lily\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"stories260K\",\"choices\":[{\"index\":0,\"text\":\"\",\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"stories260K\",\"choices\":[{\"index\":0,\"text\":\" was\",\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\n",
    "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"stories260K\",\"choices\":[],\"usage\":{\"prompt_tokens\":17,\"completion_tokens\":3,\"total_tokens\":20}}\n\n",
    "data: [DONE]\n\n",
);

/// llama-server, `/v1/chat/completions`: a role-only first delta, content deltas, a last
/// empty delta with the `finish_reason`, no usage.
const LLAMA_SERVER_CHAT: &str = concat!(
    "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null}}],\"created\":1,\"id\":\"chatcmpl-x\",\"model\":\"m\",\"object\":\"chat.completion.chunk\"}\n\n",
    "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\"Once\"}}],\"created\":1,\"id\":\"chatcmpl-x\",\"model\":\"m\",\"object\":\"chat.completion.chunk\"}\n\n",
    "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\" upon\"}}],\"created\":1,\"id\":\"chatcmpl-x\",\"model\":\"m\",\"object\":\"chat.completion.chunk\"}\n\n",
    "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\" a\"}}],\"created\":1,\"id\":\"chatcmpl-x\",\"model\":\"m\",\"object\":\"chat.completion.chunk\"}\n\n",
    "data: {\"choices\":[{\"finish_reason\":\"length\",\"index\":0,\"delta\":{}}],\"created\":1,\"id\":\"chatcmpl-x\",\"model\":\"m\",\"object\":\"chat.completion.chunk\",\"timings\":{\"predicted_n\":3}}\n\n",
    "data: [DONE]\n\n",
);

/// llama-server, `/v1/completions`: the last chunk has empty text, the `finish_reason` and
/// usage.
const LLAMA_SERVER_COMPLETIONS: &str = concat!(
    "data: {\"choices\":[{\"text\":\"The\",\"index\":0,\"logprobs\":null,\"finish_reason\":null}],\"object\":\"text_completion\"}\n\n",
    "data: {\"choices\":[{\"text\":\" end\",\"index\":0,\"logprobs\":null,\"finish_reason\":null}],\"object\":\"text_completion\"}\n\n",
    "data: {\"choices\":[{\"text\":\"\",\"index\":0,\"logprobs\":null,\"finish_reason\":\"length\"}],\"object\":\"text_completion\",\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":5,\"total_tokens\":7}}\n\n",
    "data: [DONE]\n\n",
);

/// TGI's `/generate_stream` (as Fission serves it): one event a token, the last with
/// `generated_text` and `details`.
const TGI_STREAM: &str = concat!(
    "data:{\"index\":1,\"token\":{\"id\":7,\"text\":\" Tim\",\"logprob\":-0.1,\"special\":false},\"top_tokens\":[],\"generated_text\":null,\"details\":null}\n\n",
    "data:{\"index\":2,\"token\":{\"id\":9,\"text\":\" saw\",\"logprob\":-0.2,\"special\":false},\"top_tokens\":[],\"generated_text\":null,\"details\":null}\n\n",
    "data:{\"index\":3,\"token\":{\"id\":4,\"text\":\" a\",\"logprob\":-0.3,\"special\":false},\"top_tokens\":[],\"generated_text\":\" Tim saw a\",\"details\":{\"finish_reason\":\"length\",\"generated_tokens\":3,\"seed\":null}}\n\n",
);

#[test]
fn fission_completions_count_every_token_and_take_usage() {
    for piece in [1, 7, 64, 4096] {
        let t = tally(Api::OpenaiCompletions, FISSION_COMPLETIONS, piece);
        assert_eq!(t.error(), None, "piece {piece}");
        assert_eq!(t.output_tokens(), 3);
        assert_eq!(t.counted_tokens, 3, "the empty-text token counts");
        assert_eq!(t.prompt_tokens, Some(17));
        assert_eq!(t.itl_s.len(), 2);
    }
}

#[test]
fn llama_server_chat_skips_role_and_finish_only_deltas() {
    for piece in [1, 13, 4096] {
        let t = tally(Api::OpenaiChat, LLAMA_SERVER_CHAT, piece);
        assert_eq!(t.error(), None);
        assert_eq!(t.output_tokens(), 3, "piece {piece}");
        assert_eq!(t.reported_tokens, None, "no usage: counted from the chunks");
    }
}

#[test]
fn llama_server_completions_do_not_count_the_finish_chunk() {
    let t = tally(Api::OpenaiCompletions, LLAMA_SERVER_COMPLETIONS, 5);
    assert_eq!(t.error(), None);
    assert_eq!(t.counted_tokens, 2);
    assert_eq!(t.output_tokens(), 2);
    assert_eq!(t.prompt_tokens, Some(5));
}

#[test]
fn tgi_streams_end_with_generated_text() {
    let t = tally(Api::Tgi, TGI_STREAM, 11);
    assert_eq!(t.error(), None);
    assert_eq!(t.output_tokens(), 3);
    let cut = &TGI_STREAM[..TGI_STREAM.rfind("data:").expect("three events")];
    let t = tally(Api::Tgi, cut, 11);
    assert_eq!(t.error(), Some(ErrorKind::Incomplete));
    assert_eq!(t.output_tokens(), 2);
}

#[test]
fn error_events_are_typed_in_each_shape() {
    let fission = "data: {\"index\":1,\"token\":{\"id\":7,\"text\":\"a\",\"logprob\":0,\"special\":false},\"generated_text\":null,\"details\":null}\n\ndata: {\"error\":\"no decode node\",\"error_type\":\"overloaded\"}\n\n";
    let t = tally(Api::Tgi, fission, 3);
    assert_eq!(
        t.error(),
        Some(ErrorKind::SseError {
            error_type: "overloaded".into()
        })
    );
    assert_eq!(t.output_tokens(), 1);
    let openai =
        "data: {\"error\":{\"message\":\"x\",\"type\":\"server_error\",\"code\":null}}\n\n";
    assert_eq!(
        tally(Api::OpenaiCompletions, openai, 4).error(),
        Some(ErrorKind::SseError {
            error_type: "server_error".into()
        })
    );
    let named = "event: error\ndata: {\"message\":\"boom\"}\n\n";
    assert_eq!(
        tally(Api::OpenaiChat, named, 4).error(),
        Some(ErrorKind::SseError {
            error_type: "error".into()
        })
    );
    assert_eq!(
        tally(Api::OpenaiChat, "data: {not json\n\n", 4).error(),
        Some(ErrorKind::Malformed)
    );
}

#[test]
fn a_stream_cut_before_its_end_is_incomplete() {
    let cut = &FISSION_COMPLETIONS[..FISSION_COMPLETIONS.find("\"length\"").expect("has it") - 40];
    let t = tally(Api::OpenaiCompletions, cut, 4096);
    assert_eq!(t.error(), Some(ErrorKind::Incomplete));
}

#[test]
fn timing_follows_the_token_events() {
    let mut t = StreamTally::default();
    let token = EventMeaning {
        tokens: 1,
        ..EventMeaning::default()
    };
    t.observe(EventMeaning::default(), 0.05);
    t.observe(token.clone(), 0.1);
    t.observe(token.clone(), 0.15);
    t.observe(
        EventMeaning {
            finished: true,
            ..token
        },
        0.3,
    );
    assert_eq!(t.ttft_s, Some(0.1));
    let itl: Vec<_> = t.itl_s.iter().map(|x| (x * 1e3).round()).collect();
    assert_eq!(itl, vec![50.0, 150.0]);
    assert_eq!(t.error(), None);
}

#[test]
fn requests_ask_for_exact_lengths() {
    let spec = RequestSpec {
        index: 0,
        prompt: "sys user".into(),
        system: Some("sys".into()),
        user: "user".into(),
        input_len: 2,
        output_len: 9,
    };
    let b = openai::body(&spec, Some("m"), false);
    assert_eq!(b["prompt"], "sys user");
    assert_eq!(b["max_tokens"], 9);
    assert_eq!(b["ignore_eos"], true);
    assert_eq!(b["stream"], true);
    assert_eq!(b["model"], "m");
    let c = openai::body(&spec, None, true);
    assert_eq!(c["messages"][0]["role"], "system");
    assert_eq!(c["messages"][1]["content"], "user");
    assert!(c.get("model").is_none());
    assert_eq!(tgi::body(&spec)["parameters"]["max_new_tokens"], 9);
}
