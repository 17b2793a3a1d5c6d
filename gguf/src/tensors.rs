//! llama.cpp's tensors under transformers' names (each architecture's map is in `arch.rs`),
//! each dequantised, with what the converter changed undone: the q/k row permutation of the
//! Llama family (so the engine's rotate-half rope applies to them as to the original
//! checkpoint), Gemma's `1 +` folded into its norms, and a mixture's experts split out of
//! their 3-D tensors, one `[out, in]` tensor per expert.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use crate::arch::{Arch, Target};
use crate::error::{GgufError, Result};
use std::io::{Read, Seek, SeekFrom};

use crate::file::{GgufFile, MetadataExt};
use crate::types::GgmlType;

/// transformers' name for a Llama file's tensor name; `None` for tensors the engine does not
/// use. Other architectures: [`Arch::target`].
pub fn hf_name(gguf: &str) -> Option<String> {
    match Arch::Llama.target(gguf)? {
        Target::One(n) => Some(n),
        Target::Experts { .. } => None,
    }
}

/// Undoes `convert_hf_to_gguf.py`'s `LlamaModel.permute` on `[heads * head_dim, ...]` rows:
/// it stored each head's rows as `(head_dim / 2, 2)` where transformers has `(2, head_dim / 2)`.
fn unpermute(t: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    if heads == 0 || rows % (heads * 2) != 0 {
        return Err(GgufError::BadTensor {
            name: "q/k projection".into(),
            reason: format!("{rows} rows do not split into {heads} heads of even size"),
        });
    }
    let half = rows / heads / 2;
    let mut split = vec![heads, half, 2];
    split.extend_from_slice(&dims[1..]);
    Ok(t.reshape(split)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// A 2-D block-quantised tensor's bytes as the file stores them, its rows (outputs) in
/// transformers' order (llama.cpp's q/k permutation undone row by row: a block never spans
/// rows).
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub ggml_type: GgmlType,
    /// Outputs.
    pub rows: usize,
    /// Inputs.
    pub cols: usize,
    pub data: Vec<u8>,
}

/// Every tensor the engine uses, under transformers' names, dequantised and converted to
/// `dtype` on `device`: what a `VarBuilder` over a safetensors checkpoint would hold.
pub fn load_tensors(
    file: &GgufFile,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    Ok(load_tensors_keeping(file, dtype, device, |_| false)?.0)
}

/// [`load_tensors`], and beside it the stored blocks of every 2-D weight whose type `keep`
/// names, under the same names, for kernels that run on them as stored.
pub fn load_tensors_keeping(
    file: &GgufFile,
    dtype: DType,
    device: &Device,
    keep: impl Fn(GgmlType) -> bool,
) -> Result<(HashMap<String, Tensor>, HashMap<String, RawTensor>)> {
    let arch = crate::config::arch(file)?;
    let m = file.metadata();
    let k = |s: &str| format!("{}.{s}", arch.gguf_name());
    let heads = m.usize(&k("attention.head_count"))?;
    let kv_heads = m
        .opt_u64(&k("attention.head_count_kv"))?
        .map(|v| v as usize)
        .unwrap_or(heads);
    let mut reader = file.reader()?;
    let mut out = HashMap::new();
    let mut raw = HashMap::new();
    for entry in file.tensors() {
        let Some(target) = arch.target(&entry.name) else {
            continue;
        };
        let mut t = file.tensor_f32(&mut reader, &entry.name)?;
        let mut heads_of = None;
        if arch.permutes_qk() {
            if entry.name.ends_with(".attn_q.weight") || entry.name.ends_with(".attn_q.bias") {
                t = unpermute(&t, heads)?;
                heads_of = Some(heads);
            } else if entry.name.ends_with(".attn_k.weight") || entry.name.ends_with(".attn_k.bias")
            {
                t = unpermute(&t, kv_heads)?;
                heads_of = Some(kv_heads);
            }
        }
        if arch.norms_store_one_plus() && entry.name.ends_with("norm.weight") {
            // Exact for the stored values in [0.5, 2^24] (Sterbenz), so the engine's `1 + w`
            // gives back the stored value bit for bit.
            t = (t - 1.0)?;
        }
        let keep_raw = entry.ggml_type.is_quantized() && keep(entry.ggml_type);
        let stored = |reader: &mut std::io::BufReader<std::fs::File>| -> Result<Vec<u8>> {
            let mut data = vec![0u8; entry.size_bytes as usize];
            reader
                .seek(SeekFrom::Start(file.header().data_offset + entry.offset))
                .and_then(|_| reader.read_exact(&mut data))
                .map_err(GgufError::Read)?;
            Ok(data)
        };
        match target {
            Target::One(name) => {
                if entry.dims.len() == 2 && keep_raw {
                    let (cols, rows) = (entry.dims[0] as usize, entry.dims[1] as usize);
                    let mut data = stored(&mut reader)?;
                    if let Some(h) = heads_of {
                        data = unpermute_rows(&data, rows, h);
                    }
                    let kept = RawTensor {
                        ggml_type: entry.ggml_type,
                        rows,
                        cols,
                        data,
                    };
                    raw.insert(name.clone(), kept);
                }
                out.insert(name, t.to_dtype(dtype)?.to_device(device)?);
            }
            Target::Experts { layer, part } => {
                let [cols, rows, experts] = entry.dims[..] else {
                    return Err(GgufError::BadTensor {
                        name: entry.name.clone(),
                        reason: format!(
                            "expected 3 dimensions (experts, out, in), found {:?}",
                            entry.dims
                        ),
                    });
                };
                let (cols, rows, experts) = (cols as usize, rows as usize, experts as usize);
                if experts == 0 {
                    return Err(GgufError::BadTensor {
                        name: entry.name.clone(),
                        reason: "no experts".into(),
                    });
                }
                let data = if keep_raw {
                    Some(stored(&mut reader)?)
                } else {
                    None
                };
                for e in 0..experts {
                    let name = arch.expert_name(layer, part, e);
                    if let Some(data) = &data {
                        // Blocks never span rows, so each expert's rows are its own bytes.
                        let per = data.len() / experts;
                        raw.insert(
                            name.clone(),
                            RawTensor {
                                ggml_type: entry.ggml_type,
                                rows,
                                cols,
                                data: data[e * per..(e + 1) * per].to_vec(),
                            },
                        );
                    }
                    let x = t.get(e)?.contiguous()?;
                    out.insert(name, x.to_dtype(dtype)?.to_device(device)?);
                }
            }
        }
    }
    Ok((out, raw))
}

/// [`unpermute`] on whole stored rows (`heads` divides `rows` evenly, checked by
/// [`unpermute`] on the same tensor first): output row `(h, t, i)` is stored row `(h, i, t)`.
fn unpermute_rows(data: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let row_bytes = data.len() / rows;
    let half = rows / heads / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for t in 0..2 {
            for i in 0..half {
                let to = h * 2 * half + t * half + i;
                let from = h * 2 * half + i * 2 + t;
                out[to * row_bytes..(to + 1) * row_bytes]
                    .copy_from_slice(&data[from * row_bytes..(from + 1) * row_bytes]);
            }
        }
    }
    out
}

/// How many tensors of each type the file holds, for logs and the model's identity.
pub fn type_counts(file: &GgufFile) -> Vec<(&'static str, usize)> {
    let mut counts: HashMap<crate::GgmlType, usize> = HashMap::new();
    for t in file.tensors() {
        *counts.entry(t.ggml_type).or_default() += 1;
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort();
    v.into_iter().map(|(t, n)| (t.name(), n)).collect()
}

/// The type of the projections (the most common type among `blk.*` 2-D weights): what the
/// file is "in", as llama.cpp's file type names it (Q4_K_M files mix Q4_K and Q6_K).
pub fn weight_type(file: &GgufFile) -> &'static str {
    let mut counts: HashMap<crate::GgmlType, usize> = HashMap::new();
    for t in file
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with("blk.") && t.dims.len() == 2)
    {
        *counts.entry(t.ggml_type).or_default() += 1;
    }
    counts
        .into_iter()
        .max_by_key(|&(t, n)| (n, std::cmp::Reverse(t)))
        .map(|(t, _)| t.name())
        .unwrap_or("none")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_transformers() {
        assert_eq!(
            hf_name("blk.3.attn_q.weight").as_deref(),
            Some("model.layers.3.self_attn.q_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.attn_k.bias").as_deref(),
            Some("model.layers.0.self_attn.k_proj.bias")
        );
        assert_eq!(
            hf_name("blk.12.ffn_norm.weight").as_deref(),
            Some("model.layers.12.post_attention_layernorm.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
    }

    #[test]
    fn unpermute_inverts_the_converters_permute() -> Result<()> {
        // convert_hf_to_gguf.py: w.reshape(heads, 2, rows/heads/2, in).swapaxes(1, 2).reshape(w.shape)
        let (heads, head_dim, cols) = (2, 4, 3);
        let w = Tensor::arange(0f32, (heads * head_dim * cols) as f32, &Device::Cpu)?
            .reshape((heads * head_dim, cols))?;
        let permuted = w
            .reshape((heads, 2, head_dim / 2, cols))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((heads * head_dim, cols))?;
        let back = unpermute(&permuted, heads)?;
        // The stored rows move as the rows of the tensor do.
        let bytes: Vec<u8> = permuted
            .to_vec2::<f32>()?
            .iter()
            .flat_map(|r| r.iter().flat_map(|v| v.to_le_bytes()))
            .collect();
        let rows_back: Vec<f32> = unpermute_rows(&bytes, heads * head_dim, heads)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(rows_back, w.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(back.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        assert_ne!(permuted.to_vec2::<f32>()?, w.to_vec2::<f32>()?);
        Ok(())
    }
}
