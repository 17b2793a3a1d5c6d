//! Paged attention, KV block copies, the packed-weight GEMM of the linear layers and the elementwise steps between them (SwiGLU, RMS norm), in portable Rust for CPU and in CUDA behind the `cuda`
//! feature (module `cuda`; the CUDA C++ sources are in `kernels/cuda/`).
//!
//! This crate knows byte layouts and block ids only: it must not depend on models, tokenizers or networking.
//!
//! The CPU attention kernel is written once as generic code and instantiated for AVX-512,
//! AVX2+FMA and the compile target's baseline; the best one is picked at run time, since the
//! crate is built for baseline x86-64. [`reference::paged_attention_reference`] is the slow
//! yardstick every fast kernel is tested against.

mod activation;
mod attention;
mod capped;
mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
mod elem;
mod error;
mod gemm;
#[cfg(any(feature = "cuda", test))]
mod gpu_plan;
mod huge;
mod kernel_isa;
mod kquant;
mod kquant_gemm;
mod kquant_simd;
mod kv_int8;
mod kv_rows;
mod layout;
mod narrow;
mod packed;
mod peak;
mod pool;
mod q8;
#[cfg(target_arch = "x86_64")]
mod q8_avx2;
mod q8_gemm;
mod q8_simd;
#[cfg(target_arch = "x86_64")]
mod q8_simd_x86;
mod q8_tile;
pub mod reference;
mod simd;
#[cfg(target_arch = "x86_64")]
mod simd_x86;
mod split;
mod tile;
mod tile_dispatch;
mod wide;

pub use activation::{rms_norm, silu_mul};
pub use attention::{SeqAttn, MAX_CONTEXT_LEN};
pub use capped::{paged_attention, paged_attention_with, AttnOptions};
pub use copy::{copy_blocks, gather_blocks, reshape_and_cache, scatter_blocks};
pub use elem::KvElem;
pub use error::KernelError;
pub use gemm::{packed_matmul, packed_matmul_add};
pub use kernel_isa::kernel_isa;
pub use kquant::{random_blocks, KQuantPart, KQuantType, KQuantWeight};
pub use kv_int8::{
    gather_blocks_int8, int8_payload_bytes, paged_attention_int8, quantize_row_int8,
    reshape_and_cache_int8, scatter_blocks_int8, Int8Kv, Int8KvMut,
};
pub use kv_types::KvDtype;
pub use layout::CacheShape;
pub use packed::{PackedWeight, WeightDtype, PANEL};
pub use peak::fma_peak_gflops;
pub use pool::{parallel_for, pool_threads};
pub use q8::Q8_BLOCK;
pub use simd::avx2_allowed;
