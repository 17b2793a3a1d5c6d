//! A CPU tensor's data as a slice, for the host kernels. Its own file because both the model
//! and the KV cache read tensors this way, and the cache must not import the model's modules
//! that import the cache back.

use candle_core::{Storage, Tensor, WithDType};

use crate::error::{EngineError, Result};

/// Runs `f` on the contiguous CPU slice behind `t`.
pub(crate) fn with_slice<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => {
            let data = cpu.as_slice::<T>()?;
            let (a, b) = layout
                .contiguous_offsets()
                .expect("tensor was made contiguous above");
            Ok(f(&data[a..b]))
        }
        _ => Err(EngineError::InvalidConfig {
            reason: "the CPU attention path was given a non-CPU tensor".into(),
        }),
    }
}
