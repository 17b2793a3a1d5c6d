//! `tokenizer.ggml.*`: a Llama BPE tokenizer with byte fallback (stories260K's) as llama.cpp's
//! converter lays it out for the SentencePiece `llama` model: every id's piece, special tokens
//! as CONTROL with score -1000, `<0xXX>` as BYTE with score 0, the others NORMAL scored by
//! their rank (0, -1, -2, ...: SentencePiece BPE's merge priority).

use std::path::Path;

use anyhow::{ensure, Context};
use serde_json::Value;

use super::VocabSource;

/// llama.cpp's token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

pub(crate) struct Vocab {
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub types: Vec<i32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub chat_template: Option<String>,
}

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn is_byte_piece(s: &str) -> bool {
    s.len() == 6
        && s.starts_with("<0x")
        && s.ends_with('>')
        && s[3..5].bytes().all(|b| b.is_ascii_hexdigit())
}

pub(crate) fn vocab(dir: &Path, source: VocabSource) -> anyhow::Result<Vocab> {
    let tok = read_json(&dir.join("tokenizer.json"))?;
    let model = &tok["model"];
    ensure!(
        model["type"] == "BPE" && model["byte_fallback"] == true,
        "{}: the GGUF writer takes a Llama BPE tokenizer with byte fallback",
        dir.display()
    );
    let mut pieces: Vec<Option<(String, f32, i32)>> = Vec::new();
    fn put(pieces: &mut Vec<Option<(String, f32, i32)>>, id: usize, entry: (String, f32, i32)) {
        if pieces.len() <= id {
            pieces.resize(id + 1, None);
        }
        pieces[id] = Some(entry);
    }
    let vocab = model["vocab"]
        .as_object()
        .context("tokenizer.json has no model.vocab")?;
    let mut by_id: Vec<(usize, &str)> = vocab
        .iter()
        .filter_map(|(piece, id)| Some((id.as_u64()? as usize, piece.as_str())))
        .collect();
    by_id.sort_unstable();
    let added = tok["added_tokens"].as_array().cloned().unwrap_or_default();
    let special = |id: usize| {
        added
            .iter()
            .any(|t| t["id"].as_u64() == Some(id as u64) && t["special"] == true)
    };
    let mut rank = 0u32;
    for (id, piece) in by_id {
        let entry = if special(id) {
            (-1000.0, CONTROL)
        } else if is_byte_piece(piece) {
            (0.0, BYTE)
        } else {
            // -(rank as f32): the first normal piece scores -0.0, as the converter wrote it.
            rank += 1;
            (-((rank - 1) as f32), NORMAL)
        };
        put(&mut pieces, id, (piece.to_string(), entry.0, entry.1));
    }
    for t in &added {
        let (Some(id), Some(content)) = (t["id"].as_u64(), t["content"].as_str()) else {
            continue;
        };
        let id = id as usize;
        if pieces.get(id).is_some_and(Option::is_some) {
            continue;
        }
        let ty = if t["special"] == true {
            CONTROL
        } else {
            USER_DEFINED
        };
        put(&mut pieces, id, (content.to_string(), -1000.0, ty));
    }
    let mut out = Vocab {
        tokens: Vec::with_capacity(pieces.len()),
        scores: Vec::with_capacity(pieces.len()),
        types: Vec::with_capacity(pieces.len()),
        bos: None,
        eos: None,
        unk: None,
        add_bos: false,
        add_eos: false,
        chat_template: None,
    };
    for (id, p) in pieces.into_iter().enumerate() {
        let (piece, score, ty) = p.with_context(|| format!("tokenizer.json has no id {id}"))?;
        out.tokens.push(piece);
        out.scores.push(score);
        out.types.push(ty);
    }
    let cfg = read_json(&dir.join("tokenizer_config.json"))?;
    let id_of = |key: &str| -> Option<u32> {
        let text = cfg[key].as_str().or_else(|| cfg[key]["content"].as_str())?;
        out.tokens.iter().position(|t| t == text).map(|i| i as u32)
    };
    out.bos = id_of("bos_token");
    out.eos = id_of("eos_token");
    out.unk = id_of("unk_token");
    out.add_bos = cfg["add_bos_token"].as_bool().unwrap_or(false);
    out.add_eos = cfg["add_eos_token"].as_bool().unwrap_or(false);
    if source == VocabSource::SentencePiece {
        out.chat_template = cfg["chat_template"].as_str().map(str::to_string);
    }
    Ok(out)
}
