//! Compiles the .proto files in pure Rust (protox), so building needs no protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/fission.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
