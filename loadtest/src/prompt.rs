//! Prompts of an exact token length. Random benchmark models pad their tokenizer with
//! `<extra_N>` added tokens, each of which tokenizes to exactly one token.

/// A prompt of `num_tokens` tokens (BOS is added by the tokenizer on top), different per `seed`
/// so prefix caching cannot serve it.
pub fn exact_prompt(num_tokens: usize, seed: usize, first_extra_id: usize, vocab: usize) -> String {
    let span = vocab - first_extra_id;
    (0..num_tokens)
        .map(|i| {
            format!(
                "<extra_{}>",
                first_extra_id + (i * 7919 + seed * 104_729) % span
            )
        })
        .collect()
}
