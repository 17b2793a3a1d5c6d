//! Wall time per op of the host forward pass, summed process-wide while switched on
//! (`fission bench engine --op-times`). Not to be confused with the cost profiles of
//! [`crate::cost`], which model a machine the engine does not run on.
//!
//! Sampling profilers mislead here: `perf` put 91% of an AVX2 prefill of 512 tokens in the
//! GEMM and 2.6% in attention, where timers around the calls measured 87% and 10.5% (the
//! kernels are large inlined functions whose samples land in the wrong symbol). These timers
//! cost one relaxed load per op when off, and two clock reads and an atomic add when on.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// The timed ops of a layer, the output head, and the whole forward pass around them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Both RMS norms of every layer, and the final one.
    Norm,
    Qkv,
    /// RoPE, the cache write and the attention kernel.
    Attention,
    OProj,
    GateUp,
    Silu,
    Down,
    LmHead,
    /// The whole host forward pass, the ops above included.
    Forward,
}

impl Op {
    pub const ALL: [Op; 9] = [
        Op::Norm,
        Op::Qkv,
        Op::Attention,
        Op::OProj,
        Op::GateUp,
        Op::Silu,
        Op::Down,
        Op::LmHead,
        Op::Forward,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Norm => "norm",
            Op::Qkv => "qkv",
            Op::Attention => "attention",
            Op::OProj => "o_proj",
            Op::GateUp => "gate_up",
            Op::Silu => "silu",
            Op::Down => "down",
            Op::LmHead => "lm_head",
            Op::Forward => "forward",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; Op::ALL.len()] = [const { AtomicU64::new(0) }; Op::ALL.len()];

/// Starts (or stops) adding up the ops' time.
pub fn enable(on: bool) {
    ON.store(on, Relaxed);
}

/// The time summed so far per op, in [`Op::ALL`] order. Take two and subtract
/// ([`OpTimes::since`]) to time a stretch of work.
pub fn snapshot() -> OpTimes {
    OpTimes(std::array::from_fn(|i| NANOS[i].load(Relaxed)))
}

/// Summed nanoseconds per op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpTimes([u64; Op::ALL.len()]);

impl OpTimes {
    /// The time spent between `earlier` and this snapshot.
    pub fn since(&self, earlier: &OpTimes) -> OpTimes {
        OpTimes(std::array::from_fn(|i| {
            self.0[i].saturating_sub(earlier.0[i])
        }))
    }

    pub fn get(&self, op: Op) -> Duration {
        Duration::from_nanos(self.0[op as usize])
    }
}

/// Runs `f`, adding its wall time to `op` while profiling is on.
#[inline]
pub(crate) fn timed<R>(op: Op, f: impl FnOnce() -> R) -> R {
    if !ON.load(Relaxed) {
        return f();
    }
    let start = Instant::now();
    let r = f();
    NANOS[op as usize].fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
    r
}
