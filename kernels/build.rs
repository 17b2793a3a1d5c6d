//! Compiles `cuda/*.cu` to PTX in `OUT_DIR`, only when the `cuda` feature is on.
//!
//! The CPU build (no feature) does nothing here, so it never needs nvcc. PTX rather than a
//! cubin: the driver JIT-compiles it for whatever GPU runs it, and `include_str!` embeds it.
//! `FISSION_CUDA_ARCH` picks the virtual architecture (default `compute_90`, Hopper); `NVCC`
//! or `CUDA_ROOT`/`CUDA_HOME`/`CUDA_PATH` locate nvcc, else it is taken from `PATH`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

const SOURCES: [&str; 4] = [
    "paged_attention",
    "flash_prefill",
    "reshape_and_cache",
    "block_copy",
];
const HEADERS: [&str; 2] = ["common.cuh", "attention_tile.cuh"];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for name in SOURCES {
        println!("cargo::rerun-if-changed=cuda/{name}.cu");
    }
    for header in HEADERS {
        println!("cargo::rerun-if-changed=cuda/{header}");
    }
    for var in [
        "FISSION_CUDA_ARCH",
        "NVCC",
        "CUDA_ROOT",
        "CUDA_HOME",
        "CUDA_PATH",
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let arch = std::env::var("FISSION_CUDA_ARCH").unwrap_or_else(|_| "compute_90".into());
    let nvcc = find_nvcc();
    // All files at once: paged_attention.cu alone takes most of a minute.
    let jobs: Vec<(&str, Child)> = SOURCES
        .iter()
        .map(|name| (*name, spawn_nvcc(&nvcc, &arch, name, &out_dir)))
        .collect();
    let mut failed = Vec::new();
    for (name, child) in jobs {
        let output = child.wait_with_output().unwrap_or_else(|e| {
            panic!("waiting for nvcc on cuda/{name}.cu: {e}");
        });
        if !output.status.success() {
            eprintln!("{}", String::from_utf8_lossy(&output.stderr));
            failed.push(name);
        }
    }
    if !failed.is_empty() {
        panic!(
            "nvcc failed on cuda/{{{}}}.cu (errors above)",
            failed.join(",")
        );
    }
}

fn spawn_nvcc(nvcc: &Path, arch: &str, name: &str, out_dir: &Path) -> Child {
    Command::new(nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch={arch}"))
        .arg("-o")
        .arg(out_dir.join(format!("{name}.ptx")))
        .arg(format!("cuda/{name}.cu"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "the `cuda` feature needs nvcc; running {} failed: {e}. Set NVCC or CUDA_ROOT \
                 (see ../shared/cuda/README.md or deploy/check-cuda.sh)",
                nvcc.display()
            )
        })
}

fn find_nvcc() -> PathBuf {
    if let Some(nvcc) = std::env::var_os("NVCC") {
        return nvcc.into();
    }
    for var in ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            let nvcc = Path::new(&root).join("bin").join("nvcc");
            if nvcc.is_file() {
                return nvcc;
            }
        }
    }
    PathBuf::from("nvcc")
}
