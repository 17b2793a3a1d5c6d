//! The tokenizer rebuilt from `tokenizer.ggml.*` as the transformers `tokenizer.json` that
//! HF's own converters write for the same model, and the `tokenizer_config.json` that carries
//! `tokenizer.chat_template` and the special tokens.
//!
//! Two models: `llama` (SentencePiece BPE: merges rebuilt from the scores, as transformers'
//! `SentencePieceExtractor` does, with byte fallback) and `gpt2` (byte-level BPE with the
//! file's merges and the pre-tokenizer that `tokenizer.ggml.pre` names).

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use serde_json::{json, Value as Json};

use crate::error::{GgufError, Result};
use crate::file::{Metadata, MetadataExt};

/// llama.cpp's token types.
const NORMAL: i64 = 1;
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

struct Vocab<'m> {
    tokens: Vec<&'m str>,
    types: Vec<i64>,
    meta: &'m Metadata,
}

fn strings<'m>(m: &'m Metadata, key: &str) -> Result<Vec<&'m str>> {
    let arr = m
        .opt_array(key)?
        .ok_or_else(|| GgufError::MissingMetadata { key: key.into() })?;
    arr.iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.as_str()),
            other => Err(GgufError::BadMetadata {
                key: key.into(),
                reason: format!("expected strings, found {:?}", other.value_type()),
            }),
        })
        .collect()
}

fn numbers(m: &Metadata, key: &str, len: usize) -> Result<Option<Vec<f64>>> {
    let Some(arr) = m.opt_array(key)? else {
        return Ok(None);
    };
    if arr.len() != len {
        return Err(GgufError::BadMetadata {
            key: key.into(),
            reason: format!("{} entries for {len} tokens", arr.len()),
        });
    }
    arr.iter()
        .map(|v| match *v {
            Value::F32(x) => Ok(f64::from(x)),
            Value::F64(x) => Ok(x),
            Value::I32(x) => Ok(f64::from(x)),
            Value::U32(x) => Ok(f64::from(x)),
            Value::I8(x) => Ok(f64::from(x)),
            Value::U8(x) => Ok(f64::from(x)),
            ref other => Err(GgufError::BadMetadata {
                key: key.into(),
                reason: format!("expected numbers, found {:?}", other.value_type()),
            }),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

impl<'m> Vocab<'m> {
    fn read(meta: &'m Metadata) -> Result<Self> {
        let tokens = strings(meta, "tokenizer.ggml.tokens")?;
        let types = numbers(meta, "tokenizer.ggml.token_type", tokens.len())?
            .map(|t| t.into_iter().map(|x| x as i64).collect())
            .unwrap_or_else(|| vec![NORMAL; tokens.len()]);
        Ok(Vocab {
            tokens,
            types,
            meta,
        })
    }

    fn token(&self, key: &str) -> Result<Option<&'m str>> {
        match self.meta.opt_u64(key)? {
            None => Ok(None),
            Some(id) => self
                .tokens
                .get(id as usize)
                .copied()
                .map(Some)
                .ok_or_else(|| GgufError::BadMetadata {
                    key: key.into(),
                    reason: format!(
                        "token id {id} is outside the vocabulary of {}",
                        self.tokens.len()
                    ),
                }),
        }
    }

    fn vocab_map(&self) -> serde_json::Map<String, Json> {
        let mut map = serde_json::Map::new();
        for (id, t) in self.tokens.iter().enumerate() {
            // A duplicated piece keeps its last id, as transformers' dict built in order does.
            map.insert((*t).to_string(), json!(id));
        }
        map
    }

    /// Control, unknown and user-defined tokens: matched whole before the model runs.
    fn added_tokens(&self) -> Vec<Json> {
        self.tokens
            .iter()
            .zip(&self.types)
            .enumerate()
            .filter(|(_, (_, ty))| matches!(**ty, UNKNOWN | CONTROL | USER_DEFINED))
            .map(|(id, (t, ty))| {
                json!({
                    "id": id, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": *ty != USER_DEFINED,
                })
            })
            .collect()
    }

    fn post_processor(&self, add_bos: bool, add_eos: bool) -> Result<Json> {
        let bos = self
            .token("tokenizer.ggml.bos_token_id")?
            .filter(|_| add_bos);
        let eos = self
            .token("tokenizer.ggml.eos_token_id")?
            .filter(|_| add_eos);
        if bos.is_none() && eos.is_none() {
            return Ok(Json::Null);
        }
        let mut single = Vec::new();
        let mut special = serde_json::Map::new();
        let id_of = |t: &str| self.tokens.iter().position(|x| *x == t).unwrap_or(0);
        if let Some(b) = bos {
            single.push(json!({"SpecialToken": {"id": b, "type_id": 0}}));
            special.insert(b.into(), json!({"id": b, "ids": [id_of(b)], "tokens": [b]}));
        }
        single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
        if let Some(e) = eos {
            single.push(json!({"SpecialToken": {"id": e, "type_id": 0}}));
            special.insert(e.into(), json!({"id": e, "ids": [id_of(e)], "tokens": [e]}));
        }
        let mut pair = single.clone();
        pair.extend(single.iter().map(|p| {
            let mut p = p.clone();
            for v in p.as_object_mut().into_iter().flat_map(|o| o.values_mut()) {
                v["type_id"] = json!(1);
                if v["id"] == "A" {
                    v["id"] = json!("B");
                }
            }
            p
        }));
        Ok(
            json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}),
        )
    }

    /// SentencePiece BPE: a merge for every split of a normal piece into two pieces of the
    /// vocabulary, ranked by the merged piece's score (transformers' `SentencePieceExtractor`).
    fn spm_merges(&self) -> Result<Vec<Json>> {
        let scores =
            numbers(self.meta, "tokenizer.ggml.scores", self.tokens.len())?.ok_or_else(|| {
                GgufError::MissingMetadata {
                    key: "tokenizer.ggml.scores".into(),
                }
            })?;
        let ids: HashMap<&str, usize> = self
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (*t, i))
            .collect();
        let mut merges: Vec<(usize, usize, f64)> = Vec::new();
        for (i, piece) in self.tokens.iter().enumerate() {
            if self.types[i] != NORMAL {
                continue;
            }
            let mut local: Vec<(usize, usize, f64)> = piece
                .char_indices()
                .skip(1)
                .filter_map(|(at, _)| {
                    let (l, r) = piece.split_at(at);
                    Some((*ids.get(l)?, *ids.get(r)?, scores[i]))
                })
                .collect();
            local.sort_by_key(|&(l, r, _)| (l, r));
            merges.extend(local);
        }
        // Stable, as Python's sort: equal scores keep the vocabulary's order.
        merges.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(merges
            .into_iter()
            .map(|(l, r, _)| json!([self.tokens[l], self.tokens[r]]))
            .collect())
    }
}

/// `tokenizer.json` for the file's tokenizer.
pub fn tokenizer_json(meta: &Metadata) -> Result<Json> {
    let vocab = Vocab::read(meta)?;
    let model = meta.str("tokenizer.ggml.model")?;
    let add_bos = meta.opt_bool("tokenizer.ggml.add_bos_token")?;
    let add_eos = meta
        .opt_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);
    let (normalizer, pre_tokenizer, decoder, bpe) = match model {
        "llama" => {
            let prefix = meta
                .opt_bool("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(true);
            let replace =
                json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
            let normalizer = if prefix {
                json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, replace]})
            } else {
                replace
            };
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            let unk = vocab
                .token("tokenizer.ggml.unknown_token_id")?
                .or_else(|| vocab.tokens.iter().copied().find(|t| *t == "<unk>"));
            let bpe = json!({
                "type": "BPE", "dropout": null, "unk_token": unk,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab.vocab_map(), "merges": vocab.spm_merges()?,
            });
            (
                normalizer,
                Json::Null,
                json!({"type": "Sequence", "decoders": decoders}),
                (bpe, add_bos.unwrap_or(true)),
            )
        }
        "gpt2" => {
            let pre = meta.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
            let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
            let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
            let (normalizer, pre_tokenizer, ignore_merges) = match pre {
                "gpt2" | "default" => (Json::Null, byte_level(true), false),
                "smollm" => (
                    Json::Null,
                    json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]}),
                    false,
                ),
                "llama-bpe" | "llama3" => (
                    Json::Null,
                    json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
                    true,
                ),
                "qwen2" => (
                    json!({"type": "NFC"}),
                    json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
                    false,
                ),
                other => {
                    return Err(GgufError::BadMetadata {
                        key: "tokenizer.ggml.pre".into(),
                        reason: format!(
                            "pre-tokenizer {other:?} is not supported (gpt2, default, smollm, llama-bpe and qwen2 are)"
                        ),
                    })
                }
            };
            let merges: Vec<Json> = strings(meta, "tokenizer.ggml.merges")?
                .into_iter()
                .map(|m| match m.split_once(' ') {
                    Some((a, b)) => Ok(json!([a, b])),
                    None => Err(GgufError::BadMetadata {
                        key: "tokenizer.ggml.merges".into(),
                        reason: format!("merge {m:?} is not two pieces"),
                    }),
                })
                .collect::<Result<_>>()?;
            let bpe = json!({
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                "vocab": vocab.vocab_map(), "merges": merges,
            });
            (
                normalizer,
                pre_tokenizer,
                json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
                (bpe, add_bos.unwrap_or(false)),
            )
        }
        other => {
            return Err(GgufError::BadMetadata {
                key: "tokenizer.ggml.model".into(),
                reason: format!("tokenizer model {other:?} is not supported (llama and gpt2 are)"),
            })
        }
    };
    let (bpe, add_bos) = bpe;
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": vocab.added_tokens(),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": vocab.post_processor(add_bos, add_eos)?,
        "decoder": decoder,
        "model": bpe,
    }))
}

/// The file's tokenizer, built from [`tokenizer_json`].
pub fn tokenizer(meta: &Metadata) -> Result<tokenizers::Tokenizer> {
    let json = tokenizer_json(meta)?;
    json.to_string()
        .parse::<tokenizers::Tokenizer>()
        .map_err(|e| GgufError::Tokenizer(e.to_string()))
}

/// `tokenizer_config.json`: the chat template and the special tokens it renders.
pub fn tokenizer_config(meta: &Metadata) -> Result<Json> {
    let vocab = Vocab::read(meta)?;
    let mut cfg = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.token("tokenizer.ggml.bos_token_id")?,
        "eos_token": vocab.token("tokenizer.ggml.eos_token_id")?,
        "unk_token": vocab.token("tokenizer.ggml.unknown_token_id")?,
        "pad_token": vocab.token("tokenizer.ggml.padding_token_id")?,
        "clean_up_tokenization_spaces": false,
    });
    if let Some(b) = meta.opt_bool("tokenizer.ggml.add_bos_token")? {
        cfg["add_bos_token"] = json!(b);
    }
    if let Some(t) = meta.opt_str("tokenizer.chat_template")? {
        cfg["chat_template"] = json!(t);
    }
    Ok(cfg)
}

/// `generation_config.json`: the end-of-sequence ids, with the end-of-turn id when the file
/// names one apart from eos (chat models stop on it).
pub fn generation_config(meta: &Metadata) -> Result<Json> {
    let mut eos: Vec<u64> = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = meta.opt_u64(key)? {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    Ok(json!({
        "bos_token_id": meta.opt_u64("tokenizer.ggml.bos_token_id")?,
        "eos_token_id": eos,
    }))
}
