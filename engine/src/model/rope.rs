//! Rotary position embeddings, computed exactly as transformers does (f32 inverse frequencies,
//! f32 angles, rotate-half layout) so greedy tokens match the reference.

use crate::config::{ModelConfig, RopeScaling};

/// Inverse frequencies for one head, with the configured scaling applied.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::with_base(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling)
    }

    /// The sliding layers' own rope, unscaled, when the model has one (Gemma 3's
    /// `rope_local_base_freq`).
    pub fn local(cfg: &ModelConfig) -> Option<Self> {
        cfg.local_rope_theta
            .map(|theta| Self::with_base(cfg.head_dim, theta, &RopeScaling::None))
    }

    fn with_base(dim: usize, theta: f64, scaling: &RopeScaling) -> Self {
        let base = theta as f32;
        let mut inv_freq: Vec<f32> = (0..dim)
            .step_by(2)
            .map(|i| 1.0 / base.powf(i as f32 / dim as f32))
            .collect();
        match *scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                for f in &mut inv_freq {
                    *f /= factor as f32;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                // transformers' _compute_llama3_parameters.
                let old = original_max_position_embeddings as f32;
                let (factor, low, high) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                );
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        *f
                    };
                    let smooth = (old / wavelen - low) / (high - low);
                    let is_medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    *f = if is_medium {
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
        }
        Rope { inv_freq }
    }

    pub fn half_dim(&self) -> usize {
        self.inv_freq.len()
    }

    /// cos and sin tables `[positions.len(), head_dim / 2]`, computed once per forward and shared
    /// by every layer.
    pub fn tables(&self, positions: &[u32]) -> RopeTables {
        let h = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * h);
        let mut sin = Vec::with_capacity(positions.len() * h);
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = f * p as f32;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeTables {
            cos,
            sin,
            half_dim: h,
        }
    }
}

/// Per-token cos/sin rows for one forward pass.
pub struct RopeTables {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub half_dim: usize,
}

impl RopeTables {
    /// Rotates one head vector in place (rotate_half: pairs i and i + d/2).
    #[inline]
    pub fn apply(&self, token: usize, x: &mut [f32]) {
        let h = self.half_dim;
        let cos = &self.cos[token * h..(token + 1) * h];
        let sin = &self.sin[token * h..(token + 1) * h];
        let (a, b) = x.split_at_mut(h);
        for i in 0..h {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}
