//! What a GGUF file holds, in the form `gguf/tests/fixtures/manifest.py` records for the files
//! llama.cpp's tools made: size and sha256 of the file, each key's value type and the sha256 of
//! its stored bytes, each tensor's type, dims, offset and the sha256 of its data. Comparing two
//! manifests says where two files differ.

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> anyhow::Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.context("truncated")?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u32(&mut self) -> anyhow::Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }

    fn u64(&mut self) -> anyhow::Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }

    fn string(&mut self) -> anyhow::Result<String> {
        let n = self.u64()? as usize;
        Ok(String::from_utf8(self.take(n)?.to_vec())?)
    }

    fn skip_value(&mut self, ty: u32) -> anyhow::Result<()> {
        match ty {
            8 => {
                let n = self.u64()? as usize;
                self.take(n)?;
            }
            9 => {
                let (inner, n) = (self.u32()?, self.u64()?);
                for _ in 0..n {
                    self.skip_value(inner)?;
                }
            }
            0 | 1 | 7 => drop(self.take(1)?),
            2 | 3 => drop(self.take(2)?),
            4..=6 => drop(self.take(4)?),
            10..=12 => drop(self.take(8)?),
            other => bail!("value type {other}"),
        }
        Ok(())
    }
}

/// (elements, bytes) per block of the types the fixtures hold.
fn block(ty: u32) -> anyhow::Result<(u64, u64)> {
    match ty {
        0 => Ok((1, 4)),
        1 => Ok((1, 2)),
        8 => Ok((32, 34)),
        other => bail!("tensor type {other}"),
    }
}

/// The manifest of the GGUF file `data`.
pub fn manifest(data: &[u8]) -> anyhow::Result<Value> {
    let mut c = Cursor { data, pos: 0 };
    ensure!(c.take(4)? == b"GGUF", "not a GGUF file");
    let (version, n_tensors, n_kv) = (c.u32()?, c.u64()?, c.u64()?);
    let mut kv = Vec::new();
    let mut alignment = 32u64;
    for _ in 0..n_kv {
        let key = c.string()?;
        let start = c.pos;
        let ty = c.u32()?;
        c.skip_value(ty)?;
        if key == "general.alignment" {
            alignment = u64::from(u32::from_le_bytes(data[start + 4..c.pos].try_into()?));
        }
        kv.push(json!([key, ty, hex(&data[start..c.pos])]));
    }
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let name = c.string()?;
        let n_dims = c.u32()?;
        let dims = (0..n_dims)
            .map(|_| c.u64())
            .collect::<anyhow::Result<Vec<_>>>()?;
        infos.push((name, dims, c.u32()?, c.u64()?));
    }
    let base = (c.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::new();
    for (name, dims, ty, off) in infos {
        let (per, bytes) = block(ty)?;
        let len = dims.iter().product::<u64>() / per * bytes;
        let start = (base + off) as usize;
        let body = data
            .get(start..start + len as usize)
            .with_context(|| format!("{name}: data past the end"))?;
        tensors.push(json!([name, ty, dims, off, hex(body)]));
    }
    Ok(json!({
        "version": version,
        "size": data.len(),
        "sha256": hex(data),
        "kv": kv,
        "tensors": tensors,
    }))
}

/// Where manifest `ours` differs from `want`, one line each; empty when they are the same.
pub fn differences(ours: &Value, want: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for k in ["version", "size", "sha256"] {
        if ours[k] != want[k] {
            out.push(format!("{k}: {} vs {}", ours[k], want[k]));
        }
    }
    for list in ["kv", "tensors"] {
        let (a, b) = (
            ours[list].as_array().cloned().unwrap_or_default(),
            want[list].as_array().cloned().unwrap_or_default(),
        );
        if a.len() != b.len() {
            out.push(format!("{list}: {} entries vs {}", a.len(), b.len()));
        }
        for (x, y) in a.iter().zip(&b) {
            if x != y {
                out.push(format!("{list}: {x} vs {y}"));
            }
        }
    }
    out
}
