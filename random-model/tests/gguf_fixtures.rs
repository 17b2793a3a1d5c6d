//! The GGUF writer against llama.cpp: each fixture it writes is the file llama.cpp's
//! converter (and llama-quantize) made, byte for byte, as `gguf/tests/fixtures/manifest.json`
//! recorded it (per key and per tensor, so a failure says what differs).

use random_model::gguf_out::{fixtures, manifest};

fn check(name: &str) {
    let work = tempfile::tempdir().expect("tempdir");
    let bytes = fixtures::generate(name, work.path()).expect("writes");
    let ours = manifest::manifest(&bytes).expect("reads back");
    let want = fixtures::recorded(name).expect("recorded");
    let diff = manifest::differences(&ours, &want);
    assert!(
        diff.is_empty(),
        "{name} differs from llama.cpp's:\n{}",
        diff.join("\n")
    );
}

#[test]
fn every_fixture_is_recorded_and_every_recorded_file_a_fixture() {
    let text = std::fs::read_to_string(fixtures::sources_dir().join("manifest.json")).unwrap();
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut recorded: Vec<String> = all["files"].as_object().unwrap().keys().cloned().collect();
    let mut ours = fixtures::names();
    recorded.sort();
    ours.sort();
    assert_eq!(ours, recorded);
}

macro_rules! same_as_llama_cpp {
    ($($test:ident => $file:expr),* $(,)?) => {
        $(#[test] fn $test() { check($file); })*
    };
}

same_as_llama_cpp!(
    stories260k_f32 => "stories260K-f32.gguf",
    stories260k_q8_0 => "stories260K-q8_0.gguf",
    gemma2_f32 => "arch/gemma2-f32.gguf",
    gemma2_q8_0 => "arch/gemma2-q8_0.gguf",
    gemma3_f32 => "arch/gemma3-f32.gguf",
    gemma3_q8_0 => "arch/gemma3-q8_0.gguf",
    phi3_f32 => "arch/phi3-f32.gguf",
    phi3_q8_0 => "arch/phi3-q8_0.gguf",
    phi4_mini_f32 => "arch/phi4_mini-f32.gguf",
    phi4_mini_q8_0 => "arch/phi4_mini-q8_0.gguf",
    mixtral_f32 => "arch/mixtral-f32.gguf",
    mixtral_q8_0 => "arch/mixtral-q8_0.gguf",
    qwen3_moe_f32 => "arch/qwen3_moe-f32.gguf",
    qwen3_moe_q8_0 => "arch/qwen3_moe-q8_0.gguf",
);
