//! Where a model runs (`--device cpu|cuda[:N]`) and which forward pass it takes
//! (`--path auto|host|tensor`), parsed once for every binary that loads a model.
//!
//! [`DeviceSpec::open`] is called before any weight is read, so a build without the `cuda`
//! feature asked for CUDA fails at once with [`EngineError::NotCompiledWithCuda`], not after
//! minutes of loading or with a candle error from deep inside a kernel.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device};

use crate::error::{EngineError, Result};
use crate::loader::ModelSource;
use crate::model::{LoadedModel, Model};
use crate::quantize::Quantize;

/// A device as the command line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// A CUDA device by ordinal (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl DeviceSpec {
    /// Whether this build can open CUDA devices.
    pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

    /// The candle device. Cheap for the CPU; for CUDA it creates the context, so a machine
    /// without a driver or that ordinal fails here too.
    pub fn open(&self) -> Result<Device> {
        match *self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            #[cfg(feature = "cuda")]
            DeviceSpec::Cuda(ordinal) => {
                let device = Device::new_cuda(ordinal)?;
                // What is free before this process loads anything: its own use is measured
                // against it when the KV cache is sized (`device_kv_blocks`).
                let (free, _) = cuda_memory(ordinal)?;
                free_at_open()
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(ordinal, free);
                Ok(device)
            }
            #[cfg(not(feature = "cuda"))]
            DeviceSpec::Cuda(_) => Err(EngineError::NotCompiledWithCuda {
                device: self.to_string(),
            }),
        }
    }

    /// [`NotCompiledWithCuda`](EngineError::NotCompiledWithCuda) for CUDA in a CPU build,
    /// without opening anything: for a launcher whose children open the device.
    pub fn check_compiled(&self) -> Result<()> {
        match self {
            DeviceSpec::Cuda(_) if !Self::CUDA_COMPILED => Err(EngineError::NotCompiledWithCuda {
                device: self.to_string(),
            }),
            _ => Ok(()),
        }
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }
}

impl FromStr for DeviceSpec {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| EngineError::InvalidParameter {
            field: "device",
            reason: reason.into(),
            given: s.into(),
        };
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map(DeviceSpec::Cuda)
                    .map_err(|_| bad("the CUDA ordinal must be a number (cuda:0)")),
                None => Err(bad("expected cpu, cuda or cuda:N")),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Which forward pass steps take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardPath {
    /// The host path where the model can take it (f32/bf16 weights on the CPU), else the
    /// tensor path; `FISSION_TENSOR_FORWARD=1` still forces the tensor path.
    #[default]
    Auto,
    /// The host path, an error where the model cannot take it.
    Host,
    /// The device-generic tensor path on any device: on the CPU it runs what a GPU runs, so
    /// CI checks that path without a GPU.
    Tensor,
}

impl FromStr for ForwardPath {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(ForwardPath::Auto),
            "host" => Ok(ForwardPath::Host),
            "tensor" => Ok(ForwardPath::Tensor),
            _ => Err(EngineError::InvalidParameter {
                field: "path",
                reason: "expected auto, host or tensor".into(),
                given: s.into(),
            }),
        }
    }
}

impl fmt::Display for ForwardPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ForwardPath::Auto => "auto",
            ForwardPath::Host => "host",
            ForwardPath::Tensor => "tensor",
        })
    }
}

/// Loads `source` onto `device` for `path`: the device is opened first, so a CUDA request in
/// a CPU build fails before any file is read. What every binary that takes `--device` calls.
pub fn load_model(
    source: &ModelSource,
    dtype: Option<DType>,
    quantize: Quantize,
    device: DeviceSpec,
    path: ForwardPath,
) -> Result<LoadedModel> {
    let dev = device.open()?;
    on_path(
        LoadedModel::load_quantized(source, dtype, quantize, &dev)?,
        path,
    )
}

/// `model` on `path`: [`ForwardPath::Tensor`] moves it to the tensor path,
/// [`ForwardPath::Host`] checks that it is on the host path.
pub fn on_path(model: LoadedModel, path: ForwardPath) -> Result<LoadedModel> {
    let host = match &*model.model {
        Model::Llama(m) => m.runs_host_path(),
        Model::Mock(_) => true,
    };
    match path {
        ForwardPath::Auto => Ok(model),
        ForwardPath::Tensor if host => Ok(model.with_tensor_path()),
        ForwardPath::Tensor => Ok(model),
        ForwardPath::Host if host => Ok(model),
        ForwardPath::Host => Err(EngineError::InvalidParameter {
            field: "path",
            reason: "the host path takes f32 or bf16 weights on the CPU (not --quantize, GGUF \
                     k-quants or a GPU device, or FISSION_TENSOR_FORWARD is set)"
                .into(),
            given: path.to_string(),
        }),
    }
}

/// Free bytes of each CUDA ordinal when this process opened it ([`DeviceSpec::open`]).
#[cfg(feature = "cuda")]
fn free_at_open() -> &'static std::sync::Mutex<std::collections::HashMap<usize, u64>> {
    static FREE: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<usize, u64>>> =
        std::sync::OnceLock::new();
    FREE.get_or_init(Default::default)
}

#[cfg(feature = "cuda")]
fn own_use(ordinal: usize, free_now: u64) -> u64 {
    let before = free_at_open()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&ordinal)
        .copied()
        .unwrap_or(free_now);
    before.saturating_sub(free_now)
}

#[cfg(not(feature = "cuda"))]
fn own_use(_ordinal: usize, _free_now: u64) -> u64 {
    0
}

/// The KV blocks a CUDA device holds under `--gpu-memory-utilization`, vLLM's meaning: this
/// process may use `utilization` of the device's total memory, so the KV cache gets that
/// share less what the process already uses (the weights: free memory at open less free
/// memory now), and never more than is free. So two nodes on one GPU at 0.45 each both get a
/// cache, whichever loads first. `None` on the CPU, where `--kv-memory-fraction` of host
/// memory sizes the cache.
pub fn device_kv_blocks(
    device: DeviceSpec,
    model: &LoadedModel,
    cfg: &crate::engine::EngineConfig,
    utilization: f64,
) -> Result<Option<usize>> {
    if !(0.0..=1.0).contains(&utilization) || utilization == 0.0 {
        return Err(EngineError::InvalidParameter {
            field: "gpu_memory_utilization",
            reason: "must be in (0, 1]".into(),
            given: utilization.to_string(),
        });
    }
    let DeviceSpec::Cuda(ordinal) = device else {
        return Ok(None);
    };
    let (free, total) = cuda_memory(ordinal)?;
    let mc = model.config();
    let dtype = match cfg.kv_cache_dtype {
        Some(d) => d,
        None => match model.model.dtype() {
            DType::BF16 => kv_types::KvDtype::Bf16,
            DType::F16 => kv_types::KvDtype::F16,
            _ => kv_types::KvDtype::F32,
        },
    };
    let layout = kv_types::KvLayout {
        dtype,
        num_layers: mc.num_layers as u32,
        block_size: cfg.block_size as u32,
        num_kv_heads: mc.num_kv_heads as u32,
        head_dim: mc.head_dim as u32,
        windows: Default::default(),
    };
    Ok(Some(kv_blocks_in(
        free,
        total,
        utilization,
        own_use(ordinal, free),
        layout.bytes_per_block_all_layers(),
    )))
}

/// Blocks of `block_bytes` in `utilization` of `total` less the `own` bytes the process
/// already holds, capped by what is `free`.
pub fn kv_blocks_in(free: u64, total: u64, utilization: f64, own: u64, block_bytes: u64) -> usize {
    let share = ((total as f64 * utilization) as u64).saturating_sub(own);
    (share.min(free) / block_bytes.max(1)) as usize
}

/// `(free, total)` bytes of CUDA device `ordinal`.
#[cfg(feature = "cuda")]
fn cuda_memory(ordinal: usize) -> Result<(u64, u64)> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let cuda =
        |e: candle_core::cuda_backend::cudarc::driver::DriverError| EngineError::InvalidConfig {
            reason: format!("CUDA device {ordinal}: {e}"),
        };
    let ctx = CudaContext::new(ordinal).map_err(cuda)?;
    let (free, total) = ctx.mem_get_info().map_err(cuda)?;
    Ok((free as u64, total as u64))
}

#[cfg(not(feature = "cuda"))]
fn cuda_memory(_ordinal: usize) -> Result<(u64, u64)> {
    Err(EngineError::NotCompiledWithCuda {
        device: "cuda".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_as_the_flag_spells_them() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("CUDA:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
        for bad in ["metal", "cuda:x", "cuda:", ""] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn the_device_cache_gets_the_process_share_less_its_own_use() {
        let gib = 1u64 << 30;
        // 80 GiB card, 20 GiB of weights, 0.9: 72 GiB for the process, 52 for KV.
        assert_eq!(kv_blocks_in(60 * gib, 80 * gib, 0.9, 20 * gib, gib), 52);
        // Two nodes at 0.45 on one card, 2 GiB of weights each: the second to load gets as
        // much as the first, not what the first left beyond a 55% reserve.
        let first = kv_blocks_in(78 * gib, 80 * gib, 0.45, 2 * gib, gib);
        assert_eq!(first, 34);
        let second = kv_blocks_in((78 - 34 - 2) * gib, 80 * gib, 0.45, 2 * gib, gib);
        assert_eq!(second, 34);
        // Weights past the share: no blocks, not an underflow; never more than is free.
        assert_eq!(kv_blocks_in(5 * gib, 80 * gib, 0.1, 9 * gib, gib), 0);
        assert_eq!(kv_blocks_in(10 * gib, 80 * gib, 1.0, 0, 2 * gib), 5);
    }

    #[test]
    fn paths_parse() {
        assert_eq!(
            "tensor".parse::<ForwardPath>().unwrap(),
            ForwardPath::Tensor
        );
        assert_eq!("host".parse::<ForwardPath>().unwrap(), ForwardPath::Host);
        assert!("gpu".parse::<ForwardPath>().is_err());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_cpu_build_refuses_cuda_by_name() {
        let err = DeviceSpec::Cuda(1).open().unwrap_err();
        assert!(
            matches!(err, EngineError::NotCompiledWithCuda { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("NotCompiledWithCuda"), "{err}");
        assert!(DeviceSpec::Cpu.open().is_ok());
    }
}
