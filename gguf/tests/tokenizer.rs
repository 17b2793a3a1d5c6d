//! The tokenizer rebuilt from `tokenizer.ggml.*` encodes and decodes as the transformers
//! tokenizer it came from: byte-level BPE in Llama 3's layout here (SentencePiece is checked
//! on stories260K in engine/tests/gguf.rs).

use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

const CORPUS: &[&str] = &[
    "Once upon a time, there was a little girl named Lily.",
    "fn tokenizer_json(meta: &Metadata) -> Result<Json> {",
    "  two leading spaces and trailing  ",
    "It's 3:45pm! I'll say 12345 678.9 -- don't you've?",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "caf\u{e9} na\u{ef}ve \u{65e5}\u{672c}\u{8a9e} \u{1f600} emoji",
    "<|begin_of_text|>inline special<|end_of_text|> tokens",
    "",
    " ",
    "The GGUF header is checked before anything is allocated.",
];

#[test]
fn gpt2_bpe_tokenizer_matches_the_hf_tokenizer() {
    let file = gguf::GgufFile::open(&fixture("bpe-llama3.tokenizer.gguf")).expect("opens");
    let ours = gguf::tokenizer(file.metadata()).expect("builds");
    let hf = tokenizers::Tokenizer::from_file(fixture("bpe-llama3.tokenizer.json")).expect("hf");
    assert_eq!(ours.get_vocab_size(true), hf.get_vocab_size(true));
    for text in CORPUS {
        for special in [false, true] {
            let a = ours.encode(*text, special).expect("encode");
            let b = hf.encode(*text, special).expect("encode");
            assert_eq!(
                a.get_ids(),
                b.get_ids(),
                "{text:?} (special tokens {special})"
            );
            for skip in [false, true] {
                assert_eq!(
                    ours.decode(a.get_ids(), skip).expect("decode"),
                    hf.decode(b.get_ids(), skip).expect("decode"),
                    "{text:?}"
                );
            }
        }
    }
    for id in 0..hf.get_vocab_size(true) as u32 {
        assert_eq!(
            ours.decode(&[id], false).ok(),
            hf.decode(&[id], false).ok(),
            "id {id}"
        );
    }
}

#[test]
fn tokenizer_config_carries_the_chat_template_and_special_tokens() {
    let file = gguf::GgufFile::open(&fixture("bpe-llama3.tokenizer.gguf")).expect("opens");
    let cfg = gguf::tokenizer_config(file.metadata()).expect("config");
    assert_eq!(cfg["bos_token"], "<|begin_of_text|>");
    assert_eq!(cfg["eos_token"], "<|end_of_text|>");
    assert!(cfg["chat_template"]
        .as_str()
        .is_some_and(|t| t.contains("messages")));
    let gen = gguf::generation_config(file.metadata()).expect("generation");
    assert_eq!(gen["eos_token_id"], serde_json::json!([1]));
}
