//! Constraints on a real vocabulary (stories260K's byte-fallback tokenizer): masks admit only
//! grammar tokens, a masked walk completes with a valid output, and it is deterministic.

use grammar::{GrammarSpec, Vocabulary};
use serde_json::json;

fn vocab() -> (Vocabulary, tokenizers::Tokenizer) {
    let path = testkit::shared_model("stories260K").join("tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(&path).expect("stories260K tokenizer");
    // Padded past the tokenizer's 512 tokens, as random models are.
    let vocab = Vocabulary::from_tokenizer(&tokenizer, 520, &[2, 1]).expect("vocabulary");
    (vocab, tokenizer)
}

/// Pseudo-random logits that depend only on `(salt, step)`.
fn logits(salt: u64, step: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let mut x =
                salt ^ ((step as u64) << 20) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            x ^= x >> 31;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 29;
            (x % 1000) as f32 / 100.0
        })
        .collect()
}

/// Greedy walk under the mask until the grammar completes or `max_tokens` pass.
fn walk(vocab: &Vocabulary, spec: &GrammarSpec, salt: u64, max_tokens: usize) -> (Vec<u32>, bool) {
    let mut constraint = vocab.compile(spec).expect("compiles");
    let mut out = Vec::new();
    for step in 0..max_tokens {
        let mut row = logits(salt, step, vocab.vocab_size());
        let before = row.clone();
        constraint.mask_logits(&mut row, &[2, 1]).expect("mask");
        let allowed = constraint.allowed_tokens().expect("mask");
        for (id, (&x, &was)) in row.iter().zip(&before).enumerate() {
            let admitted = id < allowed.len() && allowed.is_allowed(id as u32)
                || (matches!(id, 1 | 2) && allowed.is_allowed(2));
            assert_eq!(x.is_finite(), admitted, "id {id} at step {step}");
            if admitted {
                assert_eq!(x, was, "admitted logits are untouched");
            }
        }
        let (best, _) = row
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |acc, (i, &x)| if x > acc.1 { (i, x) } else { acc },
            );
        let token = best as u32;
        if token == 1 || token == 2 {
            return (out, true);
        }
        out.push(token);
        constraint
            .accept(token)
            .expect("admitted token is accepted");
        if constraint.is_complete() {
            return (out, true);
        }
    }
    (out, false)
}

#[test]
fn json_schema_walks_complete_with_valid_json() {
    let (vocab, tokenizer) = vocab();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "mood": {"enum": ["happy", "sad"]}
        },
        "required": ["name", "age", "mood"],
        "additionalProperties": false
    });
    let spec = GrammarSpec::JsonSchema(schema);
    for salt in 0..10 {
        let (ids, complete) = walk(&vocab, &spec, salt, 200);
        assert!(complete, "salt {salt} did not complete: {ids:?}");
        let text = tokenizer.decode(&ids, true).expect("decodes");
        let value: serde_json::Value = serde_json::from_str(text.trim())
            .unwrap_or_else(|e| panic!("salt {salt}: {text:?} is not JSON: {e}"));
        assert!(
            value["name"]
                .as_str()
                .is_some_and(|s| s.chars().count() <= 8),
            "{text}"
        );
        assert!(value["age"].as_u64().is_some_and(|a| a <= 120), "{text}");
        assert!(
            ["happy", "sad"].contains(&value["mood"].as_str().unwrap_or("")),
            "{text}"
        );
    }
}

#[test]
fn a_walk_is_deterministic() {
    let (vocab, _) = vocab();
    let spec = GrammarSpec::Regex("(yes|no), [a-z]{1,6}!".into());
    let first = walk(&vocab, &spec, 7, 50);
    assert!(first.1);
    assert_eq!(walk(&vocab, &spec, 7, 50), first);
}

#[test]
fn regex_output_matches() {
    let (vocab, tokenizer) = vocab();
    let spec = GrammarSpec::Regex("[0-9]{3}-[a-z]{2,4}".into());
    for salt in 0..5 {
        let (ids, complete) = walk(&vocab, &spec, salt, 50);
        assert!(complete);
        let text = tokenizer.decode(&ids, true).expect("decodes");
        let text = text.trim_start();
        assert!(
            text.len() >= 6 && text.as_bytes()[..3].iter().all(u8::is_ascii_digit),
            "{text:?}"
        );
        assert_eq!(&text[3..4], "-", "{text:?}");
    }
}

#[test]
fn bad_grammars_fail_to_compile_with_their_kind() {
    let vocab = Vocabulary::bytes_only().expect("bytes");
    let bad = [
        GrammarSpec::JsonSchema(json!({"type": "no-such-type"})),
        GrammarSpec::Regex("([a-z]".into()),
        GrammarSpec::Lark("start: undefined_rule".into()),
    ];
    for spec in bad {
        let e = vocab.check(&spec).expect_err("invalid");
        assert!(
            e.to_string()
                .starts_with(&format!("invalid {}", spec.kind())),
            "{e}"
        );
    }
    vocab
        .check(&GrammarSpec::json_object())
        .expect("json_object compiles");
}

/// Issue 31: `[^\s\S]` compiled and the engine then sampled outside the grammar. A grammar
/// that matches nothing is refused by the check, while one that matches something passes.
#[test]
fn a_grammar_that_matches_nothing_is_refused() {
    let bytes = Vocabulary::bytes_only().expect("byte vocabulary");
    for rx in [r"[^\s\S]", r"a[^\s\S]", r"(x[^\s\S])+"] {
        let err = bytes
            .check(&GrammarSpec::Regex(rx.into()))
            .expect_err("an empty language is refused");
        assert!(
            matches!(err, grammar::GrammarError::Empty { kind: "regex" }),
            "{rx}: {err:?}"
        );
        assert!(err.to_string().contains("matches no text"), "{err}");
    }
    for rx in ["", "a|[^\\s\\S]", "[0-9]{1,3} years old"] {
        bytes
            .check(&GrammarSpec::Regex(rx.into()))
            .unwrap_or_else(|e| panic!("{rx:?}: {e}"));
    }
}

/// A constraint whose mask failed is spent: it refuses every token after, so a row sampled
/// without the mask can never be taken for grammar output (the engine then fails the
/// sequence).
#[test]
fn a_failed_mask_refuses_every_later_token() {
    let (vocab, _) = vocab();
    let mut constraint = vocab
        .compile(&GrammarSpec::Regex(r"[^\s\S]".into()))
        .expect("compiles");
    let mut row = vec![0.0f32; vocab.vocab_size()];
    let err = constraint.mask_logits(&mut row, &[2]).expect_err("no mask");
    assert!(!err.to_string().contains('\n'), "one line: {err}");
    for token in [2, 300, 65] {
        assert!(constraint.accept(token).is_err(), "token {token}");
    }
}
