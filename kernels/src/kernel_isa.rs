//! The instruction sets this process's kernels run, for benchmark records. It names both the
//! f32 kernels' pick ([`crate::simd`]) and the int8 GEMM's ([`crate::q8_simd`]), so it sits
//! above the two rather than in either.

use crate::q8_simd::QIsa;
use crate::simd::Isa;

/// The instruction sets the kernels picked in this process, for benchmark records: the f32
/// kernels' and the int8 GEMM's, e.g. `avx512 (int8: vnni)`.
pub fn kernel_isa() -> String {
    let f32_isa = match Isa::detect() {
        Isa::Avx512 => "avx512",
        Isa::Avx2Fma => "avx2",
        Isa::Portable => "portable",
    };
    let q8 = match QIsa::detect() {
        QIsa::Vnni => "vnni",
        QIsa::Avx512Bw => "avx512bw",
        QIsa::Avx2 => "avx2",
        QIsa::Portable => "portable",
    };
    format!("{f32_isa} (int8: {q8})")
}
