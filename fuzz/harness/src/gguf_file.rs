//! Arbitrary bytes as a GGUF file (`gguf`): the bounded header check, candle's parse of the
//! metadata it admits, the config, tokenizer and chat template built from that metadata, and
//! the tensors it declares. Each either succeeds or is refused with a [`gguf::GgufError`]
//! that formats; a file the header check admits must read every tensor it declares.

use std::io::Cursor;
use std::path::Path;

use ::gguf::GgufFile;

/// Tensors larger than this are not dequantised here: the fuzzer's inputs are small, and a
/// header that declares a large tensor was already checked against the input's length.
const MAX_TENSOR_BYTES: u64 = 1 << 20;

pub fn gguf(data: &[u8]) {
    let mut r = Cursor::new(data);
    let file = match GgufFile::from_reader(Path::new("fuzz.gguf"), &mut r, data.len() as u64) {
        Ok(file) => file,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let h = file.header();
    assert!(h.data_offset <= h.file_len || h.tensors.is_empty());
    for t in file.tensors() {
        let end = h.data_offset + t.offset + t.size_bytes;
        assert!(end <= data.len() as u64, "{} ends past the input", t.name);
        if t.size_bytes <= MAX_TENSOR_BYTES {
            if let Err(e) = file.tensor_f32(&mut r, &t.name) {
                panic!("{} passed the header check but does not read: {e}", t.name);
            }
        }
    }
    for result in [
        ::gguf::hf_config(&file).map(drop),
        ::gguf::tokenizer_json(file.metadata()).map(drop),
        ::gguf::tokenizer_config(file.metadata()).map(drop),
        ::gguf::generation_config(file.metadata()).map(drop),
    ] {
        if let Err(e) = result {
            assert!(!e.to_string().is_empty());
        }
    }
    if let Ok(tok) = ::gguf::tokenizer(file.metadata()) {
        if let Ok(enc) = tok.encode("Once upon a time", true) {
            let _ = tok.decode(enc.get_ids(), false);
        }
    }
}
