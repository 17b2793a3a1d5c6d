//! Writes the GGUF fixtures named on the command line (all of them without arguments) into
//! `target/fixtures/gguf/` (or `FISSION_GGUF_FIXTURES`), checked against llama.cpp's files,
//! and prints their paths: the tests do the same on demand.
//!
//! `cargo run --release -p random-model --example gguf_fixtures [stories260K-f32.gguf ...]`

use random_model::gguf_out::fixtures;

fn main() -> anyhow::Result<()> {
    let mut names: Vec<String> = std::env::args().skip(1).collect();
    if names.is_empty() {
        names = fixtures::names();
    }
    for name in names {
        println!("{}", fixtures::try_path(&name)?.display());
    }
    Ok(())
}
