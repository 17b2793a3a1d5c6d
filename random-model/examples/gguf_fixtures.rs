//! Writes every GGUF fixture into `target/fixtures/gguf/` (or `FISSION_GGUF_FIXTURES`),
//! checked against llama.cpp's files, and prints their paths: the tests do the same on demand.

fn main() -> anyhow::Result<()> {
    for name in random_model::gguf_out::fixtures::names() {
        println!(
            "{}",
            random_model::gguf_out::fixtures::try_path(&name)?.display()
        );
    }
    Ok(())
}
